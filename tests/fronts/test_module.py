"""memory_efficient_fusion(module): shared parameters and state_dict keys, train/eval, no_grad,
autocast, checkpoints, forwards that write their buffers (written back) or arguments (run through torch)."""
import copy
import io
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfuse
from memfuse.driver.fallback import StrictModeError
from memfuse.fronts.module import FusedModule, MutatedInputError


class Block(nn.Module):
    """Pre-norm residual MLP with dropout and a (non-parameter) buffer."""

    def __init__(self, width=32, p=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(p)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, width))

    def forward(self, x):
        return x + self.drop(self.proj(F.gelu(self.fc(self.norm(x))))) * self.gain


class Net(nn.Module):
    def __init__(self, p=0.0):
        super().__init__()
        self.blocks = nn.ModuleList(Block(p=p) for _ in range(2))
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def pair(p=0.0, seed=0):
    """(plain Net, the same Net deep-copied with memfuse-wrapped blocks)."""
    torch.manual_seed(seed)
    plain = Net(p)
    fused = copy.deepcopy(plain)
    for i, block in enumerate(fused.blocks):
        fused.blocks[i] = memfuse.memory_efficient_fusion(block)
    return plain, fused


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def test_wrapper_shares_parameters_names_and_buffers():
    block = Block()
    fused = memfuse.memory_efficient_fusion(block)
    assert isinstance(fused, FusedModule) and fused.original is block
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in block.named_parameters()]
    assert all(a is b for a, b in zip(fused.parameters(), block.parameters()))
    assert [n for n, _ in fused.named_buffers()] == ["gain"] and fused.gain is block.gain
    assert fused.fc is block.fc
    block.note = "plain attribute"
    assert fused.note == "plain attribute"   # read through from the original
    opt = torch.optim.SGD(fused.parameters(), lr=1.0)
    fused(torch.randn(3, 32)).sum().backward()
    before = block.fc.weight.detach().clone()
    opt.step()
    assert not torch.equal(block.fc.weight, before)   # the optimizer stepped the original's tensors


def test_state_dict_keys_identical_and_checkpoints_cross_load():
    plain, fused = pair()
    assert list(fused.state_dict()) == list(plain.state_dict())
    whole = memfuse.memory_efficient_fusion(Net())
    assert list(whole.state_dict()) == list(plain.state_dict())
    # fused -> plain and plain -> fused, strict, through a saved file
    for source, target in ((fused, Net()), (plain, pair(seed=1)[1]), (whole, Net())):
        buffer = io.BytesIO()
        torch.save(source.state_dict(), buffer)
        buffer.seek(0)
        result = target.load_state_dict(torch.load(buffer), strict=True)
        assert not result.missing_keys and not result.unexpected_keys
        for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
            assert torch.equal(a, b), name
    with pytest.raises(RuntimeError, match="Missing key"):
        fused.load_state_dict({}, strict=True)


def test_outputs_and_grads_match_eager_over_batch_shapes():
    plain, fused = pair()
    memfuse.reset_stats()
    for shape in ((4, 6, 32), (3, 5, 32), (7, 32)):
        for model in (plain, fused):
            model.zero_grad()
        x = torch.randn(shape)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = plain(x1), fused(x2)
        g = torch.randn_like(y1)
        y1.backward(g)
        y2.backward(g)
        torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-5)
        for name, g1 in grads(plain).items():
            torch.testing.assert_close(grads(fused)[name], g1, rtol=1e-4, atol=1e-5, msg=name)
    # two blocks x (rank 3, rank 2): a new batch or sequence size reuses the program
    assert memfuse.stats()["compiles"] == 4


def test_train_and_eval_are_separate_programs():
    torch.manual_seed(0)
    block = Block(p=0.5)
    fused = memfuse.memory_efficient_fusion(block)
    x = torch.randn(8, 32)
    memfuse.reset_stats()
    y_train = fused(x)
    fused.eval()
    assert not block.training and not block.drop.training
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    fused.train()
    assert block.drop.training
    y_again = fused(x)
    assert memfuse.stats()["compiles"] == 2 and memfuse.stats()["cache_hits"] == 1
    assert not torch.equal(y_train, y_again)           # a fresh seed per call
    # a submodule switched on its own is part of the key too
    block.drop.eval()
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)


def test_changing_a_submodules_plain_attribute_compiles_anew():
    """Dropout's p and a norm's eps are constants of the trace: changing one after the first call
    must select another program, never run the old constant."""
    torch.manual_seed(0)
    block = Block(p=0.5)
    fused = memfuse.memory_efficient_fusion(block)
    x = torch.randn(8, 32)
    fused(x)
    block.drop.p = 0.0
    block.norm.eps = 0.5
    memfuse.reset_stats()
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    stats = memfuse.stats()
    assert (stats["compiles"], stats["eager_calls"], stats["graph_fallbacks"]) == (1, 0, 0), stats


