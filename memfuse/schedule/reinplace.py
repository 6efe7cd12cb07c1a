"""reinplace: an aten call writes into memory nobody else reads, in place, not into a copy.

- A functional graph writes `index_put(zeros, indices, values, accumulate)` (an embedding's backward)
  or `scatter(full, dim, index, value)` (the one-hot of a cross-entropy's backward): aten's
  out-of-place op first clones its base, a copy of the whole tensor (a device-to-device memcpy on a
  GPU: for a vocabulary of 50257 that is the size of the logits, or of the embedding table). When
  the base is a fill the graph itself makes (a constant written by a kernel, or an aten full/zeros:
  fresh memory nobody else holds) and the scatter is its only reader, the in-place op writes into
  it: the same values, no copy.
- An extern op a pattern registered with an in-place twin (memfuse.ir.patterns, ExternRule.in_place:
  the chunked loss head's backward, which scales the gradients its forward formed) is asked whether
  this call may write into its operands, and why; that check is the pattern's.

The result aliases what it was written into, as the in-place op's schema says, which memfuse.buffers
reads. `schedule.schedule` runs it on each program's graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from memfuse.ir.graph import Extern, Graph, Node, Op, ValueRef, value_refs
from memfuse.ir.patterns import rule

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
    and every call of a registered op whose in-place twin its rule allows, made in place (the graph
    itself when there is none). `replayed`: the program runs as CUDA-graph replays
    (Config.seed_from_memory): its saved values are static buffers that a retained graph's next
    replay reads again; the rules are told so."""
    users = graph.users()
    outputs = {o for o in graph.outputs if o is not None}
    changed, records = {}, []
    for name, node in graph.nodes.items():
        if node.op is not Op.EXTERN:
            continue
        if node.attr.target in IN_PLACE:
            record, target = _scatter_into_fill(graph, node, users, outputs), IN_PLACE[node.attr.target]
        elif (twin := rule(node.attr.target).in_place) is not None:
            choice = twin(graph, node, users, outputs, replayed)
            record, target = (None, None) if choice is None else (
                InPlace(node.name, str(node.attr.target), choice.base, choice.reason), choice.target)
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
    if not isinstance(base, ValueRef) or not only_reader(node, base.name, users, outputs):
        return None       # the base is read elsewhere too (or returned): its values must stay
    fill = _fill(graph, base.name)
    if fill is None:
        return None       # it may be memory the caller holds (an input, a view of one)
    return InPlace(node.name, str(node.attr.target), base.name,
                   f"{base.name} is {fill} that only {node.name} reads: written in place, not cloned")


def saved_only_here(graph: Graph, node: Node, name: str, users: dict, outputs: set) -> bool:
    return name in graph.inputs and only_reader(node, name, users, outputs)


def only_reader(node: Node, name: str, users: dict, outputs: set) -> bool:
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
