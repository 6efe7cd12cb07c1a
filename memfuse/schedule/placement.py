"""Where a value is computed: inside every kernel that reads it when it has no input
(`input_free`), loaded through its access map by each reader (`read_by_readers`), moved into its
earliest reader's kernel (`sink`), or computed again by a later reader for fewer bytes than
reading it (`recompute_in_readers`). Each move is recorded with its reason for `explain()`."""
from __future__ import annotations

from typing import Optional

from memfuse.ir.graph import FUSIBLE, MEMORY_VIEWS, POINTWISE, RANDOM, Graph, Op, column_padding
from memfuse.plan import is_exact_upcast
from memfuse.schedule.reads import (SOURCES, fusion_barrier, is_view, node_space, reads_from_memory, row_bytes,
                                    values_loaded)
from memfuse.schedule.steps import ExternStep, KernelGroup, Space


def input_free(graph: Graph) -> set:
    """The fusible values computed from constants, sizes and the seed alone (a fill, an iota, a
    random draw) that no step needs in memory: every reader is a kernel node reading it in
    registers, and the program does not return it. Each kernel reading one computes it itself:
    it costs no load, and no buffer holds it."""
    users = graph.users()
    outputs = set(graph.outputs)
    free: set = set()
    for name, node in graph.nodes.items():
        if node.op in FUSIBLE and node.op not in MEMORY_VIEWS and fusion_barrier(graph, name) is None \
                and all(graph[i].op in SOURCES or i in free for i in node.inputs) \
                and name not in outputs and users[name] \
                and all(graph[u].op in FUSIBLE and not reads_from_memory(graph, u, name) for u in users[name]):
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
                graph[u].op in FUSIBLE and not reads_from_memory(graph, u, name) for u in users[name]):
            loads.add(name)
    return loads



def compute_free_in_readers(graph: Graph, groups: list, free: set, loads: set, placed: list) -> None:
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


RECOMPUTABLE = POINTWISE | RANDOM      # no reduction (a pass over a row or all rows), no read from memory
MAX_RECOMPUTED = 32                    # nodes one value may bring into a reader's kernel



def recompute_in_readers(graph: Graph, groups: list, stage: dict, free: set, loads: set, placed: list) -> None:
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
            loaded = values_loaded(graph, members, free)
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
                saved = sum(row_bytes(graph[m].value) for m in together)
                cost = sum(row_bytes(graph[n].value) for n in new_loads)
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
                group.space = group.space.join(node_space(graph, graph[n], owner))
            sources = sorted(values_loaded(graph, members, free) - loaded)
            for name in together:
                placed.append((name, f"computed again in {group.name} from "
                                     f"{', '.join(sources) or 'what it loads already'} "
                                     f"({cost} B a row for {len(together)} value(s), {len(nodes)} ops) instead of "
                                     f"read from memory ({row_bytes(graph[name].value)} B a row)"))



def write_narrow(graph: Graph, groups: list, free: set, loads: set, placed: list) -> None:
    """An exact upcast (bf16 -> fp32) one kernel computes and later kernels read from memory is
    cast again in each reader from its narrow source, which the owner writes instead: half the
    bytes written and read, and no fp32 buffer twice the activation's size alive between the
    kernels (BatchNorm's backward under autocast: the masked bf16 gradient, upcast for its sums
    over M, read again after them; rebuilding the bf16 value would load more than the fp32 copy).
    Only where every reader of the upcast is a kernel that reads it in registers (an extern, a
    returned value or a view's root needs it in memory anyway) and the owner computes the source
    itself or has it in memory."""
    users = graph.users()
    outputs = set(graph.outputs)
    position = {n: i for i, n in enumerate(graph.nodes)}
    owner = {n: g for g in groups for n in g.nodes if n not in g.recomputed}
    computed_in: dict = {}
    for group in groups:
        for n in group.nodes:
            computed_in.setdefault(n, []).append(group)
    for name, node in graph.nodes.items():
        home = owner.get(name)
        if home is None or name in outputs or name in free or name in loads or not is_exact_upcast(node, graph):
            continue
        source = node.inputs[0]
        if source in free or source in loads or fusion_barrier(graph, source) is not None or not (
                owner.get(source) is home or graph[source].op is Op.INPUT):
            continue
        readers = _narrow_readers(graph, name, home, users[name], computed_in, owner)
        if not readers:
            continue
        for group in readers:
            group.nodes.append(name)
            group.nodes.sort(key=position.__getitem__)
            group.recomputed.append(name)
            group.space = group.space.join(node_space(graph, node, owner))
        placed.append((name, f"written narrow: {home.name} writes {source} ({graph[source].value.dtype}), and "
                             f"{', '.join(g.name for g in readers)} cast it again (exact) instead of reading "
                             f"the {node.value.dtype} upcast from memory"))


def _narrow_readers(graph: Graph, name: str, home: KernelGroup, readers: list, computed_in: dict,
                    owner: dict) -> list:
    """The kernels other than `home` that read the upcast `name` from memory, each able to cast it
    itself; [] where some reader needs it in memory (an extern step, a view's root) or a kernel
    cannot compute it in its space."""
    node = graph[name]
    found: list = []
    for user in readers:
        kernels = computed_in.get(user)
        if kernels is None or reads_from_memory(graph, user, name):
            return []
        for group in kernels:
            if group is home or name in group.nodes or group in found:
                continue
            if column_padding(graph, node) is not None or not group.space.agrees(node_space(graph, node, owner)):
                return []
            found.append(group)
    return found


def _rebuild(graph, name, group, members, owner, stage, free, loads, loaded, users):
    """(nodes, new loads): the nodes `group` must compute to have `name` in registers, and the
    values it must load for them that it does not load yet; None where it cannot (a reduction or
    a read from memory on the way not yet in memory, another space, too many nodes, or a reader
    of `name` in `group` that reads it as a view's root in memory)."""
    node = graph[name]
    if node.op not in RECOMPUTABLE or fusion_barrier(graph, name) is not None:
        return None
    if any(u in members and reads_from_memory(graph, u, name) for u in users[name]):
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
        if home is not None and n not in loads and node.op in RECOMPUTABLE and fusion_barrier(graph, n) is None \
                and column_padding(graph, node) is None and group.space.agrees(node_space(graph, node, owner)):
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


# -- values computed where they are read ------------------------------------------------------------
def sink(graph: Graph, stage: dict, group_of: dict, groups: list, externs: list, placed: list, loads: set) -> None:
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
        elif is_view(graph[name]):
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
    if not readers or fusion_barrier(graph, name) is not None or column_padding(graph, node) is not None \
            or any(reads_from_memory(graph, r, name) for r in readers):
        return None
    latest = min(stage[r] for r in readers)
    space = node_space(graph, node, group_of)
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
            group.space = group.space.join(node_space(graph, graph[name], group_of))
