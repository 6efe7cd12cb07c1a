"""plan: decide what the forward saves and what the backward recomputes, by a min-cut.

Each forward-computable node n is split into (n, IN) -> (n, OUT) with capacity = the bytes of
saving n. Data edges are infinite. The primal inputs and the nodes that cannot be recomputed
(extern calls, reductions over M) hang from the source; every forward node a backward node reads hangs to the sink. The cheapest cut
is the cheapest set of values to keep alive; the forward computes its own outputs regardless. The primal inputs cost one byte: they are alive
anyway, and the byte only breaks ties towards fewer tensors. Random values are recomputable
for free: their only input, the seed, is a Python int kept on the side, so a dropout mask is
regenerated in the backward and never saved.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import networkx as nx

from .capture import Captured
from .ir import REDUCTION, Graph, Kind, Node, Op, Reduce, value_bytes

INFINITE = float("inf")
FREE_LEAVES = {Op.SEED, Op.CONSTANT, Op.SYMBOL}   # available to both graphs at no cost
INPUT_COST = 1


class Side(enum.Enum):
    IN = "in"
    OUT = "out"


class Decision(enum.Enum):
    SAVE = "save"
    RECOMPUTE = "recompute"
    REGENERATE = "regenerate"      # a random value, redrawn in the backward from the seed
    FORWARD = "forward"            # computed in the forward only


@dataclass(frozen=True)
class SavedValue:
    name: str
    bytes: int
    is_input: bool
    reason: str


@dataclass
class Plan:
    forward: Graph                 # inputs: primals, [seed]; outputs: user outputs, then saved
    backward: Graph | None         # inputs: saved, [seed], tangents; outputs: one grad per primal
    num_fwd_outputs: int
    saved: list = field(default_factory=list)        # SavedValue, in forward-output order
    decisions: dict = field(default_factory=dict)    # node name -> (Decision, reason)

    @property
    def saved_bytes(self) -> int:
        """Bytes kept alive for the backward beyond the inputs (hinted sizes)."""
        return sum(s.bytes for s in self.saved if not s.is_input)


def recomputable(node: Node) -> bool:
    if node.op in (Op.EXTERN, Op.GETITEM):
        return False
    if node.op in REDUCTION and isinstance(node.attr, Reduce) and node.attr.axis is Kind.COL:
        return False   # a reduction over every row: recomputing it costs a whole extra pass
    if node.op is Op.STRIDED and node.attr.summed:
        return False   # a sum over leading dims: recomputing it re-reads every row it adds up
    return True


def plan(captured: Captured) -> Plan:
    joint = captured.joint
    if captured.num_tangents == 0 and len(joint.outputs) == captured.num_fwd_outputs:
        return plan_inference(captured)
    n_fwd = captured.num_fwd_outputs
    fwd_outputs, grads = joint.outputs[:n_fwd], joint.outputs[n_fwd:]
    primals = joint.inputs[:captured.num_primals]
    tangents = joint.inputs[len(joint.inputs) - captured.num_tangents:]

    backward_only = _descendants(joint, tangents)
    backward_needed = _ancestors(joint, [g for g in grads if g is not None])
    cut = _min_cut(captured, backward_only, backward_needed, grads)

    saved_names = [n for n in joint.nodes if n in cut]
    saved = [SavedValue(n, value_bytes(joint[n].value, captured.hints), joint[n].op is Op.INPUT,
                        _save_reason(joint[n], backward_only, joint))
             for n in saved_names]
    forward = _subgraph(joint, inputs=primals + (["seed"] if captured.has_seed else []),
                        outputs=list(fwd_outputs) + saved_names)
    bw_inputs = saved_names + (["seed"] if captured.has_seed else []) + tangents
    backward = _subgraph(joint, inputs=bw_inputs, outputs=list(grads))
    decisions = _decisions(joint, forward, backward, saved, backward_only)
    return Plan(forward, backward, n_fwd, saved, decisions)


def plan_inference(captured: Captured) -> Plan:
    """Forward only (no_grad, or nothing needs a gradient): nothing is saved."""
    joint = captured.joint
    n_fwd = captured.num_fwd_outputs
    inputs = joint.inputs[:captured.num_primals] + (["seed"] if captured.has_seed else [])
    forward = _subgraph(joint, inputs=inputs, outputs=list(joint.outputs[:n_fwd]))
    decisions = {n: (Decision.FORWARD, "forward only") for n in forward.nodes}
    return Plan(forward, None, n_fwd, [], decisions)


def _min_cut(captured, backward_only, backward_needed, grads) -> set:
    """The values the backward receives. Forward-needed nodes are not tied to the source:
    the forward computes them anyway, and the backward may compute them again."""
    joint = captured.joint
    users = joint.users()
    flow = nx.DiGraph()
    source, sink = "source", "sink"
    flow.add_node(source)
    flow.add_node(sink)
    for name, node in joint.nodes.items():
        if name in backward_only or node.op in FREE_LEAVES:
            continue
        if name not in backward_needed:
            continue   # the backward never reads it, directly or through recomputation
        inside, outside = (name, Side.IN), (name, Side.OUT)
        if node.op is Op.INPUT:
            capacity = INPUT_COST
        elif node.value.dtype is None:
            capacity = INFINITE   # a tuple result cannot be saved as one tensor
        else:
            capacity = max(value_bytes(node.value, captured.hints), 1)
        flow.add_edge(inside, outside, capacity=capacity)
        if node.op is Op.INPUT or not recomputable(node):
            flow.add_edge(source, inside, capacity=INFINITE)
        for inp in node.inputs:
            if (inp, Side.OUT) in flow:
                flow.add_edge((inp, Side.OUT), inside, capacity=INFINITE)
        if any(u in backward_only for u in users[name]) or name in grads:
            flow.add_edge(outside, sink, capacity=INFINITE)
    if not flow.has_node(sink) or not nx.has_path(flow, source, sink):
        return set()
    _, (reachable, _) = nx.minimum_cut(flow, source, sink)
    return {key[0] for key in reachable if key != source and key[1] is Side.IN
            and (key[0], Side.OUT) not in reachable}


def _subgraph(joint: Graph, inputs: list, outputs: list) -> Graph:
    """The nodes needed for `outputs` given `inputs`; the inputs become INPUT (or SEED) nodes."""
    needed = _ancestors(joint, [o for o in outputs if o is not None], stop=set(inputs))
    graph = Graph()
    for name in inputs:
        node = joint[name]
        op = Op.SEED if node.op is Op.SEED else Op.INPUT
        graph.add(Node(name, op, (), node.value))
    graph.inputs = list(inputs)
    for name, node in joint.nodes.items():
        if name in needed and name not in graph.nodes:
            graph.add(node)
    graph.outputs = list(outputs)
    return graph


def _ancestors(graph: Graph, roots, stop=frozenset()) -> set:
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in stop:
            stack.extend(graph[name].inputs)
    return seen


def _descendants(graph: Graph, roots) -> set:
    users = graph.users()
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(users[name])
    return seen


def _save_reason(node: Node, backward_only: set, joint: Graph) -> str:
    if node.op is Op.INPUT:
        return "an input, alive anyway: the backward recomputes from it"
    if not recomputable(node):
        what = "an extern call" if node.op in (Op.EXTERN, Op.GETITEM) else "a reduction over M"
        return f"{what}: cheaper to keep than to redo"
    return "cheaper to keep than to recompute from the inputs (min-cut)"


def _decisions(joint, forward, backward, saved, backward_only) -> dict:
    saved_names = {s.name: s for s in saved}
    decisions = {}
    for name, node in joint.nodes.items():
        if node.op in FREE_LEAVES or node.op is Op.INPUT:
            continue
        if name in saved_names:
            decisions[name] = (Decision.SAVE, saved_names[name].reason)
        elif name in backward.nodes and name not in backward_only:
            if node.op is Op.RAND:
                decisions[name] = (Decision.REGENERATE, "redrawn from the seed: the mask is never saved")
            else:
                decisions[name] = (Decision.RECOMPUTE, "recomputed in the backward from saved inputs")
        elif name in forward.nodes:
            decisions[name] = (Decision.FORWARD, "needed by the forward outputs only")
    return decisions
