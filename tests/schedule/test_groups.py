"""The scheduler: kernel groups over [M, D], stages across barriers, recorded reasons, limits, and
where values are computed (in their readers, as late as their readers allow)."""
import sympy
import torch
import torch.nn.functional as F

import memfuse
from helpers import BLOCKS, block_inputs, counters, delta, forward_backward, rel_error
from memfuse.buffers import memory_timeline, plan_buffers
from memfuse.capture import capture
from memfuse.base.config import Config
from memfuse.ir.graph import Kind, Op, format_graph
from memfuse.plan import Decision, plan
from memfuse.schedule.groups import schedule
from memfuse.schedule.steps import ExternStep

SHAPE = (2, 7, 48)


def planned(fn, tensors):
    return plan(capture(fn, tensors, trace_joint=True))


def test_layer_norm_block_is_one_kernel_each_way():
    tensors, consts, _ = block_inputs("layer_norm_block", SHAPE, dropout_prob=0.1)
    the_plan = planned(lambda *t: (BLOCKS["layer_norm_block"].fn(*t, **consts),), tensors)
    forward = schedule(the_plan.forward, Config(), "forward")
    backward = schedule(the_plan.backward, Config(), "backward")
    assert [type(s) for s in forward.steps] == [type(forward.kernels[0])]
    # beyond its kernel the backward only reshapes the finished column sums (no aten call)
    finishing = [s for s in backward.steps if isinstance(s, ExternStep)]
    assert len(backward.steps) == 1 + len(finishing)
    assert all(the_plan.backward[s.name].op in (Op.VIEW, Op.CAST) for s in finishing)
    fwd, = forward.kernels
    bwd, = backward.kernels
    assert fwd.space.d == SHAPE[-1] and fwd.space.m is not None and not fwd.column_sums
    # the three [D] parameter grads (weight, bias1, bias2) are column sums of the one backward pass
    assert len(bwd.column_sums) == 3 and bwd.space == fwd.space
    assert fwd.name == "memfuse_forward_0" and bwd.name == "memfuse_backward_0"


def test_lone_reductions_keep_their_sources_space():
    """A reduction whose source comes from memory still walks the source's [M, D]."""
    x = torch.randn(9, 20, requires_grad=True)
    for fn in (lambda x: (x.sum(0),), lambda x: (x.sum(-1),)):
        the_plan = plan(capture(fn, [x.detach()], trace_joint=False))
        group, = schedule(the_plan.forward, Config(), "forward").kernels
        assert group.space.m is not None and group.space.d == 20, group


def test_reading_a_finished_column_sum_starts_a_new_stage():
    x = torch.randn(9, 20, requires_grad=True)
    the_plan = plan(capture(lambda x: (x - x.mean(0),), [x.detach()], trace_joint=False))
    sched = schedule(the_plan.forward, Config(), "forward")
    first, second = sched.kernels
    assert first.stage < second.stage and first.column_sums
    assert any("reduces over every row" in reason for _, _, reason in sched.not_fused), sched.not_fused


def test_extern_result_is_read_by_a_later_stage():
    def fn(x, w, b):
        return (torch.sigmoid(torch.mm(x, w)) * b,)

    tensors = [torch.randn(6, 8), torch.randn(8, 20), torch.randn(20)]
    the_plan = plan(capture(fn, tensors, trace_joint=False))
    sched = schedule(the_plan.forward, Config(), "forward")
    extern, kernel = sched.steps
    assert isinstance(extern, ExternStep) and extern.name == "mm"
    assert kernel.stage > extern.stage and "mm" in kernel.inputs
    assert ("sigmoid", "mm", "mm is an extern call") in sched.not_fused


def test_rows_longer_than_the_persistent_limit():
    """D beyond Config.max_row_length: still right. Without looped kernels the group runs
    through aten, and its recorded reason names D, the limit and the knob."""
    config = Config(max_row_length=32)
    tensors, consts, grad_output = block_inputs("rms_norm_block", SHAPE)     # D = 48 > 32
    the_plan = planned(lambda *t: (BLOCKS["rms_norm_block"].fn(*t, **consts),), tensors)
    group, = schedule(the_plan.forward, config, "forward").kernels
    through_aten = group.aten_reason is not None
    if through_aten:
        assert "D=48" in group.aten_reason and "32" in group.aten_reason and "max_row_length" in group.aten_reason

    before = counters()
    fused = memfuse.memory_efficient_fusion(BLOCKS["rms_norm_block"].fn, config=config)
    out, grads = forward_backward(fused, tensors, consts, grad_output)
    ref_out, ref_grads = forward_backward(BLOCKS["rms_norm_block"].fn, tensors, consts, grad_output)
    moved = delta(before)
    if through_aten:
        assert moved["kernels_launched"] == 0 and moved["fallbacks"] == 2, moved
    else:
        assert moved["kernels_launched"] == 2 and moved["fallbacks"] == 0, moved
    assert rel_error(out, ref_out) <= 1e-5
    for grad, ref in zip(grads, ref_grads):
        assert rel_error(grad, ref) <= 1e-5


