"""Rewrite: a value placed at a window along D (a cat's part, a slice_scatter's source) computed
at its columns in registers.

The rule: where a part is a pointwise function of reads of tensors in memory (through slices
along D of such functions), each read is shifted to the part's window (0 outside it) and the
function computed there, in the kernel that reads the cat, instead of a kernel writing the part
for the cat to read. (A rotation that concatenates a negated half with the other half, as rotary
embeddings do, is one such cat; its backward another.)"""
from __future__ import annotations

from typing import Optional

import sympy
import torch

from memfuse.ir import views
from memfuse.ir.graph import BINARY, UNARY, Kind, Op, Value

# How many pointwise ops deep a cat's part is rebuilt in registers (columns_in_registers).
COLUMN_DEPTH = 6


class ColumnsInRegisters:
    """A mixin of memfuse.capture.lower.Lowering."""

    def columns_in_registers(self, name: str, step: tuple, value: Value, window: tuple, label: str,
                             depth: int = COLUMN_DEPTH) -> Optional[str]:
        """`name` placed at its window of a [M, D] `value` (a cat's part, a slice_scatter's source,
        along the last dim), computed there in registers: its pointwise ops over reads of tensors
        in memory, each read shifted to the window (0 outside it), through slices along D of such
        ops. A rotation of halves, cat(-x2, x1) (rotary embeddings' rotate_half), read this way
        needs no kernel of half the row writing -x2 first, and its backward no kernel writing the
        gradient times sin. None
        where `name` is not such a value (a reduction, a value a kernel computes from another
        space), or the cat is not along D."""
        node = self.graph[name]
        if value.kind is not Kind.FULL or window[-1] is None or any(w is not None for w in window[:-1]) \
                or not all(isinstance(b, int) or sympy.sympify(b).is_Integer for b in window[-1]):
            return None
        if depth > 0 and self.shifts_columns_of_computed(name):
            # a slice along D of a value computed from reads: that value, read at the slice's place
            view = self.plain_view(name)
            through = view.then(*step, value.shape)
            return self.columns_in_registers(view.root, (through.coeffs, through.consts), value, window,
                                             label, depth - 1)
        in_memory = node.op in (Op.INPUT, Op.EXTERN, Op.GETITEM) or (node.op is Op.STRIDED and self.plain_view(name) is not None)
        if in_memory and depth == COLUMN_DEPTH:
            return None        # read where it lies: the windowed read over the fallback is one node
        if self.summed_read(name) is not None and depth < COLUMN_DEPTH:
            return self.summed_at_window(name, step, value, window, label)
        if node.op is Op.VIEW and self.summed_read(node.inputs[0]) is not None and depth < COLUMN_DEPTH:
            # a register copy of a sum (its kept size-1 dim dropped): the sum, through the reshape
            source = self.graph[node.inputs[0]].value.shape
            reshape = views.reshape(source, node.value.shape)
            if reshape is None:
                return None
            through = views.identity(node.inputs[0], source, True).then(*reshape, node.value.shape).then(
                *step, value.shape)
            return self.summed_at_window(node.inputs[0], (through.coeffs, through.consts), value, window, label)
        if in_memory:
            read = Value(node.value.dtype, Kind.FULL, value.shape, value.m, value.d)
            return self.strided(f"{label}_{name}", self.access(name).then(*step, value.shape), read,
                                f"{name} read at its window", window, self.const(0, node.value.dtype))
        if node.op not in UNARY | BINARY | {Op.WHERE} or node.value.kind is not Kind.FULL or depth == 0:
            return None
        inputs = []
        for i in node.inputs:
            kind = self.graph[i].value.kind
            moved = i if kind in (Kind.SCALAR, Kind.ROW) else \
                self.columns_in_registers(i, step, value, window, label, depth - 1) if kind is Kind.FULL else None
            if moved is None:
                return None
            inputs.append(moved)
        computed = Value(node.value.dtype, Kind.FULL, value.shape, value.m, value.d)
        return self.add(node.op, inputs, computed, node.attr, name=f"{label}_{name}")

    def shifts_columns_of_computed(self, name: str) -> bool:
        """Whether `name` is a view that only moves along D (a slice of the last dim: rows kept,
        so row values still line up) of a pointwise value no kernel has to write."""
        view = self.plain_view(name)
        if view is None or self.graph[view.root].op not in UNARY | BINARY | {Op.WHERE}:
            return False
        rank = len(view.shape)
        return len(view.coeffs) == rank and all(
            views.same(view.coeffs[j][k], 1 if j == k else 0) for j in range(rank) for k in range(rank)) \
            and all(views.same(c, 0) for c in view.consts[:-1])

    def column_window(self, start, end, value: Value) -> str:
        """The COL mask of the columns [start, end) of a [M, D] value."""
        column = self.add(Op.IOTA, [], Value(torch.int64, Kind.COL, (sympy.Integer(value.d),), d=value.d),
                          name="column")
        mask = Value(torch.bool, Kind.COL, (sympy.Integer(value.d),), d=value.d)
        after = self.pointwise(Op.GE, [column, self.const(int(start))], mask, "column_from")
        before = self.pointwise(Op.LT, [column, self.const(int(end))], mask, "column_before")
        return self.pointwise(Op.LOGICAL_AND, [after, before], mask, "column_window")

