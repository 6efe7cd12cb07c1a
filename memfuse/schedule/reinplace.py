"""reinplace: an aten call writes into memory nobody else reads, in place, not into a copy.

- A functional graph writes `index_put(zeros, indices, values, accumulate)` (an embedding's backward)
  or `scatter(full, dim, index, value)` (the one-hot of a cross-entropy's backward): aten's
  out-of-place op first clones its base, a copy of the whole tensor (a device-to-device memcpy on a
  GPU: for a vocabulary of 50257 that is the size of the logits, or of the embedding table). When
  the base is a fill the graph itself makes (a constant written by a kernel, or an aten full/zeros:
  fresh memory nobody else holds) and the scatter is its only reader, the in-place op writes into
  it: the same values, no copy.
- The chunked loss head's backward (memfuse.patterns.loss_head.op) scales the gradients its forward formed by
  the loss's gradient: out of place, a second [vocab, H] weight gradient is allocated while the
  first is alive (1 GB for a vocabulary of 128256 at H = 4096 in bf16). When those formed gradients
  are saved values the backward reads only there, the in-place op scales them where they lie (the
  hidden states' too where the forward formed it in their dtype: no second [tokens, H] gradient); a
  backward run that keeps its graph for another gets scaled copies (the op checks at run time).

The result aliases what it was written into, as the in-place op's schema says, which memfuse.buffers
reads. `schedule.schedule` runs it on each program's graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from memfuse.patterns.loss_head import op as loss_head  # noqa: F401  (registers the loss head's ops, named below)
from memfuse.ir.graph import Extern, Graph, Node, Op, ValueRef, value_refs

aten = torch.ops.aten

# out-of-place scatter -> its in-place form (same arguments, writes into the first)
IN_PLACE = {
    aten.index_put.default: aten.index_put_.default,
    aten.scatter.value: aten.scatter_.value,
    aten.scatter.src: aten.scatter_.src,
    aten.scatter_add.default: aten.scatter_add_.default,
    aten.scatter_reduce.two: aten.scatter_reduce_.two,
    aten.index_add.default: aten.index_add_.default,
}
# aten calls that return a new tensor of one value
FRESH_FILLS = {aten.full.default, aten.zeros.default, aten.full_like.default, aten.zeros_like.default,
               aten.new_zeros.default, aten.new_full.default}
# the loss head's backward -> the form that scales the formed gradients in place (same arguments)
LOSS_HEAD_BACKWARD = torch.ops.memfuse.linear_cross_entropy_backward.default
LOSS_HEAD_BACKWARD_IN_PLACE = torch.ops.memfuse.linear_cross_entropy_backward_.default
# ... and the form that scales the hidden states' gradient in place too, where it is in hidden's dtype
LOSS_HEAD_BACKWARD_ALL_IN_PLACE = torch.ops.memfuse.linear_cross_entropy_backward_all_.default
HIDDEN, HIDDEN_UNIT = 2, 7          # its arguments hidden and hidden_unit
# results of in-place calls that alias a saved value only that call reads (the rewrite checks it): the
# program's own memory, not the caller's, so a returned reshape of one may alias it (no copy kernel)
OWN_ALIASES = {LOSS_HEAD_BACKWARD_ALL_IN_PLACE: (0,)}
WRITTEN_GRADIENTS = slice(8, 10)    # the arguments its in-place forms write: weight_unit, bias_unit (and hidden_unit)


@dataclass(frozen=True)
class InPlace:
    """An aten call that writes into memory nobody else reads, in place, and why that is safe."""
    name: str
    target: str
    base: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.target} -> in place into {self.base}): {self.reason}"


def reinplace(graph: Graph, *, replayed: bool = False) -> tuple:
    """(graph, [InPlace]): the graph with every scatter into a fresh fill that nothing else reads,
    and every loss-head backward whose formed gradients nothing else reads, made in place (the graph
    itself when there is none). `replayed`: the program runs as CUDA-graph replays
    (Config.seed_from_memory): its saved values are static buffers that a retained graph's next
    replay reads again, and the op asks autograd whether the graph is kept only at the capture, so
    the loss head's backward keeps its copies."""
    users = graph.users()
    outputs = {o for o in graph.outputs if o is not None}
    changed, records = {}, []
    for name, node in graph.nodes.items():
        if node.op is not Op.EXTERN:
            continue
        if node.attr.target in IN_PLACE:
            record, target = _scatter_into_fill(graph, node, users, outputs), IN_PLACE[node.attr.target]
        elif node.attr.target is LOSS_HEAD_BACKWARD and not replayed:
            record, target = _formed_gradients_scaled(graph, node, users, outputs)
        else:
            continue
        if record is not None:
            changed[name] = Node(name, node.op, node.inputs, node.value, Extern(target, node.attr.args, node.attr.kwargs))
            records.append(record)
    if not changed:
        return graph, records
    rewritten = Graph(inputs=list(graph.inputs), outputs=list(graph.outputs))
    for name, node in graph.nodes.items():
        rewritten.add(changed.get(name, node))
    return rewritten, records


