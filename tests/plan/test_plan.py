"""The planner on joint graphs from memfuse.capture: what the forward saves, what the backward
recomputes or regenerates, and how that compares with torch's own min-cut partitioner."""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, min_cut_rematerialization_partition

from helpers import BLOCKS, block_inputs, rel_error
from memfuse import memory_efficient_fusion
from memfuse.capture import capture, decomposition_table
from memfuse.ir.graph import EXTERNAL, Kind, Op, value_bytes, verify
from memfuse.plan import Decision, is_view, plan

SHAPE = (2, 7, 48)
ROWS = SHAPE[0] * SHAPE[1]


def block_fn(name, consts):
    """The block over its tensors only, returning a tuple, as memfuse's api traces it."""
    def fn(*tensors):
        return (BLOCKS[name].fn(*tensors, **consts),)
    return fn


def capture_block(name, p):
    tensors, consts, _ = block_inputs(name, SHAPE, dropout_prob=p)
    return capture(block_fn(name, consts), tensors, trace_joint=True), tensors, consts


def torch_saved_bytes(fn, tensors) -> int:
    """Bytes torch's min_cut_rematerialization_partition saves beyond the inputs, on the same
    decompositions: the forward graph's outputs after the user outputs, placeholders excluded."""
    seen = {}

    def partition(joint, inputs, *, num_fwd_outputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)
        seen["forward"], seen["num_fwd_outputs"] = fw, num_fwd_outputs
        return fw, bw

    compiled = aot_function(fn, lambda gm, _: gm, lambda gm, _: gm, partition_fn=partition,
                            decompositions=decomposition_table())
    compiled(*[t.detach().requires_grad_(t.requires_grad) for t in tensors])
    output, = [n for n in seen["forward"].graph.nodes if n.op == "output"]
    saved = output.args[0][seen["num_fwd_outputs"]:]
    total = 0
    for node in saved:
        val = node.meta.get("val")
        if node.op != "placeholder" and isinstance(val, torch.Tensor):
            total += val.numel() * val.element_size()
    return total


BLOCK_CASES = [(name, p) for name in sorted(BLOCKS) for p in (0.0, 0.1)]
CASE_IDS = [f"{name}-p{p}" for name, p in BLOCK_CASES]


@pytest.mark.parametrize("name,p", BLOCK_CASES, ids=CASE_IDS)
def test_seed_blocks_save_no_full_size_value(name, p):
    captured, _, _ = capture_block(name, p)
    the_plan = plan(captured)
    for saved in the_plan.saved:
        node = captured.joint[saved.name]
        assert saved.is_input or node.value.kind is not Kind.FULL, (saved, node)
    assert the_plan.saved_bytes <= 2 * ROWS * 4
    verify(the_plan.forward)
    verify(the_plan.backward)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_dropout_mask_is_regenerated_never_saved(name):
    captured, _, _ = capture_block(name, 0.1)
    the_plan = plan(captured)
    joint = captured.joint
    rand = [n for n, node in joint.nodes.items() if node.op is Op.RAND]
    assert rand and captured.has_seed
    for saved in the_plan.saved:
        node = joint[saved.name]
        assert node.op is not Op.RAND and node.value.dtype != torch.bool, saved
    for n in rand:
        assert the_plan.decisions[n][0] is Decision.REGENERATE
        assert the_plan.backward[n].op is Op.RAND          # redrawn in the backward, not an input
    assert "seed" in the_plan.forward.inputs and "seed" in the_plan.backward.inputs


def test_plan_graph_interfaces():
    """forward: primals, seed -> user outputs, saved; backward: saved, seed, tangents -> grads."""
    captured, tensors, _ = capture_block("layer_norm_block", 0.1)
    the_plan = plan(captured)
    saved = [s.name for s in the_plan.saved]
    primals = captured.joint.inputs[:captured.num_primals]
    tangents = captured.joint.inputs[-captured.num_tangents:]
    assert the_plan.forward.inputs == primals + ["seed"]
    assert the_plan.forward.outputs[the_plan.num_fwd_outputs:] == saved
    assert the_plan.backward.inputs == saved + ["seed"] + tangents
    assert len(the_plan.backward.outputs) == len(tensors)
    assert not set(tangents) & set(the_plan.forward.nodes)
    for s in the_plan.saved:
        assert s.is_input == (s.name in primals)
        assert the_plan.decisions.get(s.name, (Decision.SAVE,))[0] is Decision.SAVE


