"""memfuse.patterns.attention: an attention mask built from sizes alone (as HuggingFace's mask code builds
one under any trace) runs as the kernel's own causal mask, or as no mask, at every size where it is
one, and as the mask itself elsewhere. Outputs and gradients match eager either way; the counters
say which path each call took."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import memfuse
from memfuse.patterns.attention import OutputMasks, mask_form, marked_form


def causal(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=j <= i) * 2


def window_of_6(q, k, v):
    """Causal while the sequence is at most 6 long, a sliding window past that."""
    i = torch.arange(q.shape[-2], device=q.device)[:, None]
    j = torch.arange(k.shape[-2], device=q.device)[None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(j <= i) & (j > i - 6)) * 2


def masks_nothing(q, k, v):
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep) * 2


def user_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2


def _qkv(length: int, seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, length, 16, generator=generator, requires_grad=True) for _ in range(3)]


def _against_eager(fused, fn, tensors: list, *rest) -> None:
    out = fused(*tensors, *rest)
    out.square().sum().backward()
    grads = [t.grad for t in tensors]
    for t in tensors:
        t.grad = None
    want = fn(*tensors, *rest)
    want.square().sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, t in zip(grads, tensors):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-6)


def _counts() -> tuple:
    s = memfuse.stats()
    return s["attention_masks_checked"], s["attention_masks_dropped"]


def test_a_causal_mask_built_from_sizes_runs_as_is_causal_at_every_size():
    fused = memfuse.memory_efficient_fusion(causal)
    checked, dropped = _counts()
    _against_eager(fused, causal, _qkv(8))
    assert _counts() == (checked + 1, dropped + 2)            # checked once; forward and backward without it
    _against_eager(fused, causal, _qkv(8, seed=1))
    assert _counts() == (checked + 1, dropped + 4)            # the same sizes: no new check
    _against_eager(fused, causal, _qkv(5))
    assert _counts() == (checked + 2, dropped + 6)            # a new length: checked again, one program still
    report = str(memfuse.explain(fused, *_qkv(8)))
    assert "attention masks" in report and "replaced: built from sizes alone, causal" in report


def test_a_mask_causal_only_at_some_sizes_runs_as_the_mask_elsewhere():
    """A sliding window of 6: causal at the traced length 4, not at 9. At 9 the call gets the mask
    (evaluated from the sizes) and results stay eager's."""
    fused = memfuse.memory_efficient_fusion(window_of_6)
    checked, dropped = _counts()
    _against_eager(fused, window_of_6, _qkv(4))
    assert _counts() == (checked + 1, dropped + 2)
    _against_eager(fused, window_of_6, _qkv(9))
    assert _counts() == (checked + 2, dropped + 2)            # checked, and run with the mask


def test_a_mask_that_masks_nothing_is_dropped():
    fused = memfuse.memory_efficient_fusion(masks_nothing)
    checked, dropped = _counts()
    _against_eager(fused, masks_nothing, _qkv(6))
    assert _counts() == (checked + 1, dropped + 2)


def test_a_mask_passed_in_stays_a_mask_and_explain_says_why():
    mask = torch.rand(6, 6) > 0.3
    mask.fill_diagonal_(True)
    fused = memfuse.memory_efficient_fusion(user_mask)
    checked, dropped = _counts()
    _against_eager(fused, user_mask, _qkv(6), mask)
    assert _counts() == (checked, dropped)
    assert "kept: reads the values of input" in str(memfuse.explain(fused, *_qkv(6), mask))


def test_a_sliding_window_narrower_than_the_traced_sequence_is_not_replaced():
    fused = memfuse.memory_efficient_fusion(window_of_6)
    checked, dropped = _counts()
    _against_eager(fused, window_of_6, _qkv(10))
    assert _counts() == (checked, dropped)
    assert "neither causal nor empty at the traced sizes" in str(memfuse.explain(fused, *_qkv(10)))


def test_the_backend_replaces_it_too():
    torch._dynamo.reset()
    compiled = torch.compile(causal, backend="memfuse", dynamic=True)
    checked, dropped = _counts()
    _against_eager(compiled, causal, _qkv(8))
    assert memfuse.stats()["attention_masks_dropped"] >= dropped + 2


