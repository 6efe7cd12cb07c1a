"""schedule: group a graph's nodes into kernels over [M, D], and everything else into extern steps.

Each fusible node gets a stage: the largest stage of its inputs, plus one across anything a
kernel cannot read in the same pass (an extern result, a reduction over M, a value from a group
of another space, the root a STRIDED view reads from memory). A node joins the groups of its
inputs at its own stage when their spaces agree (merging them), else starts a new one. Every edge
between groups then runs from a lower stage to a higher one; the steps run in the graph's order
(the plan's: a backward's recomputations right before their first reader), each after the
steps it reads. Five rules then place values where they cost least memory:
- a value computed from constants, sizes and the seed alone (a fill, an iota, a dropout draw) is
  computed inside every kernel that reads it, never written (`input_free`);
- a view read in place (a permute, slice or broadcast of a tensor in memory) that only kernels
  read is loaded by each of them through its access map, never written (`read_by_readers`);
- a value is computed where it is read: a node whose readers all run at later stages moves to the
  earliest reader's stage, into that reader's kernel (`_sink`), unless that would write one of
  its inputs to memory that was not written before;
- two kernels of one stage join (horizontal fusion) only when they run one after the other and
  read an input in common: one load, and no buffer allocated earlier than before;
- a pointwise value a later kernel reads from memory is computed again in that kernel when it
  can be rebuilt from values in memory anyway for fewer bytes than it costs to read
  (`_recompute_in_readers`); its owner then writes it only for readers that still load it.
A group of [M] values alone never joins one of [D] values alone (it would walk M x D elements),
and a returned reshape of an aten result (the logits) is the runtime's `.reshape`, not a copy.
Why two nodes did not share a kernel, and why a node was placed where it is, are recorded for
`explain()`.
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Optional

import sympy
import torch

from memfuse.base.config import Config
from memfuse.base.debug import timed
from memfuse.ir.ops import TRITON_DTYPES
from memfuse.ir.patterns import rule
from memfuse.ir.graph import (EXTERNAL, FUSIBLE, LEAF, MEMORY_VIEWS, POINTWISE, RANDOM, REDUCTION, Extern, Graph, Kind, Node, Op,
                 Reduce, Reshape, Value, aten_schema, column_padding, verify)
from memfuse.schedule.padding import pad_matmuls
from memfuse.schedule.reinplace import reinplace
from memfuse.schedule.row_order import order_rows


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
        compute M + D (the labels of a language model, 16384 of each: 1.8 ms a step on an H100)."""
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


@timed("schedule")
def schedule(graph: Graph, config: Config, kind: str) -> Schedule:
    """`kind` names the graph ("forward", "backward") in kernel names. Three rewrites come first:
    matmuls whose operands are better aligned (memfuse.schedule.padding, Config.pad_matmuls), scatters into a
    fresh fill and the loss head's backward made in place (memfuse.schedule.reinplace), returned reshapes of aten results read from the
    result itself (`returned_reshapes`)."""
    graph, paddings = pad_matmuls(graph, config)
    graph, in_place = reinplace(graph, replayed=config.seed_from_memory)
    reshaped = reshapes_for_aten(returned_reshapes(graph))
    if config.check and (in_place or any(p.padded for p in paddings) or reshaped is not graph):
        verify(reshaped)
    graph = reshaped
    free = input_free(graph)
    loads = read_by_readers(graph, free)
    stage, group_of, groups, externs, not_fused = _group(graph, free, loads)
    placed: list = [(name, f"a reshape of {node.inputs[0]}, in memory, that an aten call reads: the runtime's "
                           f"`.reshape` (an alias), not a kernel copy")
                    for name, node in graph.nodes.items() if isinstance(node.attr, Reshape)]
    _sink(graph, stage, group_of, groups, externs, placed, loads)
    _join_sharing(graph, groups, free, placed)
    steps = _order(graph, groups, externs)
    _recompute_in_readers(graph, groups, stage, free, loads, placed)
    _compute_free_in_readers(graph, groups, free, loads, placed)
    steps, joined = _join_later(graph, steps, free | loads, placed)
    steps, summed = _join_column_sums(graph, steps, free | loads, placed)
    joined += summed
    groups = [s for s in steps if isinstance(s, KernelGroup)]
    _name_kernels(groups, joined, kind, placed)
    computed_in = _computed_in(groups)
    for group in steps:
        if isinstance(group, KernelGroup):
            _fill_io(graph, group, free | loads, computed_in)
            group.aten_reason = _codegen_limit(graph, group, config)
    steps = fold_column_casts(graph, steps, placed)
    kernels = [s for s in steps if isinstance(s, KernelGroup)]
    padded = {g.name for g in kernels if any(stores_padded(graph, graph[n], set(g.nodes)) for n in g.nodes)}
    order_rows(graph, kernels, config.max_row_length, padded, placed)
    return Schedule(graph, steps, not_fused, paddings, in_place, placed)


def _group(graph: Graph, free: set, loads: set) -> tuple:
    """(stage, group_of, groups, externs, not_fused): every node as early as its inputs allow, in
    the groups of its inputs at its stage when their spaces agree; a view in `loads` in no group,
    at the stage its root is in memory."""
    stage: dict = {}
    group_of: dict = {}
    groups: list = []
    externs: list = []
    not_fused: list = []
    for name, node in graph.nodes.items():
        if node.op in LEAF or name in free:
            stage[name] = 0
            continue
        if node.op in EXTERNAL or _runtime_reshape(graph, node):
            # a view or cast of a finished reduction over M: a reshape by the runtime, not a kernel
            stage[name] = max((stage[i] for i in node.inputs), default=0) + _runtime_reshape(graph, node)
            externs.append(ExternStep(name, stage[name]))
            continue
        assert node.op in FUSIBLE, node.op
        space = _node_space(graph, node, group_of)
        here = 0
        for inp in node.inputs:
            here = max(here, _input_stage(graph, inp, stage, group_of, space, not_fused, name))
        stage[name] = here
        if name in loads:
            continue
        joinable = [group_of[i] for i in node.inputs if i in group_of and group_of[i].stage == here
                    and group_of[i].space.agrees(space) and _barrier(graph, i) is None]
        if joinable:
            group = _merge(joinable, groups, group_of)
        else:
            group = KernelGroup("", here, space)
            groups.append(group)
        group.space = group.space.join(space)
        group.nodes.append(name)
        group_of[name] = group
    return stage, group_of, groups, externs, not_fused