def test_inference_capture_plans_forward_only():
    tensors, consts, _ = block_inputs("layer_norm_block", SHAPE, dropout_prob=0.1)
    captured = capture(block_fn("layer_norm_block", consts), [t.detach() for t in tensors], trace_joint=False)
    the_plan = plan(captured)
    assert the_plan.backward is None and the_plan.saved == [] and the_plan.saved_bytes == 0
    assert all(d is Decision.FORWARD for d, _ in the_plan.decisions.values())


def mm_scale(x, w, b):
    return (torch.mm(x, w) * b,)


def mm_sigmoid(x, w, b):
    return (torch.sigmoid(torch.mm(x, w)) * b,)


def mm_inputs():
    return [torch.randn(6, 8, requires_grad=True), torch.randn(8, 16, requires_grad=True),
            torch.randn(16, requires_grad=True)]


def test_extern_needed_by_backward_is_saved():
    """d/db of mm(x, w) * b needs the mm result: an extern is kept, never run again."""
    captured = capture(mm_scale, mm_inputs(), trace_joint=True)
    the_plan = plan(captured)
    assert "mm" in [s.name for s in the_plan.saved]
    decision, reason = the_plan.decisions["mm"]
    assert decision is Decision.SAVE and "extern" in reason
    assert the_plan.backward["mm"].op is Op.INPUT


@pytest.mark.parametrize("fn", [mm_scale, mm_sigmoid])
def test_externs_are_never_recomputed(fn):
    """...except aten views (mm's transposed operands): nothing to compute, rebuilt from their base."""
    captured = capture(fn, mm_inputs(), trace_joint=True)
    the_plan = plan(captured)
    externs = [n for n, node in captured.joint.nodes.items() if node.op in EXTERNAL]
    assert externs
    for n in externs:
        decision, reason = the_plan.decisions.get(n, (None, ""))
        if is_view(captured.joint[n]):
            assert decision is not Decision.SAVE and (decision is not Decision.RECOMPUTE or "view" in reason), n
        else:
            assert decision is not Decision.RECOMPUTE, n
    # the forward's mm result never reappears as a computed node of the backward
    assert the_plan.backward.nodes.get("mm") is None or the_plan.backward["mm"].op is Op.INPUT


def test_reduction_over_rows_is_saved_not_recomputed():
    """x * x.sum(0): the column sum needs a whole pass over M; the backward reads it."""
    def fn(x):
        return (x * x.sum(0),)

    captured = capture(fn, [torch.randn(10, 24, requires_grad=True)], trace_joint=True)
    the_plan = plan(captured)
    col_sums = [n for n, node in captured.joint.nodes.items()
                if node.op is Op.SUM and node.attr.axis is Kind.COL and n in the_plan.forward.nodes]
    assert col_sums
    decision, reason = the_plan.decisions[col_sums[0]]
    assert decision is Decision.SAVE and "reduction over M" in reason
    assert the_plan.saved_bytes == 24 * 4


def post_norm_layers(h, probe, w0, w1, w2, p=0.0, dropped=False):
    """A post-norm residual stream (BERT's): each layer's matmul reads the last LayerNorm's output,
    whose gradient needs it again; the matmuls' bf16 outputs are the cheapest to keep. With `p`, the
    branch goes through dropout (returned too with `dropped`: its zeros are the mask)."""
    branches = []
    for weight in (w0, w1, w2):
        branch = (h.to(torch.bfloat16) @ weight).float()
        if p:
            branch = F.dropout(branch, p, training=True)
            branches.append(branch)
        h = F.layer_norm(h + branch, h.shape[-1:])
    loss = (h * probe).sum()
    return (loss, *branches) if dropped else (loss,)


def post_norm_layer(h, probe, w0):
    h = F.layer_norm(h + (h.to(torch.bfloat16) @ w0).float(), h.shape[-1:])
    return ((h * probe).sum(),)


