"""buffers: when each tensor a program holds is made, dropped and reused, decided before it is written.

The stage between schedule and runtime. `plan_buffers(schedule)` walks the schedule's steps and
decides, per step, what memfuse allocates before it (a kernel's outputs and column totals), whether
an allocation takes over the storage of a buffer already dead (same dtype, same number of elements:
the allocator is not asked), and which locals the program drops after it (those it read last).
`runtime._ProgramWriter` writes these decisions and nothing else:

    mul_9 = mf_empty_strided((mf_s0, mf_s1, 48), (48*mf_s1, 48, 1), torch.float32)
    memfuse_backward_0(device, ...)
    del primals_1, mf_primals_1, tangents_1, mf_tangents_1
    clone = mul_9; del mul_9                        # a later allocation of the same float32 elements

A local is dropped after the last step that reads it, unless the program returns it. Storage is
released once every local that may hold it is dropped; several locals can hold one storage: a
column sum is a row of its kernel's totals, an aten view (or `_unsafe_view`) holds its base's, an
aten call's tuple holds its elements, a group run through aten may return a view of its input.
Storage a returned value may hold is never released, so never reused. Inputs are the caller's: the
program empties the list it is handed and drops its references, so a saved tensor or tangent goes
with its last reader when nothing else holds it.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass
from typing import Optional

import sympy
import torch

from memfuse.ir.targets import TensorConstant
from memfuse.base.debug import timed
from memfuse.ir.graph import Extern, Graph, Op, Value, ValueRef, aten_schema
from memfuse.schedule.groups import ALIASING_CALLS, ExternStep, KernelGroup, Schedule

ENTRY = "entry"      # the plan's first step: the inputs, unpacked from the caller's list


class Origin(enum.Enum):
    INPUT = "input"      # handed in by the caller: a primal, a saved tensor, a tangent
    OUTPUT = "output"    # a kernel's output: memfuse allocates it before the kernel
    TOTALS = "totals"    # a kernel's [n, D] column totals: memfuse allocates them before the kernel
    ROW = "row"          # a column sum: D values of its kernel's totals
    ATEN = "aten"        # an aten call's result: an extern step, a group run through aten


ALLOCATED = frozenset({Origin.OUTPUT, Origin.TOTALS})   # contiguous, on the device, nobody else's: reusable



@dataclass(frozen=True)
class Buffer:
    """A tensor the program holds in a local."""
    name: str                # its local: a graph value, or mf_totals_<dtype>[_k]
    origin: Origin
    dtype: Optional[torch.dtype]
    shape: tuple             # ints and sympy expressions over the size symbols
    nbytes: sympy.Expr       # bytes of the storage it brings (0: it may only hold others')
    storage: frozenset       # the buffers whose storage it may hold (itself when it brings its own)
    step: int                # the plan step that makes it (0: ENTRY)


@dataclass(frozen=True)
class Allocation:
    buffer: str
    reuses: Optional[str]    # the dead buffer whose storage (and local) it takes over; None: a new one
    reason: str


@dataclass(frozen=True)
class Free:
    """The program drops a local after a step."""
    buffer: str
    releases: tuple          # storages this leaves without a holder (back to the allocator, or reused)
    reused_by: Optional[str]  # the local is kept for this allocation, which drops it (Allocation.reuses)
    reason: str


@dataclass(frozen=True)
class Row:
    """A column sum as the program binds it: D values of its kernel's totals, in its local's shape."""
    totals: str
    offset: int              # elements into the totals
    value: str               # the column sum (the local is its reshape's value when that is its only reader)
    step: str                # where the line is written: the kernel's step, or the reshape's


@dataclass(frozen=True)
class StepBuffers:
    name: str                # ENTRY, a kernel group's name or an extern node's name
    allocations: tuple       # Allocation, before the step runs
    made: tuple              # names of the buffers the step binds (its allocations first)
    reads: tuple             # names of the buffers it reads
    frees: tuple             # Free, after the step


@dataclass(frozen=True)
class BufferPlan:
    buffers: dict            # name -> Buffer, in the order the program makes them
    steps: tuple             # StepBuffers: ENTRY, then one per schedule step
    rows: dict               # local -> Row, for every column sum of a generated kernel
    outputs: tuple           # buffers the program returns: never dropped

    def totals(self, step: int) -> dict:
        """dtype -> the totals local a step's kernel writes."""
        return {b.dtype: b.name for b in map(self.buffers.get, self.steps[step].made) if b.origin is Origin.TOTALS}


@dataclass(frozen=True)
class MemoryPoint:
    step: str
    during: int              # bytes of storage the program holds while the step runs
    after: int               # after the step's frees


