"""memfuse.capture.capture: a small function traced by AOTAutograd and lowered to memfuse IR.
The joint graph verifies (inputs primals then tangents; outputs the forward's then one gradient per
primal), leading dims are symbols read from each call while the row length stays static, and a
dropout becomes one random node drawn from the call's seed, whose mask both directions read."""
import pytest
import sympy
import torch
import torch.nn.functional as F

from memfuse.capture import capture
from memfuse.ir.graph import RANDOM, Kind, Op, format_graph, verify

D = 40


def scaled_tanh(x, w):
    return (torch.tanh(x) * w,)


def dropped(x):
    return (F.dropout(x, 0.5, training=True) * 2,)


def leaves(*shapes):
    return [torch.randn(*shape, requires_grad=True) for shape in shapes]


def reaches(graph, name: str) -> set:
    """The graph outputs (by position) that `name` flows into."""
    users, seen, todo = graph.users(), set(), [name]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(users[node])
    return {i for i, out in enumerate(graph.outputs) if out in seen}


def test_the_joint_graph_verifies_with_primals_tangents_and_a_gradient_per_primal():
    captured = capture(scaled_tanh, leaves((3, 5, D), (D,)), trace_joint=True)
    joint = captured.joint
    verify(joint)
    assert (captured.num_primals, captured.num_tangents, captured.num_fwd_outputs) == (2, 1, 1)
    assert [joint[name].op for name in joint.inputs] == [Op.INPUT] * 3, format_graph(joint)
    assert not captured.has_seed and captured.fallbacks == []
    forward, grad_x, grad_w = joint.outputs
    assert len(joint.outputs) == captured.num_fwd_outputs + captured.num_primals
    assert joint[grad_x].value.kind is Kind.FULL, "x's gradient has x's [M, D] shape"
    assert joint[grad_w].value.kind is Kind.COL, "w's gradient is a sum over the rows: one value per column"


def test_leading_dims_are_symbols_read_from_the_call_and_the_row_length_is_static():
    first = capture(scaled_tanh, leaves((3, 5, D), (D,)), trace_joint=True)
    x = first.joint[first.joint.inputs[0]].value
    batch, time = x.shape[:2]
    assert isinstance(batch, sympy.Symbol) and isinstance(time, sympy.Symbol) and x.shape[2] == D
    assert first.symbols == {batch: (0, 0), time: (0, 1)}, "each symbol is read from the call's first argument"
    assert first.hints == {batch: 3, time: 5}
    assert (sympy.simplify(x.m - batch * time), x.d) == (0, D), "M is the product of the leading dims"
    assert first.joint[first.joint.inputs[1]].value.shape == (D,), "a weight's size stays a number"
    assert first.specialized is None
    other = capture(scaled_tanh, leaves((2, 7, D), (D,)), trace_joint=True)
    assert format_graph(other.joint) == format_graph(first.joint), "other leading sizes, the same program"


def test_a_dropout_becomes_one_seeded_node_whose_mask_both_directions_read():
    captured = capture(dropped, leaves((3, 5, D)), trace_joint=True)
    joint = captured.joint
    verify(joint)
    seeds = [name for name in joint.inputs if joint[name].op is Op.SEED]
    random = [node for node in joint.nodes.values() if node.op in RANDOM]
    assert captured.has_seed and len(seeds) == 1, format_graph(joint)
    assert len(random) == 1 and list(random[0].inputs) == seeds, "one mask drawn from the call's seed, by nothing else"
    assert reaches(joint, random[0].name) == {0, 1}, "the forward output and the gradient read the same mask"


def test_two_dropouts_draw_from_two_streams_of_one_seed():
    def twice(x):
        return (F.dropout(x, 0.5, training=True) + F.dropout(x, 0.25, training=True),)

    joint = capture(twice, leaves((3, 5, D)), trace_joint=True).joint
    random = [node for node in joint.nodes.values() if node.op in RANDOM]
    assert len(random) == 2 and random[0].inputs == random[1].inputs, format_graph(joint)
    assert random[0].attr.stream != random[1].attr.stream, "two masks, two streams"


def test_a_forward_only_capture_has_no_tangents_and_returns_the_forward_outputs():
    x, w = (t.detach() for t in leaves((3, 5, D), (D,)))
    captured = capture(scaled_tanh, [x, w], trace_joint=False)
    verify(captured.joint)
    assert (captured.num_primals, captured.num_tangents) == (2, 0)
    assert len(captured.joint.outputs) == captured.num_fwd_outputs == 1


def test_an_input_written_in_place_is_refused_with_the_way_out():
    def bumps(x):
        x.add_(1)
        return (x * 2,)

    with pytest.raises(RuntimeError, match="modifies one of its input tensors in place.*unchanged"):
        capture(bumps, [torch.randn(3, 5, D)], trace_joint=False)


@torch.jit.script
def scaled_by_count(x):
    """Asks for concrete sizes, which the TorchScript interpreter cannot give on a trace's
    symbolic tensor: `numel()` raises there, and `size(0)` would specialize the trace on it."""
    return x * (x.numel() / x.size(0))


def scripted_helper(x, w):
    return (scaled_by_count(torch.tanh(x)) * w,)


def test_a_torchscript_helper_traces_as_its_python_original_with_symbolic_sizes():
    """A model's @torch.jit.script helper (DeBERTa's in transformers 5.17) runs as its Python
    original while memfuse traces (as Dynamo inlines it): the interpreter would fail with "The
    following operation failed in the TorchScript interpreter ... Cannot call numel() on tensor
    with symbolic sizes/strides". The sizes stay symbols: nothing specializes on the call's batch."""
    x, w = leaves((3, 5, D), (D,))
    captured = capture(scripted_helper, [x, w], trace_joint=True)
    verify(captured.joint)
    assert captured.specialized is None and captured.fallbacks == []
    assert isinstance(scaled_by_count, torch.jit.ScriptFunction)   # still a TorchScript function after