# -- values with no input: computed where they are read ---------------------------------------------
SOURCES = (Op.CONSTANT, Op.SYMBOL, Op.SEED)


def input_free(graph: Graph) -> set:
    """The fusible values computed from constants, sizes and the seed alone (a fill, an iota, a
    random draw) that no step needs in memory: every reader is a kernel node reading it in
    registers, and the program does not return it. Each kernel reading one computes it itself:
    it costs no load, and no buffer holds it."""
    users = graph.users()
    outputs = set(graph.outputs)
    free: set = set()
    for name, node in graph.nodes.items():
        if node.op in FUSIBLE and node.op not in MEMORY_VIEWS and _barrier(graph, name) is None \
                and all(graph[i].op in SOURCES or i in free for i in node.inputs) \
                and name not in outputs and users[name] \
                and all(graph[u].op in FUSIBLE and not _reads_from_memory(graph, u, name) for u in users[name]):
            free.add(name)
    return free


def read_by_readers(graph: Graph, free: set) -> set:
    """The views read in place (STRIDED nodes) that every kernel reading them loads itself
    through the access map, never written: a permute or slice of an aten result, the cos and sin
    tables broadcast over the heads. Written once, such a view costs its size in writes and reads
    again; loaded where it is read, it costs the reads of its root it had anyway. Not a sum over
    dims (many root elements per element), a padded matmul operand (its kernel stores it), a view
    another view reads in place (that one needs it in memory), or a value the program returns."""
    users = graph.users()
    outputs = set(graph.outputs)
    loads: set = set()
    for name, node in graph.nodes.items():
        if node.op is not Op.STRIDED or name in outputs or not users[name] or node.attr.summed \
                or column_padding(graph, node) is not None or node.inputs[0] in loads:
            continue
        rest = node.inputs[1:]      # the fallback of a windowed read, the sizes of the map
        if all(graph[i].op in SOURCES or i in free or i in loads for i in rest) and all(
                graph[u].op in FUSIBLE and not _reads_from_memory(graph, u, name) for u in users[name]):
            loads.add(name)
    return loads


def _reads_from_memory(graph: Graph, reader: str, name: str) -> bool:
    """Whether the fusible node `reader` reads `name` from memory (a view's root), not from registers."""
    node = graph[reader]
    return node.op in MEMORY_VIEWS and node.inputs[0] == name


def _compute_free_in_readers(graph: Graph, groups: list, free: set, loads: set, placed: list) -> None:
    """Add to each group the input-free values and the views in `loads` its nodes read (and
    theirs), in graph order."""
    position = {name: i for i, name in enumerate(graph.nodes)}
    readers: dict = {}
    in_readers = free | loads
    for group in groups:
        members = set(group.nodes)
        todo = [i for n in group.nodes for i in graph[n].inputs if i in in_readers]
        while todo:
            name = todo.pop()
            if name not in members:
                members.add(name)
                group.nodes.append(name)
                readers.setdefault(name, []).append(group.name)
                todo.extend(i for i in graph[name].inputs if i in in_readers)
        group.nodes.sort(key=position.__getitem__)
    for name in sorted(readers, key=position.__getitem__):
        what = "no input (constants, sizes, the seed): computed" if name in free else \
            f"a view of {graph[name].inputs[0]} ({graph[name].attr.describe}): loaded through its access map"
        placed.append((name, f"{what} in every kernel that reads it ({', '.join(readers[name])}), never written"))


# -- values computed again where they are read -------------------------------------------------------
RECOMPUTABLE = POINTWISE | RANDOM      # no reduction (a pass over a row or all rows), no read from memory
MAX_RECOMPUTED = 32                    # nodes one value may bring into a reader's kernel


def _recompute_in_readers(graph: Graph, groups: list, stage: dict, free: set, loads: set, placed: list) -> None:
    """A value one kernel computes and a kernel of a later stage reads from memory is computed
    again in the reader when the reader can rebuild it from what is in memory anyway for fewer
    bytes a row than reading it: GPT-2's GELU backward read three fp32 [tokens, 3072]
    intermediates its recompute kernel wrote before the matmul between them (600 MB written and
    read a layer), where the bf16 pre-activation it also read gives all three. Values that the
    same new loads rebuild count together (in fp32 the pre-activation costs as much as one of
    them, and rebuilds five). The owner then writes a value only if some other step still reads it
    from memory. Most bytes saved first, per reader."""
    users = graph.users()
    position = {n: i for i, n in enumerate(graph.nodes)}
    owner = {n: g for g in groups for n in g.nodes}
    for group in sorted(groups, key=lambda g: g.stage):
        members = set(group.nodes)
        while True:
            loaded = _loaded(graph, members, free)
            rebuilds = {}
            for name in sorted(loaded, key=position.__getitem__):
                home = owner.get(name)
                if home is None or home is group or name in free or name in loads:
                    continue
                found = _rebuild(graph, name, group, members, owner, stage, free, loads, loaded, users)
                if found is not None:
                    rebuilds[name] = found
            best = None
            for name, (_, new_loads) in rebuilds.items():
                together = [m for m, (_, theirs) in rebuilds.items() if theirs <= new_loads]
                saved = sum(_row_bytes(graph[m].value) for m in together)
                cost = sum(_row_bytes(graph[n].value) for n in new_loads)
                if cost < saved and (best is None or saved - cost > best[0]):
                    best = (saved - cost, together, cost)
            if best is None:
                break
            _, together, cost = best
            nodes = sorted(set().union(*(rebuilds[m][0] for m in together)), key=position.__getitem__)
            group.nodes.extend(nodes)
            group.recomputed.extend(nodes)
            members.update(nodes)
            for n in nodes:
                group.space = group.space.join(_node_space(graph, graph[n], owner))
            sources = sorted(_loaded(graph, members, free) - loaded)
            for name in together:
                placed.append((name, f"computed again in {group.name} from "
                                     f"{', '.join(sources) or 'what it loads already'} "
                                     f"({cost} B a row for {len(together)} value(s), {len(nodes)} ops) instead of "
                                     f"read from memory ({_row_bytes(graph[name].value)} B a row)"))