def post_norm_inputs(layers: int):
    """h [6, 32] and the weights need gradients; the probe weighs the output (a plain sum of a
    LayerNorm's output is 0 whatever its input)."""
    generator = torch.Generator().manual_seed(0)
    h = torch.randn(6, 32, generator=generator).requires_grad_()
    probe = torch.randn(6, 32, generator=generator)
    weights = [(torch.randn(32, 32, generator=generator) / 6).bfloat16().requires_grad_() for _ in range(layers)]
    return [h, probe, *weights]


def recomputed_row_reductions(the_plan, joint) -> list:
    return [n for n, (decision, _) in the_plan.decisions.items()
            if decision is Decision.RECOMPUTE and joint[n].op is Op.SUM and joint[n].attr.axis is Kind.ROW]


def test_a_chain_of_norms_keeps_their_row_statistics():
    """Three LayerNorms rebuilt one from another: their row sums are kept ([rows] values), so the
    backward's rebuild reduces no row; one LayerNorm (mean, then variance) is recomputed as before."""
    captured = capture(post_norm_layers, post_norm_inputs(3), trace_joint=True)
    the_plan = plan(captured)
    statistics = [n for n, (decision, reason) in the_plan.decisions.items()
                  if decision is Decision.SAVE and "row statistic on a chain of 6" in reason]
    assert len(statistics) == 6
    assert all(captured.joint[n].op is Op.SUM and captured.joint[n].attr.axis is Kind.ROW for n in statistics)
    assert not recomputed_row_reductions(the_plan, captured.joint)

    single = capture(post_norm_layer, post_norm_inputs(1), trace_joint=True)
    single_plan = plan(single)
    assert not any("row statistic" in reason for _, reason in single_plan.decisions.values())
    assert len(recomputed_row_reductions(single_plan, single.joint)) == 2


def gradients(fn, inputs, **consts):
    """(loss, the gradients of the inputs that need them) of one fresh copy of `inputs`."""
    copies = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    loss = fn(*copies, **consts)[0]
    loss.backward()
    return loss.detach(), [t.grad for t in copies if t.requires_grad]


def test_a_chain_of_norms_with_kept_statistics_matches_eager():
    inputs = post_norm_inputs(3)
    expected_loss, expected = gradients(post_norm_layers, inputs)
    loss, fused = gradients(memory_efficient_fusion(post_norm_layers), inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-4)
    for gradient, want in zip(fused, expected):
        assert want.float().norm() > 0.1
        assert rel_error(gradient.float(), want.float()) <= 1e-2


def test_a_chain_of_norms_with_dropout_rebuilds_the_forward_masks():
    """With dropout on each branch the kept statistics are those of the masked stream: the rebuild
    must regenerate the forward's masks. The fused run's gradients equal eager's with the very
    masks the fused forward drew (read from a variant that also returns the dropout outputs)."""
    inputs, p = post_norm_inputs(3), 0.3
    fused_fn = memory_efficient_fusion(post_norm_layers)
    torch.manual_seed(5)
    loss, fused = gradients(fused_fn, inputs, p=p)
    torch.manual_seed(5)
    loss_again, *dropped = fused_fn(*[t.detach() for t in inputs], p=p, dropped=True)
    assert loss_again.item() == loss.item(), "the same seed drew other masks"
    masks = [d.detach() != 0 for d in dropped]

    def masked(h, probe, w0, w1, w2):
        for weight, mask in zip((w0, w1, w2), masks):
            h = F.layer_norm(h + (h.to(torch.bfloat16) @ weight).float() * mask / (1 - p), h.shape[-1:])
        return ((h * probe).sum(),)

    expected_loss, expected = gradients(masked, inputs)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-4)
    for gradient, want in zip(fused, expected):
        assert rel_error(gradient.float(), want.float()) <= 1e-2
    _, undropped = gradients(post_norm_layers, inputs)       # the check can fail: no dropout is far off
    assert rel_error(fused[0].float(), undropped[0].float()) > 5e-2


def gelu_bias(x, b):
    return (F.gelu(x + b),)


def softmax_scale(x, b):
    return (torch.softmax(x * b, -1),)


