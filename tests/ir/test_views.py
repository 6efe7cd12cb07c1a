"""Views that move elements (permute, slice, select, split, cat and their backwards), read in
place through access maps, against eager: outputs and every gradient, fp32 and bf16, on
non-contiguous inputs, over several leading sizes with one compile, and never extern."""
from __future__ import annotations

import logging

import pytest
import sympy
import torch
import torch.nn.functional as F

import memfuse
from memfuse import Config
from memfuse.runtime import aten_groups as runtime
from memfuse.schedule import groups as scheduling
from memfuse.ir.graph import Op

from compare import assert_same, run_both
from helpers import assert_compiles, rel_error

DTYPES = [torch.float32, torch.bfloat16]


def swiglu(x):
    a, b = x.chunk(2, -1)
    return F.silu(a) * b


def heads(x):
    """[B, T, D] -> [B, H, T, D/H]: split D, move the heads before the sequence."""
    b, t, d = x.shape
    return (x.view(b, t, 2, d // 2).transpose(1, 2) * 2).sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return x * 0.5 + torch.cat([-x[..., half:], x[..., :half]], -1)


CASES = {   # name -> (fn, input shapes)
    "permute_leading": (lambda x: (x.permute(1, 0, 2) * 2).sin(), [(3, 4, 8)]),
    "transpose_then_row_sum": (lambda x: torch.softmax(x.transpose(0, 1), -1), [(3, 4, 8)]),
    "slice_leading": (lambda x: x[:, 1:4].exp(), [(3, 6, 8)]),
    "slice_columns": (lambda x: x[..., 2:7].exp(), [(3, 4, 8)]),
    "slice_negative_start": (lambda x: x[:, -2:] * 3, [(3, 5, 8)]),
    "select_leading": (lambda x: x[:, 1].exp(), [(3, 6, 8)]),
    "select_last_row": (lambda x: x[:, -1] * 2, [(3, 6, 8)]),
    "select_column": (lambda x: x[..., 0] * 2, [(3, 6, 8)]),
    "chunk_swiglu": (swiglu, [(3, 4, 16)]),
    "split_heads": (heads, [(3, 5, 8)], ["aten.view.default"]),   # the backward merges the heads back
    # (the merge is an aten view of the moved gradient: that gradient is written by a kernel first)
    "split_heads_plain": (lambda x: x.view(*x.shape[:2], 2, -1).transpose(1, 2) * 2, [(3, 5, 8)],
                          ["aten.view.default"]),
    "cat_columns": (lambda x, y: torch.cat([x.sin(), y], -1).exp(), [(3, 4, 8), (3, 4, 4)]),
    "cat_rows": (lambda x, y: torch.cat([x, y * 2], 1).exp(), [(3, 4, 8), (3, 2, 8)]),
    "rotate_half": (rotate_half, [(3, 4, 8)]),
    "slice_of_permute": (lambda x: x.permute(1, 0, 2)[1:, :, 2:6] * 2, [(3, 4, 8)]),
    # cat parts along D computed at their columns (capture's columns_in_registers): binary ops of
    # two shifted reads, a row value, three parts, slices of a computed product (rotate_half's
    # backward reads those), and a chain deeper than it rebuilds (read from memory instead)
    "cat_of_products": (lambda x, y: torch.cat([x[..., 4:] * y[..., :4], x[..., :4] - y[..., 4:]], -1).exp(),
                        [(3, 4, 8), (3, 4, 8)]),
    "cat_three_parts_and_a_row": (lambda x: torch.cat([x[..., :2].exp(), -x[..., 4:], x[..., 2:4] * x.sum(-1, True)],
                                                      -1) * 2, [(3, 4, 8)]),
    "rotate_half_of_a_product": (lambda x, y: rotate_half(x * y), [(3, 4, 8), (3, 4, 8)]),
    "cat_of_a_deep_chain": (lambda x: torch.cat([x[..., :4].sin().cos().exp().neg().sin().cos().exp(), x[..., 4:]],
                                                -1) * 2, [(3, 4, 8)]),
    "select_with_weight": (lambda x, w: F.layer_norm(x[:, 0], (8,), w), [(3, 4, 8), (8,)]),
}


def test_slice_with_a_step_fuses_forward_and_scatters_back_through_aten():
    """The backward's slice_scatter with a step (index (c - start) / step) is not an affine map."""
    both = run_both(lambda x: x[..., 1:8:2] * x[..., :4], [torch.randn(3, 4, 8, requires_grad=True)])
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    assert [f[1] for f in both.fallbacks] == ["aten.slice_scatter.default"]
    assert "step 2" in both.fallbacks[0][2]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(CASES))
def test_view_matches_eager_and_fuses(name, dtype):
    fn, shapes, *allowed = CASES[name]
    args = [torch.randn(s).to(dtype).requires_grad_() for s in shapes]
    before = memfuse.stats()["extern_calls"]
    both = run_both(fn, args)
    assert_same(both.fused, both.eager, reference=both.reference)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient", reference=both.reference_grads)
    fallbacks = [f for f in both.fallbacks if f[1] not in (allowed[0] if allowed else [])]
    assert not fallbacks, f"fell back to aten: {fallbacks}"
    if not allowed:
        assert memfuse.stats()["extern_calls"] == before
    joint = both.captured[0].joint
    assert any(n.op is Op.STRIDED for n in joint.nodes.values())


NON_CONTIGUOUS = {   # name -> (fn, a non-contiguous input)
    "transposed": (lambda x: (x * 2).sin(), lambda: torch.randn(4, 3, 8).transpose(0, 1)),
    "sliced_columns": (lambda x: torch.softmax(x, -1), lambda: torch.randn(3, 4, 12)[..., 2:10]),
    "sliced_rows_then_permute": (lambda x: x.permute(1, 0, 2).exp(), lambda: torch.randn(6, 4, 8)[::2]),
    "last_dim_strided": (lambda x: x.sum(-1, keepdim=True) * x, lambda: torch.randn(3, 8, 4).transpose(1, 2)),
}


@pytest.mark.parametrize("name", list(NON_CONTIGUOUS))
def test_non_contiguous_input_is_read_in_place(name):
    fn, make = NON_CONTIGUOUS[name]
    base = make()
    assert not base.is_contiguous()
    fused_fn = memfuse.memory_efficient_fusion(fn)
    x = base.detach().requires_grad_()            # a leaf with the same (non-contiguous) strides
    eager_x = base.detach().requires_grad_()
    out, want = fused_fn(x), fn(eager_x)
    grad = torch.randn_like(want)
    out.backward(grad)
    want.backward(grad)
    assert_same([out], [want])
    assert_same([x.grad], [eager_x.grad], scale=2.0, what="gradient")
    entry = next(iter(fused_fn.cache.values()))
    assert not entry.captured.fallbacks
    joint = entry.captured.joint
    reads = [n for n in joint.nodes.values() if n.op is Op.STRIDED and n.inputs[0] == joint.inputs[0]]
    assert reads and all(not n.attr.contiguous_root for n in reads)


def test_a_size_inferred_by_minus_one_is_evaluated_per_call():
    """view(2, -1, D): the size floor(s0 / 2) is Python in the program (math.floor)."""
    both = run_both(lambda x: x.view(2, -1, 8).transpose(0, 1) * 2, [torch.randn(6, 8, requires_grad=True)])
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")


def test_a_value_named_like_a_size_function_leaves_the_size_its_function():
    """A value named `floor` (aten.floor, stochastic depth's mask) beside the size floor(s0 / 2):
    the program's local `floor` shadowed math.floor there (UnboundLocalError)."""
    def fn(x):
        keep = (x + 0.5).floor()
        return x.view(2, -1, 8).transpose(0, 1) * 2 + keep.view(2, -1, 8).transpose(0, 1)
    both = run_both(fn, [torch.randn(6, 8, requires_grad=True)])
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")


def test_one_compile_serves_every_leading_size():
    def fn(x, y):
        return torch.cat([x.permute(1, 0, 2), y], -1)[..., 4:].sin()
    fused = memfuse.memory_efficient_fusion(fn)
    for b, t in [(3, 4), (5, 2), (4, 7)]:
        x = torch.randn(b, t, 8, requires_grad=True)
        y = torch.randn(t, b, 4, requires_grad=True)   # (sizes 2 and up: 1 is a compile key of its own)
        out = fused(x, y)
        xe, ye = x.detach().requires_grad_(), y.detach().requires_grad_()
        want = fn(xe, ye)
        grad = torch.randn_like(want)
        out.backward(grad)
        want.backward(grad)
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(x.grad, xe.grad)
        torch.testing.assert_close(y.grad, ye.grad)
    stats = memfuse.stats()
    assert stats["compiles"] == 1 and stats["recompiles"] == 0, stats
    assert stats["extern_calls"] == 0, stats


def test_non_contiguous_layouts_share_a_compile():
    """Inputs of one compile key but other strides: strides are read per call. Whether the last
    stride is 1 is part of the key: then a row's columns load as one block."""
    fused = memfuse.memory_efficient_fusion(lambda x: x.exp() * 2)
    rows_in_place = [torch.randn(4, 3, 8).transpose(0, 1), torch.randn(3, 8, 8)[:, ::2], torch.randn(3, 4, 12)[..., 2:10]]
    any_strides = [torch.randn(3, 4, 16)[..., ::2], torch.randn(3, 8, 4).transpose(1, 2)]
    for x in rows_in_place + any_strides:
        torch.testing.assert_close(fused(x), x.exp() * 2)
    assert memfuse.stats()["compiles"] == 2
    sources = {entry.captured.joint.nodes["arg0_1_in_place"].attr.last_stride_one:
               entry.function.forward.steps[0].kernel.source.source for entry in fused.cache.values()}
    assert "arg0_1_stride2" not in sources[True] and "+ cols[None, :]" in sources[True]
    assert "arg0_1_stride2: tl.int64" in sources[False] and "(cols * arg0_1_stride2)" in sources[False]


SLICED_LAYOUTS = {   # name -> a non-contiguous input of batch size b
    "columns_of_a_wider_tensor": lambda b: torch.randn(b, 4, 12)[..., 2:10],
    "every_other_row": lambda b: torch.randn(2 * b, 4, 8)[::2],
    "transposed_leading_dims": lambda b: torch.randn(4, b, 8).transpose(0, 1),
}


@pytest.mark.parametrize("name", list(SLICED_LAYOUTS))
def test_sliced_inputs_share_a_compile_over_batch_sizes(name):
    """softmax's decomposition checks contiguity: the trace guards on a stride (the row stride
    of x[..., 2:10] is not D). The guard holds for every batch size: checked per call, no
    recompile."""
    fused = memfuse.memory_efficient_fusion(lambda x: torch.softmax(x, -1))
    for b in (3, 5, 6):
        x = SLICED_LAYOUTS[name](b).requires_grad_()
        eager_x = x.detach().requires_grad_()
        out, want = fused(x), torch.softmax(eager_x, -1)
        grad = torch.randn_like(want)
        out.backward(grad)
        want.backward(grad)
        assert_same([out], [want])
        assert_same([x.grad], [eager_x.grad], scale=2.0, what="gradient")
    entry, = fused.cache.values()
    assert entry.captured.specialized is None
    assert memfuse.stats()["compiles"] == 1


def test_a_layout_that_breaks_the_traced_stride_guard_compiles_again(caplog):
    """Traced on x[..., 2:10] of rows of 12 (guard: row stride != D), then given rows of stride
    D = 8 (every other row of a tensor): a second program, the broken guard logged; both
    layouts then hit their own program."""
    caplog.set_level(logging.INFO, logger="memfuse.recompiles")
    fused = memfuse.memory_efficient_fusion(lambda x: torch.softmax(x, -1))
    layouts = [SLICED_LAYOUTS["columns_of_a_wider_tensor"], SLICED_LAYOUTS["every_other_row"]]
    for make in layouts + layouts:
        x = make(3)
        torch.testing.assert_close(fused(x), torch.softmax(x, -1))
    assert memfuse.stats()["compiles"] == 2 and memfuse.stats()["recompiles"] == 1
    assert any("layout guard" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    first, _ = fused.cache.values()
    assert first.captured.layout_guards and first.broken_guard([layouts[1](3)]) is not None
    assert first.broken_guard([layouts[0](5)]) is None


def test_strided_offsets_are_int64():
    """A coefficient x stride product (a select's offset into dim 0, a split dim's step) passes
    2**31 in a tensor of more elements although each factor fits in 32 bits: strides are int64
    kernel arguments and never specialized (tests/gpu/test_gpu.py reads such a tensor)."""
    fused = memfuse.memory_efficient_fusion(lambda x: x.permute(1, 0, 2)[2] * 2)
    x = torch.randn(6, 5, 8)[:, ::2]
    torch.testing.assert_close(fused(x), x.permute(1, 0, 2)[2] * 2)
    kernel = next(iter(fused.cache.values())).function.forward.steps[0].kernel.source.source
    assert "arg0_1_stride0: tl.int64," in kernel and "arg0_1_stride1: tl.int64," in kernel
    jit = next(line for line in kernel.splitlines() if line.startswith("@triton.jit"))
    assert "'arg0_1_stride0'" in jit and "'arg0_1_stride1'" in jit          # do_not_specialize
    assert "2 * arg0_1_stride1" in kernel                                   # the select's offset: int64


def test_looped_kernels_read_views():
    """Rows past Config.max_row_length: the strided reads run chunk by chunk."""
    def fn(x, y):
        return torch.softmax(torch.cat([x[:, 1:], y], -1), -1)
    args = [torch.randn(3, 5, 24, requires_grad=True), torch.randn(3, 4, 8, requires_grad=True)]
    both = run_both(fn, args, config=Config(max_row_length=16, loop_block_d=8))
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    assert not both.fallbacks


def test_explain_says_why_a_view_of_a_computed_value_ends_the_kernel():
    def fn(x):
        return x.softmax(-1).permute(1, 0, 2) * 2      # a row reduction's result: written, then read
    report = memfuse.explain(fn, torch.randn(3, 4, 8, requires_grad=True))
    assert not report.fallbacks
    assert any("in place" in row.reason for row in report.not_fused), report.not_fused


def test_a_permute_of_a_computed_value_read_once_is_computed_at_the_permuted_index():
    """A pointwise value only a permute reads (here for a matmul, as the query's gradient goes back
    to its projection) is computed at the permuted index by the kernel that writes the permuted
    copy, its reads moved through the permute: one kernel, the product never written by another."""
    def once(x, y, w):
        return (x.sin() * y).permute(1, 0, 2).reshape(4, 24) @ w

    x, y, w = torch.randn(3, 4, 8, requires_grad=True), torch.randn(3, 4, 8), torch.randn(24, 5)
    fused = memfuse.memory_efficient_fusion(once)
    out, ref = fused(x, y, w), once(x, y, w)
    assert rel_error(out, ref) <= 1e-5
    grad, = torch.autograd.grad(out.sum(), x)
    assert rel_error(grad, torch.autograd.grad(ref.sum(), x)[0]) <= 1e-5
    forward = fused.compiled_for(x, y, w).function.forward.schedule
    assert len(forward.kernels) == 1, [(k.name, k.nodes, k.outputs) for k in forward.kernels]
    assert "mul" not in forward.kernels[0].outputs


BROADCASTS = {   # name -> (fn, input shapes): operands whose leading dims repeat against the result's
    "rows_over_time": (lambda a, b: (a * b).sin(), [(4, 8), (3, 4, 8)]),
    "leading_one": (lambda a, b: (a * b).sin(), [(1, 4, 8), (3, 4, 8)]),
    "middle_one": (lambda a, b: (a + b).tanh(), [(3, 1, 8), (3, 4, 8)]),
    "row_vector": (lambda a, b: a * b, [(4, 1), (3, 4, 8)]),
    "expand": (lambda a, b: a.expand(3, 4, 8) * b, [(4, 8), (3, 4, 8)]),
    "two_leading_dims": (lambda a, b: torch.where(a > 0, a, b), [(4, 8), (2, 3, 4, 8)]),
    "layer_norm_of_sum": (lambda a, b: F.layer_norm(a + b, (8,)), [(4, 8), (3, 4, 8)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(BROADCASTS))
def test_leading_dim_broadcast_is_a_stride_0_read(name, dtype):
    """The forward reads the broadcast operand in place with stride 0 along the repeated dims;
    its gradient sums over them."""
    fn, shapes = BROADCASTS[name]
    args = [torch.randn(s).to(dtype).requires_grad_() for s in shapes]
    both = run_both(fn, args)
    assert_same(both.fused, both.eager, reference=both.reference)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient", reference=both.reference_grads)
    joint = both.captured[0].joint
    assert any(n.op is Op.STRIDED and n.attr.describe.startswith("broadcast") for n in joint.nodes.values())
    assert any(n.op is Op.STRIDED and n.attr.summed for n in joint.nodes.values())
    assert not both.fallbacks


LEADING_SUMS = {   # name -> (fn, input shape): sums and means over some of the leading dims
    "sum_first": (lambda x: x.sum(0).exp(), (3, 4, 8)),
    "mean_middle_keepdim": (lambda x: x.mean(1, keepdim=True) * x, (3, 4, 8)),
    "sum_two_of_three": (lambda x: x.sum((0, 2)).sin(), (2, 3, 4, 8)),
    "sum_with_d": (lambda x: x.sum((0, 2)), (3, 4, 8)),
    "mean_with_d_keepdim": (lambda x: x.mean((0, 2), keepdim=True) + x, (3, 4, 8)),
    "row_value": (lambda x: x.sum(-1).sum(0), (3, 4, 8)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(LEADING_SUMS))
def test_sum_over_some_leading_dims_is_a_summed_read(name, dtype):
    fn, shape = LEADING_SUMS[name]
    both = run_both(fn, [torch.randn(shape).to(dtype).requires_grad_()])
    assert_same(both.fused, both.eager, reference=both.reference)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient", reference=both.reference_grads)
    assert not both.fallbacks
    assert any(n.op is Op.STRIDED and n.attr.summed for n in both.captured[0].joint.nodes.values())


CHANNEL_SUMS = {   # name -> (fn, input shape): sums over leading dims and D whose result lies elsewhere in [M, D]
    # a [N, C] mean of [N, C, H, W] (global pooling): rows [N, C, H, 1] summed over H, few terms each
    "pooled": (lambda x: x.mean((2, 3)).sin(), (2, 3, 4, 8), False),
    # BatchNorm's per-channel statistic: a [C] column vector of N x H rows each (more terms than
    # outputs: aten sums the rows)
    "per_channel": (lambda x: x.sum((0, 2, 3)).exp(), (2, 3, 4, 8), True),
    "per_channel_keepdim": (lambda x: x * x.mean((0, 2, 3), keepdim=True), (2, 3, 4, 8), True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(CHANNEL_SUMS))
def test_sums_over_leading_dims_and_d_in_another_place(name, dtype):
    """The rows are summed in a kernel; their sum, a row value, is read in the result's place (a
    reshape of the written totals), or, with more terms than outputs, summed by one aten call."""
    fn, shape, by_aten = CHANNEL_SUMS[name]
    both = run_both(fn, [torch.randn(shape).to(dtype).requires_grad_()])
    assert_same(both.fused, both.eager, reference=both.reference)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient", reference=both.reference_grads)
    assert not both.fallbacks
    joint = both.captured[0].joint
    sums = [n for n in joint.nodes.values() if n.op is Op.EXTERN and n.attr.target is torch.ops.aten.sum.dim_IntList]
    assert bool(sums) == by_aten
    assert all(joint[n.inputs[0]].op is Op.SUM for n in sums)     # aten reads the summed rows, not x


def test_broadcast_serves_every_leading_size_with_one_compile():
    def fn(a, b, s):
        return F.layer_norm(a + b * s, (8,))
    fused = memfuse.memory_efficient_fusion(fn)
    for t, b in [(3, 4), (5, 2), (2, 6)]:
        args = [torch.randn(b, 8), torch.randn(t, b, 8), torch.randn(b, 1)]
        args = [a.requires_grad_() for a in args]
        eager = [a.detach().requires_grad_() for a in args]
        out, want = fused(*args), fn(*eager)
        grad = torch.randn_like(want)
        out.backward(grad)
        want.backward(grad)
        assert_same([out], [want])
        assert_same([a.grad for a in args], [a.grad for a in eager], scale=2.0, what="gradient")
    stats = memfuse.stats()
    assert stats["compiles"] == 1 and stats["extern_calls"] == 0, stats


def test_looped_kernels_read_broadcasts_sums_and_moved_columns():
    def fn(a, x):
        return torch.softmax(a * x, -1) + x.mean(0) + (x.transpose(1, 2) * 2).transpose(1, 2)
    args = [torch.randn(4, 24, requires_grad=True), torch.randn(3, 4, 24, requires_grad=True)]
    both = run_both(fn, args, config=Config(max_row_length=16, loop_block_d=8))
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    assert not both.fallbacks


def test_strict_mode_accepts_broadcasts():
    fused = memfuse.memory_efficient_fusion(lambda a, b: (a * b).sum(-1), config=Config(strict=True))
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(3, 4, 8, requires_grad=True)
    fused(a, b).sum().backward()
    torch.testing.assert_close(a.grad, b.sum(0).detach())


AT_ATEN = {   # name -> (fn, input shapes): every kind of strided read, in groups run op by op
    **{name: CASES[name][:2] for name in ["permute_leading", "slice_of_permute", "select_column", "cat_columns",
                                          "cat_rows", "rotate_half", "select_with_weight"]},
    **{name: BROADCASTS[name] for name in ["rows_over_time", "middle_one", "row_vector"]},
    "sum_with_d": (LEADING_SUMS["sum_with_d"][0], [LEADING_SUMS["sum_with_d"][1]]),
}


@pytest.mark.parametrize("name", list(AT_ATEN))
def test_groups_the_code_generator_declines_read_views_through_aten(name, monkeypatch):
    """runtime._read_view: the aten-group path indexes the root in torch by the same access map,
    windows (cat, the slice and select backwards) and summed dims included."""
    monkeypatch.setattr(scheduling, "_codegen_limit", lambda graph, group, config: "declined for this test")
    reads = []
    read_view = runtime._read_view
    monkeypatch.setattr(runtime, "_read_view", lambda node, *rest: reads.append(node.attr) or read_view(node, *rest))
    fn, shapes = AT_ATEN[name]
    both = run_both(fn, [torch.randn(s, requires_grad=True) for s in shapes])
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    assert both.kernels == 0 and reads
    assert memfuse.stats()["fallbacks"] > 0


LAST_DIM_MOVES = {   # name -> (fn, input shapes): transposes that move D, both ways
    "transpose_last_two": (lambda x: x.transpose(1, 2) * 2, [(3, 4, 8)]),
    "and_back": (lambda x: (x.transpose(1, 2) * 2).transpose(1, 2).softmax(-1), [(3, 4, 8)]),
    "rank_two": (lambda x: x.transpose(0, 1).sin(), [(4, 8)]),
    "rotate_dims": (lambda x: x.permute(2, 0, 1).exp(), [(3, 4, 8)]),
    "add_transposed": (lambda x, y: x.transpose(1, 2) + y, [(3, 4, 8), (3, 8, 4)]),
    "mean_of_transposed": (lambda x: x.mT.mean(1), [(3, 4, 8)]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(LAST_DIM_MOVES))
def test_moving_the_last_dim_reads_columns_by_a_stride(name, dtype):
    """x.transpose(1, 2) of [B, T, D] is [B, D, T]: its last dim is a size symbol, so it is a row
    value (one element per row); the way back ([B, D, T] -> [B, T, D]) walks its columns through
    a leading dim of the root, by that dim's stride."""
    fn, shapes = LAST_DIM_MOVES[name]
    both = run_both(fn, [torch.randn(s).to(dtype).requires_grad_() for s in shapes])
    assert_same(both.fused, both.eager, reference=both.reference)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient", reference=both.reference_grads)
    assert not both.fallbacks


def test_a_column_read_by_a_stride_in_the_generated_kernel():
    fused = memfuse.memory_efficient_fusion(lambda x: x.transpose(1, 2) * 2)
    x = torch.randn(3, 4, 8, requires_grad=True)
    fused(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))
    backward = next(iter(fused.cache.values())).function.backward
    source = "".join(step.kernel.source.source for step in backward.steps if hasattr(step, "kernel"))
    assert "read in place through permute(0, 2, 1)" in source and "(cols * " in source


def test_a_reduction_over_a_moved_symbolic_dim_stays_extern_with_its_reason():
    """softmax over x.transpose(1, 2): the rows are T long, a size symbol, not a static D."""
    both = run_both(lambda x: torch.softmax(x.transpose(1, 2), -1), [torch.randn(3, 4, 8, requires_grad=True)])
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    reasons = {f[1]: f[2] for f in both.fallbacks}
    assert "non-[M, D]" in reasons["aten.amax.default"]


def test_a_view_only_aten_calls_read_stays_an_aten_view():
    """x @ w.t() and a transposed operand of bmm: aten reads a view where it lies, a strided read
    would be a kernel that copies it. Not a fallback: only the matmuls are."""
    def fn(x, w, k):
        return (x @ w.t()).relu() + (x.transpose(0, 1) @ k).transpose(0, 1)
    args = [torch.randn(3, 4, 8, requires_grad=True), torch.nn.Parameter(torch.randn(8, 8)),
            torch.randn(4, 8, 8, requires_grad=True)]
    both = run_both(fn, args)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    assert {f[1] for f in both.fallbacks} <= {"aten.mm.default", "aten.bmm.default", "aten.view.default"}
    joint = both.captured[0].joint
    permutes = [n for n in joint.nodes.values() if n.op is Op.EXTERN and n.attr.target is torch.ops.aten.permute.default]
    assert permutes and all(joint[i].op is not Op.STRIDED for n in permutes for i in n.inputs)


def test_generated_view_reads_are_readable():
    fused = memfuse.memory_efficient_fusion(lambda x: x[:, 1:3].exp())
    fused(torch.randn(3, 4, 8))
    entry = next(iter(fused.cache.values()))
    source = entry.function.forward.steps[0].kernel.source.source
    assert "read in place through slice(dim=1)" in source
    assert "_stride0" in source and "tl.load(" in source


def attention_block(x, w_q, b_q, w_k, w_v, b_v, w_o, heads=2):
    """BERT's attention around scaled_dot_product_attention: each projection viewed as heads and
    transposed, the output transposed back and merged. The key has no bias: its gradient is zero
    (a constant added to every key's score of a query leaves its softmax as it was), so any two
    ways of computing it differ only in rounding."""
    b, t, d = x.shape
    q, k, v = (F.linear(x, w, bias).view(b, t, heads, d // heads).transpose(1, 2)
               for w, bias in ((w_q, b_q), (w_k, None), (w_v, b_v)))
    o = F.scaled_dot_product_attention(q, k, v)
    return (o.transpose(1, 2).reshape(b, t, d) @ w_o.t()).tanh()


def fused_qkv_block(x, w_qkv, w_o, heads=2):
    """GPT-2's: one projection split in three, causal."""
    b, t, d = x.shape
    q, k, v = ((z.view(b, t, heads, d // heads).transpose(1, 2)) for z in (x @ w_qkv.t()).split(d, -1))
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return (o.transpose(1, 2).reshape(b, t, d) @ w_o.t()).tanh()


def fused_qkv_sizes_mask_block(x, w_qkv, w_o, heads=2):
    """GPT-2's as HuggingFace calls attention: a causal mask built from the sizes (memfuse runs
    it as the kernel's own causal flag, through attention.AttentionCall)."""
    b, t, d = x.shape
    q, k, v = ((z.view(b, t, heads, d // heads).transpose(1, 2)) for z in (x @ w_qkv.t()).split(d, -1))
    positions = torch.arange(t, device=x.device)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=positions[None, :] <= positions[:, None])
    return (o.transpose(1, 2).reshape(b, t, d) @ w_o.t()).tanh()


def token_copy_kernels(fused) -> list:
    """(program, kernel summary) of each generated kernel over the tokens (rows that grow with the
    batch; a weight gradient's transpose is not one) that reads through an access map."""
    entry = next(iter(fused.cache.values()))
    return [(which, step.kernel.source.summary) for which in ("forward", "backward")
            for step in getattr(entry.function, which).steps
            if hasattr(step, "kernel") and "strided" in step.kernel.source.summary
            and sympy.sympify(step.group.space.m).free_symbols]


@pytest.mark.parametrize("block", ["separate projections", "split projection", "split projection, mask from sizes"])
def test_attention_reads_heads_where_the_matmuls_wrote_them(block):
    """Query, key and value reach attention as views of the projections' outputs, its output
    reaches the next matmul as a view, and their gradients come back the same way: no kernel
    copies heads into place (eager makes no such copy either), and the biases' gradients are sums
    that write nothing else but, where one joins it, the input gradient's adds. Outputs and
    gradients as eager's."""
    torch.manual_seed(0)
    d = 16
    x = torch.randn(2, 5, d, requires_grad=True)
    if block == "separate projections":
        fn, weights = attention_block, [torch.randn(d, d) / 4, torch.randn(d), torch.randn(d, d) / 4,
                                        torch.randn(d, d) / 4, torch.randn(d), torch.randn(d, d) / 4]
    else:
        fn = fused_qkv_block if block == "split projection" else fused_qkv_sizes_mask_block
        weights = [torch.randn(3 * d, d) / 4, torch.randn(d, d) / 4]
    args = [x] + [torch.nn.Parameter(w) for w in weights]     # weights of static sizes
    both = run_both(fn, args)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, scale=2.0, what="gradient")
    fused = memfuse.memory_efficient_fusion(fn)
    fused(*args).sum().backward()
    copies = token_copy_kernels(fused)
    if block.endswith("mask from sizes"):
        assert memfuse.stats()["attention_masks_dropped"] > 0      # the mask runs as is_causal
    if block == "separate projections":
        assert copies == []
        bias_sums = [step.kernel.source.summary for step in next(iter(fused.cache.values())).function.backward.steps
                     if hasattr(step, "kernel") and "sum over M" in step.kernel.source.summary]
        # each bias gradient sums attention's gradient where it lies: the matmul reads it there too
        assert len(bias_sums) == 2, bias_sums
        assert all("writes" not in summary or "ops: 3x view, 2x add, sum" in summary for summary in bias_sums)
    else:   # the split projection's input gradient gathers the three gradients (eager: a cat)
        assert [which for which, _ in copies] == ["backward"] and "3x strided" in copies[0][1]


def _permutes_of_permutes(program) -> list:
    """Permutes in a program's graph of a value a permute made (whether the program makes them by
    strides or as the tensor's method)."""
    graph = program.graph

    def is_permute(name):
        node = graph[name]
        return node.op is Op.EXTERN and node.attr.target in (torch.ops.aten.permute.default, torch.ops.aten.t.default)
    return [n for n in graph.nodes if is_permute(n) and is_permute(graph[n].inputs[0])]


def test_a_linears_weight_is_not_transposed_back_and_forth():
    """The joint graph transposes a linear's weight for the forward and that transpose back for the
    input's gradient: capture composes a permute of a permute (here into the weight itself), so the
    backward program makes no such pair of calls; results as eager's."""
    def fn(x, w, b):
        return F.gelu(F.linear(x, w, b)) * 2
    args = [torch.randn(3, 4, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True),
            torch.randn(16, requires_grad=True)]
    both = run_both(fn, args)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")
    fused = memfuse.memory_efficient_fusion(fn)
    fused(*args).sum().backward()
    entry = next(iter(fused.cache.values()))
    assert "permute = mf_reinterpret(primals_2, (8, 16), (1, 8), 0)" in entry.function.forward.source   # once
    assert not _permutes_of_permutes(entry.function.backward), entry.function.backward.source
    assert not _permutes_of_permutes(entry.function.forward)


def _with_its_double_transpose(y):
    return y, y.permute(1, 0, 2).permute(1, 0, 2)


@pytest.mark.parametrize("fn", [lambda x: (x.permute(2, 0, 1).permute(1, 2, 0) * 2).sin(),   # the identity
                                lambda x: (x.permute(1, 0, 2).permute(0, 2, 1) * 2).sin(),   # one permute
                                lambda x: x.permute(2, 1, 0).permute(-1, 0, 1).exp(),        # negative dims
                                lambda x: x.permute(1, 0, 2).permute(1, 0, 2),               # the input, returned
                                lambda x: _with_its_double_transpose(x * 2)],                # both returned
                         ids=["identity", "composed", "negative_dims", "returned", "returned_twice"])
def test_composed_permutes_keep_what_each_reads(fn):
    """A permute of a permute that is not the identity becomes one permute of the first's input, and
    a pair that undoes itself its input, also where it is returned (the input itself, or beside the
    value it undoes itself on); results and gradients as eager's."""
    both = run_both(fn, [torch.randn(3, 4, 8, requires_grad=True)])
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")


def packed_sequence_check(position_ids):
    """HuggingFace's packed-sequence check: the ids expanded over the batch, then torch.diff with a
    prepended value, read by slices of the expanded ids."""
    positions = position_ids.expand(3, -1)
    first = positions[:, :1] - 1
    return (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)


def test_views_of_an_expanded_input_read_the_input_by_stride_0():
    """A broadcast of an input that views then read (slices, a cat part) is read through the
    input with stride 0 along the repeated dim: no kernel writes the expanded copy first."""
    position_ids = torch.arange(10)[None, :]
    fused = memfuse.memory_efficient_fusion(packed_sequence_check)
    assert torch.equal(fused(position_ids), packed_sequence_check(position_ids))
    [entry] = [e for e in fused.cache.values() if hasattr(e, "function")]
    allocated = [line for line in entry.function.forward.source.splitlines() if "mf_empty_strided((" in line]
    assert not [line for line in allocated if line.strip().startswith("expand =")], allocated


def diff_with_prepend(x, ids):
    """torch.diff with a prepended column (HuggingFace's packed-sequence check): slices of a cat."""
    return (x * (torch.diff(ids, prepend=ids[:, :1] - 1, dim=-1) != 1).float(),)


def slices_across_cat_parts(x, y):
    """Slices of cats of tensors in memory that start and end inside different parts, along D and
    along M."""
    along_d = torch.cat([x, y, x], -1)[:, 3:-4]
    along_m = torch.cat([x, y], 0)[1:-1]
    return (along_d.sin() * 1.5, along_m * 2)


@pytest.mark.parametrize("fn, make", [
    (diff_with_prepend, lambda: [torch.randn(3, 9, requires_grad=True), torch.randint(0, 9, (3, 9))]),
    (slices_across_cat_parts, lambda: [torch.randn(3, 9, requires_grad=True), torch.randn(3, 9, requires_grad=True)]),
], ids=["diff_with_prepend", "slices_across_cat_parts"])
def test_a_slice_of_a_cat_reads_the_parts_where_they_lie(fn, make):
    """A slice of a cat whose parts are read in memory moves each part's window (and the windows of
    the parts before it): no kernel writes the cat for another to slice. (A part computed in the
    cat's kernel, rotate_half's -x2, is computed at its columns instead: such a cat is written.)"""
    args = make()
    both = run_both(fn, args)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")
    fused = memfuse.memory_efficient_fusion(fn)
    fused(*args)
    [entry] = [e for e in fused.cache.values() if hasattr(e, "function")]
    allocated = [line.strip() for line in entry.function.forward.source.splitlines() if "mf_empty_strided((" in line]
    assert not [line for line in allocated if line.startswith("cat")], allocated


def shifted_labels(x, labels):
    """HuggingFace's causal-LM loss shifts the labels by a pad and a slice."""
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return (x * shifted.float(),)


def cropped_pad(x):
    """A pad on both sides along D and along M, then a slice into it that crosses the window."""
    return (F.pad(x, (2, 1, 1, 0), value=0.5)[:, 1:-1].sin() * 2,)


@pytest.mark.parametrize("fn, make", [
    (shifted_labels, lambda: (torch.randn(3, 9, requires_grad=True), torch.randint(0, 50, (3, 9)))),
    (cropped_pad, lambda: (torch.randn(4, 7, requires_grad=True),)),
], ids=["shifted_labels", "cropped_pad"])
def test_a_slice_of_a_pad_is_one_windowed_read(fn, make):
    """A slice of a pad reads the pad's source where the moved window lies (the fill elsewhere): no
    kernel writes the padded tensor for another to slice, and nothing of it is saved."""
    args = make()
    both = run_both(fn, list(args))
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")
    fused = memfuse.memory_efficient_fusion(fn)
    fused(*args)
    [entry] = [e for e in fused.cache.values() if hasattr(e, "function")]
    source = entry.function.forward.source
    assert "mf_aten" not in source and "constant_pad_nd = " not in source, source     # no pad written
    assert source.count("# memfuse_forward_") == 1, source


def rotary_with_pass_through(qkv, cos, sin):
    """HuggingFace's partial-rotary attention (Phi-3, StableLM, GPT-NeoX): the rotated head dims cat
    with the rest; at a rotary factor of 1 the rest is empty along the cat's dim."""
    b, t, _ = qkv.shape
    q = qkv[..., :32].view(b, t, 2, 16).transpose(1, 2)
    rotated, passed = q[..., :16], q[..., 16:]
    half = torch.cat([-rotated[..., 8:], rotated[..., :8]], -1)
    return (torch.cat([rotated * cos + half * sin, passed], -1),)


def test_a_cat_with_an_empty_part_is_its_other_part_computed_in_place():
    """A cat part empty along the cat's dim is left out: the one part left is the result, computed in
    the kernel that computes it (not written to memory first and copied into the cat), and its
    gradient's empty slice scatters nothing."""
    args = [torch.randn(3, 5, 40, requires_grad=True), torch.randn(1, 1, 5, 16), torch.randn(1, 1, 5, 16)]
    both = run_both(rotary_with_pass_through, args)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")
    report = memfuse.explain(rotary_with_pass_through, *args)
    assert len(report.kernels_of("forward")) == 1, report
    assert not [row for row in report.not_fused if "cat part" in row.reason], report


def repeat_kv(x):
    """HuggingFace's repeat_kv: x[:, :, None] expanded over a new dim, merged into the heads."""
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, 2, t, d).reshape(b, 2 * h, t, d)


@pytest.mark.parametrize("fn, shapes", [
    (lambda x, w: (x * w)[:, None].sin(), [(3, 4, 8), (8,)]),
    (lambda x, w: (repeat_kv(x * w) * 2).sin(), [(2, 2, 4, 8), (8,)]),
    (lambda x, w: (x * w)[:, None], [(3, 4, 8), (8,)]),          # the gradient is the tangent's view
    (lambda x, w: (x[:, None] * w, x * 2), [(3, 4, 8), (8,)]),    # ... beside another gradient of x
], ids=["slice_then_sin", "repeat_kv", "returned", "two_gradients"])
def test_the_gradient_of_a_slice_of_a_whole_symbolic_dim_is_its_source(fn, shapes):
    """`x[:, ...]` over a symbolic batch traces as a slice of the whole dim (the size is not provably
    its end), whose gradient is a slice_scatter of all of it into zeros: that is its source, not a
    windowed copy whose source a kernel must write to memory first; results as eager's."""
    args = [torch.randn(s, requires_grad=True) for s in shapes]
    both = run_both(fn, args)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")
    captured = both.captured[0]
    scatters = captured.aten_graph.graph.find_nodes(op="call_function", target=torch.ops.aten.slice_scatter.default)
    assert scatters, "the trace scatters each slice's gradient into zeros of the whole dim"
    windowed = [n.name for n in captured.joint.nodes.values() if n.op is Op.STRIDED and n.attr.window is not None]
    assert not windowed, windowed


def test_the_gradient_of_a_slice_of_the_whole_batch_fuses_into_the_kernel_before_it():
    """The whole-model trace (symbolic batch) of a decoder's rotary and repeat_kv built this windowed
    copy per layer, a kernel each, where a trace of static sizes (torch.compile's) has none: here
    the backward is one kernel, as for the same function without the slice."""
    x, w = torch.randn(3, 4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    assert_compiles(lambda x, w: (x * w)[:, None].sin(), x, w, backward_kernels=1)
