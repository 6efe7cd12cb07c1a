"""memfuse.patterns.attention_bias: attention written by hand with an additive float bias (Bloom's
ALiBi `baddbmm`, T5's relative position bias) is traced as one scaled_dot_product_attention call.
The counters and explain say it fired; outputs and every gradient (the bias's too) match eager;
with dropout the forward and the backward apply one mask; where a condition fails the product stays
as written and the decision says why."""
from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import memfuse
from tests.helpers import rel_error
from memfuse.patterns.attention_bias import BiasedAttentionMode

B, H, L, D = 2, 3, 8, 16
MIN = torch.finfo(torch.float32).min


def bloom_form(q, k, v, alibi, mask):
    """Bloom's attention: ALiBi through baddbmm, the mask added, a float32 softmax, dropout, bmm."""
    b, h, length, d = q.shape
    query = q.reshape(b * h, length, d)
    key = k.reshape(b * h, length, d).transpose(-1, -2)
    value = v.reshape(b * h, length, d)
    scores = alibi.baddbmm(batch1=query, batch2=key, beta=1.0, alpha=1 / math.sqrt(d))
    weights = scores.view(b, h, length, -1) + mask
    probs = F.softmax(weights, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, 0.0, True)
    return torch.bmm(probs.view(b * h, length, -1), value).view(b, h, length, d)


class T5Form(torch.nn.Module):
    """T5's attention: q @ k^T unscaled, a learned position bias and the mask added, softmax, @ v."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.position_bias = torch.nn.Parameter(torch.randn(1, H, L, L))
        self.p = p

    def forward(self, q, k, v, mask):
        scores = torch.matmul(q, k.transpose(2, 3)) * 1.0
        scores = scores + self.position_bias
        scores = scores + mask
        probs = F.softmax(scores, dim=-1)
        probs = F.dropout(probs, p=self.p, training=self.training)
        return torch.matmul(probs, v).transpose(1, 2).contiguous()


def _tensors(seed: int = 0) -> list:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=generator, requires_grad=True) for _ in range(3)]


def _causal() -> torch.Tensor:
    return torch.zeros(B, 1, L, L).masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), MIN)


def _padding() -> torch.Tensor:
    mask = torch.zeros(B, 1, 1, L)
    mask[0, ..., -3:] = MIN
    return mask


def _alibi() -> torch.Tensor:
    slopes = 2.0 ** -torch.arange(1, H + 1, dtype=torch.float32)
    return (slopes[:, None, None] * torch.arange(L)[None, None, :]).repeat(B, 1, 1)   # [b*h, 1, kv]


def _counts() -> tuple:
    stats = memfuse.stats()
    return stats["attention_biases_fused"], stats["attention_biases_kept"]


def _against_eager(fused, fn, tensors: list, rest: list, parameters: list = ()) -> None:
    """Outputs and the gradients of `tensors` and `parameters` of fused against fn's (relative to
    their norms: the kernels sum in another order than eager)."""
    leaves = [*tensors, *parameters]
    out = fused(*tensors, *rest)
    out.square().sum().backward()
    grads = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None
    want = fn(*tensors, *rest)
    want.square().sum().backward()
    assert rel_error(out, want) < 1e-5
    for got, t in zip(grads, leaves):
        assert got is not None and rel_error(got, t.grad) < 1e-5, rel_error(got, t.grad)


def test_blooms_alibi_attention_runs_as_one_attention_call():
    fused = memfuse.memory_efficient_fusion(bloom_form)
    fired, kept = _counts()
    _against_eager(fused, bloom_form, _tensors(), [_alibi(), _causal()])
    assert _counts() == (fired + 1, kept)
    report = str(memfuse.explain(fused, *_tensors(), _alibi(), _causal()))
    assert "attention_bias_0: one attention call: softmax(scale 0.25 * q @ k^T + 2 bias term(s))" in report
    # the scores' products and softmax are gone from forward and backward: the attention op is all
    assert "aten.bmm" not in report and "_softmax" not in report, report


def test_t5s_learned_position_bias_gets_its_gradient_through_the_backend():
    torch._dynamo.reset()
    module = T5Form()
    compiled = torch.compile(module, backend="memfuse", fullgraph=True)
    fired, kept = _counts()
    _against_eager(compiled, module, _tensors(1), [_padding()], [module.position_bias])
    assert _counts() == (fired + 1, kept)


def test_dropout_is_the_attention_calls_own_with_one_mask_forward_and_backward():
    """v the identity: the output is the dropped probabilities P'; with the identity as the output's
    gradient, v's gradient is P'^T. Equal: the backward applied the forward's mask."""
    module = T5Form(p=0.5).train()
    fused = memfuse.memory_efficient_fusion(lambda q, k, v, mask: module(q, k, v, mask).transpose(1, 2))
    q, k, _ = _tensors(2)
    identity = torch.eye(L).expand(B, H, L, L)
    v = identity.clone().requires_grad_()
    fired, kept = _counts()
    out = fused(q, k, v, _padding())
    out.backward(identity)
    assert _counts() == (fired + 1, kept)
    assert 0.3 < (out == 0).float().mean() < 0.7                      # a mask of p = 0.5 was applied
    torch.testing.assert_close(v.grad.transpose(-1, -2), out.detach())
    report = str(memfuse.explain(fused, q, k, v, _padding()))
    # one random draw: the attention call's; the dropout as written was erased after the trace
    assert re.search(r"joint .* 1 random", report), report