@pytest.mark.parametrize("name,p", BLOCK_CASES, ids=CASE_IDS)
def test_seed_blocks_save_no_more_than_torch_min_cut(name, p):
    captured, tensors, consts = capture_block(name, p)
    mine = plan(captured).saved_bytes
    theirs = torch_saved_bytes(block_fn(name, consts), tensors)
    assert mine <= theirs, (mine, theirs)
    if p > 0:   # torch saves the bool mask at least
        assert mine + SHAPE[0] * SHAPE[1] * SHAPE[2] <= theirs, (mine, theirs)


@pytest.mark.parametrize("fn,make", [
    (gelu_bias, lambda: [torch.randn(6, 40, requires_grad=True), torch.randn(40, requires_grad=True)]),
    (softmax_scale, lambda: [torch.randn(6, 40, requires_grad=True), torch.randn(40, requires_grad=True)]),
    (mm_sigmoid, mm_inputs),
], ids=["gelu", "softmax", "mm_sigmoid"])
def test_other_functions_save_no_more_than_torch_min_cut(fn, make):
    tensors = make()
    mine = plan(capture(fn, tensors, trace_joint=True)).saved_bytes
    assert mine <= torch_saved_bytes(fn, tensors)


# -- whole-model heads: an LM head's matmul and its cross-entropy ------------------------------------
# N tokens, hidden H, vocabulary V (irregular, as real vocabularies are); the weight is a parameter
# (all dims static), so the logits are [N, V] in the [M, D] space.
N, H, V = 6, 8, 37
CE_CASES = [("mean", -100), ("sum", -100), ("mean", 5), ("sum", 5)]
CE_IDS = [f"{reduction}-ignore{ignore}" for reduction, ignore in CE_CASES]


def lm_head_loss(reduction, ignore_index, dtype=torch.float32):
    """cross_entropy(hidden @ W.T, targets), the logits in `dtype` (bf16: CPU autocast) and
    upcast to fp32 for the loss, as HF models do."""
    def fn(hidden, weight, targets):
        with torch.autocast("cpu", torch.bfloat16, enabled=dtype == torch.bfloat16):
            logits = hidden @ weight.T
        return (F.cross_entropy(logits.float(), targets, reduction=reduction, ignore_index=ignore_index),)
    return fn


def lm_head_inputs(ignore_index):
    generator = torch.Generator().manual_seed(0)
    targets = torch.randint(0, V, (N,), generator=generator)
    if ignore_index != -100:
        targets[1] = targets[4] = ignore_index
    hidden = torch.randn(N, H, generator=generator, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(V, H, generator=generator) * 0.3)
    return [hidden, weight, targets]


def capture_lm_head(reduction, ignore_index, dtype=torch.float32):
    return capture(lm_head_loss(reduction, ignore_index, dtype), lm_head_inputs(ignore_index), trace_joint=True,
                   static_inputs=[False, True, False])


def numel(node, captured) -> int:
    return value_bytes(node.value, captured.hints) // node.value.dtype.itemsize


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("reduction,ignore_index", CE_CASES, ids=CE_IDS)
def test_cross_entropy_saves_the_logits_once_and_no_one_hot(reduction, ignore_index, dtype):
    """The one-hot of the targets is a compare recomputed from them; of [N, V] only the matmul's
    own result is kept (in its dtype: bf16 under autocast, its fp32 upcast recomputed)."""
    captured = capture_lm_head(reduction, ignore_index, dtype)
    joint = captured.joint
    assert not [f for f in captured.fallbacks if "scatter" in f[1]], captured.fallbacks
    the_plan = plan(captured)
    wide = [s for s in the_plan.saved if not s.is_input and numel(joint[s.name], captured) >= N * V]
    assert [(joint[s.name].op, joint[s.name].value.dtype) for s in wide] == [(Op.EXTERN, dtype)], the_plan.saved
    # beyond the logits: at most two fp32 values per row (a softmax's max and log-sum) and a few scalars
    assert the_plan.saved_bytes <= N * V * dtype.itemsize + 2 * N * 4 + 4 * 4, the_plan.saved
    one_hot = [n for n in joint.nodes if n.startswith("scatter")]
    assert one_hot and all(n not in {s.name for s in the_plan.saved} for n in one_hot)
    recomputed = [n for n in one_hot if n in the_plan.decisions and joint[n].inputs]   # (the iota has none)
    assert recomputed and all(the_plan.decisions[n] == (Decision.RECOMPUTE, INDEX_REASON) for n in recomputed)
    if dtype == torch.bfloat16:
        upcast, = [n for n, node in joint.nodes.items() if node.op is Op.CAST and node.inputs == (wide[0].name,)]
        assert the_plan.decisions[upcast][0] is Decision.RECOMPUTE and "upcast" in the_plan.decisions[upcast][1]
        assert "kept in bfloat16" in wide[0].reason


