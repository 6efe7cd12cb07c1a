"""reinplace: an aten scatter into a fresh fill writes into it in place, not into a copy of it.

A functional graph writes `index_put(zeros, indices, values, accumulate)` (an embedding's backward)
or `scatter(full, dim, index, value)` (the one-hot of a cross-entropy's backward): aten's
out-of-place op first clones its base, a copy of the whole tensor (a device-to-device memcpy on a
GPU: for a vocabulary of 50257 that is the size of the logits, or of the embedding table). When the
base is a fill the graph itself makes (a constant written by a kernel, or an aten full/zeros: fresh
memory nobody else holds) and the scatter is its only reader, the in-place op writes into it:
the same values, no copy. The result aliases the base, as the in-place op's schema says, which
memfuse.buffers reads. `schedule.schedule` runs it on each program's graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ir import Extern, Graph, Node, Op, ValueRef, value_refs

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
    """A scatter that writes into its base in place, and why that is safe."""
    name: str
    target: str
    base: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name} ({self.target} -> in place into {self.base}): {self.reason}"


def reinplace_fills(graph: Graph) -> tuple:
    """(graph, [InPlace]): the graph with every scatter into a fresh fill that nothing else reads
    made in place (the graph itself when there is none)."""
    users = graph.users()
    outputs = {o for o in graph.outputs if o is not None}
    changed, records = {}, []
    for name, node in graph.nodes.items():
        if node.op is not Op.EXTERN or node.attr.target not in IN_PLACE:
            continue
        base = node.attr.args[0]
        refs = value_refs(node.attr.args) + value_refs(tuple(v for _, v in node.attr.kwargs))
        if not isinstance(base, ValueRef) or base.name in outputs or users[base.name] != [name] \
                or refs.count(base.name) != 1:
            continue      # the base is read elsewhere too (or returned): its values must stay
        fill = _fill(graph, base.name)
        if fill is None:
            continue      # it may be memory the caller holds (an input, a view of one)
        target = IN_PLACE[node.attr.target]
        changed[name] = Node(name, node.op, node.inputs, node.value, Extern(target, node.attr.args, node.attr.kwargs))
        records.append(InPlace(name, str(node.attr.target), base.name,
                               f"{base.name} is {fill} that only {name} reads: written in place, not cloned"))
    if not changed:
        return graph, records
    rewritten = Graph(inputs=list(graph.inputs), outputs=list(graph.outputs))
    for name, node in graph.nodes.items():
        rewritten.add(changed.get(name, node))
    return rewritten, records


def _fill(graph: Graph, name: str):
    """What makes `name` a fresh fill ("a constant written by a kernel", "an aten zeros"), or None."""
    node = graph[name]
    if node.op is Op.VIEW and len(node.inputs) == 1 and graph[node.inputs[0]].op is Op.CONSTANT:
        return "a constant written by a kernel"
    if node.op is Op.EXTERN and node.attr.target in FRESH_FILLS:
        return f"a fresh aten fill ({node.attr.target})"
    return None


