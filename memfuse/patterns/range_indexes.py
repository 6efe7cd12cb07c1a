"""range_indexes: indexing by a list of evenly spaced ints, `x[..., [k]]`, traced as the slice it reads.

Falcon's attention splits its fused query-key-value projection with `qkv[:, :, :, [-2]]` (the key
heads) and `qkv[:, :, :, [-1]]` (the values). A list index is advanced indexing: traced, it is an
`aten.index.Tensor` by a constant index tensor (aten's gather: an extern call, the index a
constant memfuse cannot read while it compiles) whose backward is an `aten.index_put` with
accumulate into zeros of the source's shape (a fill and a sort-and-add on CUDA). Its values are the
slice `x[..., k:k + 1]`'s; a slice is a view the kernels read in place, and its backward a windowed
write memfuse fuses.

While memfuse traces, `x[index]` where the index holds exactly one list of Python ints, forming a
rising progression within a static dim, and otherwise only slices, None and Ellipsis (so the result
keeps the list's dim where it was, as the slice does), is traced as the slice, then a clone: advanced
indexing returns a new tensor, and a clone keeps a later in-place write off the source (a clone is
a register copy in memfuse's kernels). Anything else is indexed as written.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

from memfuse.ir.patterns import register_capture


class _RangeIndexes(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__ and len(args) == 2 and not kwargs:
            index = as_slices(args[0], args[1])
            if index is not None:
                return func(args[0], index).clone()
        return func(*args, **(kwargs or {}))


def range_indexes() -> TorchFunctionMode:
    """A context: inside it, `x[..., [k, k + 1, ...]]` is traced as `x[..., k:k + n].clone()`."""
    return _RangeIndexes()


def as_slices(x: torch.Tensor, index) -> Optional[tuple]:
    """`index` with its one list of ints replaced by the slice that reads the same elements; None
    where that is not provably the same (module docstring)."""
    items = index if isinstance(index, tuple) else (index,)
    if not all(item is None or item is Ellipsis or isinstance(item, (slice, list)) for item in items) \
            or sum(isinstance(item, list) for item in items) != 1 or sum(item is Ellipsis for item in items) > 1:
        return None
    at = next(k for k, item in enumerate(items) if isinstance(item, list))
    dim = _dim_of(x, items, at)
    size = x.shape[dim] if dim is not None and dim < x.dim() else None
    values = items[at]
    if not isinstance(size, int) or not values or not all(type(v) is int and -size <= v < size for v in values):
        return None
    first, *rest = [v % size for v in values]
    step = rest[0] - first if rest else 1
    if step < 1 or any(v != first + step * (i + 1) for i, v in enumerate(rest)):
        return None
    return (*items[:at], slice(first, first + step * (len(values) - 1) + 1, step), *items[at + 1:])


def _dim_of(x: torch.Tensor, items: tuple, at: int) -> Optional[int]:
    """The dim of `x` that `items[at]` indexes: slices and lists take one dim each, None none, an
    Ellipsis the dims no other item takes."""
    taken = sum(isinstance(item, (slice, list)) for item in items)
    if taken > x.dim():
        return None
    return sum(1 if isinstance(item, (slice, list)) else (x.dim() - taken if item is Ellipsis else 0)
               for item in items[:at])


register_capture("range_indexes", trace_mode=range_indexes)