@pytest.mark.parametrize("mask, form", [
    (torch.ones(2, 1, 4, 4, dtype=torch.bool).tril(), "causal"),
    (torch.ones(4, 4, dtype=torch.bool), "none"),
    (torch.zeros(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), -math.inf), "causal"),
    (torch.zeros(1, 1, 3, 3), "none"),
    (torch.zeros(4, 4, dtype=torch.bfloat16).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(),
                                                         -65504.0), "causal"),       # torch's cuDNN path's bias
    (torch.ones(4, 4, dtype=torch.bool).tril(-1), None),                    # the diagonal masked
    (torch.ones(3, 5, dtype=torch.bool).tril(), None),                      # not square
    (torch.zeros(4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), -1e4), None),   # not -inf
    (torch.ones(4), None),
])
def test_mask_form(mask, form):
    assert mask_form(mask) == form


def bidirectional(q, k, v):
    """HuggingFace's bidirectional mask (BERT): a [1, 1, q, 1] compare broadcast along kv."""
    keep = (torch.arange(q.shape[-2], device=q.device)[None, None, :, None] >= 0)
    keep = keep.expand(q.shape[0], 1, q.shape[-2], k.shape[-2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep) * 2


def test_a_mask_broadcast_along_its_last_dim_reaches_the_trace_dense_and_is_dropped():
    """Broadcast along kv (last stride 0), SDPA on a GPU would take its math path (fp32 matmuls and
    a softmax); memfuse's trace sees the mask contiguous, and the mask masks nothing: dropped."""
    from memfuse.patterns.attention import dense_mask
    mask = torch.ones(1, 1, 4, 1, dtype=torch.bool).expand(2, 1, 4, 4)
    args, kwargs = dense_mask((1, 2, 3, mask), {})
    assert args[3].is_contiguous() and torch.equal(args[3], mask)
    args, kwargs = dense_mask((1, 2, 3), {"attn_mask": mask, "is_causal": False})
    assert kwargs["attn_mask"].is_contiguous() and kwargs["is_causal"] is False
    dense = torch.ones(4, 4, dtype=torch.bool)
    assert dense_mask((1, 2, 3, dense), {})[0][3] is dense
    fused = memfuse.memory_efficient_fusion(bidirectional)
    checked, dropped = _counts()
    _against_eager(fused, bidirectional, _qkv(6))
    assert _counts() == (checked + 1, dropped + 2)


# -- a mask one compiled graph returns and a fused layer receives (memfuse.patterns.attention.OutputMasks) --
def causal_mask_of(x, positions):
    """HuggingFace's way under torch.compile: causal by position ids (a sequence's own past), as a
    [batch, 1, q, q] boolean mask the layers receive; causal when the positions count up."""
    keep = positions[None, :] <= positions[:, None]
    return keep.expand(x.shape[0], 1, *keep.shape)


def positions_of(x):
    return torch.arange(x.shape[-2])


def _builders(**options) -> tuple:
    """(positions from sizes, the mask from positions), each through the backend."""
    torch._dynamo.reset()
    return (torch.compile(positions_of, backend="memfuse", dynamic=True),
            torch.compile(causal_mask_of, backend="memfuse", dynamic=True, options=options))


def test_a_causal_mask_the_backend_builds_from_sizes_reaches_a_fused_layer_as_is_causal():
    """The positions leave their graph marked as built from sizes; the mask that reads them is
    then looked at once per set of sizes and marked; the fused layer runs is_causal."""
    positions_from_sizes, build = _builders()
    layer = memfuse.memory_efficient_fusion(user_mask)
    x = torch.randn(2, 8, 16)
    checked, dropped = _counts()
    mask = build(x, positions_from_sizes(x))
    assert marked_form(mask) == "causal"
    _against_eager(layer, user_mask, _qkv(8), mask)
    assert _counts()[1] == dropped + 2                  # forward and backward without the mask
    again = build(x, positions_from_sizes(x))
    assert marked_form(again) == "causal"
    _against_eager(layer, user_mask, _qkv(8, seed=1), again)
    assert _counts() == (checked + 2, dropped + 4)      # the mask looked at once, the layer's call once
    report = str(memfuse.explain(layer, *_qkv(8), again))
    assert "mask mask replaced: marked causal by the backend graph that returned it" in report
    assert "output 0: mask returned replaced: marked with its form" in str(memfuse.explain(build, x, positions_from_sizes(x)))


def test_a_mask_of_eager_positions_is_looked_at_every_call_only_when_asked():
    x, positions = torch.randn(2, 8, 16), torch.arange(8)
    _, build = _builders()
    assert marked_form(build(x, positions)) is None     # reads a tensor no graph built from sizes
    _, build = _builders(check_returned_masks=True)
    checked = _counts()[0]
    assert marked_form(build(x, positions)) == "causal"
    assert marked_form(build(x, positions)) == "causal"
    assert _counts()[0] == checked + 2
    assert marked_form(build(x, positions.flip(0))) is None     # not causal at these values


def test_a_mask_the_backend_returns_stays_a_mask_where_unmarked():
    positions_from_sizes, build = _builders()
    layer = memfuse.memory_efficient_fusion(user_mask)
    x = torch.randn(2, 8, 16)
    _against_eager(layer, user_mask, _qkv(8), build(x, positions_from_sizes(x)))   # the marked program exists
    dropped = _counts()[1]
    assert marked_form(build(x, positions_from_sizes(x)).clone()) is None          # a copy carries no mark
    unmarked_causal = torch.ones(8, 8, dtype=torch.bool).tril().expand(2, 1, 8, 8)
    _against_eager(layer, user_mask, _qkv(8), unmarked_causal)             # same shape, no mark: a mask
    not_causal = unmarked_causal.clone()
    not_causal[..., 0, 1] = True
    _against_eager(layer, user_mask, _qkv(8), not_causal)
    assert _counts()[1] == dropped


def test_a_marked_mask_written_in_place_loses_its_mark():
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    OutputMasks([(0, ())], []).mark([mask], (), {})
    assert marked_form(mask) == "causal"
    mask[0, 0, 0, 1] = True
    assert marked_form(mask) is None


def hf_style_bias(q, k, v, mask):
    """What HuggingFace's layers make of a boolean mask passed in: a float bias."""
    bias = torch.where(mask, torch.zeros((), dtype=q.dtype), torch.full((), -math.inf, dtype=q.dtype))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias) * 2


