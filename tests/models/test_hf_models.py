"""Whole HuggingFace models, tiny configs (2 layers, width 64), fp32 on CPU through the Triton
interpreter, in the four wrapping styles: torch.compile(backend="memfuse"), memfuse on the whole
model, memfuse on each layer (the rest eager), and memfuse on each layer with the rest through the
backend (its loss head chunked). Dropout off, one step matches eager: the loss and
every gradient. Dropout on, the model trains: finite losses and gradients over a few optimizer
steps, and the dropout is live (another seed gives another loss, the same seed the same loss).

The configs, wrappers and error measure are benchmarks/models.py's, so the benchmark measures
what is tested here. Each (family, style) compiles twice (dropout off, dropout on): 5-30 s each
on a 2-core CPU, and an interpreted step takes 1-3 s, so the file shares what it can (eager's runs).
"""
import math

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import memfuse  # noqa: E402
from benchmarks.lib import hf_models as bench  # noqa: E402

STYLES = ("memfuse_backend", "memfuse_whole", "memfuse_per_layer", "memfuse_per_layer_backend")
CASES = [(family, style) for family in bench.FAMILIES for style in STYLES]
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4  # bench.grad_error: relative to the gradient's norm, floored at 1e-3 x the largest
CPU = bench.Setup(torch.device("cpu"), tiny=True, settings=bench.TINY_SETTINGS)  # fp32, no autocast
DROPOUT = 0.1
LR = 1e-2


def _build(family: str, dropout: float, weights=None) -> torch.nn.Module:
    spec = bench.FAMILIES[family]
    model = bench.build(spec, spec.tiny, dropout, weights)
    if family == "llama":  # Llama's only dropout is attention's: turn it on, as the others' is
        model.config.attention_dropout = dropout
        for layer in bench.layer_list(model, spec):
            layer.self_attn.attention_dropout = dropout
    return model


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # no test finds another's graphs, nor runs into Dynamo's recompile limit
    yield


def _wrap(style: str, family: str, model: torch.nn.Module):
    """The style's wrapper; memfuse must have compiled by the first step (not Dynamo gone eager)."""
    return bench.WRAPPERS[style](model, bench.FAMILIES[family])


def _assert_memfuse_compiled(style: str, family: str):
    compiles = memfuse.stats()["compiles"]
    if style == "memfuse_backend":
        assert compiles >= 1, memfuse.stats()  # one per Dynamo graph
        assert memfuse.stats()["graph_fallbacks"] == 0, memfuse.stats()  # none ran through torch
    elif style == "memfuse_per_layer_backend":  # a program per layer, then the backend's graphs around them
        assert compiles > bench.FAMILIES[family].tiny.layers, memfuse.stats()
        assert memfuse.stats()["graph_fallbacks"] == 0, memfuse.stats()
        assert memfuse.stats()["loss_heads_chunked"] >= 1, memfuse.stats()   # the head, in the backend's graph
    else:  # one program per wrapped module, no recompile
        expected = bench.FAMILIES[family].tiny.layers if style == "memfuse_per_layer" else 1
        assert compiles == expected, memfuse.stats()


@pytest.fixture(scope="module")
def eager_runs():
    """Per family: the weights, the batch, and eager's dropout-free loss and gradients."""
    runs = {}
    for family, spec in bench.FAMILIES.items():
        model = _build(family, 0.0)
        batch = bench.make_batch(spec.tiny, CPU.device)
        loss = bench.train_step(model, batch, CPU).item()
        runs[family] = (model.state_dict(), batch, loss, bench.gradients(model))
    return runs


@pytest.mark.parametrize("family,style", CASES)
def test_matches_eager_without_dropout(family, style, eager_runs):
    weights, batch, want_loss, want_grads = eager_runs[family]
    model = _build(family, 0.0, weights)
    loss = bench.train_step(_wrap(style, family, model), batch, CPU).item()
    _assert_memfuse_compiled(style, family)
    assert abs(loss - want_loss) <= LOSS_RTOL * abs(want_loss), (loss, want_loss)
    error, worst = bench.grad_error(bench.gradients(model), want_grads)
    assert error <= GRAD_RTOL, f"{worst}: gradient error {error:.2e} relative to its scale"


def _finite_step(fused, model, batch, seed: int) -> float:
    """One step on the current weights under `seed`: the loss, after checking every gradient."""
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = bench.train_step(fused, batch, CPU).item()
    assert math.isfinite(loss), loss
    bad = [name for name, grad in bench.gradients(model).items() if not torch.isfinite(grad).all()]
    assert not bad, f"non-finite gradients: {bad}"
    return loss


@pytest.mark.parametrize("family,style", CASES)
def test_trains_with_dropout(family, style, eager_runs):
    """Seeds 1, 2, 1 on the same weights, then two optimizer steps."""
    weights, batch, no_dropout_loss, _ = eager_runs[family]
    model = _build(family, DROPOUT, weights)
    fused = _wrap(style, family, model)
    first, other, again = (_finite_step(fused, model, batch, seed) for seed in (1, 2, 1))
    _assert_memfuse_compiled(style, family)
    assert first != other, "another seed, the same loss: is the dropout live?"
    assert first == again, "the same seed, another loss: the masks do not follow torch's generator"
    assert first != no_dropout_loss
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()  # on the second seed-1 step's gradients
    _finite_step(fused, model, batch, seed=3)
    optimizer.step()
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(b, a) for b, a in zip(before, after)), "the optimizer moved nothing"


def test_each_backend_mode_runs_its_own_graphs():
    """Two modes through the backend, alive in one process as in benchmarks.distributed's rounds:
    the backend's model, called again after the model whose layers were fused first, runs its own
    whole graph. With one backend callable shared, Dynamo ran the other model's entries for it
    (their guards pass: same class), with their graph break at every layer, and compiled its plain
    layers apart: a Dynamo graph and a memfuse compile at that call."""
    from torch._dynamo.utils import counters
    family = "gpt2"
    spec = bench.FAMILIES[family]
    batch = bench.make_batch(spec.tiny, CPU.device)
    whole = _wrap("memfuse_backend", family, _build(family, 0.0))
    bench.train_step(whole, batch, CPU)
    layers_first = _wrap("memfuse_per_layer_backend", family, _build(family, 0.0))
    bench.train_step(layers_first, batch, CPU)
    graphs, compiles = counters["stats"]["unique_graphs"], memfuse.stats()["compiles"]
    bench.train_step(whole, batch, CPU)
    bench.train_step(layers_first, batch, CPU)
    assert (counters["stats"]["unique_graphs"] - graphs, memfuse.stats()["compiles"] - compiles) == (0, 0)