@timed("buffers")
def plan_buffers(schedule: Schedule) -> BufferPlan:
    """Every buffer's lifetime: the step that makes it, the last that reads it, the storage it reuses."""
    graph = schedule.graph
    totals = _totals(schedule)
    rows = _rows(schedule, totals)
    made, reads = _walk(schedule, totals, rows)
    buffers = {b.name: b for step in made for b in step}
    outputs = tuple(dict.fromkeys(o for o in graph.outputs if o in buffers))
    last = {}
    for k, (step_made, step_reads) in enumerate(zip(made, reads)):
        last.update({b.name: k for b in step_made})
        last.update({n: k for n in step_reads})
    released = _released(buffers, last, outputs)
    reuses = _reuses(buffers, made, released)
    names = (ENTRY, *(s.name for s in schedule.steps))
    dropped = [[] for _ in names]                 # per step: the locals it read (or made) last
    for name in buffers:
        if name not in outputs:
            dropped[last[name]].append(name)
    read = {n for step_reads in reads for n in step_reads}
    reused_by = {root: b for b, root in reuses.items()}
    steps = tuple(StepBuffers(names[k], _allocations(buffers, made[k], reuses),
                              tuple(b.name for b in made[k]), tuple(reads[k]),
                              _frees(k, names[k], dropped[k], buffers, read, released, reused_by))
                  for k in range(len(names)))
    return BufferPlan(buffers, steps, rows, outputs)


# -- what each step makes and reads ----------------------------------------------------------------
def _totals(schedule: Schedule) -> dict:
    """kernel group -> dtype -> the local of its [n, D] totals (a second kernel's of a dtype gets _1)."""
    taken = Counter()
    totals = {}
    for group in schedule.kernels:
        if group.aten_reason is None:
            totals[group.name] = {}
            for dtype in group.totals(schedule.graph):
                name = f"mf_totals_{str(dtype).replace('torch.', '')}"
                totals[group.name][dtype] = name + (f"_{taken[name]}" if taken[name] else "")
                taken[name] += 1
    return totals


def _rows(schedule: Schedule, totals: dict) -> dict:
    """local -> Row. A column sum whose only reader is a reshape step is bound as the reshape's
    value, at its step: the backward's weight grads come as [D] -> [1, 1, D] -> [D], at no cost."""
    graph = schedule.graph
    externs = {s.name for s in schedule.steps if isinstance(s, ExternStep)}
    users = graph.users()
    rows = {}
    for group in schedule.kernels:
        if group.name not in totals:              # a group run through aten returns its sums itself
            continue
        for dtype, names in group.totals(graph).items():
            for j, name in enumerate(names):
                readers = users[name]
                reshaped = len(readers) == 1 and graph[readers[0]].op is Op.VIEW and readers[0] in externs \
                    and name not in graph.outputs
                local = readers[0] if reshaped else name
                rows[local] = Row(totals[group.name][dtype], j * group.space.d, name, local if reshaped else group.name)
    return rows


def _walk(schedule: Schedule, totals: dict, rows: dict) -> tuple:
    """Per plan step (ENTRY, then the schedule's): the Buffers it makes, the names it reads."""
    graph = schedule.graph
    made = [[_buffer(graph, n, Origin.INPUT, {n}, 0) for n in graph.inputs if graph[n].op is Op.INPUT]]
    reads = [[]]
    storage = {b.name: b.storage for b in made[0]}
    for k, step in enumerate(schedule.steps, 1):
        if isinstance(step, KernelGroup):         # a kernel also reads its totals: its rows' lines do
            step_reads = [n for n in step.inputs if n in storage] + list(totals.get(step.name, {}).values())
            step_made = _kernel_made(graph, step, k, totals, rows) if step.aten_reason is None else \
                _aten_group_made(graph, step, k, step_reads, storage)
        else:
            step_reads, step_made = _extern(graph, step.name, k, rows, storage)
        storage.update({b.name: b.storage for b in step_made})
        made.append(step_made)
        reads.append(step_reads)
    return made, reads


def _kernel_made(graph: Graph, group: KernelGroup, k: int, totals: dict, rows: dict) -> list:
    made = [_buffer(graph, n, Origin.OUTPUT, {n}, k) for n in group.outputs]
    for dtype, names in group.totals(graph).items():
        local = totals[group.name][dtype]
        shape = (len(names), group.space.d)
        made.append(Buffer(local, Origin.TOTALS, dtype, shape, _nbytes(dtype, shape), frozenset({local}), k))
    made += [_row(graph, local, row, k) for local, row in rows.items() if row.step == group.name]
    return made


