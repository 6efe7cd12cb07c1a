"""Loads of STRIDED nodes: a value read through its access map (index arithmetic over the root's
strides, a window with a fallback, dims summed on the way in)."""
from __future__ import annotations

from typing import Optional

import torch

from memfuse.base.source import Lines
from memfuse.codegen.emit import is_simple, literal, paren, plus, times
from memfuse.ir.graph import Kind, Node, Op, ValueRef
from memfuse.ir.ops import TRITON_DTYPES, accumulate_dtype, compute_dtype


class StridedReads:
    """RowKernelWriter's loads through access maps (ir.Strided)."""

    def strided(self, out: Lines, node: Node) -> None:
        """A view read in place: the row index unravels over the value's leading dims, each
        index steps through the root by its stride, the columns by the last dim's."""
        a, v, root = node.attr, self.reg(node.name), node.inputs[0]
        kind, rank = node.value.kind, len(a.sizes)
        col = rank - 1 if kind in (Kind.FULL, Kind.COL) else None     # the dim the columns walk
        row_dims = [k for k in range(rank) if k != col and a.sizes[k] != 1]
        root_strides = [f"{root}_stride{j}" for j in range(len(a.index))]
        if a.last_stride_one and root_strides:     # a 0-d root (a broadcast scalar tensor) has no dims
            root_strides[-1] = "1"
        out(f"# {node.name}: {root} read in place through {a.describe}")
        start = plus(times(self.entry(const), s) for (_, const), s in zip(a.index, root_strides))
        strides = {}
        for k in row_dims + ([col] if col is not None else []):
            strides[k] = plus(times(self.entry(coeffs[k]), s) for (coeffs, _), s in zip(a.index, root_strides))
            if not is_simple(strides[k]):
                out(f"{v}_stride{k} = {strides[k]}")
                strides[k] = f"{v}_stride{k}"
        index = {}
        if kind is not Kind.COL:
            inner = "1"
            walk = [k for k in self.group.row_order or range(rank) if k in row_dims]   # outermost first
            for k in reversed(walk):
                quotient = "rows" if inner == "1" else f"(rows // {paren(inner)})"
                index[k] = f"{v}_i{k}"
                out(f"{index[k]} = {quotient}" + (f" % {self.row_size(a, k, row_dims)}" if k != walk[0] else ""))
                inner = times(inner, self.row_size(a, k, row_dims))
            steps = [times(index[k], strides[k]) for k in row_dims]
            # a vector even for one row, or where no dim steps the rows (a broadcast: stride 0)
            row = plus([start] + (steps if any(step != "0" for step in steps) else ["0 * rows"]))
        if col is not None:
            index[col] = "cols"
            column = "cols" if strides[col] == "1" else f"(cols * {paren(strides[col])})"
        inside = self.window(out, node, index, col)
        if kind is Kind.FULL:
            offsets, mask = f"{paren(row)}[:, None] + {column}[None, :]", "mask"
        elif kind is Kind.ROW:
            offsets, mask = row, "row_mask"
        else:
            offsets, mask = plus([start, column]), "col_mask"
        out(f"{v}_offsets = {offsets}")
        mask = mask if inside is None else f"{mask} & {inside}"
        if a.summed:
            self.summed_loads(out, node, root_strides, mask)
        else:
            to = "" if node.value.dtype == torch.bool else f".to({TRITON_DTYPES[compute_dtype(node.value.dtype)]})"
            source = self.graph[root]
            if source.op in (Op.SYMBOL, Op.CONSTANT):
                # a scalar the kernel takes by value (a size expression, a constant: BEiT's
                # relative-position index scatters `num_relative_distance - 3` into a table):
                # nothing in memory to load, the view is the scalar at every position
                scalar = literal(source.attr.value) if source.op is Op.CONSTANT else self.reg(root)
                out(f"{v} = ({v}_offsets * 0 + {scalar}){to}")
            else:
                out(f"{v} = tl.load({root}_ptr + {v}_offsets, mask={mask}, other=0){to}")
        if inside is not None:
            fallback = self.operand(node.inputs[1], kind, compute_dtype(node.value.dtype), node.value.dtype)
            out(f"{v} = tl.where({inside}, {v}, {fallback})")

    def row_size(self, a, k: int, row_dims: list) -> str:
        """The size of row dim k of a view read in place: its entry, or for the outermost (None in
        the map: the rest of M) M over the others' sizes, which rows in another order need."""
        if a.sizes[k] is not None:
            return self.entry(a.sizes[k])
        others = "1"
        for j in row_dims:
            if j != k:
                others = times(others, self.entry(a.sizes[j]))
        return "M" if others == "1" else f"(M // {paren(others)})"

    def summed_loads(self, out: Lines, node: Node, root_strides: list, mask: str) -> None:
        """A sum over leading dims of the root: one load per index of the summed dims (their
        count a per-call size), accumulated in fp32 (fp64 and integers in their own dtype)."""
        a, v, root = node.attr, self.reg(node.name), node.inputs[0]
        rank = len(a.sizes)
        acc = TRITON_DTYPES[accumulate_dtype(node.value.dtype) if node.value.is_floating else node.value.dtype]
        block = {Kind.FULL: "[BLOCK_M, BLOCK_D]", Kind.ROW: "[BLOCK_M]", Kind.COL: "[BLOCK_D]"}[node.value.kind]
        count = "1"
        for size in a.summed:
            count = times(count, self.entry(size))
        out(f"{v} = tl.zeros({block}, {acc})")
        out(f"for {v}_r in tl.range(0, {count}):")
        out.indent()
        steps, inner = [], "1"
        for n in reversed(range(len(a.summed))):   # the summed index unravels like the rows do
            stride = plus(times(self.entry(coeffs[rank + n]), s) for (coeffs, _), s in zip(a.index, root_strides))
            index = f"{v}_r" if inner == "1" else f"{v}_r // {paren(inner)}"
            if n:
                index = f"{paren(index)} % {self.entry(a.summed[n])}"
            steps.append(times(index, stride))
            inner = times(inner, self.entry(a.summed[n]))
        out(f"{v} += tl.load({root}_ptr + {v}_offsets + {paren(plus(steps))}, mask={mask}, other=0).to({acc})")
        out.dedent()

    def window(self, out: Lines, node: Node, index: dict, col: Optional[int]) -> Optional[str]:
        """The mask of the elements the root covers (cat parts, scatters), None for all."""
        if node.attr.window is None:
            return None
        v = self.reg(node.name)
        rows, cols = [], []
        zero = "(cols * 0)" if node.value.kind is Kind.COL else "(rows * 0)"   # the index along a dim of size 1
        for k, w in enumerate(node.attr.window):
            if w is not None:
                i = index.get(k, zero)
                part = f"({i} >= {self.entry(w[0])}) & ({i} < {self.entry(w[1])})"
                (cols if k == col else rows).append(part)
        kind = node.value.kind
        if rows and kind is not Kind.COL:
            out(f"{v}_rows_inside = {' & '.join(rows)}")
        if cols:
            out(f"{v}_cols_inside = {' & '.join(cols)}")
        if kind is Kind.FULL:
            if rows and cols:
                return f"({v}_rows_inside[:, None] & {v}_cols_inside[None, :])"
            return f"{v}_rows_inside[:, None]" if rows else f"{v}_cols_inside[None, :]"
        return f"{v}_cols_inside" if kind is Kind.COL else f"{v}_rows_inside"

    def entry(self, item) -> str:
        """An access-map entry: an int literal, or the register of its SYMBOL input."""
        return self.reg(item.name) if isinstance(item, ValueRef) else str(item)
