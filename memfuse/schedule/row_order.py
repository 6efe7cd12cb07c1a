"""Rows in memory order: a kernel that reads a permuted view walks its rows in the order the view
lies in memory, and writes what it computes in that order too.

A kernel over [M, D] walks rows r = 0 .. M-1, unravelled over its values' leading dims row-major.
Llama's rotary embedding reads the query projection, [B, S, H*D] in memory, as [B, H, S, D]
(permute(0, 2, 1, 3)): neighbouring rows lie H*D apart, and the [B, S, D] cos and sin, broadcast
over H, are fetched again for every head: such a kernel runs far slower than a plain copy of the
same bytes at every launch configuration. Walking the rows in (B, S, H) order reads the projection
where it lies and each position's cos once a tile, and the result is stored in [B, S, H, D] memory: a [B, H, S, D] tensor
with the strides that say so, as eager's `q * cos` makes it. Attention's output then follows the
query's layout, so the merge of heads after it is a view, not a copy.

`order_rows` picks, per kernel group, the order of its value's leading dims that rows run in:
 - its reads: the memory order of its largest read through an access map (the root taken as
   contiguous, or laid out as the kernel that wrote it ordered it);
 - else its outputs: the order in which a permuted read of an output (another kernel's copy into
   the layout a matmul wants) walks memory in order.
A group qualifies where every value it reads or writes as plain rows, and every view it reads
through an access map, has the same leading dims (or a reshape of them that keeps the order's
blocks whole), and nothing else depends on the order of rows: no random draws (dropout's bits
follow the element's row), no column sums, no [M] values, no outputs returned from the graph (a
caller may `.view` what eager gave contiguous). Its outputs are allocated in the order's layout
(`KernelGroup.layouts`); a plain input the runtime finds in another layout is copied into it
(correct whatever an extern returns; a copy only where the choice guessed wrong).
"""
from __future__ import annotations

from typing import Optional

import sympy

import torch

from memfuse.ir.graph import Extern, Graph, Kind, Op, ValueRef
from memfuse.ir.views import VIEW_TARGETS, Layout, contiguous, reshape_strides, view_layout
from memfuse.ir.views import same

aten = torch.ops.aten
ANY_LAYOUT = {aten.mm.default, aten.mm.dtype, aten.bmm.default, aten.addmm.default}   # extern readers of any strides
HINT = 4096   # a size symbol's stand-in where strides are compared (any large size orders them alike)


def order_rows(graph: Graph, groups: list, max_row_length: int, padded: set, placed: list) -> None:
    """Set `row_order` and `layouts` on every kernel group of `groups` (schedule.KernelGroup, in
    run order) that qualifies and whose reads or outputs call for an order other than row-major;
    a reason in `placed` for each. `padded`: the groups that store a value with zero columns
    appended (a matmul operand), whose rows keep their order."""
    users = graph.users()
    group_of = {n: g for g in groups for n in g.nodes}
    planned: dict = {}    # value -> strides its kernel writes it in (the groups ordered so far)
    for group in groups:
        if group.aten_reason is not None or group.name in padded or not _qualifies(graph, group, max_row_length):
            continue
        found = _order_from_reads(graph, group, planned) or _order_from_outputs(graph, group, users, group_of)
        if found is None:
            continue
        shape, order, why = found
        layouts = _layouts(graph, group, shape, order, users, group_of, planned)
        if layouts is None:
            continue
        group.row_order = order
        group.layouts = layouts
        planned.update(layouts)
        placed.append((group.name, f"rows in order {order} of [{', '.join(map(str, shape))}]: {why}; "
                                   f"writes {', '.join(group.outputs)} in that order's memory layout"))


def _qualifies(graph: Graph, group, max_row_length: int) -> bool:
    if group.space.m is None or group.space.d is None or group.space.d > max_row_length:
        return False
    if group.column_sums or any(graph[n].op is Op.RAND for n in group.nodes):
        return False
    if any(o in graph.outputs for o in group.outputs):
        return False
    rowed = group.outputs + _plain_inputs(graph, group)
    return all(graph[n].value.kind in (Kind.FULL, Kind.COL, Kind.SCALAR) for n in rowed)


def _plain_inputs(graph: Graph, group) -> list:
    """The group's inputs it loads as [M, D] (or [M]) blocks: read by a node other than as the root
    of an access map."""
    plain = {i for n in group.nodes for i in graph[n].inputs[graph[n].op is Op.STRIDED:]}
    return [i for i in group.inputs if i in plain and graph[i].op not in (Op.CONSTANT, Op.SYMBOL, Op.SEED)]


def _order_from_reads(graph: Graph, group, planned: dict) -> Optional[tuple]:
    """(leading shape, order, why) from the group's largest permuted read through an access map,
    where it reads nothing as plain rows (those lie as they lie: an order would copy them)."""
    if any(graph[i].value.kind is Kind.FULL for i in _plain_inputs(graph, group)):
        return None
    best = None
    for name in group.nodes:
        node = graph[name]
        if node.op is not Op.STRIDED or node.value.kind is not Kind.FULL or node.attr.summed:
            continue
        strides = _memory_strides(graph, node, planned)
        if strides is None:
            continue
        shape = tuple(node.value.shape[:-1])
        moving = [k for k, size in enumerate(shape) if not same(size, 1)]
        if any(strides[k] == 0 for k in moving) or strides[-1] != 1:
            continue
        order = tuple(sorted(range(len(shape)), key=lambda k: (-strides[k] if k in moving else -float("inf"), k)))
        size = graph[node.inputs[0]].value.dtype.itemsize
        if best is None or size > best[0]:
            best = (size, shape, order, f"reads {node.inputs[0]} through {node.attr.describe or 'an access map'} "
                                        f"in memory order")
    if best is None or best[2] == tuple(range(len(best[2]))):
        return None
    return best[1:]