def _loaded(graph: Graph, members: set, free: set) -> set:
    """The values a group's nodes (`members`) read that it does not compute: what it loads."""
    return {i for n in members for i in graph[n].inputs
            if i not in members and i not in free and graph[i].op not in SOURCES}


def _rebuild(graph, name, group, members, owner, stage, free, loads, loaded, users):
    """(nodes, new loads): the nodes `group` must compute to have `name` in registers, and the
    values it must load for them that it does not load yet; None where it cannot (a reduction or
    a read from memory on the way not yet in memory, another space, too many nodes, or a reader
    of `name` in `group` that reads it as a view's root in memory)."""
    node = graph[name]
    if node.op not in RECOMPUTABLE or _barrier(graph, name) is not None:
        return None
    if any(u in members and _reads_from_memory(graph, u, name) for u in users[name]):
        return None
    nodes: set = set()
    leaves: set = set()
    todo = [name]
    while todo:
        n = todo.pop()
        if n in nodes or n in members or n in free or graph[n].op in SOURCES:
            continue
        node = graph[n]
        home = owner.get(n)
        if home is not None and n not in loads and node.op in RECOMPUTABLE and _barrier(graph, n) is None \
                and column_padding(graph, node) is None and group.space.agrees(_node_space(graph, node, owner)):
            nodes.add(n)
            if len(nodes) > MAX_RECOMPUTED:
                return None
            todo.extend(node.inputs)
            continue
        if not _in_memory_before(graph, n, group, owner, stage, loads, users):
            return None
        leaves.add(n)
    return nodes, frozenset(leaves - loaded)


def _in_memory_before(graph, name, group, owner, stage, loads, users) -> bool:
    """Whether `name` is in memory when `group` runs, whatever `group` computes: a program input,
    a view its readers load (whose root is), a step's result of an earlier stage that is written
    for another reader anyway."""
    node = graph[name]
    if node.op is Op.INPUT:
        return True
    if name in loads:
        return stage[name] <= group.stage
    home = owner.get(name)
    if home is None:
        return stage[name] < group.stage
    return home.stage < group.stage and (name in graph.outputs or any(
        owner.get(u) is not home and owner.get(u) is not group for u in users[name]))


def _row_bytes(value: Value) -> int:
    """Bytes a row of the iteration space: D elements of a FULL value, one of a ROW value."""
    size = value.dtype.itemsize if value.dtype is not None else 8
    return size * (value.d if value.kind is Kind.FULL else 1 if value.kind is Kind.ROW else 0)


# -- values computed where they are read ------------------------------------------------------------
def _sink(graph: Graph, stage: dict, group_of: dict, groups: list, externs: list, placed: list, loads: set) -> None:
    """Move every node whose readers all run at later stages to the earliest reader's stage: into
    that reader's kernel (or a new kernel at that stage when only externs read it there), last node
    first, so a chain moves whole; an aten view moves to just before its first reader likewise. A
    move that would have the old kernel write one of the node's inputs that it did not write before
    is undone (a row statistic moved late must not pull its [M, D] source into memory early), and
    so is every move that then reads a value too late."""
    users = graph.users()
    outputs = set(graph.outputs)
    home = dict(group_of)
    written = {n for n, g in group_of.items() if n in outputs or any(group_of.get(u) is not g for u in users[n])}
    origin = dict(stage)
    for name in reversed(graph.nodes):
        if name in outputs or not users[name]:
            continue
        if name in group_of:
            target = _latest_place(graph, name, stage, group_of, users, groups)
            if target is not None:
                _move(name, *target, stage, group_of)
        elif _is_view(graph[name]):
            stage[name] = max(stage[name], min(stage[r] - (r in group_of) for r in users[name]))
    while True:
        undo = {n for n in group_of if stage[n] != origin[n] and _forces_write(graph, n, group_of, home, written)}
        undo |= {i for n in stage for i in graph[n].inputs
                 if stage[i] != origin[i] and _too_late(i, n, stage, group_of, loads)}
        if not undo:
            break
        for name in undo:
            _move(name, origin[name], home.get(name), stage, group_of)
    externs[:] = [ExternStep(e.name, stage[e.name]) for e in externs]
    for name in graph.nodes:
        if name in stage and stage[name] != origin[name]:
            placed.append((name, f"every reader runs at stage {stage[name]} or later: computed there "
                                 f"(moved from stage {origin[name]}), not written early and held"))
    _refit(graph, groups, group_of)