def test_a_product_whose_v_broadcasts_stays_as_written_with_the_reason():
    def broadcast_v(q, k, v, mask):
        probs = F.softmax(q @ k.transpose(-1, -2) + mask, dim=-1)
        return probs @ v[:1]           # v broadcast over the batch: not one attention call's v

    fused = memfuse.memory_efficient_fusion(broadcast_v)
    fired, kept = _counts()
    _against_eager(fused, broadcast_v, _tensors(3), [_causal()])
    assert _counts() == (fired, kept + 1)
    assert "left as written: v (1, " in str(memfuse.explain(fused, *_tensors(3), _causal()))


def test_a_softmax_over_another_dim_is_not_followed():
    def over_queries(q, k, v, mask):
        return F.softmax(q @ k.transpose(-1, -2) + mask, dim=-2) @ v

    fused = memfuse.memory_efficient_fusion(over_queries)
    counts = _counts()
    _against_eager(fused, over_queries, _tensors(4), [_causal()])
    assert _counts() == counts


def test_a_scale_after_the_bias_is_not_followed():
    def scaled_bias(q, k, v, mask):
        return F.softmax((q @ k.transpose(-1, -2) + mask) * 0.5, dim=-1) @ v

    fused = memfuse.memory_efficient_fusion(scaled_bias)
    counts = _counts()
    _against_eager(fused, scaled_bias, _tensors(5), [_padding()])
    assert _counts() == counts


def test_in_bf16_the_attention_call_is_at_least_as_exact_as_the_written_form():
    """Under bf16 autocast the written form rounds the scores to bf16 (baddbmm's output) before
    its float32 softmax; the call adds the bias to float32 scores. Both round the bias to bf16 and
    the probabilities for the product with v. Against float64, the call's error is at most the
    written form's (and both are bf16's: under 2e-2 relative)."""
    q, k, v = [t.detach() * 3 for t in _tensors(6)]
    alibi, mask = _alibi() * 4, _causal()
    exact = bloom_form(q.double(), k.double(), v.double(), alibi.double(), mask.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        written = bloom_form(q, k, v, alibi, mask)
        decisions = []
        with BiasedAttentionMode(decisions):
            called = bloom_form(q, k, v, alibi, mask)
    assert [d.taken for d in decisions] == [True] and called.dtype == written.dtype == torch.bfloat16

    def error(t):
        return ((t.double() - exact).norm() / exact.norm()).item()
    assert error(called) <= error(written) * 1.05 and error(written) < 2e-2, (error(called), error(written))


@pytest.mark.parametrize("family", ["bloom", "t5"])
def test_hf_tiny_models_eager_attention_runs_as_attention_calls(family):
    """The zoo's tiny Bloom and T5 (eager attention, as transformers <= 5.17 runs T5): every layer's
    attention is one call, and the step matches eager."""
    pytest.importorskip("transformers")
    from benchmarks.lib import hf_models as bench
    from benchmarks.lib.zoo import ZOO

    torch._dynamo.reset()
    spec = ZOO[family]
    setup = bench.Setup(torch.device("cpu"), tiny=True, settings=bench.TINY_SETTINGS)
    model = _eager_attention(bench.build(spec, spec.tiny, 0.0))
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    batch = spec.make_batch(spec.tiny, setup.device)
    want = bench.train_step(model, batch, setup).item()
    want_grads = bench.gradients(model)
    twin = _eager_attention(bench.build(spec, spec.tiny, 0.0, weights))
    fired, _ = _counts()
    loss = bench.train_step(bench.WRAPPERS["memfuse_backend"](twin, spec), batch, setup).item()
    layers = spec.tiny.layers * (3 if family == "t5" else 1)    # T5: encoder self, decoder self and cross
    assert _counts()[0] - fired == layers, (_counts(), fired)
    assert memfuse.stats()["graph_fallbacks"] == 0
    assert abs(loss - want) <= 1e-5 * abs(want)
    error, worst = bench.grad_error(bench.gradients(twin), want_grads)
    assert error <= 1e-4, worst


def _eager_attention(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every module's config asking for eager attention (T5's encoder and decoder
    hold copies of the model's config)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None:
            config._attn_implementation = "eager"
    return model


def test_scores_written_in_place_are_no_longer_followed():
    """A write the mode does not follow (masked_fill_, an item set) changes the scores it follows:
    the product stays as written, and the values are eager's."""
    def filled_in_place(q, k, v, mask):
        scores = q @ k.transpose(-1, -2) + mask
        scores.masked_fill_(mask.expand_as(scores) < 0, -1e4)
        scores[..., 0] = 0.0
        return F.softmax(scores, dim=-1) @ v

    fused = memfuse.memory_efficient_fusion(filled_in_place)
    counts = _counts()
    _against_eager(fused, filled_in_place, _tensors(7), [_causal()])
    assert _counts() == counts
