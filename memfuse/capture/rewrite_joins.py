"""Rewrite: a sum of zero-padded parts over disjoint windows is the parts joined, not added.

The rule: a backward joins the gradients of the parts of a split value (a fused q/k/v or gate/up
projection's output cut by split, slices or selects) as a sum of slice_backward / select_backward
terms, each its part padded with zeros to the full shape. Where each term is a chain of windowed
reads over a zero (StridedRead with a fallback) and the windows of the two terms are provably
disjoint, each point of the sum is one term's value and the other's zero: the second term's reads
placed over the first as their fallback give the same value with no zero fill and no add, the form
a cat lowers to. Windows that may overlap, or a term that is not zero outside its windows, keep the
add."""
from __future__ import annotations

from typing import Optional

import sympy

from memfuse.ir.graph import Op, Value


class JoinsOfPaddedParts:
    """A mixin of memfuse.capture.lower.Lowering."""

    def is_zero(self, name: str) -> bool:
        """A zero constant, or a fill of one (new_zeros, zeros_like: a VIEW of the constant)."""
        node = self.graph[name]
        if node.op is Op.VIEW:
            node = self.graph[node.inputs[0]]
        return node.op is Op.CONSTANT and not isinstance(node.attr.value, bool) and node.attr.value == 0

    def zero_padded_chain(self, name: str) -> Optional[list]:
        """The windowed reads `name` is, outermost first, where the innermost reads over a zero and
        each over the one after it: the value is zero outside their windows. None for any other value."""
        chain = []
        while True:
            read = self.reads.get(name)
            if read is None or read.window is None or read.summed or read.fallback is None:
                return None
            chain.append(read)
            if self.is_zero(read.fallback):
                return chain
            name = read.fallback

    def joined_sum(self, args: list, value: Value, label: str) -> Optional[str]:
        """`args[0] + args[1]` as one chain of windowed reads (the module's rule), or None where
        the rule does not apply."""
        if len(args) != 2 or any(self.graph[a].value.dtype != value.dtype
                                 or tuple(self.graph[a].value.shape) != tuple(value.shape) for a in args):
            return None
        chains = [self.zero_padded_chain(a) for a in args]
        if None in chains or not windows_disjoint([r.window for r in chains[0]], [r.window for r in chains[1]]):
            return None
        base, placed = (0, 1) if len(chains[0]) >= len(chains[1]) else (1, 0)
        result = args[base]
        for k, read in enumerate(reversed(chains[placed])):       # the innermost read first
            last = k == len(chains[placed]) - 1
            # a slice may move the chain's windows only where it may move every read below (as a cat's)
            movable = self.movable_read(result) is not None
            result = self.strided(label if last else f"{label}_part{k}", read.access, value,
                                  f"a zero-padded part joined at {window_text(read.window)}", read.window, result,
                                  movable=movable)
        return result


def windows_disjoint(first: list, second: list) -> bool:
    """Every window of `first` provably shares no point with any of `second`."""
    return all(window_pair_disjoint(a, b) for a in first for b in second)


def window_pair_disjoint(a: tuple, b: tuple) -> bool:
    """Two windows share no point: along some dim both bound, one ends where or before the other starts."""
    for range_a, range_b in zip(a, b):
        if range_a is None or range_b is None:
            continue
        if any(sympy.simplify(sympy.sympify(end) - sympy.sympify(start)).is_nonpositive is True
               for end, start in ((range_a[1], range_b[0]), (range_b[1], range_a[0]))):
            return True
    return False


def window_text(window: tuple) -> str:
    return "[" + ", ".join(":" if w is None else f"{w[0]}:{w[1]}" for w in window) + "]"
