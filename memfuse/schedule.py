"""schedule: group a graph's nodes into kernels over [M, D], and everything else into extern steps.

Each fusible node gets a stage: the largest stage of its inputs, plus one across anything a
kernel cannot read in the same pass (an extern result, a reduction over M, a value from a group
of another space, the root a STRIDED view reads from memory). A node joins the groups of its inputs at its own stage when their spaces
agree (merging them), else any compatible group of its stage (horizontal fusion: the column
sums of a backward land in its main kernel), else starts a new one. Every edge between groups
then runs from a lower stage to a higher one, so the steps, ordered by stage, never wait on a
later step. Why two nodes did not share a kernel is recorded for `explain()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import sympy

from .config import Config
from .debug import timed
from .ops import TRITON_DTYPES
from .ir import (EXTERNAL, FUSIBLE, LEAF, MEMORY_VIEWS, REDUCTION, Graph, Kind, Op, Reduce, Value, column_padding,
                 verify)
from .padding import pad_matmuls
from .reinplace import reinplace_fills


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
        return (self.m is None or other.m is None or self.m == other.m) and \
            (self.d is None or other.d is None or self.d == other.d)

    def join(self, other: "Space") -> "Space":
        return Space(self.m if self.m is not None else other.m, self.d if self.d is not None else other.d)


@dataclass
class KernelGroup:
    name: str
    stage: int
    space: Space
    nodes: list = field(default_factory=list)          # fusible node names, topological
    inputs: list = field(default_factory=list)         # values read from memory or passed as scalars
    outputs: list = field(default_factory=list)        # values written for later steps
    column_sums: list = field(default_factory=list)    # reductions over M: partials per program
    aten_reason: Optional[str] = None                  # set when the group runs through aten

    def totals(self, graph: Graph) -> dict:
        """dtype -> the column sums of that dtype, in order: the rows of one [n, D] totals tensor
        the kernel writes (codegen's argument, the runtime's allocation)."""
        totals: dict = {}
        for name in self.column_sums:
            totals.setdefault(graph[name].value.dtype, []).append(name)
        return totals


@dataclass(frozen=True)
class ExternStep:
    name: str
    stage: int


@dataclass
class Schedule:
    graph: Graph                                       # the graph scheduled (its matmuls padded: memfuse.padding)
    steps: list                                        # KernelGroup | ExternStep, in run order
    not_fused: list = field(default_factory=list)      # (node, input, reason)
    paddings: list = field(default_factory=list)       # padding.MatmulPadding per extern matmul
    in_place: list = field(default_factory=list)       # reinplace.InPlace: scatters written into their fill

    @property
    def kernels(self) -> list:
        return [s for s in self.steps if isinstance(s, KernelGroup)]


@timed("schedule")
def schedule(graph: Graph, config: Config, kind: str) -> Schedule:
    """`kind` names the graph ("forward", "backward") in kernel names. Two rewrites of its extern
    calls come first: matmuls whose operands are better aligned (memfuse.padding, Config.pad_matmuls),
    scatters into a fresh fill made in place (memfuse.reinplace)."""
    graph, paddings = pad_matmuls(graph, config)
    graph, in_place = reinplace_fills(graph)
    if config.check and (in_place or any(p.padded for p in paddings)):
        verify(graph)
    stage: dict = {}
    group_of: dict = {}
    groups: list = []
    externs: list = []
    not_fused: list = []
    for name, node in graph.nodes.items():
        if node.op in LEAF:
            stage[name] = 0
            continue
        if node.op in EXTERNAL or _finishing(graph, node):
            # a view or cast of a finished reduction over M: a reshape by the runtime, not a kernel
            stage[name] = max((stage[i] for i in node.inputs), default=0) + _finishing(graph, node)
            externs.append(ExternStep(name, stage[name]))
            continue
        assert node.op in FUSIBLE, node.op
        space = _node_space(graph, node, group_of)
        here = 0
        for inp in node.inputs:
            here = max(here, _input_stage(graph, inp, stage, group_of, space, not_fused, name))
        stage[name] = here
        joinable = [group_of[i] for i in node.inputs if i in group_of and group_of[i].stage == here
                    and group_of[i].space.agrees(space) and _barrier(graph, i) is None]
        if not joinable:
            joinable = [g for g in groups if g.stage == here and g.space.agrees(space)][:1]
        if joinable:
            group = _merge(joinable, groups, group_of)
        else:
            group = KernelGroup("", here, space)
            groups.append(group)
        group.space = group.space.join(space)
        group.nodes.append(name)
        group_of[name] = group
    steps = _order(graph, groups, externs, kind)
    for group in steps:
        if isinstance(group, KernelGroup):
            _fill_io(graph, group, group_of)
            group.aten_reason = _codegen_limit(graph, group, config)
    return Schedule(graph, steps, not_fused, paddings, in_place)


def _node_space(graph: Graph, node, group_of: dict) -> Space:
    """Where a node runs: its value's space, and for a reduction also its source's [M, D] (a
    column sum alone in its group must still walk the M rows, a row sum the D columns); a padded
    store runs where its root does."""
    if stores_padded(graph, node, group_of):
        return Space.of(graph[node.inputs[0]].value)
    space = Space.of(node.value)
    if node.op in REDUCTION:
        space = space.join(Space.of(graph[node.inputs[0]].value))
    return space


def stores_padded(graph: Graph, node, computed) -> bool:
    """Whether `node` is a zero padding of the columns of a value a kernel computes (`computed`:
    the names kernels compute), which that kernel stores padded (memfuse.padding): its tiles span
    the padded row (BLOCK_D, the next power of two of D, reaches it)."""
    d = column_padding(graph, node)
    if d is None or node.inputs[0] not in computed:
        return False
    root_d = graph[node.inputs[0]].value.d
    return d <= 1 << max(0, (root_d - 1).bit_length())


def _finishing(graph: Graph, node) -> bool:
    """A view or cast of a finished reduction over M (D elements): done by the runtime. Only
    a reshape: a broadcast (expand) of the value is a kernel's job."""
    if node.op not in (Op.VIEW, Op.CAST) or node.value.kind not in (Kind.COL, Kind.SCALAR):
        return False
    source = graph[node.inputs[0]].value
    same_size = sympy.simplify(sympy.Mul(*source.shape) - sympy.Mul(*node.value.shape)) == 0
    return same_size and _barrier(graph, node.inputs[0]) is not None