def _aten_group_made(graph: Graph, group: KernelGroup, k: int, reads: list, storage: dict) -> list:
    """A group run through aten returns new tensors, or views of what it read (a VIEW node's)."""
    held = _held(reads, storage)
    return [_buffer(graph, n, Origin.ATEN, {n} | held, k) for n in group.outputs + group.column_sums]


def _extern(graph: Graph, name: str, k: int, rows: dict, storage: dict) -> tuple:
    """(reads, made) of an extern step: an aten call, an element of its tuple, a reshape or cast
    of a finished column sum (a row of the totals, when it is the sum's only reader)."""
    node = graph[name]
    if name in rows:
        return [rows[name].totals], [_row(graph, name, rows[name], k)]
    reads = [n for n in node.inputs if n in storage]
    if node.op is Op.GETITEM:                  # an element: part of its tuple's new storage, or a view of inputs
        call = graph[node.inputs[0]]
        fresh, aliases = _extern_storage(call, node.attr.index)
        held = _held(_aliased_inputs(call, node.attr.index), storage) if aliases else frozenset()
        return reads, [_buffer(graph, name, Origin.ATEN, held | ({call.name} if fresh else set()), k, False)]
    if node.op in (Op.VIEW, Op.CAST):          # `.reshape`, and `.to(dtype)` when the dtype changes
        fresh = graph[node.inputs[0]].value.dtype != node.value.dtype
        return reads, [_buffer(graph, name, Origin.ATEN, {name} if fresh else _held(reads, storage), k, fresh)]
    if node.value.dtype is None:               # a tuple: made with the call, the new storage of its elements
        return reads, [_tuple(graph, node, k, _held(reads, storage))]
    fresh, aliases = _extern_storage(node)
    own = {name} if fresh else set()
    return reads, [_buffer(graph, name, Origin.ATEN, own | (_held(reads, storage) if aliases else set()), k, fresh)]


def _tuple(graph: Graph, node, k: int, inputs_held: frozenset) -> Buffer:
    """An aten call's tuple: it brings the bytes of its elements that alias nothing (allocated by
    the call, while its inputs are still held: counted at its step, not at the getitems' after it)
    and holds its inputs' storage where an element may alias one. Its fresh elements hold its
    storage, which goes when the tuple and all of them have."""
    elements = [u for u in graph.users()[node.name] if graph[u].op is Op.GETITEM]
    fresh = [u for u in elements if _extern_storage(node, graph[u].attr.index)[0]]
    aliases = len(fresh) < len(elements) if elements else _extern_storage(node)[1]
    nbytes = sum((_nbytes(graph[u].value.dtype, graph[u].value.shape) for u in fresh), sympy.Integer(0))
    storage = ({node.name} if fresh else set()) | (inputs_held if aliases else set())
    return Buffer(node.name, Origin.ATEN, None, (), nbytes, frozenset(storage), k)


def _held(names, storage: dict) -> frozenset:
    """The storages any of `names` may hold."""
    return frozenset().union(*(storage[n] for n in names if n in storage))


def _extern_storage(node, element: Optional[int] = None) -> tuple:
    """(whether an aten call's result, or its tuple's `element`, brings new storage, whether it may
    hold its inputs')."""
    if not isinstance(node.attr, Extern):
        return True, True
    target = node.attr.target
    if isinstance(target, TensorConstant):     # the traced function's own tensor: nobody frees it
        return False, False
    if target in ALIASING_CALLS:
        return False, True
    schema = aten_schema(target)
    if schema is not None:
        returns = schema.returns if element is None else schema.returns[element:element + 1]
        aliases = any(r.alias_info is not None for r in returns)
        return not aliases, aliases
    return True, True                          # any other callable: either


def _aliased_inputs(call, element: int) -> list:
    """The inputs of an aten call that its tuple's `element` may hold: those of the arguments its
    schema gives the element's alias set (an in-place op's written argument), else all of them."""
    schema = aten_schema(call.attr.target) if isinstance(call.attr, Extern) else None
    alias = schema.returns[element].alias_info if schema is not None else None
    if alias is None or not isinstance(call.attr.args, tuple):
        return list(call.inputs)
    sets = alias.before_set
    named = [a.name for argument, a in zip(schema.arguments, call.attr.args)
             if isinstance(a, ValueRef) and argument.alias_info is not None and argument.alias_info.before_set & sets]
    return named or list(call.inputs)


def _buffer(graph: Graph, name: str, origin: Origin, storage, k: int, fresh: bool = True) -> Buffer:
    value: Value = graph[name].value
    return Buffer(name, origin, value.dtype, tuple(value.shape), _nbytes(value.dtype, value.shape) if fresh else
                  sympy.Integer(0), frozenset(storage), k)