def _is_view(node) -> bool:
    """An aten call whose result is a view of its input (permute, view, expand): free to run late."""
    schema = aten_schema(node.attr.target) if node.op is Op.EXTERN and isinstance(node.attr, Extern) else None
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _too_late(inp: str, name: str, stage: dict, group_of: dict, loads: set) -> bool:
    """Whether `name` would run before its input is ready: a kernel (or a view its readers load)
    reads what an earlier stage wrote (or its own kernel computes), an extern what its stage or an
    earlier one did."""
    if name in group_of and group_of.get(inp) is group_of[name]:
        return False
    return stage[inp] > stage[name] - (name in group_of or name in loads)


def _latest_place(graph: Graph, name: str, stage: dict, group_of: dict, users: dict, groups: list):
    """(stage, group) where `name` can run latest: its earliest reader's stage, in that reader's
    kernel; None where it runs now."""
    readers = users[name]
    node = graph[name]
    if not readers or _barrier(graph, name) is not None or column_padding(graph, node) is not None \
            or any(_reads_from_memory(graph, r, name) for r in readers):
        return None
    latest = min(stage[r] for r in readers)
    space = _node_space(graph, node, group_of)
    there = {id(group_of[r]): group_of[r] for r in readers if r in group_of and stage[r] == latest}
    if len(there) == 1:
        group = next(iter(there.values()))
        if group.space.agrees(space):
            return (latest, group) if latest > stage[name] else None
        latest -= 1                        # a kernel of another space reads it at `latest`: written one stage before
    elif there:
        latest -= 1                        # two kernels read it at `latest`: written one stage before
    if latest <= stage[name]:
        return None
    group = KernelGroup("", latest, space)
    groups.append(group)
    return latest, group


def _move(name: str, to_stage: int, group: Optional[KernelGroup], stage: dict, group_of: dict) -> None:
    """Put a node at a stage: a kernel node into `group`, an extern alone (group None)."""
    stage[name] = to_stage
    if group is not None:
        group_of[name].nodes.remove(name)
        group.nodes.append(name)
        group_of[name] = group


def _forces_write(graph: Graph, name: str, group_of: dict, home: dict, written: set) -> bool:
    """Whether a moved node reads an input left in its old kernel, which that kernel did not write
    before: it would now, early, and the buffer would live until the moved node runs."""
    return any(home.get(i) is home[name] and group_of[i] is home[name] and i not in written
               for i in graph[name].inputs)


def _refit(graph: Graph, groups: list, group_of: dict) -> None:
    """Drop the groups left empty; each other's space is its nodes' again."""
    groups[:] = [g for g in groups if g.nodes]
    for group in groups:
        group.space = Space(None, None)
        for name in group.nodes:
            group.space = group.space.join(_node_space(graph, graph[name], group_of))


# -- horizontal fusion --------------------------------------------------------------------------------
def _join_sharing(graph: Graph, groups: list, free: set, placed: list) -> None:
    """Join two kernels of one stage that run one after the other, agree on their space and read an
    input in common (the column sums of a backward land in its main kernel): the input is loaded
    once, and no buffer is allocated before another step runs that ran before it."""
    position = {name: i for i, name in enumerate(graph.nodes)}
    ordered = sorted(groups, key=lambda g: (g.stage, min(position[n] for n in g.nodes)))
    kept = []
    for group in ordered:
        last = kept[-1] if kept else None
        shared = _shared_input(graph, last, group, free) if last is not None and last.stage == group.stage \
            and last.space.agrees(group.space) else None
        if shared is None:
            kept.append(group)
            continue
        placed.append((min(group.nodes, key=position.__getitem__),
                       f"its kernel joins the one before it at stage {group.stage}: both read {shared}"))
        last.nodes.extend(group.nodes)
        last.space = last.space.join(group.space)
    groups[:] = kept


def _shared_input(graph: Graph, a: KernelGroup, b: KernelGroup, free: set) -> Optional[str]:
    """An input both groups load from memory (a tensor: not a constant, a size, the seed or a
    value each computes itself), or None."""
    def loads(group):
        members = set(group.nodes)
        return [i for n in group.nodes for i in graph[n].inputs
                if i not in members and i not in free and graph[i].op not in SOURCES]
    theirs = set(loads(b))
    return next((i for i in loads(a) if i in theirs), None)


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
    the names kernels compute), which that kernel stores padded (memfuse.schedule.padding): its tiles span
    the padded row (BLOCK_D, the next power of two of D, reaches it)."""
    d = column_padding(graph, node)
    if d is None or node.inputs[0] not in computed:
        return False
    root_d = graph[node.inputs[0]].value.d
    return d <= 1 << max(0, (root_d - 1).bit_length())


def _runtime_reshape(graph: Graph, node) -> bool:
    """A step the runtime does with `.reshape` (or `.to`), not a kernel: a view or cast of a
    finished reduction over M (D elements), or a returned reshape of an aten call's result (the
    logits a model returns, a view of the LM head's matmul: a kernel would copy [tokens, vocab]
    only to return it). Only a reshape: a broadcast (expand) of the value is a kernel's job."""
    if node.op not in (Op.VIEW, Op.CAST):
        return False
    if not _same_size(graph, node):
        return False
    if node.value.kind in (Kind.COL, Kind.SCALAR):
        return _barrier(graph, node.inputs[0]) is not None
    if isinstance(node.attr, Reshape):
        return True
    return node.op is Op.VIEW and node.name in graph.outputs and _made_by_aten(graph, node.inputs[0])