def _memory_strides(graph: Graph, node, planned: dict) -> Optional[list]:
    """The memory step of each of a STRIDED node's value dims (sizes at HINT), with its root laid
    out as `planned` says or contiguous; None where a coefficient is not a number."""
    root = node.inputs[0]
    root_strides = planned.get(root) or contiguous(graph[root].value.shape).strides
    root_strides = [_number(s) for s in root_strides]
    rank = len(node.value.shape)
    steps = []
    for k in range(rank):
        total = 0
        for (coeffs, _), stride in zip(node.attr.index, root_strides):
            c = coeffs[k]
            if isinstance(c, ValueRef):
                c = graph[c.name].attr.expr if graph[c.name].op is Op.SYMBOL else None
            if c is None:
                return None
            total += _number(c) * stride
        steps.append(total)
    return steps


def _number(e) -> int:
    e = sympy.sympify(e)
    return int(e.subs({s: HINT for s in e.free_symbols}))


def _order_from_outputs(graph: Graph, group, users: dict, group_of: dict) -> Optional[tuple]:
    """(leading shape, order, why) that makes a permuted read of one of the group's outputs by
    another kernel walk memory in order."""
    for out in group.outputs:
        for reader in users[out]:
            node = graph[reader]
            if node.op is not Op.STRIDED or node.inputs[0] != out or group_of.get(reader) is group:
                continue
            perm = _permutation(node, len(graph[out].value.shape))
            if perm is None or perm[-1] != len(perm) - 1:
                continue
            order = tuple(perm[:-1])
            if order != tuple(range(len(order))):
                return tuple(graph[out].value.shape[:-1]), order, \
                    f"{reader} reads {out} through {node.attr.describe or 'an access map'}, in memory order"
    return None


def _permutation(node, root_rank: int) -> Optional[list]:
    """root dim j read by value dim k, as [j for each k], where the access map is a pure
    permutation (coefficients 0 or 1, one per row and column, no offsets, window or sum)."""
    a = node.attr
    rank = len(node.value.shape)
    if a.summed or a.window is not None or rank != root_rank or len(a.index) != root_rank:
        return None
    perm = [None] * rank
    for j, (coeffs, const) in enumerate(a.index):
        ones = [k for k, c in enumerate(coeffs) if c == 1]
        if const != 0 or len(ones) != 1 or any(c not in (0, 1) for c in coeffs):
            return None
        perm[ones[0]] = j
    return None if None in perm else perm


def _layouts(graph: Graph, group, shape: tuple, order: tuple, users: dict, group_of: dict,
             planned: dict) -> Optional[dict]:
    """value -> strides, in the order's layout, of every value the group writes or reads as plain
    rows; None where one is not a view of [*shape, D] in that order, a view read through an access
    map has other leading dims, a plain input is the graph's (contiguous as callers pass it) or
    another kernel's that lies otherwise (`planned`, else contiguous), or an output has a reader
    that wants it contiguous (`_read_anywhere`)."""
    d = group.space.d
    for name in group.nodes:
        node = graph[name]
        if node.op is Op.STRIDED and not _same_shape(node.value.shape[:-1], shape):
            return None
    full = tuple(shape) + (d,)
    permuted = contiguous([full[k] for k in order] + [d]).strides
    strides = [None] * len(full)
    for position, k in enumerate(order):
        strides[k] = permuted[position]
    strides[-1] = permuted[-1]
    layouts = {}
    for name in group.outputs + _plain_inputs(graph, group):
        value = graph[name].value
        if value.kind is not Kind.FULL:
            continue
        made = reshape_strides(full, strides, tuple(value.shape))
        if made is None:
            return None
        layouts[name] = tuple(made)
    for name in _plain_inputs(graph, group):     # only an extern's result may lie in the order's layout
        if name in graph.inputs or name in group_of and layouts.get(name) != planned.get(
                name, contiguous(graph[name].value.shape).strides):
            return None
    if not all(_read_anywhere(graph, reader, Layout(tuple(graph[out].value.shape), layouts[out]), group_of)
               for out in group.outputs if out in layouts for reader in users[out]):
        return None
    return layouts


def _read_anywhere(graph: Graph, reader: str, layout: Layout, group_of: dict) -> bool:
    """Whether `reader` reads a value laid out in `layout` as well as it would a contiguous one: a
    kernel's read through an access map (its strides, per call), a matmul or attention (any
    strides), a view that strides still make (not one that would now copy)."""
    node = graph[reader]
    if reader in group_of:
        return node.op is Op.STRIDED
    if node.op in (Op.VIEW, Op.CAST):
        return reshape_strides(layout.shape, layout.strides, tuple(node.value.shape)) is not None
    if node.op is not Op.EXTERN or not isinstance(node.attr, Extern):
        return False
    target = node.attr.target
    if target in VIEW_TARGETS:
        return not node.attr.kwargs and \
            view_layout(target, node.attr.args[1:], layout, tuple(node.value.shape)) is not None
    return target in ANY_LAYOUT or "scaled_dot_product" in str(getattr(target, "__name__", target))


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
