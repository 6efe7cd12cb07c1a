"""Access maps: where each element of a view sits in the tensor it views (the root).

A view of rank r over a root of rank R is an affine map on indices: root index j of element
(i_0, ..., i_{r-1}) is `sum_k coeffs[j][k] * i_k + consts[j]`. Permute, slice, select, the
reshapes that split dims or add/remove size-1 dims, broadcasts (coefficient 0) and the shift
of a cat's part are all such maps, and a view of a view is their product. A sum over leading
dims is a map with extra index dims that the read adds up. Entries are sympy expressions over the size
symbols, so one map serves every batch size; the root's strides, read per call, turn the root
index into a memory offset (codegen). capture builds these; `strided_attr` writes one as a
STRIDED node's attribute (capture's, or a later pass's: memfuse.schedule.padding).

Layouts (the second half): the strides of a view the program makes over a tensor whose strides
it knows, worked out once when the program is written.

A view written as the tensor's method (`x.view(...)`, `x.permute(...)`, `x.t()`) costs a
dispatcher call and autograd's view bookkeeping on every run; knowing the result's sizes and
strides, the program makes it with inductor's `_reinterpret_tensor` instead, at under half the
host time (runtime._ProgramWriter.extern). Entries are sympy expressions over the size symbols,
so one layout serves every batch size. `view_layout` returns None where the strides are not
known for every size (a reshape that merges dims not adjacent in memory): that view stays a
method call, which copies if it must.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import sympy
import torch

from memfuse.ir.graph import Kind, Strided, Value

ONE, ZERO = sympy.Integer(1), sympy.Integer(0)


@dataclass(frozen=True)
class AccessMap:
    root: str                 # the tensor in memory
    shape: tuple              # the view's dims (sympy)
    coeffs: tuple             # [R][r]: root index j per view index k
    consts: tuple             # [R]
    contiguous_root: bool     # the root is made contiguous before the read
    last_stride_one: bool = True   # the root's last stride is 1 (contiguous, or an input keyed so)

    def then(self, coeffs, consts, shape) -> "AccessMap":
        """This map followed by a view whose index into *this* view is coeffs . i' + consts."""
        rank = len(shape)
        new_coeffs = tuple(tuple(sympy.expand(sum((a * coeffs[k][n] for k, a in enumerate(row)), ZERO))
                                 for n in range(rank)) for row in self.coeffs)
        new_consts = tuple(sympy.expand(sum((a * consts[k] for k, a in enumerate(row)), ZERO) + c)
                           for row, c in zip(self.coeffs, self.consts))
        return AccessMap(self.root, tuple(shape), new_coeffs, new_consts, self.contiguous_root, self.last_stride_one)


def identity(root: str, shape: Sequence, contiguous_root: bool, last_stride_one: bool = True) -> AccessMap:
    rank = len(shape)
    coeffs = tuple(tuple(ONE if j == k else ZERO for k in range(rank)) for j in range(rank))
    return AccessMap(root, tuple(shape), coeffs, (ZERO,) * rank, contiguous_root, last_stride_one)


def _unit(rank_in: int, rank_out: int, pairs) -> list:
    rows = [[ZERO] * rank_out for _ in range(rank_in)]
    for j, k, a in pairs:
        rows[j][k] = a
    return rows


def permute(shape: Sequence, dims: Sequence[int]) -> tuple:
    """(coeffs, consts, new shape): view dim k is source dim dims[k]."""
    rank = len(shape)
    dims = [d % rank for d in dims]
    return _unit(rank, rank, [(dims[k], k, ONE) for k in range(rank)]), [ZERO] * rank, [shape[d] for d in dims]


def slice_(shape: Sequence, dim: int, start, step: int, length) -> tuple:
    rank = len(shape)
    pairs = [(j, j, sympy.Integer(step) if j == dim else ONE) for j in range(rank)]
    consts = [sympy.sympify(start) if j == dim else ZERO for j in range(rank)]
    return _unit(rank, rank, pairs), consts, [length if j == dim else s for j, s in enumerate(shape)]


def select(shape: Sequence, dim: int, index) -> tuple:
    rank = len(shape)
    pairs = [(j, j if j < dim else j - 1, ONE) for j in range(rank) if j != dim]
    consts = [sympy.sympify(index) if j == dim else ZERO for j in range(rank)]
    return _unit(rank, rank - 1, pairs), consts, [s for j, s in enumerate(shape) if j != dim]


def unselect(shape: Sequence, dim: int) -> tuple:
    """select's backward: the view has the source's dims plus one at `dim` (its window)."""
    rank = len(shape) + 1
    pairs = [(j, j if j < dim else j + 1, ONE) for j in range(rank - 1)]
    return _unit(rank - 1, rank, pairs), [ZERO] * (rank - 1)