def test_the_module_tree_is_walked_again_only_when_it_changed():
    """A call reuses the last walk of the tree (TreeWatch) while every tensor, submodule and plain
    attribute it read is the same object; an assignment anywhere in the tree makes a new walk, and a
    replaced parameter is the one the next call reads."""
    torch.manual_seed(0)
    block = Block()
    fused = memfuse.memory_efficient_fusion(block)
    x = torch.randn(8, 32)
    fused(x)
    watch = fused._memfuse_watch
    fused(x)
    assert fused._memfuse_watch is watch
    block.fc.weight = nn.Parameter(torch.randn_like(block.fc.weight))   # same key: the same program
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    assert fused._memfuse_watch is not watch and memfuse.stats()["compiles"] == 1
    block.drop = nn.Dropout(0.0)                                          # a new submodule, same attributes
    watch = fused._memfuse_watch
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    assert fused._memfuse_watch is not watch and memfuse.stats()["compiles"] == 1
    block.norm.eps = 1e-5                                                 # equal value, another object
    torch.testing.assert_close(fused(x), block(x), rtol=1e-5, atol=1e-5)
    stats = memfuse.stats()
    assert (stats["compiles"], stats["eager_calls"], stats["graph_fallbacks"]) == (1, 0, 0), stats


class Rotary(nn.Module):
    """A layer called as HuggingFace's Llama calls its decoder layers: a (cos, sin) tuple and
    constants by keyword."""

    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)

    def forward(self, x, attention_mask=None, position_embeddings=None, use_cache=False):
        cos, sin = position_embeddings
        return self.norm(x * cos + x.flip(-1) * sin)


def test_a_module_called_with_a_tuple_keyword_takes_the_front():
    torch.manual_seed(0)
    layer = Rotary()
    fused = memfuse.memory_efficient_fusion(layer)
    x, cos, sin = (torch.randn(8, 32, requires_grad=True) for _ in range(3))
    call = dict(attention_mask=None, position_embeddings=(cos, sin), use_cache=False)
    for _ in range(3):
        torch.testing.assert_close(fused(x, **call), layer(x, **call), rtol=1e-5, atol=1e-5)
    assert memfuse.stats()["front_misses"] == 1 and memfuse.stats()["cache_hits"] == 2
    layer.norm.eps = 0.5                                   # an attribute: a new key, a new program
    torch.testing.assert_close(fused(x, **call), layer(x, **call), rtol=1e-5, atol=1e-5)
    assert memfuse.stats()["compiles"] == 2


def test_dropout_backward_reuses_the_forward_mask():
    class Drop(nn.Module):
        def __init__(self):
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, x):
            return self.drop(x)

    fused = memfuse.memory_efficient_fusion(Drop())
    x = (torch.rand(16, 32) + 1).requires_grad_()
    y = fused(x)
    y.backward(torch.ones_like(y))
    assert 0.3 < (y == 0).float().mean() < 0.7
    torch.testing.assert_close(x.grad, y.detach() / x.detach())   # mask / (1 - p), from the same seed
    torch.manual_seed(3)
    a = fused(x)
    torch.manual_seed(3)
    assert torch.equal(a, fused(x))


def test_no_grad_runs_forward_only():
    plain, fused = pair()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        y = fused(x)
        expected = plain(x)
    assert not y.requires_grad
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_traces_the_casts(dtype):
    torch.manual_seed(0)
    block = Block()
    fused = memfuse.memory_efficient_fusion(copy.deepcopy(block))
    x = torch.randn(4, 6, 32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype):
        y1 = block(x1)
        y2 = fused(x2)
    assert y2.dtype == y1.dtype
    torch.testing.assert_close(y2, y1, rtol=2e-2, atol=2e-2)
    assert (y2 - block(x)).abs().max() > 5e-5   # computed in low precision, not silently in fp32
    y1.sum().backward()
    y2.sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=3e-2, atol=3e-2)
    for (name, p1), p2 in zip(block.named_parameters(), fused.parameters()):
        assert p2.grad.dtype == torch.float32
        torch.testing.assert_close(p2.grad, p1.grad, rtol=5e-2, atol=5e-2, msg=name)
    # the program was traced under autocast: its graph computes in `dtype`, and it is a
    # different program from the fp32 one
    (call,) = fused._memfuse_calls.values()
    (entry,) = call.fused.cache.values()
    assert any(node.value.dtype == dtype for node in entry.captured.joint.nodes.values())
    fused(x)
    assert len(fused._memfuse_calls) == 2


