"""Pytree arguments and outputs, and the calls memfuse runs through torch instead of compiling:
an argument it cannot trace, a trace that fails (an output it cannot rebuild, an input written
in place). Each runs the original with a reason said once; strict mode makes it an error. (A
trace that reads a tensor's value: tests/fronts/test_split.py.)"""
import dataclasses
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import register_dataclass

import memfuse
from memfuse.driver.fallback import EagerCall, StrictModeError


@dataclasses.dataclass
class Norm:
    weight: torch.Tensor
    eps: float


register_dataclass(Norm)
Pair = namedtuple("Pair", ["scaled", "gate"])


def rotate(x, cos_sin, norm: Norm, extra=None):
    """A rotary-style pair, a registered dataclass and an optional dict of tensors."""
    cos, sin = cos_sin
    y = x * cos + x.flip(-1) * sin
    y = F.layer_norm(y, (y.shape[-1],), norm.weight, eps=norm.eps)
    return y if extra is None else y + extra["bias"] * extra["scale"]


def leaves(*shapes):
    return [torch.randn(*s, requires_grad=True) for s in shapes]


def grads_match(fused_fn, eager_fn, args_of, tensors):
    """Run both on copies of `tensors` (args_of builds the call's arguments) and compare outputs
    and gradients."""
    copies = [[t.detach().clone().requires_grad_() for t in tensors] for _ in range(2)]
    outs = [fn(*args_of(ts)) for fn, ts in zip((fused_fn, eager_fn), copies)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    for out in outs:
        (out * torch.linspace(0.5, 1.5, out.shape[-1])).sum().backward()
    for fused, eager in zip(*copies):
        torch.testing.assert_close(fused.grad, eager.grad, rtol=1e-4, atol=1e-5)


# -- pytree arguments ------------------------------------------------------------------------------
def test_pytree_arguments_match_eager_and_are_cached():
    x, cos, sin, w, bias = leaves((4, 8), (4, 8), (4, 8), (8,), (8,))
    fused = memfuse.memory_efficient_fusion(rotate)
    with_dict = lambda ts: (ts[0], (ts[1], ts[2]), Norm(ts[3], 1e-5), {"bias": ts[4], "scale": 2.0})  # noqa: E731
    plain = lambda ts: (ts[0], [ts[1], ts[2]], Norm(ts[3], 1e-5))                                     # noqa: E731
    grads_match(fused, rotate, with_dict, [x, cos, sin, w, bias])
    grads_match(fused, rotate, plain, [x, cos, sin, w])
    assert memfuse.stats()["compiles"] == 2
    grads_match(fused, rotate, with_dict, [x, cos, sin, w, bias])
    x7, cos7, sin7 = leaves((7, 8), (7, 8), (7, 8))     # another leading size: the same program
    grads_match(fused, rotate, with_dict, [x7, cos7, sin7, w, bias])
    assert memfuse.stats()["compiles"] == 2 and memfuse.stats()["cache_hits"] == 2
    assert fused.fronts == {}, "calls with a registered dataclass stay off the front"
    entry = fused.compiled_for(*with_dict([x, cos, sin, w, bias]))
    assert entry.input_names == ["x", "cos_sin[0]", "cos_sin[1]", "norm.weight", "extra['bias']"]


def test_a_new_structure_or_constant_leaf_recompiles_and_says_which(caplog):
    caplog.set_level("INFO", logger="memfuse.recompiles")
    x, cos, sin, w = leaves((4, 8), (4, 8), (4, 8), (8,))
    fused = memfuse.memory_efficient_fusion(rotate)
    fused.compiled_for(x, (cos, sin), Norm(w, 1e-5))
    fused.compiled_for(x, [cos, sin], Norm(w, 1e-5))        # a list where a tuple was
    fused.compiled_for(x, (cos, sin), Norm(w, 1e-3))        # a constant leaf of the dataclass
    assert memfuse.stats()["recompiles"] == 2
    said = [r.getMessage() for r in caplog.records if "recompile #" in r.getMessage()]
    assert "argument structure" in said[0] and "TreeSpec(tuple" in said[0] and "TreeSpec(list" in said[0]
    assert "argument 'norm.eps' (position 2): constant value 1e-05 -> 0.001" in said[1]


def rotate_flat(x, cos_sin, extra):
    """One level of containers: a (cos, sin) pair and a dict of a tensor and a constant."""
    cos, sin = cos_sin
    return (x * cos + x.flip(-1) * sin) * extra["scale"] + extra["bias"]


def test_tuple_and_dict_arguments_take_the_front_after_the_first_call():
    """A repeated call with a tuple and a dict argument is served by the front (generated code
    unpacks the containers): no pytree flatten, no slow-path lookup."""
    x, cos, sin, bias = leaves((4, 8), (4, 8), (4, 8), (8,))
    fused = memfuse.memory_efficient_fusion(rotate_flat)
    args_of = lambda ts: (ts[0], (ts[1], ts[2]), {"bias": ts[3], "scale": 2.0})   # noqa: E731
    grads_match(fused, rotate_flat, args_of, [x, cos, sin, bias])
    assert memfuse.stats()["front_misses"] == 1, "the first call takes the slow path"
    for _ in range(3):
        grads_match(fused, rotate_flat, args_of, [x, cos, sin, bias])
    x7, cos7, sin7 = leaves((7, 8), (7, 8), (7, 8))
    grads_match(fused, rotate_flat, args_of, [x7, cos7, sin7, bias])   # a new exact key: slow path, same program
    assert (memfuse.stats()["front_misses"], memfuse.stats()["compiles"]) == (2, 1)
    grads_match(fused, rotate_flat, args_of, [x7, cos7, sin7, bias])
    assert memfuse.stats()["front_misses"] == 2


@pytest.mark.parametrize("changed", [
    lambda ts: (ts[0], [ts[1], ts[2]], {"bias": ts[3], "scale": 2.0}),              # a list where a tuple was
    lambda ts: (ts[0], (ts[1], ts[2]), {"scale": 2.0, "bias": ts[3]}),              # the dict's keys reordered
    lambda ts: (ts[0], (ts[1], ts[2]), {"bias": ts[3], "scale": 3.0}),              # a constant inside the dict
    lambda ts: (ts[0], (ts[1], ts[2].double()), {"bias": ts[3], "scale": 2.0}),     # a dtype inside the tuple
], ids=["list", "keys", "constant", "dtype"])
def test_a_changed_container_leaves_the_front_and_compiles_its_own_program(changed):
    x, cos, sin, bias = leaves((4, 8), (4, 8), (4, 8), (8,))
    fused = memfuse.memory_efficient_fusion(rotate_flat)
    args_of = lambda ts: (ts[0], (ts[1], ts[2]), {"bias": ts[3], "scale": 2.0})   # noqa: E731
    grads_match(fused, rotate_flat, args_of, [x, cos, sin, bias])
    grads_match(fused, rotate_flat, args_of, [x, cos, sin, bias])
    out = fused(*changed([x, cos, sin, bias]))
    torch.testing.assert_close(out, rotate_flat(*changed([x, cos, sin, bias])), rtol=1e-5, atol=1e-5)
    assert (memfuse.stats()["front_misses"], memfuse.stats()["compiles"]) == (2, 2)


def test_a_tensor_argument_inside_a_pytree_names_its_path():
    x, y = torch.randn(4, 8), torch.randn(4, 8, device="meta")
    decision = memfuse.memory_efficient_fusion(lambda pair: pair[0] + pair[1]).compiled_for((x, y))
    assert "argument 'pair[1]' (position 0) is on meta" in decision.reason


# -- pytree outputs --------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda a, b: {"sum": a + b, "none": None, "n": 3},
    lambda a, b: [a * b, (a - b, 2.5)],
    lambda a, b: Pair(a.tanh(), (a * b).sigmoid()),
    lambda a, b: Norm(a * b, 0.5),
], ids=["dict", "list", "namedtuple", "dataclass"])
# the interpreter evaluates masked-off lanes too (sigmoid's division there); nothing is stored
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_pytree_outputs_come_back_as_returned(make):
    a, b = leaves((4, 8), (8,))
    fused_out, eager_out = memfuse.memory_efficient_fusion(make)(a, b), make(a, b)
    assert type(fused_out) is type(eager_out)
    flat_fused, spec_fused = torch.utils._pytree.tree_flatten(fused_out)
    flat_eager, spec_eager = torch.utils._pytree.tree_flatten(eager_out)
    assert spec_fused == spec_eager
    for got, want in zip(flat_fused, flat_eager):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want)
        else:
            assert got == want
    sum(t.sum() for t in flat_fused if isinstance(t, torch.Tensor)).backward()
    assert a.grad is not None and b.grad is not None


