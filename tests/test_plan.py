"""The planner on joint graphs from memfuse.capture: what the forward saves, what the backward
recomputes or regenerates, and how that compares with torch's own min-cut partitioner."""

import pytest
import torch
import torch.nn.functional as F
from functorch.compile import aot_function, min_cut_rematerialization_partition

from helpers import BLOCKS, block_inputs
from memfuse.capture import capture, decomposition_table
from memfuse.ir import EXTERNAL, Kind, Op, verify
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