def test_buffers_written_in_place_are_written_back():
    """BatchNorm in training mode writes its running statistics: the trace writes copies and returns
    them, the module copies them into its buffers after the call: compiled, and the statistics,
    outputs and gradients are eager's. Eval mode reads them without writing: another program."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    model = memfuse.memory_efficient_fusion(copy.deepcopy(plain))
    x, grad = torch.randn(4, 8), torch.randn(4, 8)    # (a norm's output squared sums to a constant)
    for _ in range(2):
        out, expected = model(x), plain(x)
        torch.testing.assert_close(out, expected)
        out.backward(grad)
        expected.backward(grad)
    for (name, theirs), ours in zip(plain.named_buffers(), model.original.buffers()):
        torch.testing.assert_close(ours, theirs, msg=name)
    assert int(model.original[1].num_batches_tracked) == 2
    for (name, theirs), ours in zip(plain.named_parameters(), model.original.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
    assert (memfuse.stats()["eager_calls"], memfuse.stats()["compiles"]) == (0, 1)
    (call,) = model._memfuse_calls.values()
    assert [call.key.state[i] for i in call.written] == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]
    model.eval()
    plain.eval()
    torch.testing.assert_close(model(x), plain(x))
    assert memfuse.stats()["compiles"] == 2
    torch.testing.assert_close(model.original[1].running_mean, plain[1].running_mean)


@pytest.mark.compile_fails
def test_mutating_an_argument_runs_the_original_naming_it(caplog):
    """A forward that writes into its argument runs the original (which writes it as in eager), the
    reason names the argument; strict mode raises."""
    class AddsInPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            x.add_(1.0)
            return self.lin(x)

    plain = AddsInPlace()
    model = memfuse.memory_efficient_fusion(copy.deepcopy(plain))
    x = torch.randn(4, 8)
    ours, theirs = x.clone(), x.clone()
    torch.testing.assert_close(model(ours), plain(theirs))
    torch.testing.assert_close(ours, theirs)
    assert re.search(r"argument 'x'.*Way out: ", caplog.text)
    assert memfuse.stats()["eager_calls"] == 1
    strict = memfuse.memory_efficient_fusion(plain, config=memfuse.Config(strict=True))
    with pytest.raises(StrictModeError, match=r"argument 'x'.*strict mode") as raised:
        strict(x)
    assert isinstance(raised.value.__cause__, MutatedInputError)


def test_kwargs_constants_and_structured_outputs():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)

        def forward(self, x, scale=1.0, *, shift=None):
            h = self.a(x) * scale
            if shift is not None:
                h = h + shift
            return {"h": h, "aux": (h.relu(), None), "n": 3}

    torch.manual_seed(0)
    plain = Heads()
    fused = memfuse.memory_efficient_fusion(copy.deepcopy(plain))
    x, shift = torch.randn(5, 16), torch.randn(16)
    for kwargs in ({}, {"scale": 2.0}, {"scale": 0.5, "shift": shift}):
        out, expected = fused(x, **kwargs), plain(x, **kwargs)
        assert set(out) == {"h", "aux", "n"} and out["aux"][1] is None and out["n"] == 3
        torch.testing.assert_close(out["h"], expected["h"])
        torch.testing.assert_close(out["aux"][0], expected["aux"][0])


def test_deepcopy_and_dtype_conversion_keep_sharing():
    fused = memfuse.memory_efficient_fusion(Block())
    fused(torch.randn(2, 32))
    clone = copy.deepcopy(fused)
    assert clone.original.fc.weight is clone.fc.weight and clone.fc.weight is not fused.fc.weight
    clone.double()
    assert clone.original.fc.weight.dtype == torch.float64 and clone.original.gain.dtype == torch.float64
    x = torch.randn(3, 32, dtype=torch.float64)
    torch.testing.assert_close(clone(x), clone.original(x))


def test_parameters_of_other_leading_sizes_recompile():
    """A Parameter is traced with static dims: its whole shape is part of the compile key."""
    fused = memfuse.memory_efficient_fusion(lambda x, w: F.linear(x, w).relu())
    x = torch.randn(3, 8)
    for rows in (16, 4):
        w = nn.Parameter(torch.randn(rows, 8))
        torch.testing.assert_close(fused(x, w), F.linear(x, w).relu())


@torch.jit.script
def per_element_scale(x):
    """DeBERTa-style TorchScript helper (transformers 5.17 scripts its position helpers): it reads
    sizes the TorchScript interpreter cannot give on a trace's symbolic tensors."""
    return x * (x.size(0) * x.size(1) / x.numel())


class ScriptedHelperBlock(Block):
    def forward(self, x):
        return super().forward(per_element_scale(x))


def test_a_module_calling_a_torchscript_helper_compiles_once_for_every_batch():
    """A whole-module wrapper of a forward that calls a @torch.jit.script function compiles it (no
    run through torch) and matches eager, outputs and gradients; the helper's sizes stay symbols,
    so another batch size compiles nothing new."""
    torch.manual_seed(0)
    plain = ScriptedHelperBlock()
    fused = memfuse.memory_efficient_fusion(copy.deepcopy(plain))
    memfuse.reset_stats()
    for batch in (3, 5):
        x = torch.randn(batch, 7, 32, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        out = fused(x)
        out.square().sum().backward()
        plain(x_ref).square().sum().backward()
        torch.testing.assert_close(out, plain(x_ref))
        torch.testing.assert_close(x.grad, x_ref.grad)
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    stats = memfuse.stats()
    assert (stats["compiles"], stats["eager_calls"], stats["graph_fallbacks"]) == (1, 0, 0), stats