def _row(graph: Graph, local: str, row: Row, k: int) -> Buffer:
    value = graph[local].value
    return Buffer(local, Origin.ROW, value.dtype, tuple(value.shape), sympy.Integer(0), frozenset({row.totals}), k)


def _nbytes(dtype: Optional[torch.dtype], shape) -> sympy.Expr:
    return sympy.Mul(*shape) * dtype.itemsize if dtype is not None else sympy.Integer(0)


# -- when storage goes, and who takes it ------------------------------------------------------------
def _released(buffers: dict, last: dict, outputs: tuple) -> dict:
    """storage -> the step after which its last holder is dropped; None while a returned value may hold it."""
    holders: dict = {}
    for b in buffers.values():
        for root in b.storage:
            holders.setdefault(root, []).append(b.name)
    kept = set(outputs)
    return {root: None if kept.intersection(names) else max(last[n] for n in names)
            for root, names in holders.items()}


def _reuses(buffers: dict, made: list, released: dict) -> dict:
    """allocation -> the dead allocation whose storage it takes: the same dtype and number of
    elements, released at an earlier step (the last one released first)."""
    dead_after: dict = {}
    for root, k in released.items():
        if k is not None and buffers[root].origin in ALLOCATED:
            dead_after.setdefault(k, []).append(root)
    free: dict = {}                                 # (dtype, elements) -> dead storages, last released last
    reuses = {}
    for k, step_made in enumerate(made):
        for b in step_made:
            stack = free.get(_fits(b)) if b.origin in ALLOCATED else None
            if stack:
                reuses[b.name] = stack.pop()
        for root in dead_after.get(k, ()):
            free.setdefault(_fits(buffers[root]), []).append(root)
    return reuses


def _fits(b: Buffer) -> tuple:
    return b.dtype, sympy.expand(sympy.Mul(*b.shape))


def _allocations(buffers: dict, step_made: list, reuses: dict) -> tuple:
    allocations = []
    for b in step_made:
        if b.origin not in ALLOCATED:
            continue
        taken = reuses.get(b.name)
        what = "column totals" if b.origin is Origin.TOTALS else "output"
        reason = f"{what}: a new {_dtype(b.dtype)} buffer" if taken is None else \
            f"{what}: {taken}'s storage ({taken} is dead; the same {_dtype(b.dtype)} elements)"
        allocations.append(Allocation(b.name, taken, reason))
    return tuple(allocations)


def _frees(k: int, step: str, dropped: list, buffers: dict, read: set, released: dict, reused_by: dict) -> tuple:
    """A Free per local step k reads (or makes) last, in the order they were made; a storage
    released here is listed on the last of them that holds it."""
    holder = {root: n for n in dropped for root in buffers[n].storage if released.get(root) == k}
    return tuple(Free(n, tuple(r for r, h in holder.items() if h == n), reused_by.get(n),
                      f"last read by {step}" if n in read else "never read")
                 for n in dropped)


# -- reading a plan ---------------------------------------------------------------------------------
def memory_timeline(plan: BufferPlan, sizes: dict) -> list:
    """MemoryPoint per step: bytes of storage the program holds at `sizes` (size symbol -> int),
    inputs included (a caller holding them too keeps them longer). A reused storage counts once."""
    def total(names):
        return sum(_at(plan.buffers[n].nbytes, sizes) for n in names)
    return [MemoryPoint(step.name, total(during), total(after))
            for step, (during, after) in zip(plan.steps, held_storages(plan))]


def held_storages(plan: BufferPlan) -> list:
    """Per step: (the storages the program holds while it runs, those it holds after its frees),
    each named by the buffer that brought it; a reused storage keeps its first buffer's name."""
    reuses = {a.buffer: a.reuses for step in plan.steps for a in step.allocations if a.reuses is not None}
    taken = set(reuses.values())
    first: dict = {}
    held: set = set()
    points = []
    for step in plan.steps:
        for name in step.made:
            if name in reuses:
                first[name] = first.get(reuses[name], reuses[name])
            elif plan.buffers[name].nbytes != 0:
                held.add(name)
        during = frozenset(held)
        held -= {first.get(r, r) for f in step.frees for r in f.releases if r not in taken}
        points.append((during, frozenset(held)))
    return points


def _at(expr, sizes: dict) -> int:
    return int(sympy.sympify(expr).subs(sizes))


