"""How the scheduler sees a node: its space, whether it reads from memory, whether a kernel may
compute it with its readers (`fusion_barrier`), and which views and reshapes alias what they read."""
from __future__ import annotations

from typing import Optional

import sympy
import torch

from memfuse.ir.graph import (EXTERNAL, MEMORY_VIEWS, REDUCTION, Extern, Graph, Kind, Op, Reduce, Reshape, Value,
                              aten_schema, column_padding)
from memfuse.ir.patterns import rule
from memfuse.schedule.steps import Space


# -- values with no input: computed where they are read ---------------------------------------------
SOURCES = (Op.CONSTANT, Op.SYMBOL, Op.SEED)



def reads_from_memory(graph: Graph, reader: str, name: str) -> bool:
    """Whether the fusible node `reader` reads `name` from memory (a view's root), not from registers."""
    node = graph[reader]
    return node.op in MEMORY_VIEWS and node.inputs[0] == name



def values_loaded(graph: Graph, members: set, free: set) -> set:
    """The values a group's nodes (`members`) read that it does not compute: what it loads."""
    return {i for n in members for i in graph[n].inputs
            if i not in members and i not in free and graph[i].op not in SOURCES}



def row_bytes(value: Value) -> int:
    """Bytes a row of the iteration space: D elements of a FULL value, one of a ROW value."""
    size = value.dtype.itemsize if value.dtype is not None else 8
    return size * (value.d if value.kind is Kind.FULL else 1 if value.kind is Kind.ROW else 0)



def is_view(node) -> bool:
    """An aten call whose result is a view of its input (permute, view, expand): free to run late."""
    schema = aten_schema(node.attr.target) if node.op is Op.EXTERN and isinstance(node.attr, Extern) else None
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)



def node_space(graph: Graph, node, group_of: dict) -> Space:
    """Where a node runs: its value's space, and for a reduction also its source's [M, D] (a
    column sum alone in its group must still walk the M rows, a row sum the D columns); a padded
    store runs where its root does."""
    if stores_padded(graph, node, group_of):
        return Space.of(graph[node.inputs[0]].value)
    space = Space.of(node.value)
    if node.op in REDUCTION:
        space = space.join(Space.of(graph[node.inputs[0]].value))
    return space



def stores_padded(graph: Graph, node, computed) -> bool:
    """Whether `node` is a zero padding of the columns of a value a kernel computes (`computed`:
    the names kernels compute), which that kernel stores padded (memfuse.schedule.padding): its tiles span
    the padded row (BLOCK_D, the next power of two of D, reaches it)."""
    d = column_padding(graph, node)
    if d is None or node.inputs[0] not in computed:
        return False
    root_d = graph[node.inputs[0]].value.d
    return d <= 1 << max(0, (root_d - 1).bit_length())



def runtime_reshape(graph: Graph, node) -> bool:
    """A step the runtime does with `.reshape` (or `.to`), not a kernel: a view or cast of a
    finished reduction over M (D elements), or a returned reshape of an aten call's result (the
    logits a model returns, a view of the LM head's matmul: a kernel would copy [tokens, vocab]
    only to return it). Only a reshape: a broadcast (expand) of the value is a kernel's job."""
    if node.op not in (Op.VIEW, Op.CAST):
        return False
    if not same_size(graph, node):
        return False
    if isinstance(node.attr, Reshape):
        return True
    if node.value.kind in (Kind.COL, Kind.SCALAR):
        return fusion_barrier(graph, node.inputs[0]) is not None
    return node.op is Op.VIEW and node.name in graph.outputs and made_by_aten(graph, node.inputs[0])



def same_size(graph: Graph, node) -> bool:
    """Whether `node` has as many elements as its input. Sizes equal term for term (every static
    size, and most symbolic ones) answer without sympy.simplify, which costs milliseconds a call
    and runs for every view of a graph; simplify decides only products that differ in form."""
    source = graph[node.inputs[0]].value
    before, after = sympy.Mul(*source.shape), sympy.Mul(*node.value.shape)
    if before == after:
        return True
    if before.is_Integer and after.is_Integer:
        return False
    return sympy.simplify(before - after) == 0



def made_by_aten(graph: Graph, name: str) -> bool:
    """Whether `name` is an aten call's result in storage of its own, or an aliasing view of one
    (never of a program input: a reshape of it returned would alias what the caller passed in).
    An element of an aten call's tuple (the chunked loss head's logits) counts as its result: its
    own where the schema says that element aliases nothing, or aliases a saved value memfuse.schedule.reinplace
    found only that call reads (ExternRule.own_aliases, memfuse.ir.patterns: the loss head's hidden states' gradient, scaled in place)."""
    node = graph[name]
    if node.op is Op.GETITEM and graph[node.inputs[0]].op is Op.EXTERN:
        call = graph[node.inputs[0]]
        schema = aten_schema(call.attr.target)
        if schema is not None and call.attr.target not in ALIASING_CALLS \
                and schema.returns[node.attr.index].alias_info is None:
            return True
        if node.attr.index in rule(call.attr.target).own_aliases:
            return True
        node = call
    while node.op is Op.EXTERN and aten_schema(node.attr.target) is not None:
        aliases = node.attr.target in ALIASING_CALLS or \
            any(r.alias_info is not None for r in aten_schema(node.attr.target).returns)
        if not aliases:
            return True
        if not node.inputs:
            return False
        node = graph[node.inputs[0]]
    return False


# aten calls whose result may alias an input although their schema says nothing
ALIASING_CALLS = frozenset({torch.ops.aten._unsafe_view.default})



def fusion_barrier(graph: Graph, name: str) -> Optional[str]:
    node = graph[name]
    if node.op in EXTERNAL or runtime_reshape(graph, node):
        return f"{name} is an extern call"
    if node.op in REDUCTION and isinstance(node.attr, Reduce) and node.attr.axis is Kind.COL:
        return f"{name} reduces over every row (M): its result exists only after the whole pass"
    return None
