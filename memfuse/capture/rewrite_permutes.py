"""Rewrite: a permute of leading dims of a pointwise value computed from reads, computed again at
the permuted index.

The rule: where the last dim stays, nothing else reads the value, and the value is pointwise
over reads of tensors in memory, its reads are moved through the permute and the value computed
in the kernel that reads the permute, instead of written for that kernel to read transposed.
(The gradients of rotated queries and keys, read transposed into a projection's
[batch x seq, heads x dim], are such permutes.)"""
from __future__ import annotations

from typing import Optional

from memfuse.ir import views
from memfuse.ir.graph import BINARY, UNARY, Kind, Op, Value

# How many ops deep a permuted read of a computed value is rebuilt at the permuted index.
PERMUTE_DEPTH = 12


class PermutesOfComputed:
    """A mixin of memfuse.capture.lower.Lowering."""

    def permute_of_computed(self, node, value: Value) -> Optional[str]:
        """A permute of leading dims (the last stays) of a pointwise value computed from reads, which
        nothing else reads: that value computed again at the permuted index, its reads moved through
        the permute (`permuted`), in the kernel that reads it, instead of written for that kernel to
        read through the permute. A rotary embedding's backward is one: the query's and the key's
        gradients, read transposed into the projections' [batch x seq, heads x dim], in the kernel
        that writes that copy. None where the value is not such (a reduction, a read from another space, a value
        read elsewhere too)."""
        source = node.args[0]
        name = self.env_name(source)
        dims = [d % len(value.shape) for d in node.args[1]]
        if dims[-1] != len(dims) - 1 or len(source.users) != 1 or value.kind is not Kind.FULL \
                or self.graph[name].op not in UNARY | BINARY | {Op.WHERE}:
            return None
        return self.permuted(name, dims, value, node.name, PERMUTE_DEPTH)

    def permuted(self, name: str, dims: list, value: Value, label: str, depth: int) -> Optional[str]:
        """`name` at the index `dims` permutes (value dim k is `name`'s dim dims[k]): a pointwise op
        over its inputs so permuted, a read through its map followed by the permute (its window and
        fallback moved alike, its summed dims carried); None where a part is neither."""
        node = self.graph[name]
        kind = node.value.kind
        constant = node.op is Op.VIEW and self.graph[node.inputs[0]].value.kind is Kind.SCALAR   # a fill
        if kind in (Kind.SCALAR, Kind.COL) or constant:
            return name                       # the same at every row: the columns stay in place
        if kind is not Kind.FULL or depth == 0 or len(node.value.shape) != len(dims):
            return None
        shape = tuple(node.value.shape[d] for d in dims)
        moved_value = Value(node.value.dtype, Kind.FULL, shape, value.m, value.d)
        step = views.permute(node.value.shape, dims)
        read_copied = self.reads.get(node.inputs[0]) if node.op is Op.VIEW else None
        if read_copied is not None and read_copied.window is None:
            # a register copy of a read (a sum's kept size-1 dim dropped): the read, reshaped, permuted
            source = self.graph[node.inputs[0]].value.shape
            reshape = views.reshape(source, node.value.shape)
            if reshape is None:
                return None
            through = views.identity(name, source, True).then(*reshape, node.value.shape).then(*step)
            name, node, step = node.inputs[0], self.graph[node.inputs[0]], (through.coeffs, through.consts, shape)
        if node.op is Op.STRIDED and name in self.reads:
            read = self.reads[name]
            access, window, fallback, summed = read.access, read.window, read.fallback, read.summed
            if fallback is not None and self.graph[fallback].op is not Op.CONSTANT:
                fallback = self.permuted(fallback, dims, value, label, depth - 1)
                if fallback is None:
                    return None
            through = access.then(*views.carrying(step[:2], len(dims), len(summed)), shape + summed)
            moved_window = None if window is None else tuple(window[d] for d in dims)
            return self.strided(f"{label}_{name}", through, moved_value, f"{node.attr.describe}, permuted",
                                moved_window, fallback, summed=summed)
        if node.op in (Op.INPUT, Op.EXTERN, Op.GETITEM):
            return self.strided(f"{label}_{name}", self.access(name).then(*views.permute(node.value.shape, dims)),
                                moved_value, f"{name} permuted")
        if node.op not in UNARY | BINARY | {Op.WHERE}:
            return None
        inputs = []
        for i in node.inputs:
            moved_input = self.permuted(i, dims, value, label, depth - 1)
            if moved_input is None:
                return None
            inputs.append(moved_input)
        return self.add(node.op, inputs, moved_value, node.attr, name=f"{label}_{name}")

