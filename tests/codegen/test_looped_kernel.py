"""Rows longer than Config.max_row_length run as looped kernels: each row in chunks, one pass
per row-reduction phase. A small limit makes the looped path run at small sizes on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memfuse
from memfuse import Config

from compare import assert_matches_eager, assert_same, run_both

LOOPED = Config(max_row_length=16, loop_block_d=8)        # chunks of 8 columns
PERSISTENT = Config()


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def rms_norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def bias_dropout_add_norm(x, bias, residual, w, b):
    return F.layer_norm(F.dropout(x + bias, 0.3) + residual, (x.shape[-1],), w, b)


def looped_kernels(fused) -> list:
    """Sources of the looped kernels a fused function compiled (forward and backward)."""
    sources = []
    for entry in fused.cache.values():
        for program in (entry.function.forward, entry.function.backward):
            for step in (program.steps if program is not None else []):
                kernel = getattr(step, "kernel", None)
                if kernel is not None and "for chunk in range(0, D, BLOCK_D)" in kernel.source.source:
                    sources.append(kernel.source.source)
    return sources


CASES = {
    "layer_norm": (layer_norm, lambda d: [torch.randn(3, 5, d), torch.randn(d), torch.randn(d)]),
    "rms_norm": (rms_norm, lambda d: [torch.randn(6, d), torch.randn(d)]),
    "softmax": (lambda x: torch.softmax(x, -1), lambda d: [torch.randn(4, d)]),
    "log_softmax": (lambda x: torch.log_softmax(x, -1) * 2, lambda d: [torch.randn(4, d)]),
    "max_argmax": (lambda x: (x.amax(-1), x.argmax(-1), *x.min(-1)), lambda d: [torch.randn(5, d)]),
    "column_sums": (lambda x, w: (x * w).sum(0), lambda d: [torch.randn(37, d), torch.randn(d)]),
    "pointwise": (lambda x, w: torch.sin(x) * w + 1, lambda d: [torch.randn(3, d), torch.randn(d)]),
    "column_only": (lambda w: torch.exp(w) + 1, lambda d: [torch.randn(d)]),
    "prod": (lambda x: x.prod(-1), lambda d: [torch.rand(3, d) + 0.5]),
    "total": (lambda x: (x * x).mean() + x.amax(), lambda d: [torch.randn(4, d)]),
    "var_mean": (lambda x: torch.var_mean(x, -1), lambda d: [torch.randn(4, d)]),
}


@pytest.mark.parametrize("d", [17, 40], ids=["D17", "D40"])
@pytest.mark.parametrize("name", list(CASES))
def test_looped_kernel_matches_eager(name, d):
    fn, make = CASES[name]
    args = [a.requires_grad_() for a in make(d)]
    both = assert_matches_eager(fn, args, config=LOOPED, grad_scale=4.0)
    assert name == "prod" or both.fallbacks == []   # prod's backward is cumprods through aten
    fused = memfuse.memory_efficient_fusion(fn, config=LOOPED)
    fused(*args)
    assert looped_kernels(fused), "no looped kernel was generated"


def test_layer_norm_forward_is_three_passes():
    fused = memfuse.memory_efficient_fusion(layer_norm, config=LOOPED)
    fused(torch.randn(4, 40), torch.randn(40), torch.randn(40))
    (source,) = looped_kernels(fused)
    assert "3 pass(es)" in source and source.count("for chunk in range(0, D, BLOCK_D)") == 3


def test_no_group_runs_through_aten():
    before = memfuse.stats()["fallbacks"]
    x = torch.randn(4, 100, requires_grad=True)
    assert_matches_eager(layer_norm, [x, torch.randn(100), torch.randn(100)], config=LOOPED)
    assert memfuse.stats()["fallbacks"] == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_looped_equals_persistent_with_dropout(dtype):
    """Same seed, same random numbers (offset = row * D + col), so the same results."""
    d = 40
    args = [torch.randn(3, 5, d), torch.randn(d), torch.randn(3, 5, d), torch.randn(d), torch.randn(d)]
    args = [a.to(dtype).requires_grad_() for a in args]
    looped = run_both(bias_dropout_add_norm, args, config=LOOPED, seed=7)
    persistent = run_both(bias_dropout_add_norm, args, config=PERSISTENT, seed=7)
    assert_same(looped.fused, persistent.fused, scale=0.5)
    assert_same(looped.fused_grads, persistent.fused_grads, scale=2.0, what="gradient")


def test_looped_dropout_mask_is_regenerated_in_the_backward():
    fused = memfuse.memory_efficient_fusion(lambda x: F.dropout(x, 0.5) * 3, config=LOOPED)
    x = torch.randn(6, 40, requires_grad=True)
    out = fused(x)
    out.backward(torch.ones_like(out))
    kept = out != 0
    assert 0.3 < kept.float().mean() < 0.7
    torch.testing.assert_close(out[kept], x[kept] * 6)
    torch.testing.assert_close(x.grad, kept.float() * 6)


def test_nan_in_a_later_chunk_propagates():
    x = torch.randn(3, 40)
    x[0, 35] = float("nan")
    x[1, 9] = float("nan")
    x[2, 20] = float("inf")
    both = run_both(lambda x: (x.amax(-1), x.argmax(-1), x.amin(-1), x.argmin(-1), torch.softmax(x, -1)), [x],
                    config=LOOPED)
    assert_same(both.fused, both.eager)


def test_ties_keep_the_first_index_across_chunks():
    x = torch.zeros(2, 40)
    x[0, 3] = x[0, 30] = 5.0        # the same maximum in chunk 0 and chunk 3
    x[1, 12] = x[1, 13] = -1.0
    both = run_both(lambda x: (x.argmax(-1), x.argmin(-1)), [x], config=LOOPED)
    assert_same(both.fused, both.eager)


def test_row_length_limit_boundary():
    """D == max_row_length stays persistent; one more column loops."""
    for d, looped in [(16, False), (17, True)]:
        fused = memfuse.memory_efficient_fusion(lambda x: torch.softmax(x, -1), config=LOOPED)
        x = torch.randn(3, d)
        torch.testing.assert_close(fused(x), torch.softmax(x, -1))
        assert bool(looped_kernels(fused)) == looped


# -- online sums: a row max and its sum of exps in one pass -------------------------------------
def cross_entropy_mean(x, target):
    return F.cross_entropy(x.float(), target, ignore_index=-100)


def cross_entropy_sum(x, target):
    return F.cross_entropy(x.float(), target, reduction="sum")


LOSSES = {
    "log_softmax": lambda x: torch.log_softmax(x.float(), -1),
    "softmax": lambda x: torch.softmax(x.float(), -1),
    "logsumexp": lambda x: torch.logsumexp(x.float(), -1),
    "cross_entropy_mean": cross_entropy_mean,
    "cross_entropy_sum": cross_entropy_sum,
}


def loss_args(name: str, x: torch.Tensor) -> list:
    """x, and for the losses a target per row (one row ignored: index -100 for the mean)."""
    if not name.startswith("cross_entropy"):
        return [x]
    target = torch.randint(0, x.shape[-1], x.shape[:1])
    if name == "cross_entropy_mean":
        target[1] = -100
    return [x, target]


def online_kernels(fused) -> list:
    return [s for s in looped_kernels(fused) if "mf_online_rescale(" in s]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16_upcast"])
@pytest.mark.parametrize("d", [17, 40], ids=["D17", "D40"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_online_loss_matches_eager(name, d, dtype):
    x = (torch.randn(6, d) * 4).to(dtype)
    x[2] = torch.arange(d) * 0.7          # a max that grows in every chunk: every chunk rescales the sum
    args = loss_args(name, x.requires_grad_())
    assert_matches_eager(LOSSES[name], args, config=LOOPED)
    fused = memfuse.memory_efficient_fusion(LOSSES[name], config=LOOPED)
    fused(*args).sum().backward()
    assert online_kernels(fused), "no online sum was generated"


def masked_rows(d: int) -> torch.Tensor:
    """Rows with -inf: masked columns in the first chunks (whose running max is -inf), a row of
    -inf only, a row whose only finite value is in its last chunk."""
    x = torch.randn(5, d)
    x[0, :9] = float("-inf")
    x[1, ::3] = float("-inf")
    x[2] = float("-inf")
    x[3, :-1] = float("-inf")
    return x


@pytest.mark.parametrize("name", ["log_softmax", "softmax", "logsumexp"])
def test_online_rows_with_minus_infinity_match_eager(name):
    """Eager gives NaN (log_softmax, softmax) or -inf (logsumexp) for the row of -inf only."""
    x = masked_rows(40).requires_grad_()
    both = run_both(LOSSES[name], [x], config=LOOPED)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    assert both.eager[0][2].isnan().all() or both.eager[0][2].item() == float("-inf")


def test_online_cross_entropy_with_masked_logits_matches_eager():
    x = masked_rows(40)
    x[2] = torch.randn(40)                # (a row of -inf only makes the mean NaN: checked above)
    x.requires_grad_()
    target = torch.tensor([20, 1, 5, 39, -100])
    both = run_both(cross_entropy_mean, [x, target], config=LOOPED)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")


def test_nan_reaches_the_online_sum():
    x = torch.randn(3, 40)
    x[0, 3] = float("nan")
    x[1, 38] = float("nan")
    both = run_both(lambda x: (torch.log_softmax(x, -1), torch.logsumexp(x, -1)), [x], config=LOOPED)
    assert_same(both.fused, both.eager)


def test_log_softmax_max_and_sum_share_a_pass():
    """The max and the sum of exps in pass 0, the store in pass 1: two passes, not three."""
    fused = memfuse.memory_efficient_fusion(lambda x: torch.log_softmax(x.float(), -1), config=LOOPED)
    x = torch.randn(4, 40, dtype=torch.bfloat16, requires_grad=True)
    fused(x).sum().backward()
    forward, backward = looped_kernels(fused)
    for source in (forward, backward):
        assert "2 pass(es)" in source and source.count("for chunk in range(0, D, BLOCK_D)") == 2
    report = memfuse.explain(fused, x)
    (kernel,) = report.kernels_of("forward")
    assert kernel.passes == 2 and kernel.online == ("sum_1 = sum of exp(. - amax) online with amax",)
    assert "online: sum_1 = sum of exp(. - amax) online with amax" in str(report)


def test_a_sum_of_exps_of_another_tensor_keeps_its_pass():
    """exp(y - max(x)) with y != x: terms of y may exceed the running max of x; no online sum."""
    fused = memfuse.memory_efficient_fusion(
        lambda x, y: torch.exp(y - x.amax(-1, keepdim=True)).sum(-1), config=LOOPED)
    x, y = torch.randn(4, 40), torch.randn(4, 40)
    torch.testing.assert_close(fused(x, y), torch.exp(y - x.amax(-1, keepdim=True)).sum(-1))
    (kernel,) = memfuse.explain(fused, x, y).kernels_of("forward")
    assert kernel.passes == 2 and kernel.online == ()
    ((name, why),) = kernel.not_online
    assert name == "sum_1" and why.endswith("is not the tensor amax is the max of")