INDEX_REASON = "index op on integer targets: recomputed from the targets"


@pytest.mark.parametrize("reduction,ignore_index", CE_CASES, ids=CE_IDS)
def test_cross_entropy_saves_no_more_than_torch_min_cut(reduction, ignore_index):
    for dtype in (torch.float32, torch.bfloat16):
        mine = plan(capture_lm_head(reduction, ignore_index, dtype)).saved_bytes
        theirs = torch_saved_bytes(lm_head_loss(reduction, ignore_index, dtype), lm_head_inputs(ignore_index))
        assert mine <= theirs, (dtype, mine, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("reduction,ignore_index", CE_CASES, ids=CE_IDS)
def test_cross_entropy_gradients_match_eager(reduction, ignore_index, dtype):
    fn = lm_head_loss(reduction, ignore_index, dtype)
    fused = memory_efficient_fusion(fn)
    inputs = lm_head_inputs(ignore_index)
    (want,) = fn(*inputs)
    want_grads = torch.autograd.grad(want, inputs[:2])
    (got,) = fused(*inputs)
    got_grads = torch.autograd.grad(got, inputs[:2])
    tolerance = {} if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-2)   # bf16 matmuls and grads
    torch.testing.assert_close(got, want, **tolerance)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, **tolerance)
    entry, = fused.cache.values()
    assert not [f for f in entry.captured.fallbacks if "scatter" in f[1]]


def saved_names(the_plan) -> set:
    return {s.name for s in the_plan.saved}


def gram(x, w):
    """y @ y.t() of y = x @ w: the backward reads y and its transpose (aten views)."""
    y = x @ w
    return (y @ y.t(),)


def upcast(x, w):
    z = (x @ w).float()          # a bf16 matmul, upcast for the math that follows
    return ((z.exp() * z).sum(),)


def downcast(x, w):
    y = x @ w
    z = y.to(torch.bfloat16)     # the fp32 result rounded: z does not give y back
    return ((z.float().exp() * y).sum(),)


def matmul_inputs(dtype=torch.float32):
    return [torch.randn(6, 8, dtype=dtype, requires_grad=True), torch.nn.Parameter(torch.randn(8, 16, dtype=dtype))]


def plan_of(fn, inputs):
    captured = capture(fn, inputs, trace_joint=True, static_inputs=[False, True])
    return captured, plan(captured)


def test_saving_a_value_and_its_transpose_costs_its_bytes_once():
    captured, the_plan = plan_of(gram, matmul_inputs())
    assert the_plan.saved_bytes == 6 * 16 * 4, the_plan.saved
    views = [n for n, node in captured.joint.nodes.items() if is_view(node)]
    assert views and not saved_names(the_plan) & set(views)
    for n in views:
        decision, reason = the_plan.decisions.get(n, (Decision.FORWARD, ""))
        assert decision is not Decision.RECOMPUTE or "view" in reason, (n, reason)
    assert the_plan.saved_bytes <= torch_saved_bytes(gram, matmul_inputs())


def test_upcast_value_is_saved_in_the_narrow_dtype():
    captured, the_plan = plan_of(upcast, matmul_inputs(torch.bfloat16))
    saved, = [s for s in the_plan.saved if not s.is_input]
    assert captured.joint[saved.name].value.dtype == torch.bfloat16 and the_plan.saved_bytes == 6 * 16 * 2
    cast, = [n for n, node in captured.joint.nodes.items() if node.op is Op.CAST and node.inputs == (saved.name,)]
    assert the_plan.decisions[cast] == (Decision.RECOMPUTE, "an exact upcast: recomputed from the narrower value")
    assert "kept in bfloat16" in saved.reason
    assert the_plan.saved_bytes <= torch_saved_bytes(upcast, matmul_inputs(torch.bfloat16))