def shift(rank: int, dim: int, start) -> tuple:
    """A cat part or slice_scatter source placed at `start` along `dim`: index i' - start."""
    pairs = [(j, j, ONE) for j in range(rank)]
    consts = [-sympy.sympify(start) if j == dim else ZERO for j in range(rank)]
    return _unit(rank, rank, pairs), consts


def expand(shape: Sequence, new_shape: Sequence) -> tuple | None:
    """A broadcast (dims aligned from the right): a size-1 or missing dim of the source repeats
    along the new one, index coefficient 0 (stride 0). None when the shapes do not broadcast."""
    extra = len(new_shape) - len(shape)
    if extra < 0:
        return None
    pairs = []
    for j, size in enumerate(shape):
        if same(size, new_shape[j + extra]):
            pairs.append((j, j + extra, ONE))
        elif not same(size, 1):
            return None
    return _unit(len(shape), len(new_shape), pairs), [ZERO] * len(shape)


def sum_over(shape: Sequence, dims: Sequence[int], keepdim: bool) -> tuple:
    """(coeffs, consts, shape) of a sum over `dims` as a map: the result's dims (the summed ones
    kept as size 1 with keepdim) followed by one index dim per summed dim, which the read adds up."""
    kept = [j for j in range(len(shape)) if j not in dims or keepdim]
    result = [ONE if j in dims else shape[j] for j in kept]
    position = {j: k for k, j in enumerate(kept) if j not in dims}
    position.update({j: len(kept) + n for n, j in enumerate(dims)})
    rank = len(kept) + len(dims)
    return _unit(len(shape), rank, [(j, position[j], ONE) for j in range(len(shape))]), \
        [ZERO] * len(shape), result + [shape[j] for j in dims]


def carrying(step: tuple, rank: int, extra: int) -> tuple:
    """(coeffs, consts) of `step` (over a view's `rank` dims) on a map whose shape has `extra` dims
    after them (a sum's summed dims, `sum_over`), those carried through as they are."""
    coeffs, consts = step
    moved = [list(row[:rank]) + [ZERO] * extra for row in coeffs] + \
        [[ZERO] * rank + [ONE if n == k else ZERO for n in range(extra)] for k in range(extra)]
    return moved, list(consts) + [ZERO] * extra


def same(a, b) -> bool:
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def reshape(shape: Sequence, new_shape: Sequence) -> Optional[tuple]:
    """A row-major reshape as an index map, when it only splits dims or adds/removes dims of
    size 1 (None when it merges dims: not affine in the view's indices)."""
    src = [j for j, s in enumerate(shape) if not same(s, 1)]
    dst = [k for k, s in enumerate(new_shape) if not same(s, 1)]
    pairs, k = [], 0
    for j in src:
        group, product = [], ONE
        while k < len(dst) and not same(product, shape[j]):
            group.append(dst[k])
            product *= new_shape[dst[k]]
            k += 1
        if not group or not same(product, shape[j]):
            return None
        after = ONE
        for kk in reversed(group):   # a split: the outer index counts blocks of the inner sizes
            pairs.append((j, kk, after))
            after *= new_shape[kk]
    if k != len(dst):
        return None
    return _unit(len(shape), len(new_shape), pairs), [ZERO] * len(shape)


# -- layouts: the strides of a view the program makes ----------------------------------------


aten = torch.ops.aten


@dataclass(frozen=True)
class Layout:
    """A tensor's sizes and strides (size expressions), and where it starts in its source's
    memory, counted from the source's own start (what `_reinterpret_tensor` takes)."""
    shape: tuple
    strides: tuple
    offset: object = 0


def contiguous(shape: Sequence) -> Layout:
    """Row-major strides: what memfuse allocates, and what a matmul returns."""
    strides, inner = [], sympy.Integer(1)
    for size in reversed(shape):
        strides.append(inner)
        inner = inner * size
    return Layout(tuple(shape), tuple(reversed(strides)))


# views a program can make by strides alone
VIEW_TARGETS = {aten.permute.default, aten.t.default, aten.view.default, aten.reshape.default,
                aten.unsqueeze.default, aten.expand.default, aten.narrow.default}


