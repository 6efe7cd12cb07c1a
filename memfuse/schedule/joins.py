"""Kernels joined after grouping: two of one stage that read an input in common (horizontal
fusion, `join_sharing`), a kernel joined into a later one it runs right before (`join_later`), and
a lone column-sum kernel hosted by another (`join_column_sums`); each join recorded with its reason."""
from __future__ import annotations

from typing import Optional

from memfuse.ir.graph import Graph, Kind, Op
from memfuse.schedule.reads import (SOURCES, fusion_barrier, is_view, reads_from_memory, row_bytes, runtime_reshape,
                                    values_loaded)
from memfuse.schedule.steps import KernelGroup


# -- horizontal fusion --------------------------------------------------------------------------------
def join_sharing(graph: Graph, groups: list, free: set, placed: list) -> None:
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



def steps_read(graph: Graph, step, owner: dict, skip: frozenset = frozenset()) -> set:
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



def join_later(graph: Graph, steps: list, in_readers: set, placed: list) -> tuple:
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
                    and fusion_barrier(graph, n) is None}
    first_loads = _load_bytes(graph, first, in_readers)
    after: set = set()                       # the steps from k on that read what the kernel at k computes
    for j in range(k + 1, len(steps)):
        second = steps[j]
        reads = steps_read(graph, second, owner) - {j}
        joinable = isinstance(second, KernelGroup) and not reads & after and first.space.agrees(second.space) \
            and first.space.m is not None and first.space.m == second.space.m \
            and first_loads <= _load_bytes(graph, second, in_readers)
        # joined, a kernel reads the first one's values in registers, except through a view in memory
        direct = {n for n in in_registers if any(
            n in graph[r].inputs and not reads_from_memory(graph, r, n) for r in second.nodes)} if joinable else set()
        if joinable and k in reads and k in steps_read(graph, second, owner, skip=direct):
            joinable = False                 # it reads the first one's results from memory too
        if joinable and any(reads_from_memory(graph, r, n) for r in second.nodes for n in in_registers):
            joinable = False                 # a view reads one in memory: the joint kernel would compute it too late
        shared = _shared_input(graph, first, second, in_readers) if joinable else None
        if joinable and (shared is not None or direct):
            return j, shared, direct, after
        if k in reads or reads & after:
            if isinstance(second, KernelGroup):
                return None                  # it would wait for the joint kernel, whose results would wait longer
            after.add(j)
    return None



def join_column_sums(graph: Graph, steps: list, in_readers: set, placed: list) -> tuple:
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
    row than that kernel does. Run after `join_later`, so that it joins the kernels as they end up.
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
        theirs = set(target.nodes) - set(target.recomputed)
        # what either computes again stays computed again, unless the other owns it (computes it
        # into memory): the target's own recomputed values are no new outputs
        target.recomputed = sorted((set(target.recomputed) | set(lone.recomputed)) - owned - theirs,
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
    pending = list(steps_read(graph, step, owner))
    while pending:
        i = pending.pop()
        if i < k or i in moved:
            continue
        if not _aliases(graph, steps[i]):
            return None
        moved.add(i)
        pending.extend(steps_read(graph, steps[i], owner) - {i})
    return sorted(moved)



def _later_target(graph: Graph, steps: list, j: int, in_readers: set, owner: dict) -> Optional[int]:
    """The index of the next kernel after `j` that the kernel at `j` can join side by side, or None."""
    dependent = {j}          # it and the views of its totals
    for k in range(j + 1, len(steps)):
        step = steps[k]
        if steps_read(graph, step, owner) & dependent:
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
        if steps_read(graph, steps[i], owner) & dependent:
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
    return runtime_reshape(graph, node) or (node.op is Op.EXTERN and is_view(node))



def _aliased(graph: Graph, name: str) -> str:
    """The tensor whose memory `name` is: through aten views and the runtime's reshapes."""
    node = graph[name]
    while node.inputs and (runtime_reshape(graph, node) or (node.op is Op.EXTERN and is_view(node))):
        node = graph[node.inputs[0]]
    return node.name



def _load_bytes(graph: Graph, group: KernelGroup, in_readers: set) -> int:
    """Bytes a row a kernel loads from memory."""
    return sum(row_bytes(graph[i].value) for i in values_loaded(graph, set(group.nodes), in_readers))
