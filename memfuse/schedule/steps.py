"""What a schedule is made of: `KernelGroup` (nodes run as one kernel over a `Space` [M, D]),
`ExternStep` (a node run through aten or the runtime), and the `Schedule` of a graph."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import sympy

from memfuse.ir.graph import Graph, Kind, Value


@dataclass(frozen=True)
class Space:
    """A group's iteration space; None where no node of the group fixes it yet."""
    m: Optional[sympy.Expr]
    d: Optional[int]

    @staticmethod
    def of(value: Value) -> "Space":
        if value.kind is Kind.FULL:
            return Space(value.m, value.d)
        if value.kind is Kind.ROW:
            return Space(value.m, None)
        if value.kind is Kind.COL:
            return Space(None, value.d)
        return Space(None, None)

    def agrees(self, other: "Space") -> bool:
        """Same M and D where both fix them, and no [M, D] walk made of rows alone and columns
        alone: a group of [M] values joined with one of [D] values would walk M x D elements to
        compute M + D (the labels of a language model: M x D is tokens x tokens)."""
        same = (self.m is None or other.m is None or self.m == other.m) and \
            (self.d is None or other.d is None or self.d == other.d)
        return same and not (self.only_rows and other.only_columns or self.only_columns and other.only_rows)

    @property
    def only_rows(self) -> bool:
        return self.m is not None and self.d is None

    @property
    def only_columns(self) -> bool:
        return self.d is not None and self.m is None

    def join(self, other: "Space") -> "Space":
        return Space(self.m if self.m is not None else other.m, self.d if self.d is not None else other.d)



@dataclass
class KernelGroup:
    name: str
    stage: int
    space: Space
    nodes: list = field(default_factory=list)          # fusible node names, topological
    recomputed: list = field(default_factory=list)     # nodes another kernel owns, computed again here: never written
    inputs: list = field(default_factory=list)         # values read from memory or passed as scalars
    outputs: list = field(default_factory=list)        # values written for later steps
    column_sums: list = field(default_factory=list)    # reductions over M: partials per program
    aten_reason: Optional[str] = None                  # set when the group runs through aten
    # column sum -> the casts of it (each the only reader of the one before) the kernel applies as
    # it writes the totals: its row holds the last one (`fold_column_casts`)
    column_casts: dict = field(default_factory=dict)
    # the order of the leading dims its rows run in (empty: row-major), and the strides of each
    # value it writes or reads as plain rows in that order's layout (memfuse.schedule.row_order)
    row_order: tuple = ()
    layouts: dict = field(default_factory=dict)

    def column_values(self) -> list:
        """What the totals hold, one per column sum: the sum, or the last of its casts."""
        return [self.column_casts[n][-1] if n in self.column_casts else n for n in self.column_sums]

    def totals(self, graph: Graph) -> dict:
        """dtype -> the column values (`column_values`) of that dtype, in order: the rows of one
        [n, D] totals tensor the kernel writes (codegen's argument, the runtime's allocation)."""
        totals: dict = {}
        for name in self.column_values():
            totals.setdefault(graph[name].value.dtype, []).append(name)
        return totals



@dataclass(frozen=True)
class ExternStep:
    name: str
    stage: int



@dataclass
class Schedule:
    graph: Graph                                       # the graph scheduled (its matmuls padded: memfuse.schedule.padding)
    steps: list                                        # KernelGroup | ExternStep, in run order
    not_fused: list = field(default_factory=list)      # (node, input, reason)
    paddings: list = field(default_factory=list)       # padding.MatmulPadding per extern matmul
    in_place: list = field(default_factory=list)       # reinplace.InPlace: aten calls written in place
    placed: list = field(default_factory=list)         # (node, reason): moved, duplicated or joined, and why

    @property
    def kernels(self) -> list:
        return [s for s in self.steps if isinstance(s, KernelGroup)]
