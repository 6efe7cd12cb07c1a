"""memfuse.schedule.row_order: a kernel that reads a permuted view walks its rows in memory order and writes
its outputs in that order's layout, where nothing that reads them needs them contiguous. Results
match eager whatever the layouts; the runtime copies a plain input that lies otherwise."""
import torch
import torch.nn.functional as F

import memfuse
from memfuse.capture import capture
from memfuse.base.config import Config
from memfuse.plan import plan
from memfuse.runtime.program import _in_layout
from memfuse.schedule.groups import schedule

B, S, H, D = 2, 8, 2, 8


def rotary(x, cos, sin, heads):
    """Llama's rotary embedding of a projection read as heads: [B, S, heads*D] as [B, heads, S, D]."""
    q = x.view(B, S, heads, D).transpose(1, 2)
    rotated = torch.cat((-q[..., D // 2:], q[..., :D // 2]), dim=-1)
    return q * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def attention_block(x, wq, wk, wv, wo, cos, sin):
    q, k = rotary(x @ wq, cos, sin, H), rotary(x @ wk, cos, sin, H)
    v = (x @ wv).view(B, S, H, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (out.transpose(1, 2).reshape(B * S, H * D) @ wo).square().sum()


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(16, H * D, generator=g, requires_grad=True) for _ in range(3)]
    return [torch.randn(B * S, 16, generator=g, requires_grad=True), *weights,
            torch.randn(H * D, 4, generator=g, requires_grad=True),
            torch.randn(B, S, D, generator=g), torch.randn(B, S, D, generator=g)]


def _schedules(fn, tensors):
    the_plan = plan(capture(lambda *t: (fn(*t),), tensors, trace_joint=True))
    return schedule(the_plan.forward, Config(), "forward"), schedule(the_plan.backward, Config(), "backward")


def _against_eager(fn, tensors):
    fused = memfuse.memory_efficient_fusion(fn)
    got = fused(*tensors)
    got.backward()
    grads = [t.grad for t in tensors if t.requires_grad]
    for t in tensors:
        t.grad = None
    want = fn(*tensors)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, t in zip(grads, [t for t in tensors if t.requires_grad]):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-5)


def test_rotary_walks_the_projection_in_memory_order_and_writes_heads_as_the_projection_lies():
    forward, backward = _schedules(attention_block, _inputs())
    ordered = [g for g in forward.kernels if g.row_order]
    outputs = [out for g in ordered for out in g.outputs]
    assert len(outputs) == 2                             # the query's and the key's rotary
    for group in ordered:
        assert group.row_order == (0, 2, 1)              # [B, H, S] walked as (B, S, H)
        for out in group.outputs:
            b, h, s, d = forward.graph[out].value.shape
            assert group.layouts[out] == (s * h * d, d, h * d, 1)    # [B, H, S, D] in [B, S, H, D] memory
    reasons = [reason for _, reason in forward.placed if "rows in order" in reason]
    assert len(reasons) == len(ordered) and all("through permute(0, 2, 1, 3) in memory order" in r for r in reasons)
    assert any(g.row_order for g in backward.kernels)    # the rotary the backward computes again
    _against_eager(attention_block, _inputs())


def test_the_kernel_unravels_rows_in_that_order():
    forward, _ = _schedules(attention_block, _inputs())
    group = next(g for g in forward.kernels if g.row_order)
    source = memfuse.codegen.generate(forward.graph, group, Config()).source
    assert "rows run in order (0, 2, 1)" in source.source and "rows in order (0, 2, 1)" in source.summary
    assert "permute_i1 = rows % " in source.source       # the heads' index moves fastest


def permute_then_sin(x):
    return (x.permute(1, 0, 2) * 2).sin()


def test_a_returned_value_or_a_contiguous_input_keeps_row_major_rows():
    """The forward returns its kernel's output (a caller may `.view` it as eager made it); the
    backward reads the incoming gradient as plain rows (contiguous: another order would copy it)."""
    x = torch.randn(3, 4, 8, requires_grad=True)
    forward, backward = _schedules(permute_then_sin, [x])
    assert not any(g.row_order for g in forward.kernels + backward.kernels)
    fused = memfuse.memory_efficient_fusion(permute_then_sin)
    out = fused(x)
    assert out.is_contiguous()
    torch.testing.assert_close(out, permute_then_sin(x))


def heads_flattened(x, w):
    y = x.view(B, S, H, D).transpose(1, 2) * 2           # [B, H, S, D], a kernel's output
    return (y.reshape(B * H, S * D) @ w).square().sum()  # a reshape [B, S, H, D] memory would copy


def test_an_output_that_a_reshape_reads_as_rows_keeps_row_major_rows():
    tensors = [torch.randn(B * S, H * D, requires_grad=True), torch.randn(S * D, 3, requires_grad=True)]
    forward, _ = _schedules(heads_flattened, tensors)
    assert not any(g.row_order for g in forward.kernels)
    _against_eager(heads_flattened, tensors)


def test_in_layout_copies_only_what_lies_otherwise():
    x = torch.randn(2, 3, 4, 5)
    bshd = (60, 5, 15, 1)                                # [2, 3, 4, 5] as [2, 4, 3, 5] memory
    made = _in_layout(x, bshd)
    assert made.stride() == bshd and torch.equal(made, x) and made.data_ptr() != x.data_ptr()
    assert _in_layout(made, bshd) is made
    one = torch.randn(40).as_strided((2, 1, 4, 5), (20, 7, 5, 1))    # a size-1 dim may have any stride
    assert _in_layout(one, (20, 20, 5, 1)) is one


def test_the_tiny_llama_orders_its_rotary_backward_by_the_copy_that_reads_it():
    """Llama's rotary backward writes the query projection's gradient as heads; the copy into the
    projection's layout then reads it in order. Its plain input (attention's gradient, an aten
    result) is taken as it lies or copied: gradients match eager either way."""
    from benchmarks.lib.hf_models import FAMILIES, build, make_batch
    family = FAMILIES["llama"]
    torch.manual_seed(0)
    model, reference = build(family, family.tiny, 0.0), build(family, family.tiny, 0.0)
    reference.load_state_dict(model.state_dict())
    batch = make_batch(family.tiny, torch.device("cpu"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="memfuse")
    compiled(**batch).loss.backward()
    reference(**batch).loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    backward = memfuse.explain(compiled, **batch)
    assert "in memory order" in str(backward) and "reads add" in str(backward)