def test_downcast_is_never_moved():
    """The backward reads the fp32 matmul result and its bf16 rounding: the fp32 value is kept,
    the rounding recomputed from it; the bf16 value alone would not give the fp32 one back."""
    captured, the_plan = plan_of(downcast, matmul_inputs())
    saved, = [s for s in the_plan.saved if not s.is_input]
    assert captured.joint[saved.name].value.dtype == torch.float32 and the_plan.saved_bytes == 6 * 16 * 4
    rounded, = [n for n, node in captured.joint.nodes.items()
                if node.op is Op.CAST and node.value.dtype == torch.bfloat16 and node.inputs == (saved.name,)]
    assert the_plan.decisions[rounded][0] is Decision.RECOMPUTE


def one_hot_product(x, t):
    """A one-hot built by scatter at targets nothing checked: it stays an aten call."""
    one_hot = torch.zeros_like(x).scatter(-1, t[:, None], 1.0)
    return ((x * one_hot).sum(),)


def test_extern_one_hot_is_recomputed_from_the_targets():
    x, t = torch.randn(6, 37, requires_grad=True), torch.randint(0, 37, (6,))
    captured = capture(one_hot_product, [x, t], trace_joint=True, static_inputs=[True])
    assert [f[1] for f in captured.fallbacks] == ["aten.scatter.value"], captured.fallbacks
    the_plan = plan(captured)
    assert the_plan.saved_bytes == 0, the_plan.saved
    assert the_plan.decisions["scatter"] == (Decision.RECOMPUTE, INDEX_REASON)
    assert the_plan.backward["scatter"].op is Op.EXTERN


def flipped_gather(x, t):
    """The targets reversed (an aten call that does not grow them), gathered: the gather's backward
    reads the reversed targets."""
    flipped = t.flip(0)
    return ((x.gather(-1, flipped[:, None]) * 2).sum(),)


def test_index_op_that_does_not_expand_is_kept():
    x, t = torch.randn(7, 37, requires_grad=True), torch.randint(0, 37, (7,))
    captured = capture(flipped_gather, [x, t], trace_joint=True, static_inputs=[True])
    the_plan = plan(captured)
    flip, = [n for n, node in captured.joint.nodes.items() if node.op is Op.EXTERN
             and node.attr.target is torch.ops.aten.flip.default]
    decision, reason = the_plan.decisions[flip]
    assert decision is Decision.SAVE and "does not expand" in reason, (decision, reason)


def padded_gather(x, t):
    """The targets padded by one, gathered: a pad is a read a kernel makes (memfuse.capture.rules_views), so the
    backward recomputes it from the targets, and nothing of it is saved."""
    padded = F.pad(t, (0, 1), value=0)
    return ((x.gather(-1, padded[:, None]) * 2).sum(),)


def test_a_padded_index_is_recomputed_from_the_targets():
    x, t = torch.randn(7, 37, requires_grad=True), torch.randint(0, 37, (6,))
    captured = capture(padded_gather, [x, t], trace_joint=True, static_inputs=[True])
    assert not [f for f in captured.fallbacks if f[1] == "aten.constant_pad_nd.default"], captured.fallbacks
    pad, = [n for n, node in captured.joint.nodes.items() if node.op is Op.STRIDED and n.startswith("constant_pad")]
    the_plan = plan(captured)
    assert the_plan.decisions[pad][0] is Decision.RECOMPUTE, the_plan.decisions[pad]
    assert pad not in [s.name for s in the_plan.saved]