def format_buffer_plan(plan: BufferPlan, sizes: Optional[dict] = None) -> str:
    """One block per step: what it allocates (or reuses), binds and drops, and why; with `sizes`,
    the bytes held while each step runs and after it."""
    points = {p.step: p for p in memory_timeline(plan, sizes)} if sizes is not None else {}
    lines = []
    for step in plan.steps:
        held = f"  (holds {points[step.name].during} B, then {points[step.name].after} B)" if points else ""
        lines.append(f"  {step.name}{held}")
        for a in step.allocations:
            b = plan.buffers[a.buffer]
            lines.append(f"    allocate {a.buffer}: {_dtype(b.dtype)}{list(b.shape)}, {b.nbytes} B: {a.reason}")
        for name in step.made:
            b = plan.buffers[name]
            if b.origin not in ALLOCATED:
                lines.append(f"    bind {name}: {_made(plan, b)}")
        for f in step.frees:
            kept = f"; kept for {f.reused_by}" if f.reused_by else ""
            lines.append(f"    drop {f.buffer}: {f.reason}{_releases(f)}{kept}")
    lines.append(f"  returns {', '.join(plan.outputs) or 'nothing'}")
    if points:
        peak = max(points.values(), key=lambda p: p.during)
        lines.append(f"  peak: {peak.during} B while {peak.step} runs")
    return "\n".join(lines)


def _made(plan: BufferPlan, b: Buffer) -> str:
    if b.origin is Origin.INPUT:
        return f"input, {_dtype(b.dtype)}{list(b.shape)}, {b.nbytes} B"
    if b.origin is Origin.ROW:
        row = plan.rows[b.name]
        return f"row of {row.totals} at {row.offset}" + (f" (the reshape of {row.value})" if row.value != b.name else "")
    others = sorted(b.storage - {b.name})
    shares = f", may hold the storage of {', '.join(others)}" if others else ""
    return f"aten, {_dtype(b.dtype)}{list(b.shape)}, {b.nbytes} B new{shares}" if b.nbytes != 0 else \
        f"aten, a view{shares}"


def _releases(f: Free) -> str:
    return f" (releases {', '.join(f.releases)})" if f.releases else ""


def _dtype(dtype) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "tuple"


class BufferPlanError(AssertionError):
    pass


@timed("verify")
def verify_buffer_plan(plan: BufferPlan, schedule: Schedule) -> None:
    """Every buffer is made once; every one not returned is dropped exactly once, never before a
    step that reads it (as the schedule says: a group's inputs, an extern's); a returned one never;
    a reuse takes an allocation of the same dtype and elements whose every holder is gone."""
    graph = schedule.graph
    position = {}
    for k, step in enumerate(plan.steps):
        for name in step.made:
            _check(name not in position, f"{name} is made twice", plan)
            position[name] = k
    dropped = {}
    for k, step in enumerate(plan.steps):
        for f in step.frees:
            _check(f.buffer not in dropped, f"{f.buffer} is dropped twice", plan)
            dropped[f.buffer] = k
    for name in plan.buffers:
        _check((name in dropped) != (name in plan.outputs), f"{name}: dropped {name in dropped}, "
               f"returned {name in plan.outputs}", plan)
    for k, step in enumerate(schedule.steps, 1):
        node_inputs = step.inputs if isinstance(step, KernelGroup) else graph[step.name].inputs
        for name in set(node_inputs) | set(plan.steps[k].reads):
            read = plan.rows[step.name].totals if step.name in plan.rows else name
            _check(read not in dropped or dropped[read] >= k, f"{read} is dropped after step "
                   f"{plan.steps[dropped.get(read, 0)].name}, before {plan.steps[k].name} reads it", plan)
    holders = {}
    for b in plan.buffers.values():
        for root in b.storage:
            holders.setdefault(root, []).append(b.name)
    taken = Counter(a.reuses for step in plan.steps for a in step.allocations if a.reuses is not None)
    _check(all(n == 1 for n in taken.values()), f"a storage is taken twice: {taken}", plan)
    for k, step in enumerate(plan.steps):
        for a in step.allocations:
            if a.reuses is not None:
                old, new = plan.buffers[a.reuses], plan.buffers[a.buffer]
                _check(old.origin in ALLOCATED and _fits(old) == _fits(new), f"{a.buffer} cannot take {a.reuses}", plan)
                _check(all(h in dropped and dropped[h] < k for h in holders[a.reuses]),
                       f"{a.buffer} takes {a.reuses} before all of {holders[a.reuses]} are dropped", plan)


def _check(ok: bool, message: str, plan: BufferPlan) -> None:
    if not ok:
        raise BufferPlanError(f"memfuse buffers: {message}\n{format_buffer_plan(plan)}")
