"""Rewrite: a sum over leading dims read again through a view or at a window, instead of written.

The rule: a strided read that adds up some leading dims (a broadcast's gradient, or the gradient
of a tensor several others read in turn, as keys and values shared by groups of attention heads
are) is summed again at the index a later view or window reads it at, where the sum is small
(SMALL_SUM terms) or the reader is a pointwise value computed at a window (rewrite_columns): one
kernel, not a sum written and a copy made of it."""
from __future__ import annotations

from typing import Optional

import sympy

from memfuse.ir import views
from memfuse.ir.graph import Kind, Value

# A view of a sum over leading dims of at most this many terms sums again through the view
# (view_of_small_sum): each reader repeats the sum, which a handful of loads allows.
SMALL_SUM = 8


class SumsThroughViews:
    """A mixin of memfuse.capture.lower.Lowering."""

    def summed_at_window(self, name: str, step: tuple, value: Value, window: tuple, label: str) -> str:
        """A sum over leading dims read at a window of a pointwise value computed from it, 0
        outside: the same sum at the moved index. (A key shared by several attention heads gets
        their gradients summed; a rotary embedding's backward then rotates that sum times sin: read
        so, the product needs no kernel writing it for the rotation to slice.)"""
        read = Value(self.graph[name].value.dtype, Kind.FULL, value.shape, value.m, value.d)
        return self.summed_through(name, step, read, f"{label}_{name}", f"{name} summed at its window", window,
                                   self.const(0, read.dtype))

    def summed_through(self, name: str, step: tuple, value: Value, label: str, describe: str,
                       window: Optional[tuple] = None, fallback: Optional[str] = None) -> str:
        """Sum `name` (a summed read) again at `step`'s index: the step moves the sum's value dims
        (coefficients per its dim, then per `value`'s), the summed dims carried through."""
        read = self.summed_read(name)
        access, summed = read.access, read.summed
        through = access.then(*views.carrying(step, len(value.shape), len(summed)), tuple(value.shape) + summed)
        return self.strided(label, through, value, describe, window, fallback, summed=summed)

    def view_of_small_sum(self, source: "views.AccessMap", step: tuple, value: Value, label: str,
                          describe: str) -> Optional[str]:
        """A view (`step` after `source`) of a sum over leading dims of at most SMALL_SUM terms,
        summed again through the view instead of written for it to read: one kernel, not a sum
        written and a copy (a value shared by several attention heads: its gradient summed over
        them, read transposed for its projection's matmul). None for other views."""
        if self.summed_read(source.root) is None or value.kind is not Kind.FULL:
            return None
        terms = sympy.Mul(*self.summed_read(source.root).summed)
        if not terms.is_Integer or terms > SMALL_SUM:
            return None
        through = source.then(*step)
        return self.summed_through(source.root, (through.coeffs, through.consts), value, label,
                                   f"{describe} of {source.root}")