# -- calls that run through torch ------------------------------------------------------------------
class LayerCache:
    """Stands for a KV cache: an object the call appends to."""

    def __init__(self):
        self.keys = []

    def update(self, k):
        self.keys.append(k)
        return torch.cat(self.keys)


def attend(x, cache):
    return cache.update(x).sum(0) * x


def test_an_untraceable_argument_runs_the_original_and_says_so_once(caplog):
    fused = memfuse.memory_efficient_fusion(attend)
    x = torch.randn(4, 8)
    for _ in range(3):
        torch.testing.assert_close(fused(x, LayerCache()), attend(x, LayerCache()))
    said = [r.getMessage() for r in caplog.records if r.name == "memfuse.fallbacks"]
    assert len(said) == 1, "one line per distinct reason"
    assert "attend runs through torch, not compiled: argument 'cache' (position 1) is a LayerCache" in said[0]
    assert "use_cache=False" in said[0]                      # a cache's way out
    assert memfuse.stats()["eager_calls"] == 3 and memfuse.stats()["compiles"] == 0
    assert isinstance(fused.compiled_for(x, LayerCache()), EagerCall)
    with pytest.raises(StrictModeError, match=r"'cache' \(position 1\) is a LayerCache.*strict mode"):
        memfuse.memory_efficient_fusion(attend, config=memfuse.Config(strict=True))(x, LayerCache())


