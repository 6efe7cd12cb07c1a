"""Layouts of the views a program makes: the strides of a view over a tensor whose strides the
program knows, worked out once when the program is written.

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
from typing import Optional, Sequence

import sympy
import torch

from .views import same

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