def view_layout(target, args: tuple, source: Layout, shape: tuple) -> Optional[Layout]:
    """The layout of `target(source, *args)`, a view of traced shape `shape`, or None where
    it is not known for every size. `target` is an aten view (VIEW_TARGETS) or `aten.reshape`
    for a graph's reshape node; `args` are the call's arguments after the tensor."""
    if target is aten.t.default:
        return Layout(source.shape[::-1], source.strides[::-1])
    if target is aten.permute.default:
        dims = [d % len(source.shape) for d in args[0]] if source.shape else []
        return Layout(tuple(source.shape[d] for d in dims), tuple(source.strides[d] for d in dims))
    if target is aten.unsqueeze.default:
        dim = args[0] % (len(source.shape) + 1)
        stride = source.strides[dim] * source.shape[dim] if dim < len(source.shape) else sympy.Integer(1)
        return Layout(tuple(shape), source.strides[:dim] + (stride,) + source.strides[dim:])
    if target is aten.expand.default:
        return _expanded(source, tuple(shape))
    if target is aten.narrow.default:
        dim, start = args[0] % len(source.shape), args[1]
        if not isinstance(start, int):
            return None
        return Layout(tuple(shape), source.strides, start * source.strides[dim])
    if target in (aten.view.default, aten.reshape.default):
        strides = reshape_strides(source.shape, source.strides, tuple(shape))
        return None if strides is None else Layout(tuple(shape), strides)
    return None


def _expanded(source: Layout, shape: tuple) -> Optional[Layout]:
    """Broadcast dims (size 1 in the source, or new leading dims) read with stride 0."""
    lead = len(shape) - len(source.shape)
    strides = [sympy.Integer(0)] * lead
    for size, (old, stride) in zip(shape[lead:], zip(source.shape, source.strides)):
        if same(size, old):
            strides.append(stride)
        elif same(old, 1):
            strides.append(sympy.Integer(0))
        else:
            return None
    return Layout(shape, tuple(strides))


def reshape_strides(shape: Sequence, strides: Sequence, new_shape: Sequence) -> Optional[tuple]:
    """The strides of `new_shape` as a view of a tensor of `shape` and `strides` (torch's
    computeStride, over size expressions): source and target dims are matched in groups of
    equal element count; a group's source dims must lie in memory as one block (each stride the
    next one's times its size), its target dims split that block row-major. None where a group
    or a block is not certain for every size (then torch may have to copy)."""
    src = [j for j, s in enumerate(shape) if not same(s, 1)]
    dst = [k for k, s in enumerate(new_shape) if not same(s, 1)]
    result: list = [None] * len(new_shape)
    i = k = 0
    while i < len(src) or k < len(dst):
        if i == len(src) or k == len(dst):
            return None
        group_src, group_dst = [src[i]], [dst[k]]
        count_src, count_dst = shape[src[i]], new_shape[dst[k]]
        i, k = i + 1, k + 1
        while not same(count_src, count_dst):
            larger = _larger(count_src, count_dst)
            if larger is None:
                return None
            if larger == "source" and k < len(dst):
                group_dst.append(dst[k])
                count_dst, k = count_dst * new_shape[dst[k]], k + 1
            elif larger == "target" and i < len(src):
                group_src.append(src[i])
                count_src, i = count_src * shape[src[i]], i + 1
            else:
                return None
        if not all(same(strides[a], strides[b] * shape[b]) for a, b in zip(group_src, group_src[1:])):
            return None
        inner = strides[group_src[-1]]
        for d in reversed(group_dst):
            result[d] = inner
            inner = inner * new_shape[d]
    inner = sympy.Integer(1)          # dims of size 1: any stride reads the same; torch's choice
    for d in reversed(range(len(new_shape))):
        if result[d] is None:
            result[d] = inner
        inner = result[d] * new_shape[d]
    return tuple(result)


def _larger(a, b) -> Optional[str]:
    """Which of two element counts is a multiple of the other: "source" (a), "target" (b), or
    None when neither is for every size."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    if a.is_Number and b.is_Number:
        return "source" if a > b else "target"
    numerator, denominator = sympy.fraction(sympy.cancel(a / b))
    if denominator == 1 and numerator != 1:
        return "source"
    if numerator == 1 and denominator != 1:
        return "target"
    return None


def strided_attr(m: AccessMap, value: Value, describe: str, size_operand: Callable,
                 window: Optional[tuple] = None, summed: tuple = ()) -> Strided:
    """The access map of a STRIDED node reading `m.root` through `m` as `value` (FULL, ROW or COL).
    `size_operand` turns a sympy entry into an int or a ValueRef to a SYMBOL node of the graph
    being built (capture's, or a later pass's: memfuse.schedule.padding)."""
    # the rows unravel over the leading dims (all dims of a row value): the outermost size is not needed
    col = len(value.shape) - 1 if value.kind in (Kind.FULL, Kind.COL) else None
    outer = next((k for k, s in enumerate(value.shape) if k != col and not same(s, 1)), None)
    sizes = tuple(None if k == outer else size_operand(s) for k, s in enumerate(value.shape))
    index = tuple((tuple(size_operand(c) for c in row), size_operand(const)) for row, const in zip(m.coeffs, m.consts))
    win = None if window is None else tuple(
        None if w is None else (size_operand(w[0]), size_operand(w[1])) for w in window)
    return Strided(sizes, index, win, m.contiguous_root, describe, tuple(size_operand(s) for s in summed),
                   m.last_stride_one)