def _barrier(graph: Graph, name: str) -> Optional[str]:
    node = graph[name]
    if node.op in EXTERNAL or _finishing(graph, node):
        return f"{name} is an extern call"
    if node.op in REDUCTION and isinstance(node.attr, Reduce) and node.attr.axis is Kind.COL:
        return f"{name} reduces over every row (M): its result exists only after the whole pass"
    return None


def _input_stage(graph, inp, stage, group_of, space, not_fused, name) -> int:
    barrier = _barrier(graph, inp)
    if barrier is not None:
        not_fused.append((name, inp, barrier))
        return stage[inp] + 1
    node = graph[name]
    if inp == node.inputs[0] and stores_padded(graph, node, group_of):
        return stage[inp]      # the kernel that computes inp stores it padded
    if node.op in MEMORY_VIEWS and inp == node.inputs[0] and inp in group_of:
        not_fused.append((name, inp, f"reads {inp} in place ({node.attr.describe}): a kernel writes it "
                                     f"to memory first"))
        return stage[inp] + 1
    if inp in group_of and not group_of[inp].space.agrees(space):
        not_fused.append((name, inp, f"iteration spaces differ: {group_of[inp].space} vs {space}"))
        return stage[inp] + 1
    return stage[inp]


def _merge(joinable, groups, group_of) -> KernelGroup:
    target = joinable[0]
    for other in joinable[1:]:
        if other is target or other not in groups:
            continue
        target.space = target.space.join(other.space)
        target.nodes.extend(other.nodes)
        for n in other.nodes:
            group_of[n] = target
        groups.remove(other)
    return target


def _order(graph: Graph, groups: list, externs: list, kind: str) -> list:
    position = {name: i for i, name in enumerate(graph.nodes)}
    for g in groups:
        g.nodes.sort(key=position.__getitem__)
    # At one stage, kernels run before externs (an extern of stage s reads kernels of stage s).
    keyed = [((g.stage, 0, position[g.nodes[0]]), g) for g in groups] + \
            [((e.stage, 1, position[e.name]), e) for e in externs]
    steps = [step for _, step in sorted(keyed, key=lambda kv: kv[0])]
    for i, g in enumerate(s for s in steps if isinstance(s, KernelGroup)):
        g.name = f"memfuse_{kind}_{i}"
    return steps


def _fill_io(graph: Graph, group: KernelGroup, group_of: dict) -> None:
    members = set(group.nodes)
    users = graph.users()
    outputs = set(o for o in graph.outputs if o is not None)
    inputs = []
    for name in group.nodes:
        for inp in graph[name].inputs:
            if inp not in members and inp not in inputs:
                inputs.append(inp)
    group.inputs = inputs
    for name in group.nodes:
        if _barrier(graph, name) is not None:
            group.column_sums.append(name)
        elif name in outputs or any(u not in members for u in users[name]):
            group.outputs.append(name)


def _codegen_limit(graph: Graph, group: KernelGroup, config: Config) -> Optional[str]:
    """Why no kernel can run this group (None when one can: persistent rows up to
    Config.max_row_length, looped kernels past it)."""
    if group.space.d == 0:
        return "rows of length D=0: nothing for a kernel to walk"
    for name in group.nodes + group.inputs:
        dtype = graph[name].value.dtype
        if dtype is not None and dtype not in TRITON_DTYPES:
            return f"{name} has dtype {dtype}, which the kernels do not handle"
    return None