# -- where values are computed: no-input values in their readers, others where they are read ------
def _backward_memory(fused, args) -> tuple:
    """(the backward's BufferPlan, bytes held at entry, the most bytes held while a step runs), at
    the example sizes."""
    entry = fused.compiled_for(*args)
    buffers = entry.function.backward.buffers
    timeline = memory_timeline(buffers, entry.captured.hints)
    return buffers, timeline[0].after, max(p.during for p in timeline)


def test_a_fill_is_computed_in_the_kernel_that_reads_it():
    """A fill read after an extern matmul (a later stage) is no kernel's output and no buffer."""
    def fn(x, w):
        y = x @ w
        return torch.where(y > 0, y, torch.full_like(y, 0.25))

    x, w = torch.randn(6, 8, requires_grad=True), torch.randn(8, 20, requires_grad=True)
    the_plan = plan(capture(lambda x, w: (fn(x, w),), [x.detach(), w.detach()], trace_joint=False))
    fill = next(n for n, node in the_plan.forward.nodes.items()
                if node.op is Op.VIEW and the_plan.forward[node.inputs[0]].op is Op.CONSTANT and node.value.shape)
    sched = schedule(the_plan.forward, Config(), "forward")
    reader, = sched.kernels
    assert fill in reader.nodes and fill not in reader.outputs and reader.stage > 0
    assert fill not in plan_buffers(sched).buffers
    assert any(n == fill and "computed in every kernel that reads it" in why for n, why in sched.placed)
    report = memfuse.explain(fn, x, w)
    assert any(p.node == fill and p.program == "forward" for p in report.placed)
    assert f"forward {fill}: no input" in str(report)

    fused = memfuse.memory_efficient_fusion(fn)
    out = fused(x, w)
    grads = torch.autograd.grad(out.sum(), (x, w))
    ref = fn(x, w)
    assert rel_error(out, ref) <= 1e-5
    for grad, expected in zip(grads, torch.autograd.grad(ref.sum(), (x, w))):
        assert rel_error(grad, expected) <= 1e-5