def _scatter_into_fill(graph: Graph, node: Node, users: dict, outputs: set) -> Optional[InPlace]:
    base = node.attr.args[0]
    if not isinstance(base, ValueRef) or not _only_reader(node, base.name, users, outputs):
        return None       # the base is read elsewhere too (or returned): its values must stay
    fill = _fill(graph, base.name)
    if fill is None:
        return None       # it may be memory the caller holds (an input, a view of one)
    return InPlace(node.name, str(node.attr.target), base.name,
                   f"{base.name} is {fill} that only {node.name} reads: written in place, not cloned")


def _formed_gradients_scaled(graph: Graph, node: Node, users: dict, outputs: set) -> tuple:
    """(InPlace or None, the in-place form): the weight's and the bias's formed gradients scaled in
    place; the hidden states' too where it is a saved value only this reads, in hidden's dtype."""
    formed = node.attr.args[WRITTEN_GRADIENTS]
    if not all(isinstance(f, ValueRef) for f in formed):
        return None, None
    names = [f.name for f in formed]
    if not all(_saved_only_here(graph, node, n, users, outputs) for n in names):
        return None, None       # computed here, or read by another step: the copies stay
    if not graph[names[0]].value.shape or 0 in graph[names[0]].value.shape:
        return None, None       # the forward formed none: the backward recomputes them, nothing to scale
    hidden, hidden_unit = node.attr.args[HIDDEN], node.attr.args[HIDDEN_UNIT]
    if (isinstance(hidden, ValueRef) and isinstance(hidden_unit, ValueRef)
            and _saved_only_here(graph, node, hidden_unit.name, users, outputs)
            and graph[hidden_unit.name].value.dtype == graph[hidden.name].value.dtype):
        return InPlace(node.name, str(node.attr.target), ", ".join([hidden_unit.name, *names]),
                       "the gradients the forward formed (the hidden states' in their dtype) are saved values only "
                       "it reads: scaled in place (copies where a backward keeps its graph), no second weight or "
                       "hidden states' gradient"), LOSS_HEAD_BACKWARD_ALL_IN_PLACE
    return InPlace(node.name, str(node.attr.target), ", ".join(names),
                   "the gradients the forward formed are saved values only it reads: scaled in place (copies "
                   "where a backward keeps its graph), no second weight gradient"), LOSS_HEAD_BACKWARD_IN_PLACE


def _saved_only_here(graph: Graph, node: Node, name: str, users: dict, outputs: set) -> bool:
    return name in graph.inputs and _only_reader(node, name, users, outputs)


def _only_reader(node: Node, name: str, users: dict, outputs: set) -> bool:
    refs = value_refs(node.attr.args) + value_refs(tuple(v for _, v in node.attr.kwargs))
    return name not in outputs and users[name] == [node.name] and refs.count(name) == 1


def _fill(graph: Graph, name: str):
    """What makes `name` a fresh fill ("a constant written by a kernel", "an aten zeros"), or None."""
    node = graph[name]
    if node.op is Op.VIEW and len(node.inputs) == 1 and graph[node.inputs[0]].op is Op.CONSTANT:
        return "a constant written by a kernel"
    if node.op is Op.EXTERN and node.attr.target in FRESH_FILLS:
        return f"a fresh aten fill ({node.attr.target})"
    return None