def reshapes_for_aten(graph: Graph) -> Graph:
    """The graph with each reshape (VIEW) of a tensor already in memory (a program input, an aten
    result, or such a reshape) that an aten call reads marked `Reshape`: the runtime's
    `.reshape`, an alias, where a kernel would copy it. BERT's backward reads each layer's saved
    attention probabilities as a [batch x heads, seq, seq] bmm operand: four 384 MB fp32 copies,
    alive together, otherwise; and each projection's bias gradient sums the rows of the matmul
    operand that attention's gradient already is. Kernels that read one too read it in memory, as
    they would its source. A returned one stays a copy (it would alias the caller's input)."""
    users = graph.users()
    outputs = set(graph.outputs)
    for_aten: set = set()        # VIEW nodes an aten call reads, directly or through such VIEWs
    for name in reversed(graph.nodes):
        node = graph[name]
        if node.op is Op.VIEW and name not in outputs and any(
                graph[u].op in EXTERNAL or u in for_aten for u in users[name]):
            for_aten.add(name)
    marked: set = set()
    for name in graph.nodes:
        node = graph[name]
        source = graph[node.inputs[0]] if node.inputs else None
        if name in for_aten and node.attr is None and node.value.kind in (Kind.FULL, Kind.ROW) \
                and source.value.dtype == node.value.dtype \
                and (source.op is Op.INPUT or source.op in EXTERNAL or source.name in marked) \
                and _same_size(graph, node):
            marked.add(name)
    if not marked:
        return graph
    rewritten = Graph(inputs=list(graph.inputs), outputs=list(graph.outputs))
    for name, node in graph.nodes.items():
        rewritten.add(Node(name, node.op, node.inputs, node.value, Reshape()) if name in marked else node)
    return rewritten


def returned_reshapes(graph: Graph) -> Graph:
    """The graph with each returned reshape of an aten call's result (through a chain of
    reshapes: `view`, then the `clone` AOTAutograd puts on an output) reading that result itself,
    so that the runtime reshapes it (`_runtime_reshape`); the bypassed reshapes nothing else reads
    are dropped."""
    rewired = {}
    for name in set(o for o in graph.outputs if o is not None):
        node, root = graph[name], graph[name]
        while root.op is Op.VIEW and _same_size(graph, root):
            root = graph[root.inputs[0]]
        if node.op is Op.VIEW and root.name != node.inputs[0] and root.op is Op.EXTERN \
                and _made_by_aten(graph, root.name):
            rewired[name] = Node(name, node.op, (root.name,), node.value, node.attr)
    if not rewired:
        return graph
    nodes = {name: rewired.get(name, node) for name, node in graph.nodes.items()}
    outputs = set(o for o in graph.outputs if o is not None)
    while True:
        read = {i for node in nodes.values() for i in node.inputs}
        dead = [n for n, node in nodes.items() if node.op is Op.VIEW and n not in read and n not in outputs]
        if not dead:
            break
        for n in dead:
            del nodes[n]
    rewritten = Graph(inputs=list(graph.inputs), outputs=list(graph.outputs))
    for node in nodes.values():
        rewritten.add(node)
    return rewritten


# dtypes a kernel's finish rounds a column total through (in fp32 registers, as `cast` does)
FOLDED_CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fold_column_casts(graph: Graph, steps: list, placed: list) -> list:
    """The steps without the casts of finished column sums that the kernels finishing those sums
    now apply as they write their totals (KernelGroup.column_casts). Under autocast each bias
    gradient is an fp32 column sum cast to bf16 (the matmul's dtype) and back to fp32 (the
    parameter's): as steps of their own, two `.to` calls a bias, each a launch (BERT's backward: 58
    a step, 2 ms of its host time under cProfile on an H200 machine, 2026-11-27). A chain is folded while each value has one reader, a cast the
    runtime would run (`_runtime_reshape`: a cast, or a reshape, free on a row of the totals), in
    fp32, bf16 or fp16; the last may have any readers."""
    users = graph.users()
    externs = {s.name for s in steps if isinstance(s, ExternStep)}
    folded: set = set()
    for group in steps:
        if not isinstance(group, KernelGroup) or group.aten_reason is not None:
            continue
        for total in group.column_sums:
            chain, value = [], total
            while value not in graph.outputs and len(users[value]) == 1 and \
                    graph[value].value.dtype in FOLDED_CAST_DTYPES:
                reader = graph[users[value][0]]
                if reader.op not in (Op.CAST, Op.VIEW) or reader.name not in externs or \
                        reader.value.dtype not in FOLDED_CAST_DTYPES or not _same_size(graph, reader):
                    break
                chain.append(reader.name)
                value = reader.name
            if any(graph[c].op is Op.CAST for c in chain):
                group.column_casts[total] = tuple(chain)
                folded.update(chain)
                casts = " then ".join(str(graph[c].value.dtype).replace("torch.", "") for c in chain
                                      if graph[c].op is Op.CAST)
                placed.append((chain[-1], f"column sum {total} cast to {casts} by {group.name} as it writes its "
                                          f"totals: no `.to` step"))
    return [s for s in steps if not (isinstance(s, ExternStep) and s.name in folded)]


def _same_size(graph: Graph, node) -> bool:
    source = graph[node.inputs[0]].value
    return sympy.simplify(sympy.Mul(*source.shape) - sympy.Mul(*node.value.shape)) == 0


