"""schedule: group a graph's nodes into kernels over [M, D], and everything else into extern steps.

Each fusible node gets a stage: the largest stage of its inputs, plus one across anything a
kernel cannot read in the same pass (an extern result, a reduction over M, a value from a group
of another space, the root a STRIDED view reads from memory). A node joins the groups of its
inputs at its own stage when their spaces agree (merging them), else starts a new one. Every edge
between groups then runs from a lower stage to a higher one; the steps run in the graph's order
(the plan's: a backward's recomputations right before their first reader), each after the
steps it reads. Six rules then place values where they cost least memory:
- a value computed from constants, sizes and the seed alone (a fill, an iota, a dropout draw) is
  computed inside every kernel that reads it, never written (`input_free`);
- a view read in place (a permute, slice or broadcast of a tensor in memory) that only kernels
  read is loaded by each of them through its access map, never written (`read_by_readers`);
- a value is computed where it is read: a node whose readers all run at later stages moves to the
  earliest reader's stage, into that reader's kernel (`sink`), unless that would write one of
  its inputs to memory that was not written before;
- two kernels of one stage join (horizontal fusion) only when they run one after the other and
  read an input in common: one load, and no buffer allocated earlier than before;
- a pointwise value a later kernel reads from memory is computed again in that kernel when it
  can be rebuilt from values in memory anyway for fewer bytes than it costs to read
  (`recompute_in_readers`); its owner then writes it only for readers that still load it;
- an exact upcast (bf16 -> fp32) a later kernel reads from memory is cast again there from its
  narrow source, which its kernel writes instead (`write_narrow`).
A group of [M] values alone never joins one of [D] values alone (it would walk M x D elements),
and a returned reshape of an aten result (the logits) is the runtime's `.reshape`, not a copy.
Why two nodes did not share a kernel, and why a node was placed where it is, are recorded for
`explain()`. The placement rules live in schedule/placement.py, the joins in schedule/joins.py.
"""
from __future__ import annotations

import heapq
import re
from typing import Optional

from memfuse.base.config import Config
from memfuse.base.debug import timed
from memfuse.ir.graph import EXTERNAL, FUSIBLE, LEAF, MEMORY_VIEWS, Graph, Reshape, verify
from memfuse.ir.ops import TRITON_DTYPES
from memfuse.schedule.joins import join_column_sums, join_later, join_sharing, steps_read
from memfuse.schedule.padding import pad_matmuls
from memfuse.schedule.placement import (compute_free_in_readers, input_free, read_by_readers, recompute_in_readers, sink,
                                        write_narrow)
from memfuse.schedule.reads import fusion_barrier, node_space, runtime_reshape, stores_padded
from memfuse.schedule.reinplace import reinplace
from memfuse.schedule.reshapes import fold_column_casts, reshapes_for_aten, returned_reshapes
from memfuse.schedule.row_order import order_rows
from memfuse.schedule.steps import ExternStep, KernelGroup, Schedule


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
    sink(graph, stage, group_of, groups, externs, placed, loads)
    join_sharing(graph, groups, free, placed)
    steps = _order(graph, groups, externs)
    recompute_in_readers(graph, groups, stage, free, loads, placed)
    write_narrow(graph, groups, free, loads, placed)
    compute_free_in_readers(graph, groups, free, loads, placed)
    steps, joined = join_later(graph, steps, free | loads, placed)
    steps, summed = join_column_sums(graph, steps, free | loads, placed)
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
        if node.op in EXTERNAL or runtime_reshape(graph, node):
            # a view or cast of a finished reduction over M: a reshape by the runtime, not a kernel
            stage[name] = max((stage[i] for i in node.inputs), default=0) + runtime_reshape(graph, node)
            externs.append(ExternStep(name, stage[name]))
            continue
        assert node.op in FUSIBLE, node.op
        space = node_space(graph, node, group_of)
        here = 0
        for inp in node.inputs:
            here = max(here, _input_stage(graph, inp, stage, group_of, space, not_fused, name))
        stage[name] = here
        if name in loads:
            continue
        joinable = [group_of[i] for i in node.inputs if i in group_of and group_of[i].stage == here
                    and group_of[i].space.agrees(space) and fusion_barrier(graph, i) is None]
        if joinable:
            group = _merge(joinable, groups, group_of)
        else:
            group = KernelGroup("", here, space)
            groups.append(group)
        group.space = group.space.join(space)
        group.nodes.append(name)
        group_of[name] = group
    return stage, group_of, groups, externs, not_fused



def _input_stage(graph, inp, stage, group_of, space, not_fused, name) -> int:
    barrier = fusion_barrier(graph, inp)
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
        for before in steps_read(graph, step, owner) - {k}:
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
        if fusion_barrier(graph, name) is not None:
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