def _marked(mask: torch.Tensor, form: str) -> torch.Tensor:
    OutputMasks([(0, ())], []).mark([mask], (), {})
    assert marked_form(mask) == form
    return mask


def test_the_backend_runs_a_mask_made_from_a_marked_input_as_is_causal():
    """A graph that gets its mask as an input (a layer's graph that Dynamo's DDPOptimizer split off
    from the graph that built the mask) runs is_causal where the input arrives marked causal."""
    torch._dynamo.reset()
    compiled = torch.compile(hf_style_bias, backend="memfuse")
    mask = _marked(torch.ones(2, 1, 8, 8, dtype=torch.bool).tril(), "causal")
    checked, dropped = _counts()
    _against_eager(compiled, hf_style_bias, _qkv(8), mask)
    assert _counts() == (checked + 1, dropped + 2)    # the bias looked at once; forward and backward
    _against_eager(compiled, hf_style_bias, _qkv(8, seed=1), mask)
    assert _counts() == (checked + 1, dropped + 4)
    everything = _marked(torch.ones(2, 1, 8, 8, dtype=torch.bool), "none")
    checked = _counts()[0]
    _against_eager(compiled, hf_style_bias, _qkv(8), everything)
    assert _counts() == (checked + 1, dropped + 6)    # no mask at all


def test_a_mask_made_from_an_unmarked_or_rewritten_input_stays_a_mask():
    torch._dynamo.reset()
    compiled = torch.compile(hf_style_bias, backend="memfuse")
    unmarked = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()
    checked, dropped = _counts()
    _against_eager(compiled, hf_style_bias, _qkv(8), unmarked)
    written = _marked(torch.ones(2, 1, 8, 8, dtype=torch.bool).tril(), "causal")
    written[0, 0, 0, 1] = True                  # after the mark: the call must read the mask
    _against_eager(compiled, hf_style_bias, _qkv(8), written)
    assert _counts() == (checked + 1, dropped)        # (the one look is the mark's)


def inverted_bias(q, k, v, mask):
    """A function of the input that is not its mask: masks where the input keeps."""
    bias = torch.where(mask, torch.full((), -math.inf, dtype=q.dtype), torch.zeros((), dtype=q.dtype))
    bias[..., 0] = 0.0                         # every row keeps its first key
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias) * 2


def test_a_marked_input_whose_mask_is_not_causal_is_read_as_a_mask():
    """What a graph makes of a marked input is looked at, not assumed: the inverse of a causal
    input is no causal mask."""
    torch._dynamo.reset()
    compiled = torch.compile(inverted_bias, backend="memfuse")
    mask = _marked(torch.ones(2, 1, 8, 8, dtype=torch.bool).tril(), "causal")
    dropped = _counts()[1]
    _against_eager(compiled, inverted_bias, _qkv(8), mask)
    assert _counts()[1] == dropped