def _made_by_aten(graph: Graph, name: str) -> bool:
    """Whether `name` is an aten call's result in storage of its own, or an aliasing view of one
    (never of a program input: a reshape of it returned would alias what the caller passed in).
    An element of an aten call's tuple (the chunked loss head's logits) counts as its result: its
    own where the schema says that element aliases nothing, or aliases a saved value memfuse.schedule.reinplace
    found only that call reads (ExternRule.own_aliases, memfuse.ir.patterns: the loss head's hidden states' gradient, scaled in place)."""
    node = graph[name]
    if node.op is Op.GETITEM and graph[node.inputs[0]].op is Op.EXTERN:
        call = graph[node.inputs[0]]
        schema = aten_schema(call.attr.target)
        if schema is not None and call.attr.target not in ALIASING_CALLS \
                and schema.returns[node.attr.index].alias_info is None:
            return True
        if node.attr.index in rule(call.attr.target).own_aliases:
            return True
        node = call
    while node.op is Op.EXTERN and aten_schema(node.attr.target) is not None:
        aliases = node.attr.target in ALIASING_CALLS or \
            any(r.alias_info is not None for r in aten_schema(node.attr.target).returns)
        if not aliases:
            return True
        if not node.inputs:
            return False
        node = graph[node.inputs[0]]
    return False


# aten calls whose result may alias an input although their schema says nothing
ALIASING_CALLS = frozenset({torch.ops.aten._unsafe_view.default})


def _barrier(graph: Graph, name: str) -> Optional[str]:
    node = graph[name]
    if node.op in EXTERNAL or _runtime_reshape(graph, node):
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