class Opaque:
    """An object memfuse cannot see into (no __dict__): an output it cannot rebuild."""
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


def opaque(x):
    return x * 2, Opaque(x)


@pytest.mark.compile_fails
def test_a_failed_trace_runs_the_original_decided_once_per_key(caplog, monkeypatch):
    traces = []
    capture = memfuse.driver.compile.capture
    monkeypatch.setattr(memfuse.driver.compile, "capture", lambda *a, **k: traces.append(1) or capture(*a, **k))
    fused = memfuse.memory_efficient_fusion(opaque)
    for x in (torch.ones(4, 8), -torch.ones(4, 8), torch.ones(5, 8)):
        torch.testing.assert_close(fused(x)[0], opaque(x)[0])
    assert len(traces) == 1, "the failure is cached for the key: no retrace per call"
    assert memfuse.stats()["eager_calls"] == 3
    said = [r.getMessage() for r in caplog.records if r.name == "memfuse.fallbacks"]
    assert len(said) == 1
    assert "compiling it failed in memfuse.fronts.outputs: UntraceableOutputError: opaque returns a Opaque at " \
           "output[1]" in said[0]
    assert "return a tensor, or a pytree" in said[0]
    strict = memfuse.memory_efficient_fusion(opaque, config=memfuse.Config(strict=True))
    with pytest.raises(StrictModeError, match="UntraceableOutputError.*strict mode") as raised:
        strict(torch.ones(4, 8))
    assert isinstance(raised.value.__cause__, TypeError)


@pytest.mark.compile_fails
def test_the_originals_own_error_reaches_the_caller():
    def mismatched(x, y):
        return x @ y
    fused = memfuse.memory_efficient_fusion(mismatched)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        fused(torch.randn(4, 8), torch.randn(4, 8))


# -- modules ---------------------------------------------------------------------------------------
class Rotary(nn.Module):
    """A layer called like a HuggingFace decoder layer: a (cos, sin) pair by keyword, a cache
    object, a dict output."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, position_embeddings=None, past_key_values=None, use_cache=False):
        cos, sin = position_embeddings
        h = self.proj(self.norm(x))
        h = h * cos + h.flip(-1) * sin
        if past_key_values is not None:
            h = past_key_values.update(h)[-x.shape[0]:]
        return {"hidden": x + h, "cached": use_cache}


def test_a_module_takes_pytree_arguments_and_runs_the_original_for_a_cache(caplog):
    torch.manual_seed(0)
    plain = Rotary()
    fused = memfuse.memory_efficient_fusion(Rotary())
    fused.load_state_dict(plain.state_dict())
    x, cos, sin = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        out = fused(x, position_embeddings=(cos, sin))
        torch.testing.assert_close(out["hidden"], plain(x, position_embeddings=(cos, sin))["hidden"])
    assert out["cached"] is False and memfuse.stats()["compiles"] == 1 and memfuse.stats()["cache_hits"] == 1
    out = fused(x, position_embeddings=(cos, sin), past_key_values=LayerCache(), use_cache=True)
    want = plain(x, position_embeddings=(cos, sin), past_key_values=LayerCache(), use_cache=True)
    torch.testing.assert_close(out["hidden"], want["hidden"])
    assert "Rotary runs through torch, not compiled: argument 'past_key_values' is a LayerCache" in caplog.text
    assert memfuse.stats()["eager_calls"] == 1 and memfuse.stats()["compiles"] == 1