# -- the memory-efficient kernel's rule for its bias (the GPU op cannot run here: the rule can) -------
def _offset_by_one(shape) -> torch.Tensor:
    """Strides the kernel takes, at an address 4 bytes past an aligned one."""
    base = torch.randn(*shape[:-1], shape[-1] + 8)
    return base[..., 1:shape[-1] + 1]


BIASES = {
    "swin-window-contiguous": lambda: torch.randn(6, 3, 49, 49),                     # stride 7203
    "bf16-odd-last-dim": lambda: torch.randn(2, 5, 7, 13).to(torch.bfloat16),
    "broadcast-batch": lambda: torch.randn(1, 3, 49, 49).expand(4, 3, 49, 49),
    "broadcast-last-dim": lambda: torch.randn(2, 1, 7, 1).expand(2, 1, 7, 5),
    "transposed": lambda: torch.randn(2, 3, 16, 16).transpose(-1, -2),
    "misaligned-address": lambda: _offset_by_one((2, 3, 8, 16)),
    "three-dims": lambda: torch.randn(6, 10, 10),
}


@pytest.mark.parametrize("make", BIASES.values(), ids=BIASES.keys())
def test_a_bias_the_efficient_kernel_would_reject_is_copied_into_aligned_strides(make):
    from memfuse.patterns.attention import BIAS_ALIGNMENT, aligned_bias, bias_aligned
    bias = make()
    assert not bias_aligned(bias)
    aligned = aligned_bias(bias)
    assert bias_aligned(aligned)
    assert aligned.shape == bias.shape and aligned.dtype == bias.dtype and aligned.stride(-1) == 1
    assert all(stride % BIAS_ALIGNMENT == 0 for stride in aligned.stride()[:-1])
    assert [s == 0 for s in aligned.stride()[:-1]] == [s == 0 for s in bias.stride()[:-1]]   # still broadcast
    assert torch.equal(aligned, bias)


@pytest.mark.parametrize("bias", [torch.randn(2, 3, 64, 64), torch.randn(1, 1, 7, 16).expand(4, 3, 7, 16),
                                  torch.randn(1, 1, 1, 13)], ids=["aligned", "broadcast-aligned", "sizes-of-1"])
def test_a_bias_the_efficient_kernel_takes_is_passed_as_it_lies(bias):
    from memfuse.patterns.attention import aligned_bias
    assert aligned_bias(bias) is bias


class _RecordingOp:
    """Stands for an attention op on the CPU: its schema, and the bias each call got."""

    def __init__(self, op):
        self._schema, self.biases = op._schema, []

    def __call__(self, *args, **kwargs):
        self.biases.append(args[3] if len(args) > 3 else kwargs["attn_bias"])    # attn_bias: 4th in fwd
        return "called"


def test_programs_call_the_efficient_ops_with_the_bias_aligned():
    from memfuse.ir.patterns import rule
    from memfuse.patterns.attention import AttentionCall, SizeOnlyMask, bias_aligned, with_aligned_bias
    from memfuse.runtime.externs import substitute
    aten = torch.ops.aten
    for op in (aten._scaled_dot_product_efficient_attention.default,
               aten._scaled_dot_product_efficient_attention_backward.default):
        assert substitute(op) is rule(op).implementation is not None
        assert AttentionCall(op, SizeOnlyMask(None, "mask")).run is rule(op).implementation
    wrapper = AttentionCall(aten._scaled_dot_product_efficient_attention.default, SizeOnlyMask(None, "mask"))
    assert substitute(wrapper) is wrapper               # the wrapper rewrites its mask, then calls the implementation
    recording = _RecordingOp(aten._scaled_dot_product_efficient_attention.default)
    q = torch.randn(6, 3, 49, 32)
    window_bias = torch.randn(6, 3, 49, 49)
    assert with_aligned_bias(recording)(q, q, q, window_bias, True) == "called"
    assert with_aligned_bias(recording)(q, q, q, attn_bias=window_bias, compute_log_sumexp=True) == "called"
    assert with_aligned_bias(recording)(q, q, q, None, True) == "called"
    for got in recording.biases[:2]:
        assert bias_aligned(got) and torch.equal(got, window_bias)
    assert recording.biases[2] is None