def _order(graph: Graph, groups: list, externs: list) -> list:
    """The steps in the graph's order, each after the steps it reads: of the steps whose inputs
    are computed, the one whose first node comes first in the graph runs next. The graph's order
    is the plan's (recomputations of the forward right before their first reader in a backward),
    which stages alone would not keep: a recomputation's inputs are all in memory at the start."""
    position = {name: i for i, name in enumerate(graph.nodes)}
    for g in groups:
        g.nodes.sort(key=position.__getitem__)
    steps = groups + externs
    first = [position[s.nodes[0] if isinstance(s, KernelGroup) else s.name] for s in steps]
    owner = {name: k for k, g in enumerate(groups) for name in g.nodes}
    owner.update({e.name: len(groups) + k for k, e in enumerate(externs)})
    readers: list = [set() for _ in steps]
    waiting = [0] * len(steps)
    for k, step in enumerate(steps):
        for before in _steps_read(graph, step, owner) - {k}:
            readers[before].add(k)
            waiting[k] += 1
    ready = [(first[k], k) for k in range(len(steps)) if waiting[k] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        _, k = heapq.heappop(ready)
        ordered.append(steps[k])
        for reader in readers[k]:
            waiting[reader] -= 1
            if waiting[reader] == 0:
                heapq.heappush(ready, (first[reader], reader))
    assert len(ordered) == len(steps), "schedule: the steps read each other in a cycle"
    for i, g in enumerate(s for s in ordered if isinstance(s, KernelGroup)):
        g.name = f"<kernel {i}>"       # until the final order: `_name_kernels`
    return ordered


def _steps_read(graph: Graph, step, owner: dict, skip: frozenset = frozenset()) -> set:
    """The steps (indices in `owner`) whose results `step` reads: through a value no step
    computes (a view loaded in place, a value computed where it is read), its inputs'. `skip`:
    inputs left out."""
    return {owner[name] for name in _values_read(graph, step, owner, skip) if name in owner}


def _values_read(graph: Graph, step, owner: dict, skip: frozenset = frozenset()) -> set:
    """The step results (named in `owner`) and program inputs `step` reads, through values no step
    computes. `skip`: inputs left out."""
    names = step.nodes if isinstance(step, KernelGroup) else [step.name]
    members = set(names) | set(skip)      # what a kernel computes, itself or again
    pending = [i for n in names for i in graph[n].inputs if i not in members]
    seen, found = set(), set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in owner or graph[name].op is Op.INPUT:
            found.add(name)
        else:
            pending.extend(graph[name].inputs)
    return found


def _join_later(graph: Graph, steps: list, in_readers: set, placed: list) -> tuple:
    """(steps, joined): a kernel joins the next kernel of its space that loads an input it loads or
    reads its values, where only aten calls between read its results: those run after the joint
    kernel. BERT's backward computes GELU(h) again for the down projection's weight gradient, then
    the GELU backward after the matmul that gives its input gradient: both load h, and joined they
    load it once, compute erf once, and launch once (in the whole model the GELU backward read a
    value the first kernel wrote for it: now in registers). Not where a kernel between reads the
    first one's results: it would wait for the joint kernel, and what the later kernel writes would
    be written that much earlier and held (the backward's first kernel would take on the cast of
    the layer's input that the weight gradients of the query, key and value read last). Nor where
    the first loads more a row than the later one: the joint kernel runs at the later one's launch
    configuration, chosen for its rows, and BERT's rebuild of the residual stream (nine loads, 16
    fp32 values written a row) would bring into the last LayerNorm backward more registers than
    that holds. `joined`: (the kernel that joined, the kernel it joined)."""
    joined: list = []
    k = 0
    while k < len(steps):
        first = steps[k]
        later = _joinable_after(graph, steps, k, in_readers) if isinstance(first, KernelGroup) else None
        if later is None:
            k += 1
            continue
        j, shared, direct, after = later
        second = steps[j]
        owned = set(first.nodes) - set(first.recomputed)
        theirs = set(second.nodes) - set(second.recomputed)
        position = {name: i for i, name in enumerate(graph.nodes)}
        second.nodes = sorted(set(first.nodes) | set(second.nodes), key=position.__getitem__)
        second.recomputed = sorted((set(first.recomputed) | set(second.recomputed)) - owned - theirs,
                                   key=position.__getitem__)
        second.space = second.space.join(first.space)
        placed.append((min(owned, key=position.__getitem__),
                       f"its kernel joined {second.name}, a later kernel of its space: " +
                       ", and ".join(([f"both load {shared}"] if shared else []) +
                                     ([f"{second.name} reads {', '.join(sorted(direct))} in registers now"]
                                      if direct else [])) +
                       (f"; the {len(after)} aten call(s) reading its results run after the joint kernel"
                        if after else "")))
        joined.append((first, second))
        between = [s for i, s in enumerate(steps[k + 1:j], k + 1) if i not in after]
        steps = steps[:k] + between + [second] + [steps[i] for i in sorted(after)] + steps[j + 1:]
    return steps, joined


def _joinable_after(graph: Graph, steps: list, k: int, in_readers: set):
    """(index, an input both load or None, the values of the kernel at `k` it reads in registers once
    joined, indices of the steps between that read the kernel at `k`) of the first later kernel
    `steps[k]` can join, or None."""
    first = steps[k]
    owner = _owners(steps, in_readers)
    in_registers = {n for n in first.nodes if n not in first.recomputed and n not in in_readers
                    and _barrier(graph, n) is None}
    first_loads = _load_bytes(graph, first, in_readers)
    after: set = set()                       # the steps from k on that read what the kernel at k computes
    for j in range(k + 1, len(steps)):
        second = steps[j]
        reads = _steps_read(graph, second, owner) - {j}
        joinable = isinstance(second, KernelGroup) and not reads & after and first.space.agrees(second.space) \
            and first.space.m is not None and first.space.m == second.space.m \
            and first_loads <= _load_bytes(graph, second, in_readers)
        # joined, a kernel reads the first one's values in registers, except through a view in memory
        direct = {n for n in in_registers if any(
            n in graph[r].inputs and not _reads_from_memory(graph, r, n) for r in second.nodes)} if joinable else set()
        if joinable and k in reads and k in _steps_read(graph, second, owner, skip=direct):
            joinable = False                 # it reads the first one's results from memory too
        shared = _shared_input(graph, first, second, in_readers) if joinable else None
        if joinable and (shared is not None or direct):
            return j, shared, direct, after
        if k in reads or reads & after:
            if isinstance(second, KernelGroup):
                return None                  # it would wait for the joint kernel, whose results would wait longer
            after.add(j)
    return None


def _join_column_sums(graph: Graph, steps: list, in_readers: set, placed: list) -> tuple:
    """(steps, joined): a kernel that writes only column sums (a bias's gradient, summed over the
    rows) joins another kernel of its space where that costs no memory, for one launch fewer:
    - the latest earlier kernel after which everything it reads is ready (the aten views it reads
      through moved before that kernel). BERT's backward sums the query's, key's and value's
      gradients for their biases, each in a kernel of its own after the matmuls that read the same
      gradient; they join the kernel before them, which runs once all three exist. It reads what is
      there already, and its totals are [D];
    - else the next kernel, where only aten views between read its totals and everything it reads
      stays in memory until then anyway: GPT-2's output bias sums the incoming gradient through the
      reshape its matmul reads, then the next kernel reads that gradient as the residual's.
    The joint kernel runs at the other kernel's launch configuration, so the sum may load no more a
    row than that kernel does. Run after `_join_later`, so that it joins the kernels as they end up.
    `joined`: (the kernel that joined, the kernel it joined)."""
    users = graph.users()
    outputs = set(graph.outputs)
    position = {name: i for i, name in enumerate(graph.nodes)}
    joined: list = []
    j = 0
    while j < len(steps):
        lone = steps[j]
        if not isinstance(lone, KernelGroup) or not _writes_only_column_sums(graph, lone, users, outputs):
            j += 1
            continue
        owner = _owners(steps, in_readers)
        earlier = _earlier_target(graph, steps, j, in_readers, owner)
        later = None if earlier is not None else _later_target(graph, steps, j, in_readers, owner)
        if earlier is None and later is None:
            j += 1
            continue
        k, moved = earlier if earlier is not None else (later, [])
        target = steps[k]
        owned = set(lone.nodes) - set(lone.recomputed)
        target.recomputed = sorted((set(target.recomputed) | set(lone.recomputed)) - owned - set(target.nodes),
                                   key=position.__getitem__)
        target.nodes = sorted(set(target.nodes) | set(lone.nodes), key=position.__getitem__)
        target.space = target.space.join(lone.space)
        placed.append((min(owned, key=position.__getitem__), (
            f"its kernel joined {target.name}, an earlier kernel of its space: it writes only column sums, "
            f"and what it reads is ready by then" +
            (f" (the {len(moved)} aten view(s) it reads through moved before it)" if moved else "")
        ) if earlier is not None else (
            f"its kernel joined {target.name}, the next kernel of its space, side by side: it writes only "
            f"column sums, and what it reads stays in memory until then anyway")))
        joined.append((lone, target))
        if earlier is not None:
            steps = steps[:k] + [steps[i] for i in moved] + [
                step for i, step in enumerate(steps[k:], k) if i != j and i not in moved]
        else:       # the aten views of its totals between the two now run after the joint kernel
            between = _views_of(graph, steps, j, k, owner)
            steps = steps[:j] + [steps[i] for i in range(j + 1, k) if i not in between] + [target] + [
                steps[i] for i in between] + steps[k + 1:]
    return steps, joined


def _writes_only_column_sums(graph: Graph, group: KernelGroup, users: dict, outputs: set) -> bool:
    members = set(group.nodes)
    written = [n for n in group.nodes if n not in group.recomputed and (
        n in outputs or any(u not in members for u in users[n]))]
    return bool(written) and group.space.m is not None and all(graph[n].value.kind is Kind.COL for n in written)


def _owners(steps: list, in_readers: set) -> dict:
    """value -> index of the step that computes it into memory."""
    owner = {}
    for i, step in enumerate(steps):
        if isinstance(step, KernelGroup):
            owner.update((n, i) for n in step.nodes if n not in step.recomputed and n not in in_readers)
        else:
            owner[step.name] = i
    return owner


def _can_host(graph: Graph, target, lone: KernelGroup, in_readers: set) -> bool:
    return isinstance(target, KernelGroup) and target.space.m == lone.space.m and target.space.agrees(lone.space) \
        and _load_bytes(graph, lone, in_readers) <= _load_bytes(graph, target, in_readers)


def _earlier_target(graph: Graph, steps: list, j: int, in_readers: set, owner: dict):
    """(index of the latest earlier kernel the kernel at `j` can join, the aten views to move
    before it, in run order), or None."""
    for k in range(j - 1, -1, -1):
        if _can_host(graph, steps[k], steps[j], in_readers):
            moved = _ready_before(graph, steps, steps[j], k, owner)
            if moved is not None:
                return k, moved
    return None


def _ready_before(graph: Graph, steps: list, step, k: int, owner: dict) -> Optional[list]:
    """The aten views (indices, in run order) to run before step `k` so that everything `step`
    reads is ready there, or None where something it reads is computed at or after `k`."""
    moved: set = set()
    pending = list(_steps_read(graph, step, owner))
    while pending:
        i = pending.pop()
        if i < k or i in moved:
            continue
        if not _aliases(graph, steps[i]):
            return None
        moved.add(i)
        pending.extend(_steps_read(graph, steps[i], owner) - {i})
    return sorted(moved)


def _later_target(graph: Graph, steps: list, j: int, in_readers: set, owner: dict) -> Optional[int]:
    """The index of the next kernel after `j` that the kernel at `j` can join side by side, or None."""
    dependent = {j}          # it and the views of its totals
    for k in range(j + 1, len(steps)):
        step = steps[k]
        if _steps_read(graph, step, owner) & dependent:
            if not _aliases(graph, step):
                return None  # a step reads its totals: it would wait for the joint kernel
            dependent.add(k)
        elif isinstance(step, KernelGroup) and _can_host(graph, step, steps[j], in_readers):
            alive = {_aliased(graph, name) for name in graph.outputs if name in graph.nodes}
            for later in steps[k:]:
                alive |= _buffers_read(graph, later, owner)
            return k if _buffers_read(graph, steps[j], owner) <= alive else None
    return None


def _views_of(graph: Graph, steps: list, j: int, k: int, owner: dict) -> list:
    """The steps between `j` and `k` that read step `j`'s results, themselves or through each other."""
    dependent = {j}
    for i in range(j + 1, k):
        if _steps_read(graph, steps[i], owner) & dependent:
            dependent.add(i)
    return sorted(dependent - {j})


def _buffers_read(graph: Graph, step, owner: dict) -> set:
    """The buffers `step` reads: the step results and program inputs it loads, each taken to the
    tensor it aliases (an aten view or reshape's input)."""
    return {_aliased(graph, name) for name in _values_read(graph, step, owner)}


def _aliases(graph: Graph, step) -> bool:
    """Whether a step only names memory another value has (an aten view, a runtime reshape)."""
    if isinstance(step, KernelGroup):
        return False
    node = graph[step.name]
    return _runtime_reshape(graph, node) or (node.op is Op.EXTERN and _is_view(node))


def _aliased(graph: Graph, name: str) -> str:
    """The tensor whose memory `name` is: through aten views and the runtime's reshapes."""
    node = graph[name]
    while node.inputs and (_runtime_reshape(graph, node) or (node.op is Op.EXTERN and _is_view(node))):
        node = graph[node.inputs[0]]
    return node.name


def _load_bytes(graph: Graph, group: KernelGroup, in_readers: set) -> int:
    """Bytes a row a kernel loads from memory."""
    return sum(_row_bytes(graph[i].value) for i in _loaded(graph, set(group.nodes), in_readers))


def _name_kernels(groups: list, joined: list, kind: str, placed: list) -> None:
    """Each kernel's name in run order; reasons recorded before name it so (one that joined a later
    one, by that one's name)."""
    final = {}
    for i, group in enumerate(groups):
        final[group.name] = f"memfuse_{kind}_{i}"
    for first, second in reversed(joined):
        final[first.name] = final[second.name]
    for group in groups:
        group.name = final[group.name]
    placed[:] = [(name, re.sub(r"<kernel \d+>", lambda m: final[m.group(0)], reason)) for name, reason in placed]


def _computed_in(groups: list) -> dict:
    """node -> the kernels that compute it (its own, and those that compute it again)."""
    where: dict = {}
    for group in groups:
        for name in group.nodes:
            where.setdefault(name, []).append(group)
    return where


def _fill_io(graph: Graph, group: KernelGroup, free: set, computed_in: dict) -> None:
    """A group's inputs (what its nodes read that it does not compute) and outputs: what it owns
    and a later step reads from memory (a kernel that computes the value again does not)."""
    members = set(group.nodes)
    users = graph.users()
    outputs = set(o for o in graph.outputs if o is not None)
    inputs = []
    for name in group.nodes:
        for inp in graph[name].inputs:
            if inp not in members and inp not in inputs:
                inputs.append(inp)
    group.inputs = inputs
    local = free | set(group.recomputed)
    for name in group.nodes:
        if _barrier(graph, name) is not None:
            group.column_sums.append(name)
        elif name not in local and (name in outputs or any(
                _reads_from(name, u, group, computed_in) for u in users[name])):
            group.outputs.append(name)


def _reads_from(name: str, user: str, group: KernelGroup, computed_in: dict) -> bool:
    """Whether `user` needs `name` from `group`'s memory: it is an extern step, or a kernel
    other than `group` that does not compute `name` itself runs it."""
    kernels = computed_in.get(user)
    if kernels is None:
        return True
    return any(g is not group and name not in g.nodes for g in kernels)


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
