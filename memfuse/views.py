"""Access maps: where each element of a view sits in the tensor it views (the root).

A view of rank r over a root of rank R is an affine map on indices: root index j of element
(i_0, ..., i_{r-1}) is `sum_k coeffs[j][k] * i_k + consts[j]`. Permute, slice, select, the
reshapes that split dims or add/remove size-1 dims, broadcasts (coefficient 0) and the shift
of a cat's part are all such maps, and a view of a view is their product. A sum over leading
dims is a map with extra index dims that the read adds up. Entries are sympy expressions over the size
symbols, so one map serves every batch size; the root's strides, read per call, turn the root
index into a memory offset (codegen). capture builds these; nothing here touches the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import sympy

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