def test_tiny_gpt2_head_saves_its_logits_once_in_bf16():
    """A one-layer GPT-2 with its LM head and HF's loss (labels shifted by a pad, logits upcast to
    fp32) under bf16 autocast: of [tokens, vocab] the plan keeps the bf16 logits only."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=1001, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    names, params = zip(*model.named_parameters())
    ids = torch.randint(0, 1001, (2, 16))

    def step(*values):
        with torch.autocast("cpu", torch.bfloat16):
            state = dict(zip(names, values[:len(names)]))
            return (torch.func.functional_call(model, state, (values[-2],), {"labels": values[-1]}).loss,)

    inputs = [*params, ids, ids.clone()]
    captured = capture(step, inputs, trace_joint=True, static_inputs=[True] * len(params))
    assert not [f for f in captured.fallbacks if "scatter" in f[1]], captured.fallbacks
    the_plan = plan(captured)
    joint, tokens_by_vocab = captured.joint, 2 * 16 * 1001
    wide = [s for s in the_plan.saved if not s.is_input and numel(joint[s.name], captured) >= tokens_by_vocab]
    assert [joint[s.name].value.dtype for s in wide] == [torch.bfloat16], the_plan.saved
    assert the_plan.saved_bytes <= torch_saved_bytes(step, inputs)


def autocast_linears(x, w1, w2):
    with torch.autocast("cpu", torch.bfloat16):
        return (F.linear(F.silu(F.linear(x, w1)), w2).float().sum(-1),)


def matmul_products(captured) -> list:
    return [n for n in captured.joint.nodes.values()
            if n.op is Op.EXTERN and n.attr.target is torch.ops.aten.mm.dtype]


def test_an_fp32_cast_of_a_bf16_product_is_the_matmuls_own_output(monkeypatch):
    """autocast's weight gradients, mm then a cast to the fp32 parameter's dtype, are one
    `aten.mm.dtype` where the build writes fp32 products (CUDA; on the CPU only with the probe
    patched, and not run): no cast kernel, no bf16 product. The forward's products, read as bf16
    by the next op, stay bf16 matmuls."""
    from memfuse.capture import rules_pointwise as capture_module
    inputs = [torch.randn(4, 16, 32, requires_grad=True), torch.randn(64, 32, requires_grad=True),
              torch.randn(32, 64, requires_grad=True)]
    plain = capture(autocast_linears, inputs, trace_joint=True)
    assert not matmul_products(plain)          # the CPU has no fp32-output matmul: left as it was
    monkeypatch.setattr(capture_module, "matmul_writes_fp32", lambda device, dtype: True)
    fused = capture(autocast_linears, inputs, trace_joint=True)
    made = matmul_products(fused)
    gradients = fused.joint.outputs[fused.num_fwd_outputs:]
    assert sorted(n.name for n in made) == sorted(gradients[1:])      # both weights' gradients
    assert all(n.value.dtype is torch.float32 and n.attr.args[-1] is torch.float32 for n in made)

    def casts(c):
        return sum(n.op is Op.CAST for n in c.joint.nodes.values())
    assert casts(fused) == casts(plain) - 2
    the_plan = plan(fused)
    assert all(the_plan.backward[n.name].attr.target is torch.ops.aten.mm.dtype for n in made)   # run there


def test_fp32_output_matmuls_run_through_the_program_as_eager_does(monkeypatch):
    """The rewritten matmuls, run: the probe patched as on CUDA, and `aten.mm.dtype` (which the CPU
    lacks) bound to the fp32 product of the same bf16 operands, what cuBLAS computes (SUBSTITUTES,
    the runtime's table of what an extern step calls). Output and every gradient within bf16's
    tolerance of eager autocast's; both weight gradients come out of the two matmuls in fp32."""
    from memfuse.capture import rules_pointwise as capture_module
    from memfuse.runtime import externs
    monkeypatch.setattr(capture_module, "matmul_writes_fp32", lambda device, dtype: True)
    calls = []

    def fp32_product(a, b, dtype):
        calls.append(dtype)
        return torch.mm(a.to(dtype), b.to(dtype))
    monkeypatch.setitem(externs.SUBSTITUTES, torch.ops.aten.mm.dtype, fp32_product)
    torch.manual_seed(0)
    inputs = [torch.randn(4, 16, 32, requires_grad=True), (torch.randn(64, 32) * 0.2).requires_grad_(),
              (torch.randn(32, 64) * 0.2).requires_grad_()]
    refs = [t.detach().clone().requires_grad_() for t in inputs]
    out = memory_efficient_fusion(autocast_linears)(*inputs)[0]
    out.backward(torch.ones_like(out))
    assert calls == [torch.float32, torch.float32]
    ref = autocast_linears(*refs)[0]
    ref.backward(torch.ones_like(ref))
    assert rel_error(out, ref) < 1e-2
    for ours, theirs in zip(inputs, refs):
        assert ours.grad.dtype == torch.float32 and rel_error(ours.grad, theirs.grad) < 1e-2
