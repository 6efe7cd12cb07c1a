"""The model zoo's CPU guard: every family of benchmarks/lib/zoo.py at its tiny size (2 layers,
width 32-64, fp32, dropout off) in every memfuse wrapping style, one training step against eager:
the loss and every gradient close, and nothing run through torch instead of memfuse (no graph
fallback, no call of the wrapped model or a layer run eagerly). Silent fallbacks are what this
guards: a graph memfuse cannot compile runs through torch and its results match eager.

FAILS_TODAY lists the (family, style) pairs that fail now, each with its error: a strict xfail,
so whoever fixes one deletes its entry (a fixed pair fails until then). The zoo's GPU sizes select
other code paths: benchmarks.zoo measures those (make bench-zoo).
"""
import logging

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import memfuse  # noqa: E402
from benchmarks.lib import hf_models as bench  # noqa: E402
from benchmarks.lib.zoo import ZOO  # noqa: E402

# (family, style): the error it fails with today (tiny size, CPU, the Triton interpreter). "graph
# fallback": the backend ran a Dynamo graph through torch; "eager call": the wrapped model or layer
# ran through torch; "crash": the error reached the training loop.
FAILS_TODAY: dict = {}

STYLES = ("memfuse_backend", "memfuse_whole", "memfuse_per_layer")
CPU = bench.Setup(torch.device("cpu"), tiny=True, settings=bench.TINY_SETTINGS)  # fp32, no autocast
LOSS_RTOL = 1e-5
# bench.grad_error: relative to the gradient's norm, floored at 1e-3 x the largest; at the tiny
# sizes in fp32 memfuse's sums differ from eager's in order only, ~1e-6.
GRAD_RTOL = 1e-4
FP32_NOISE = 4    # past GRAD_RTOL: memfuse's distance from fp64 over eager's own


def _case(family: str, style: str):
    marks = [pytest.mark.xdist_group(family)]  # the family's eager step is computed once per worker
    if (family, style) in FAILS_TODAY:
        # compile_fails: a whole-model compile that fails runs through torch, which conftest fails on its own
        marks += [pytest.mark.xfail(strict=True, reason=FAILS_TODAY[family, style]), pytest.mark.compile_fails]
    return pytest.param(family, style, marks=marks, id=f"{family}-{style}")


CASES = [_case(family, style) for family, spec in ZOO.items() for style in STYLES
         if spec.layer_paths or style != "memfuse_per_layer"]
_EAGER: dict = {}


def _eager(family: str):
    """The family's weights, batch, and eager's dropout-free loss and gradients."""
    if family not in _EAGER:
        spec = ZOO[family]
        model = bench.build(spec, spec.tiny, 0.0)
        batch = spec.make_batch(spec.tiny, CPU.device)
        weights = {name: value.clone() for name, value in model.state_dict().items()}
        loss = bench.train_step(model, batch, CPU).item()
        _EAGER[family] = (weights, batch, loss, bench.gradients(model))
    return _EAGER[family]


def _fp64_gradients(family: str) -> dict:
    """The family's gradients in fp64 on the same weights and batch: the reference where eager's
    own fp32 gradients are further from it than GRAD_RTOL (BatchNorm's weight gradients sum
    cancelling products over every pixel)."""
    weights, batch, _, _ = _eager(family)
    spec = ZOO[family]
    model = bench.build(spec, spec.tiny, 0.0, weights).double()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in batch.items()}
    bench.train_step(model, batch, CPU)
    return bench.gradients(model)


class _Fallbacks(logging.Handler):
    """memfuse's `fallbacks` topic while the step runs: the reasons, for the failure message."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons = []

    def emit(self, record):
        self.reasons.append(record.getMessage())


@pytest.mark.parametrize("family,style", CASES)
def test_matches_eager_and_runs_no_graph_through_torch(family, style):
    torch._dynamo.reset()
    weights, batch, want_loss, want_grads = _eager(family)
    spec = ZOO[family]
    model = bench.build(spec, spec.tiny, 0.0, weights)
    fallbacks = _Fallbacks()
    logger = logging.getLogger("memfuse.fallbacks")
    logger.addHandler(fallbacks)
    try:
        loss = bench.train_step(bench.WRAPPERS[style](model, spec), batch, CPU).item()
    finally:
        logger.removeHandler(fallbacks)
    stats = memfuse.stats()
    assert stats["graph_fallbacks"] == 0 and stats["eager_calls"] == 0, "\n".join(fallbacks.reasons)
    assert stats["compiles"] >= 1, stats
    assert abs(loss - want_loss) <= LOSS_RTOL * abs(want_loss), (loss, want_loss)
    grads = bench.gradients(model)
    error, worst = bench.grad_error(grads, want_grads)
    if error > GRAD_RTOL:
        # then no further from fp64 than FP32_NOISE x eager's own fp32 gradients are
        exact = _fp64_gradients(family)
        eager_error, _ = bench.grad_error(want_grads, exact)
        error, worst = bench.grad_error(grads, exact)
        assert error <= FP32_NOISE * eager_error, (
            f"{worst}: gradient error {error:.2e} from fp64, eager's {eager_error:.2e}")