def test_returned_logits_are_a_reshape_of_the_matmul_not_a_copy():
    """A model that returns its logits ([batch, seq, vocab], a view of the LM head's matmul) and a
    loss over them: the runtime reshapes the matmul's result; no kernel writes a copy of it."""
    def head(h, w, labels):
        logits = (h @ w.t()).view(2, 6, 20)
        return logits, F.cross_entropy(logits.view(-1, 20), labels)

    h, w = torch.randn(12, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    labels = torch.randint(0, 20, (12,))
    fused = memfuse.memory_efficient_fusion(head)
    logits, loss = fused(h, w, labels)
    ref_logits, ref_loss = head(h, w, labels)
    assert rel_error(logits, ref_logits) <= 1e-5 and rel_error(loss, ref_loss) <= 1e-5
    grads = torch.autograd.grad(loss + logits.sum(), (h, w))
    for grad, expected in zip(grads, torch.autograd.grad(ref_loss + ref_logits.sum(), (h, w))):
        assert rel_error(grad, expected) <= 1e-5
    forward = fused.compiled_for(h, w, labels).function.forward.schedule
    returned = forward.graph.outputs[0]
    assert all(returned not in k.outputs for k in forward.kernels)
    assert any(isinstance(s, ExternStep) and s.name == returned for s in forward.steps)


def _grads_match_eager(fn, fused, args, leaves, tolerance=1e-5):
    out = fused(*args)
    grads = torch.autograd.grad(out.sum(), leaves)
    ref = fn(*args)
    assert rel_error(out, ref) <= tolerance
    for grad, expected in zip(grads, torch.autograd.grad(ref.sum(), leaves)):
        assert rel_error(grad, expected) <= tolerance


def test_the_cross_entropy_backward_holds_no_fp32_logits():
    """A language-model head as HuggingFace writes it (bf16 logits upcast to fp32, a vocabulary
    longer than a persistent row): the backward recomputes the log-softmax from the saved bf16
    logits inside the kernel that writes their bf16 gradient. No fp32 [tokens, vocab] buffer (the
    one-hot's zero fill, exp of the logits) is made; the peak stays below the inputs plus one."""
    batch, seq, hidden, vocab = 2, 6, 8, 96

    def head(ids, emb, w, labels):
        logits = (F.embedding(ids, emb).to(torch.bfloat16) @ w.to(torch.bfloat16).t()).float()
        return F.cross_entropy(logits.view(-1, vocab), labels.view(-1))

    ids, labels = torch.randint(0, 11, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    emb, w = torch.randn(11, hidden, requires_grad=True), torch.randn(vocab, hidden, requires_grad=True)
    # the unchunked head's schedule: memfuse.patterns.loss_head.detect would otherwise swap in the chunked loss head
    fused = memfuse.memory_efficient_fusion(head, config=Config(max_row_length=32, chunk_loss_head=False))
    _grads_match_eager(head, fused, (ids, emb, w, labels), (emb, w))
    buffers, held, peak = _backward_memory(fused, (ids, emb, w, labels))
    tokens_by_vocab = batch * seq * vocab
    hints = fused.compiled_for(ids, emb, w, labels).captured.hints
    fp32_logits = [b.name for b in buffers.buffers.values() if b.dtype == torch.float32
                   and int(sympy.sympify(sympy.Mul(*b.shape)).subs(hints)) == tokens_by_vocab]
    assert not fp32_logits, fp32_logits
    assert peak < held + 4 * tokens_by_vocab, (peak, held)


def test_recomputed_layers_are_computed_where_the_backward_reads_them():
    """Four GELU layers: the backward recomputes each layer's activations from its saved matmul
    result. Computed as soon as possible they would all be alive at the backward's start (one wide
    kernel writing every layer's); computed where they are read, the peak above what the backward
    is handed stays below all layers' recomputed activations together."""
    layers, rows, d, hidden = 4, 12, 8, 32

    def deep(x, *weights):
        h = x
        for w_in, w_out in zip(weights[::2], weights[1::2]):
            h = h + F.gelu(h @ w_in, approximate="tanh") @ w_out
        return h

    x = torch.randn(rows, d, requires_grad=True)
    weights = [(torch.randn(*shape) / 3).requires_grad_() for _ in range(layers) for shape in ((d, hidden), (hidden, d))]
    fused = memfuse.memory_efficient_fusion(deep)
    _grads_match_eager(deep, fused, (x, *weights), (x, *weights))
    _, held, peak = _backward_memory(fused, (x, *weights))
    all_layers_activations = layers * rows * hidden * 4
    assert peak - held < all_layers_activations, (peak, held, all_layers_activations)


def test_matmuls_a_budget_recomputes_run_where_the_backward_reads_them():
    """Under a small memory budget the backward recomputes each branch's matmul from its saved
    input. Run at the program's start (the joint graph's order, and the earliest stage their inputs
    allow) every branch's product would be alive while the first branch's backward runs; run as
    autograd would, right before the branch's own backward, one at a time."""
    branches, rows, d, hidden = 4, 64, 4, 32

    def branched(*args):
        xs, weights = args[:branches], args[branches:]
        return sum(torch.relu(x @ w_in) @ w_out for x, w_in, w_out in zip(xs, weights[::2], weights[1::2]))

    xs = [torch.randn(rows, d, requires_grad=True) for _ in range(branches)]
    weights = [(torch.randn(*shape) / 3).requires_grad_() for _ in range(branches) for shape in ((d, hidden), (hidden, d))]
    args = (*xs, *weights)
    fused = memfuse.memory_efficient_fusion(branched, memory_budget=0.1)
    _grads_match_eager(branched, fused, args, args)
    entry = fused.compiled_for(*args)
    recomputed = [n for n, (decision, _) in entry.plan.decisions.items()
                  if decision is Decision.RECOMPUTE and entry.plan.backward[n].op is Op.EXTERN]
    assert len(recomputed) >= branches, recomputed          # the budget recomputed every branch's product
    _, held, peak = _backward_memory(fused, args)
    # one branch's backward holds four [rows, hidden] values: its product, the gradient coming in,
    # the activation (for its weight's gradient) and the gradient going out; all four branches'
    # products and activations at once would be ten
    one_product = rows * hidden * 4
    assert peak - held <= 4 * one_product, (peak - held, one_product)


def rope(x, w, cos, sin):
    """Llama's rotary embedding as HuggingFace writes it: q from a projection, split into heads
    (a permuted view of the matmul's result), rotate_half as cat(-x2, x1), cos and sin tables
    broadcast over batch and heads."""
    batch, seq, heads, dim = x.shape[0], x.shape[1], 2, w.shape[1] // 2
    q = (x @ w).view(batch, seq, heads, dim).transpose(1, 2)
    x1, x2 = q[..., : dim // 2], q[..., dim // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return q * cos + rotated * sin


def rope_inputs() -> tuple:
    """x [2, 5, 8] and the projection's weight (both differentiated), cos and sin tables [5, 4]."""
    x, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    angles = torch.arange(5.0)[:, None] * torch.arange(1.0, 3.0).repeat(2)[None, :] / 5
    return x, w, angles.cos(), angles.sin()


def test_rotary_embedding_is_one_kernel_reading_the_matmul_where_it_lies():
    """The heads' permute and the cos/sin broadcasts are loaded where they are read, and -x2 is
    computed in the kernel that places it: one forward kernel over the heads after the matmul,
    none over half the row, no view written; the backward's gradient through it one kernel too."""
    x, w, cos, sin = rope_inputs()
    fused = memfuse.memory_efficient_fusion(rope)
    _grads_match_eager(rope, fused, (x, w, cos, sin), (x, w))
    forward = fused.compiled_for(x, w, cos, sin).function.forward.schedule
    over_heads = [k for k in forward.kernels if k.space.d != x.shape[-1]]    # not the input's reshape
    assert [k.space.d for k in over_heads] == [4], [(k.name, k.space, k.outputs) for k in forward.kernels]
    strided = {n for n, node in forward.graph.nodes.items() if node.op is Op.STRIDED}
    assert not [o for k in forward.kernels for o in k.outputs if o in strided]
    # the backward: the gradient through rotate_half (slices of grad * sin, one negated, placed
    # by slice_scatter) in one kernel, computed where its transpose into the matmul's
    # [batch, seq, heads x dim] lies (permute_of_computed): no gradient written for a copy to read
    backward = fused.compiled_for(x, w, cos, sin).function.backward.schedule
    over_heads = [k for k in backward.kernels if k.space.d != x.shape[-1]]
    assert [k.space.d for k in over_heads] == [4], [(k.name, k.space, k.outputs) for k in backward.kernels]


def grouped_rope(x, w, cos, sin):
    """A key as Llama's grouped-query attention makes it: rotary on 2 heads of the projection, each
    repeated for 2 query heads (repeat_kv: expand, reshape), so that its gradient is summed over
    the repeats before the rotary's backward rotates it."""
    k = rope(x, w, cos, sin)
    batch, heads, seq, dim = k.shape
    return k.unsqueeze(2).expand(batch, heads, 2, seq, dim).reshape(batch, heads * 2, seq, dim)


def test_rotary_backward_of_a_summed_gradient_is_one_kernel():
    """The key's gradient summed over its repeats, times sin, sliced and placed by rotate_half's
    backward: the sum is read again at each slice's place (a summed read at a window), so the
    backward rotates it in the kernel that sums it, as it does an unsummed gradient, and writes it
    transposed; the tiny Llama's layer backward made four kernels of it (the product, its negated
    half, the sum, the transposed copy)."""
    x, w, cos, sin = rope_inputs()
    fused = memfuse.memory_efficient_fusion(grouped_rope)
    _grads_match_eager(grouped_rope, fused, (x, w, cos, sin), (x, w))
    backward = fused.compiled_for(x, w, cos, sin).function.backward.schedule
    over_heads = [k for k in backward.kernels if k.space.d != x.shape[-1]]
    assert [k.space.d for k in over_heads] == [4], [(k.name, k.space, k.outputs) for k in backward.kernels]
    summed_at_windows = [n for k in over_heads for n in k.nodes if backward.graph[n].op is Op.STRIDED
                         and backward.graph[n].attr.summed and backward.graph[n].attr.window is not None]
    assert len(summed_at_windows) == 2          # the two halves rotate_half's backward moves


def grouped_values(x, w):
    """Values as Llama's grouped-query attention makes them: 2 heads of a projection, each repeated
    for 2 query heads (repeat_kv), so that their gradient is summed over the repeats and then read
    transposed back into the projection's [batch x seq, heads x dim] for its matmuls."""
    batch, seq, heads, dim = x.shape[0], x.shape[1], 2, w.shape[1] // 2
    v = (x @ w).view(batch, seq, heads, dim).transpose(1, 2)
    return v.unsqueeze(2).expand(batch, heads, 2, seq, dim).reshape(batch, heads * 2, seq, dim)


def test_a_transposed_read_of_a_small_sum_sums_in_the_reading_kernel():
    """The values' gradient, summed over two repeats and read transposed for the matmul, is one
    kernel that sums each element where it writes the transposed copy: no kernel writing the sum
    for the copy to read (the tiny Llama's layer backward made two)."""
    x, w = torch.randn(2, 5, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(grouped_values)
    _grads_match_eager(grouped_values, fused, (x, w), (x, w))
    backward = fused.compiled_for(x, w).function.backward.schedule
    over_heads = [k for k in backward.kernels if k.space.d != x.shape[-1]]
    assert len(over_heads) == 1, [(k.name, k.space, k.nodes) for k in backward.kernels]
    summed = [backward.graph[n] for n in over_heads[0].nodes if backward.graph[n].op is Op.STRIDED]
    assert [n.attr.summed for n in summed] == [(2,)] and "permute" in summed[0].attr.describe


def test_a_view_read_by_kernels_of_two_stages_is_loaded_by_each():
    """A permuted view of an aten result that kernels of two stages read (before and after
    another matmul) is never written: each kernel loads it through its access map."""
    def two_reads(x, w, v):
        heads = (x @ w).view(x.shape[0], 2, 4).transpose(0, 1)     # [2, rows, 4]: a permute
        first = (heads * 2).transpose(0, 1).reshape(x.shape[0], 8) @ v
        return heads.sum() + first.sum() * heads.amax()

    x, w, v = (torch.randn(*s, requires_grad=True) for s in ((6, 8), (8, 8), (8, 3)))
    fused = memfuse.memory_efficient_fusion(two_reads)
    out, ref = fused(x, w, v), two_reads(x, w, v)
    assert rel_error(out, ref) <= 1e-5
    forward = fused.compiled_for(x, w, v).function.forward.schedule
    permutes = [n for n, node in forward.graph.nodes.items()
                if node.op is Op.STRIDED and forward.graph[node.inputs[0]].op is Op.EXTERN]
    assert permutes
    readers = [k for k in forward.kernels if set(permutes) & set(k.nodes)]
    assert len(readers) >= 2, [(k.name, k.nodes) for k in forward.kernels]
    assert not [o for k in forward.kernels for o in k.outputs if o in permutes]


def test_safe_softmax_is_one_kernel_each_way():
    """_safe_softmax (attention with a mask: rows of -inf give 0, not nan) asks any(x != -inf) of
    each row: a row reduction in the softmax's kernel, not a bool tensor written for aten."""
    scores, keep = torch.randn(2, 3, 5, 5, requires_grad=True), torch.rand(2, 3, 5, 5) > 0.4
    keep[0, 0, 1] = False                                   # a row with nothing kept: 0, as eager gives
    def safe(scores, keep):
        return torch.ops.aten._safe_softmax(scores.masked_fill(~keep, float("-inf")), -1) * 3

    fused = memfuse.memory_efficient_fusion(safe)
    out, ref = fused(scores, keep), safe(scores, keep)
    assert torch.equal(out[0, 0, 1], torch.zeros(5)) and rel_error(out, ref) <= 1e-5
    grad, = torch.autograd.grad((out * torch.arange(5.0)).sum(), [scores])
    expected, = torch.autograd.grad((ref * torch.arange(5.0)).sum(), [scores])
    assert rel_error(grad, expected) <= 1e-5
    entry = fused.compiled_for(scores, keep)
    joint = entry.captured.joint
    assert not [n for n in joint.nodes.values() if n.op is Op.EXTERN and "any" in str(n.attr.target)]
    assert len(entry.function.forward.schedule.kernels) == 1


def test_any_and_all_over_rows_and_columns_match_eager():
    def flags(x):
        return torch.where((x > -1).all(-1, keepdim=True), x, -x) * (x > 1).any(0, keepdim=True)

    x = torch.randn(7, 6, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(flags)
    _grads_match_eager(flags, fused, (x,), (x,))
    joint = fused.compiled_for(x).captured.joint
    assert not [n for n in joint.nodes.values() if n.op is Op.EXTERN], format_graph(joint)


def gelu_new(h):
    """GPT-2's activation as HuggingFace writes it (`NewGELUActivation`): autograd saves the tanh
    and the products around it, so its backward reads values the forward's recompute also makes."""
    return 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))


def test_intermediates_are_computed_again_in_the_kernel_after_the_matmul():
    """GPT-2's MLP: the backward recomputes the activation for the second matmul's weight
    gradient, and the activation's gradient (after the matmul that makes grad @ w_out) reads the
    tanh and the products around it. The kernel after the matmul computes them again from the
    pre-activation it reads anyway, and the kernel before it, which then only writes the matmul's
    operand from the same load, joins it: one kernel, reading nothing but the pre-activation and
    the matmul's result."""
    rows, d, hidden = 12, 8, 32

    def mlp(x, w_in, w_out):
        return gelu_new(x @ w_in) @ w_out

    x = torch.randn(rows, d, requires_grad=True)
    w_in, w_out = (torch.randn(d, hidden) / 3).requires_grad_(), (torch.randn(hidden, d) / 3).requires_grad_()
    fused = memfuse.memory_efficient_fusion(mlp)
    _grads_match_eager(mlp, fused, (x, w_in, w_out), (x, w_in, w_out))
    backward = fused.compiled_for(x, w_in, w_out).function.backward.schedule
    joint, = [k for k in backward.kernels if k.space.d == hidden]
    graph = backward.graph
    wide_inputs = [i for i in joint.inputs if graph[i].value.kind is Kind.FULL]
    assert sorted(graph[i].op.name for i in wide_inputs) == ["EXTERN", "INPUT"], [(i, graph[i].op) for i in wide_inputs]
    operand = [o for o in joint.outputs if any(graph[u].op is Op.EXTERN for u in graph.users()[o])]
    assert len(joint.outputs) == 2 and operand, joint.outputs
    assert any(f"computed again in {joint.name}" in reason for _, reason in backward.placed)
    assert any(f"its kernel joined {joint.name}" in reason for _, reason in backward.placed)


def test_a_value_dearer_to_rebuild_than_to_read_is_read():
    """v = a * b, written for a matmul, read again after it: rebuilding it would load a and b
    (two rows of fp32) to save one load of v, so the later kernel reads it."""
    def fn(a, b, w):
        v = a * b
        return (v @ w) * v

    a, b, w = torch.randn(6, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True), torch.randn(8, 8)
    fused = memfuse.memory_efficient_fusion(fn)
    _grads_match_eager(fn, fused, (a, b, w), (a, b))
    forward = fused.compiled_for(a, b, w).function.forward.schedule
    assert not [k for k in forward.kernels if k.recomputed], [(k.name, k.nodes) for k in forward.kernels]
    first, second = sorted(forward.kernels, key=lambda k: k.stage)
    shared, = first.outputs
    assert shared in second.inputs


def test_values_one_new_load_rebuilds_count_together():
    """fp32: three values of x that a kernel writes for the kernel after a matmul. Rebuilding any
    one of them costs a load of x as large as reading it; the three together cost one load of x
    for three reads saved: the later kernel loads x and computes them again."""
    def fn(x, w):
        a, b, c = x.tanh(), x.sigmoid(), x * x
        y = (a + b + c) @ w
        return y * a + y * b + y * c

    x, w = torch.randn(6, 8), torch.randn(8, 8)
    fused = memfuse.memory_efficient_fusion(fn)
    assert rel_error(fused(x, w), fn(x, w)) <= 1e-5
    forward = fused.compiled_for(x, w).function.forward.schedule
    first, second = sorted(forward.kernels, key=lambda k: k.stage)
    assert len(first.outputs) == 1 and first.outputs[0] not in second.inputs, (first.outputs, second.inputs)
    assert len(second.recomputed) >= 3 and any(forward.graph[i].op is Op.INPUT for i in second.inputs)


def test_a_kernel_joins_a_later_one_that_loads_its_input():
    """A GELU MLP's backward: GELU(h) is computed again for the down projection's weight gradient,
    and the GELU backward runs after the matmul that gives its input gradient. Both load h. The
    first kernel joins the second (h loaded once, one launch); the weight gradient's matmul, which
    reads the first one's result, runs after the joint kernel. Gradients as eager's."""
    def mlp(x, w1, b1, w2):
        return F.gelu(x @ w1.t() + b1) @ w2.t()

    torch.manual_seed(0)
    tensors = [t.requires_grad_() for t in (torch.randn(2, 7, 48), torch.randn(96, 48), torch.randn(96),
                                            torch.randn(48, 96))]
    grad_output = torch.randn(2, 7, 48)
    fused = memfuse.memory_efficient_fusion(mlp)
    out, grads = forward_backward(fused, tensors, {}, grad_output)
    expected_out, expected_grads = forward_backward(mlp, tensors, {}, grad_output)
    assert rel_error(out, expected_out) <= 1e-5
    for got, want in zip(grads, expected_grads):
        assert rel_error(got, want) <= 1e-5
    backward = fused.compiled_for(*tensors).function.backward.schedule
    wide = [k for k in backward.kernels if k.space.d == 96 and k.space.m == backward.kernels[0].space.m]
    joint, = wide                          # GELU(h) for the weight gradient and the GELU backward: one kernel
    assert joint.column_sums and len(joint.outputs) == 2, (joint.column_sums, joint.outputs)
    h, = [i for i in joint.inputs if backward.graph[i].op is Op.INPUT and backward.graph[i].value.d == 96]
    order = [s.nodes[0] if not isinstance(s, ExternStep) else s.name for s in backward.steps]
    readers = [k for k, s in enumerate(backward.steps) if isinstance(s, ExternStep)
               and set(backward.graph[s.name].inputs) & set(joint.outputs)]
    assert readers and min(readers) > backward.steps.index(joint), order
    assert any(f"both load {h}" in reason and joint.name in reason for _, reason in backward.placed), \
        backward.placed


def conv1d_block(x, g, beta, w1, b1, w2, b2):
    """GPT-2's MLP: pre-norm, Conv1D layers (addmm over the flattened rows), the residual added."""
    rows = x.reshape(-1, x.shape[-1])
    inner = F.gelu(torch.addmm(b1, F.layer_norm(rows, (x.shape[-1],), g, beta), w1))
    return x + torch.addmm(b2, inner, w2).view(x.shape)


def test_a_lone_column_sum_runs_beside_a_later_kernel(monkeypatch):
    """The output bias's gradient sums the incoming gradient through the reshape its matmul reads
    (GPT-2's Conv1D): alone, a kernel of its own. It joins the next kernel of its space, which shares
    no input with it, since the incoming gradient stays in memory until then anyway: one launch
    fewer, gradients as eager's, and the backward holds no more than with the sum on its own."""
    torch.manual_seed(0)
    tensors = [t.requires_grad_() for t in (torch.randn(2, 7, 48), torch.randn(48), torch.randn(48),
                                            torch.randn(48, 96), torch.randn(96), torch.randn(96, 48),
                                            torch.randn(48))]
    fused = memfuse.memory_efficient_fusion(conv1d_block)
    _grads_match_eager(conv1d_block, fused, tensors, tensors)
    backward = fused.compiled_for(*tensors).function.backward.schedule
    sides = [(node, reason) for node, reason in backward.placed if "side by side" in reason]
    assert len(sides) == 1, backward.placed
    (bias_sum, reason), = sides
    assert backward.graph[bias_sum].op is Op.SUM and backward.graph[bias_sum].value.kind is Kind.COL
    joint, = [k for k in backward.kernels if bias_sum in k.nodes]
    assert joint.name in reason and len(joint.nodes) > 1
    joint_peak = _backward_memory(fused, tensors)[2]

    monkeypatch.setattr("memfuse.schedule.joins._later_target", lambda *args: None)
    alone = memfuse.memory_efficient_fusion(conv1d_block)
    _grads_match_eager(conv1d_block, alone, tensors, tensors)
    assert len(alone.compiled_for(*tensors).function.backward.schedule.kernels) == len(backward.kernels) + 1
    assert joint_peak <= _backward_memory(alone, tensors)[2]


def projections_attention(x, wq, bq, wk, bk, wv, bv):
    """BERT's self-attention: the query, key and value projections with biases, heads split, SDPA."""
    batch, seq, hidden = x.shape
    heads = 2
    q, k, v = ((x @ w.t() + bias).view(batch, seq, heads, hidden // heads).transpose(1, 2)
               for w, bias in ((wq, bq), (wk, bk), (wv, bv)))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, seq, hidden)


def test_bias_sums_of_an_aten_calls_results_join_one_kernel(monkeypatch):
    """The three bias gradients are column sums of the attention backward's three gradients, each
    after the matmuls that read its gradient: three kernels of one sum each. Each joins the latest
    earlier kernel of its space after which its gradient exists (the views it reads through moved
    before it): one kernel sums all three, gradients as eager's (the key bias's aside: attention
    does not depend on it, and its gradient is rounding noise), and the backward holds no more."""
    torch.manual_seed(0)
    tensors = [t.requires_grad_() for t in (torch.randn(2, 7, 48),) + sum(
        ((torch.randn(48, 48), torch.randn(48)) for _ in range(3)), ())]
    compared = tensors[:4] + tensors[5:]
    fused = memfuse.memory_efficient_fusion(projections_attention)
    _grads_match_eager(projections_attention, fused, tensors, compared)
    backward = fused.compiled_for(*tensors).function.backward.schedule
    summing = [k for k in backward.kernels if k.column_sums]
    assert [len(k.column_sums) for k in summing] == [3], [(k.name, k.column_sums) for k in backward.kernels]
    assert sum("an earlier kernel of its space" in reason for _, reason in backward.placed) == 2
    joint_peak = _backward_memory(fused, tensors)[2]

    monkeypatch.setattr("memfuse.schedule.joins._earlier_target", lambda *args: None)
    apart = memfuse.memory_efficient_fusion(projections_attention)
    _grads_match_eager(projections_attention, apart, tensors, compared)
    assert len([k for k in apart.compiled_for(*tensors).function.backward.schedule.kernels if k.column_sums]) == 3
    assert joint_peak <= _backward_memory(apart, tensors)[2]


def _rounded_column_sums(x, w):
    """Column sums cast as autocast's bias gradients are (fp32 -> bf16 -> fp32), and one cast once."""
    weighted = (x * w).sum(0)
    return weighted.to(torch.bfloat16).to(torch.float32), x.sum(0).to(torch.bfloat16)


def test_casts_of_a_finished_column_sum_are_applied_by_its_kernel():
    """No `.to` step after the kernel: it rounds its totals through the casts as it writes them."""
    x, w = torch.randn(37, 20), torch.randn(37, 20)
    the_plan = plan(capture(_rounded_column_sums, [x, w], trace_joint=False))
    sched = schedule(the_plan.forward, Config(), "forward")
    group, = sched.kernels
    assert not [s for s in sched.steps if isinstance(s, ExternStep) and the_plan.forward[s.name].op is Op.CAST]
    assert sorted(len(casts) for casts in group.column_casts.values()) == [1, 2]
    assert any("as it writes its totals" in reason for _, reason in sched.placed)
    fused = memfuse.memory_efficient_fusion(_rounded_column_sums)
    rounded, once = fused(x, w)
    assert ".to(" not in fused.compiled_for(x, w).function.forward.source
    assert rounded.dtype == torch.float32 and once.dtype == torch.bfloat16
    assert torch.equal(rounded, rounded.to(torch.bfloat16).float())    # rounded through bf16 on the way
    for got, want in zip((rounded, once), _rounded_column_sums(x, w)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def test_a_chain_of_casts_stops_at_a_value_read_twice():
    """The kernel writes the bf16 sum, read twice; its cast to fp32 stays a step of its own."""
    def fn(x):
        rounded = x.sum(0).to(torch.bfloat16)
        return rounded.to(torch.float32), rounded * 2
    x = torch.randn(37, 20)
    sched = schedule(plan(capture(fn, [x], trace_joint=False)).forward, Config(), "forward")
    casts = [s.name for s in sched.steps if isinstance(s, ExternStep) and sched.graph[s.name].op is Op.CAST]
    assert len(casts) == 1 and sched.graph[casts[0]].value.dtype == torch.float32
    assert [len(c) for g in sched.kernels for c in g.column_casts.values()] == [1]
    for got, want in zip(memfuse.memory_efficient_fusion(fn)(x), fn(x)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def _autocast_mlp(x, w1, b1, w2, b2):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def test_autocasts_bias_gradients_leave_their_kernels_in_fp32():
    """Under autocast each bias gradient is a bf16 column sum, reshaped and cast to the fp32
    parameter's dtype: the kernel writes it so, the backward makes no `.to` call."""
    torch.manual_seed(0)
    args = [torch.randn(6, 5, 16), torch.randn(24, 16) / 4, torch.randn(24), torch.randn(8, 24) / 5, torch.randn(8)]
    args = [a.requires_grad_() for a in args]
    grad = torch.randn(6, 5, 8, dtype=torch.bfloat16)
    fused = memfuse.memory_efficient_fusion(_autocast_mlp)
    got = torch.autograd.grad(fused(*args), args, grad)
    assert ".to(" not in fused.compiled_for(*args).function.backward.source
    for g, want in zip(got, torch.autograd.grad(_autocast_mlp(*args), args, grad)):
        assert g.dtype == want.dtype == torch.float32
        torch.testing.assert_close(g, want, rtol=2e-2, atol=2e-2)


def clipped_plus_its_first_row(x: torch.Tensor) -> torch.Tensor:
    """A value read in registers and, through a view (its first row), from memory by one kernel."""
    t = torch.where(x > 0, x, x * 0.5)
    return t * 2 + t[0][None, :]


def test_a_kernel_reading_a_value_through_a_view_does_not_join_its_producer():
    """The kernel that computes `t` stays before the one that reads `t[0]` from memory: joined, the
    reader computed `t` in registers but read the view from a buffer never written (NameError at
    the first run: BEiT's relative-position table wrapped layer by layer)."""
    fused = memfuse.memory_efficient_fusion(clipped_plus_its_first_row)
    x = torch.randn(17, 17)
    torch.testing.assert_close(fused(x), clipped_plus_its_first_row(x))
    stats = memfuse.stats()
    assert stats["eager_calls"] == 0 and stats["first_run_fallbacks"] == 0, stats


def test_an_upcast_read_after_a_barrier_is_written_narrow():
    """BatchNorm's backward in bf16 autocast: the masked bf16 gradient is upcast to fp32, its sums
    over M are taken, and a later kernel reads the upcast again. Rebuilding the bf16 value would
    load three inputs, so the later kernel reads it from memory; the earlier kernel then writes
    the bf16 value (2 B an element) and the later one casts it again (exact), never a fp32 copy
    (4 B an element: a transient twice the size of the activation)."""
    def fn(a, b, c):
        masked = torch.where(a > 0, b, c) * c
        wide = masked.float()
        return wide * wide.sum(0)

    a, b, c = (torch.randn(24, 16).bfloat16() for _ in range(3))
    fused = memfuse.memory_efficient_fusion(fn)
    assert rel_error(fused(a, b, c), fn(a, b, c)) <= 1e-5
    forward = fused.compiled_for(a, b, c).function.forward.schedule
    graph = forward.graph
    first, second = sorted(forward.kernels, key=lambda k: k.stage)
    assert [graph[o].value.dtype for o in first.outputs] == [torch.bfloat16], first.outputs
    assert first.outputs[0] in second.inputs and any(graph[n].op is Op.CAST for n in second.recomputed)
    assert any("written narrow" in reason for _, reason in forward.placed), forward.placed
