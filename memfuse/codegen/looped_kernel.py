"""Emit a Triton kernel for a KernelGroup whose rows are too long for registers (D past
Config.max_row_length): each row is walked in chunks of BLOCK_D columns, once per pass.

A value's *phase* counts the row reductions (over D) on its way from the inputs: pass p
recomputes, chunk by chunk, whatever the phase-p work needs (from the loads, so nothing but
the outputs is ever written), accumulates the reductions that finish in this pass, and stores
the [M, D] outputs of phase p. Between passes the finished row values are combined in
registers (mean, rstd). LayerNorm's forward is three passes: the sum, the squared deviations
from the mean, then normalize and store. Random values are regenerated in every pass from
the same offsets (row * D + col), so they match the persistent kernel's bit for bit.
Column reductions (over M) add into their program's row of the partials buffer chunk by chunk;
the last program combines the rows into the totals, chunk by chunk (`finish_column_sums`).

Online sums: a row sum of exp(x - max) whose max is a row max of the same x (softmax,
log-softmax, logsumexp, cross-entropy) is accumulated in the max's own pass against the running
max, and rescaled by exp(before - after) whenever the max grows (`OnlineSum`): the max and the
sum of exps finish together, one pass over the row fewer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from memfuse.base.source import Lines
from memfuse.ir.graph import Graph, Kind, Node, Op
from memfuse.ir.ops import ARG_REDUCE, REDUCE, TRITON_DTYPES
from memfuse.schedule.steps import KernelGroup
from memfuse.codegen.kernel_source import KernelSource
from memfuse.codegen.row_kernel import RowKernelWriter

CHUNKED = (Kind.FULL, Kind.COL)      # register kinds that live in a chunk of columns


def _prev_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


@dataclass(frozen=True)
class OnlineSum:
    """A row sum of exp(x - shift) carried in the pass of the row max of x that the shift comes
    from. x <= max, so the terms of a row whose running max is still -inf wait (eager's
    exp(-inf - max) is 0 once the max is finite), and a row of -inf only gets eager's value at the
    end. The shift is the max, or the max with its infinities replaced by a finite constant
    (logsumexp): a zero sum stays zero whichever way the shift moves."""
    sum: str          # the SUM over D
    max: str          # the MAX over D it is carried with
    shift: str        # the row value exp subtracts from x
    chain: tuple      # the row values from the max to the shift: recomputed as the running max grows

    def describe(self) -> str:
        return f"{self.sum} = sum of exp(. - {self.shift}) online with {self.max}"


def online_sums(graph: Graph, group: KernelGroup, kinds: dict) -> tuple:
    """(the OnlineSums of a group, [(sum, why not)] for its other row sums of exp(a - b))."""
    members = set(group.nodes)
    carried, refused = [], []
    for name in group.nodes:
        node = graph[name]
        if node.op is not Op.SUM or node.attr.axis is not Kind.ROW:
            continue
        exp = _skip_views(graph, node.inputs[0])
        sub = _skip_views(graph, graph[exp].inputs[0]) if graph[exp].op is Op.EXP else exp
        if graph[sub].op is not Op.SUB or not {exp, sub} <= members:
            continue
        found = _online_sum(graph, group, kinds, name, (exp, sub))
        if isinstance(found, OnlineSum):
            carried.append(found)
        else:
            refused.append((name, found))
    return carried, refused


def _online_sum(graph: Graph, group: KernelGroup, kinds: dict, name: str, terms: tuple) -> Union[OnlineSum, str]:
    """The OnlineSum of the row sum `name` of exp(sub) (`terms`: the exp and sub nodes), or why not."""
    if any(graph[n].value.dtype != torch.float32 for n in (name, *terms)):
        return "not float32 (eager rounds each exp against the final max)"
    x, shift = graph[terms[1]].inputs
    if kinds.get(shift, graph[shift].value.kind) is not Kind.ROW:
        return f"{shift} is not a row value"
    row_max = _shifted_max(graph, group, shift)
    if row_max is None:
        return f"{shift} is neither a row max over D nor one with its infinities replaced by a finite constant"
    if _skip_views(graph, x) != _skip_views(graph, graph[row_max].inputs[0]):
        return f"{x} is not the tensor {row_max} is the max of"
    chain = _row_chain(graph, group, kinds, shift, row_max)
    if chain is None:
        return f"{shift} depends on row values other than {row_max}"
    return OnlineSum(name, row_max, shift, chain)


def _skip_views(graph: Graph, name: str) -> str:
    while graph[name].op is Op.VIEW:
        name = graph[name].inputs[0]
    return name


def _shifted_max(graph: Graph, group: KernelGroup, shift: str) -> Optional[str]:
    """The row max (a MAX over D of this group) that `shift` is, or replaces with a finite
    constant where it is infinite (logsumexp's where(|max| == inf, 0, max)); None otherwise."""
    root = _skip_views(graph, shift)
    if graph[root].op is Op.WHERE:
        condition, constant, root = (_skip_views(graph, v) for v in graph[root].inputs)
        finite = graph[constant].op is Op.CONSTANT and math.isfinite(graph[constant].attr.value)
        if not (finite and _tests_infinity(graph, condition, root)):
            return None
    node = graph[root]
    if root in group.nodes and node.op is Op.MAX and node.attr.axis is Kind.ROW:
        return root
    return None


def _tests_infinity(graph: Graph, condition: str, value: str) -> bool:
    """Whether `condition` is isinf(value) or |value| == inf."""
    node = graph[condition]
    if node.op is Op.ISINF:
        return _skip_views(graph, node.inputs[0]) == value
    if node.op is not Op.EQ:
        return False
    left, right = (graph[_skip_views(graph, v)] for v in node.inputs)
    return left.op is Op.ABS and _skip_views(graph, left.inputs[0]) == value \
        and right.op is Op.CONSTANT and right.attr.value == float("inf")


def _row_chain(graph: Graph, group: KernelGroup, kinds: dict, shift: str, row_max: str) -> Optional[tuple]:
    """The row values computed here between `row_max` and `shift`, in order; None if one of them
    reads a tile or another row reduction (then the shift is no function of the max alone)."""
    members, chain, stack = set(group.nodes), set(), [shift]
    while stack:
        name = stack.pop()
        if name == row_max or name in chain or name not in members:
            continue          # (values from memory are ready before any pass)
        node = graph[name]
        kind = kinds.get(name, node.value.kind)
        if kind is Kind.SCALAR:
            continue
        if kind is not Kind.ROW or node.op in REDUCE or node.op in ARG_REDUCE:
            return None
        chain.add(name)
        stack.extend(node.inputs)
    return tuple(n for n in group.nodes if n in chain)


class LoopedKernelWriter(RowKernelWriter):
    def __init__(self, graph: Graph, group: KernelGroup, block_d: int, seed_from_memory: bool = False):
        super().__init__(graph, group, seed_from_memory)
        self.block_d = block_d
        self.column_origin = "chunk"
        self.reg_kind = self.register_kinds()
        self.online, self.not_online = online_sums(graph, group, self.reg_kind)
        self.online_of = {o.sum: o for o in self.online}
        self.phase = self.phases()

    # -- static analysis: where each value lives, and in which pass it is ready ----------
    def kind_of(self, name: str) -> Kind:
        return self.reg_kind.get(name, self.graph[name].value.kind)

    def is_row_reduction(self, name: str) -> bool:
        node = self.graph[name]
        return (node.op in REDUCE or node.op in ARG_REDUCE) and node.attr.axis is Kind.ROW

    def is_col_reduction(self, name: str) -> bool:
        return name in self.group.column_sums

    def defined_by_compute(self, name: str) -> bool:
        return not self.is_row_reduction(name)

    def phases(self) -> dict:
        """A row reduction is ready one pass after its inputs; an online sum with its max."""
        phase = {}
        for name in self.group.nodes:
            inputs = max((phase.get(i, 0) for i in self.graph[name].inputs), default=0)
            if name in self.online_of:
                phase[name] = phase[self.online_of[name].max]
            else:
                phase[name] = inputs + 1 if self.is_row_reduction(name) else inputs
        return phase

    def chunk_stores(self, p: int) -> list:
        return [n for n in self.group.outputs if self.graph[n].value.kind in CHUNKED and self.phase[n] == p]

    def accumulated(self, p: int) -> list:
        """Reductions whose inputs are ready in pass p: accumulated during its chunk loop."""
        return [n for n in self.group.nodes if (self.is_row_reduction(n) and self.phase[n] == p + 1)
                or (self.is_col_reduction(n) and self.phase[n] == p)]

    def needed(self, p: int) -> set:
        """Chunk values pass p computes or loads: the closure of its stores and reductions."""
        stack = self.chunk_stores(p) + [self.graph[n].inputs[0] for n in self.accumulated(p)]
        seen = set()
        while stack:
            name = stack.pop()
            if name in seen or self.kind_of(name) not in CHUNKED:
                continue
            seen.add(name)
            if name in self.members:   # (a STRIDED view's root is read in place, not loaded; a padded
                in_place = self.graph[name].op is Op.STRIDED and name not in self.padded   # store's is computed)
                stack.extend(self.graph[name].inputs[in_place:])
        return seen

    def last_pass(self) -> int:
        work = [self.phase[n] for n in self.group.outputs if self.graph[n].value.kind in CHUNKED]
        work += [self.phase[n] - 1 for n in self.group.nodes if self.is_row_reduction(n)]
        work += [self.phase[n] for n in self.group.column_sums]
        return max(work, default=-1)

    # -- the kernel ----------------------------------------------------------------------
    def header(self, out: Lines) -> None:
        g = self.group
        passes = self.last_pass() + 1
        out(f"# {g.name}: {len(g.nodes)} ops over [M, D={self.d}], looped: {passes} pass(es) over each row "
            f"in chunks of {self.block_d} columns, BLOCK_M rows a tile"
            f"{', persistent grid' if self.persistent else ''}")
        out(f"# moves at least {self.bytes_per_row()} bytes per row (every pass re-reads the inputs it needs)")
        for online in self.online:
            out(f"# {online.describe()} (a running max; the sum rescaled by exp(before - after) as it grows)")
        out(f"# ops: {', '.join(self.graph[n].op.value for n in g.nodes)}")

    def walk(self) -> str:
        online = f" ({len(self.online)} sum(s) of exp online)" if self.online else ""
        return (f"[M, {self.d}] looped: {self.last_pass() + 1} pass(es) over each row in chunks of {self.block_d}"
                f"{online}" + (", a persistent grid" if self.persistent else ""))

    def write(self) -> KernelSource:
        source = super().write()
        source.passes = self.last_pass() + 1
        source.online = tuple(o.describe() for o in self.online)
        source.not_online = tuple(self.not_online)
        return source

    def body(self, out: Lines) -> None:
        g = self.group
        out("pid = tl.program_id(0)")
        out("# scalars: loaded once per program")
        for name in g.inputs:
            if self.graph[name].value.kind is Kind.SCALAR:
                self.load(out, name)
        for name in g.nodes:
            if self.kind_of(name) is Kind.SCALAR:
                self.compute(out, name)
                if name in g.outputs and self.graph[name].value.kind is Kind.SCALAR:
                    self.store(out, name)
        if not self.has_rows:
            self.column_pass(out)
            return
        self.tile_walk(out)
        for name in g.inputs:
            if self.graph[name].value.kind is Kind.ROW:
                self.load(out, name)
        for name in g.outputs:   # per-row outputs of scalars (a fill): broadcast stores
            if self.kind_of(name) is Kind.SCALAR and self.graph[name].value.kind is Kind.ROW:
                self.store(out, name)
        for p in range(self.last_pass() + 1):
            self.row_values(out, p)
            self.chunk_pass(out, p)
        self.row_values(out, self.last_pass() + 1)
        if self.persistent:
            out.dedent()
            self.finish_column_sums(out)

    def row_values(self, out: Lines, p: int) -> None:
        """Per-row values of phase p: finished reductions, then what combines them."""
        names = [n for n in self.group.nodes if self.kind_of(n) is Kind.ROW and self.phase[n] == p]
        if names:
            out(f"# row values ready before pass {p}" if p <= self.last_pass() else "# row values after the last pass")
        for name in names:
            if self.is_row_reduction(name):
                self.finish(out, self.graph[name])
            else:
                self.compute(out, name)
            if name in self.group.outputs and self.graph[name].value.kind is Kind.ROW:
                self.store(out, name)

    def chunk_pass(self, out: Lines, p: int) -> None:
        needed = self.needed(p)
        reductions = self.accumulated(p)
        stores = self.chunk_stores(p)
        carried: dict = {}   # row max -> the online sums this pass carries with it
        for o in self.online:
            if o.sum in reductions:
                carried.setdefault(o.max, []).append(o)
        for name in reductions:
            self.start_accumulator(out, self.graph[name])
        for row_max, sums in carried.items():
            self.running_max(out, row_max, sums)
        out(f"# pass {p}: {self.describe_pass(reductions, stores)}")
        out("for chunk in range(0, D, BLOCK_D):")
        out.indent()
        self.chunk_indices(out)
        for name in self.group.inputs:
            if name in needed:
                self.load(out, name)
        for name in self.group.nodes:
            if name in needed and name in self.members:
                self.compute(out, name)
            elif name in reductions:
                for o in carried.get(name, ()):
                    out(f"{self.reg(o.sum)}_shift_before = {self.reg(o.shift)}")
                self.compute(out, name)
                if name in carried:
                    self.running_max(out, name, carried[name])
            if name in stores:
                self.store(out, name)
        out.dedent()

    def running_max(self, out: Lines, row_max: str, sums: list) -> None:
        """The max so far and the shifts it gives the online sums (before the walk: their first values)."""
        self.finish(out, self.graph[row_max])
        for name in self.group.nodes:
            if any(name in o.chain for o in sums):
                self.compute(out, name)

    def describe_pass(self, reductions, stores) -> str:
        parts = []
        if reductions:
            parts.append("accumulate " + ", ".join(
                f"{n} (online: against the running {self.online_of[n].max})" if n in self.online_of else n
                for n in reductions))
        if stores:
            parts.append("store " + ", ".join(stores))
        return "; ".join(parts) or "nothing"

    def chunk_indices(self, out: Lines) -> None:
        out("cols = chunk + tl.arange(0, BLOCK_D)")
        out("col_mask = cols < D")
        if self.has_rows:
            out("mask = row_mask[:, None] & col_mask[None, :]")
            out("offsets = rows[:, None] * D + cols[None, :]")

    def column_pass(self, out: Lines) -> None:
        """A group of column vectors only (no rows): one walk over the chunks."""
        out("for chunk in range(0, D, BLOCK_D):")
        out.indent()
        self.chunk_indices(out)
        for name in self.group.inputs:
            if self.graph[name].value.kind is Kind.COL:
                self.load(out, name)
        for name in self.group.nodes:
            if self.kind_of(name) is not Kind.SCALAR:
                self.compute(out, name)
            if name in self.group.outputs and self.graph[name].value.kind is Kind.COL:
                self.store(out, name)
        out.dedent()

    # -- reductions, one chunk at a time ------------------------------------------------
    def start_accumulator(self, out: Lines, node: Node) -> None:
        target = self.reg(node.name)
        if self.is_col_reduction(node.name):
            return   # partials live in memory: the program's own row of the buffer
        acc, neutral = self.reduce_types(node)
        if node.op in ARG_REDUCE:
            out(f"{target}_best = tl.full([BLOCK_M], float('-inf'), {TRITON_DTYPES[acc]})")
            out(f"{target}_index = tl.zeros([BLOCK_M], tl.int32)")
        else:
            out(f"{target}_acc = tl.full([BLOCK_M], {neutral}, {TRITON_DTYPES[acc]})")

    def reduce(self, out: Lines, node: Node) -> None:
        if node.name in self.online_of:
            self.accumulate_online(out, self.online_of[node.name])
            return
        masked, _, neutral = self.reduce_source(node)
        target = self.reg(node.name)
        if node.op in ARG_REDUCE:
            self.use("mf_arg_best")
            self.use("mf_arg_merge")
            out(f"{target}_chunk_best, {target}_chunk_index = mf_arg_best({masked}, cols)")
            out(f"{target}_best, {target}_index = mf_arg_merge({target}_best, {target}_index, "
                f"{target}_chunk_best, {target}_chunk_index)")
            return
        info = REDUCE[node.op]
        self.use(info.helper)
        if node.attr.axis is Kind.ROW:
            out(f"{target}_acc = {info.combine.format(f'{target}_acc', info.triton.format(masked, 1))}")
            return
        names = self.sums[node.op]
        row = f"pid.to(tl.int64) * {len(names)} + {names.index(node.name)}"
        partial = f"partials_{node.op.value}_ptr + ({row}) * D + cols"
        # the first tile starts from the neutral element: the buffer is never zeroed
        out(f"{target}_prev = tl.load({partial}, mask=col_mask & (step > 0), other={neutral})")
        out(f"tl.store({partial}, {info.combine.format(f'{target}_prev', info.triton.format(masked, 0))}, "
            f"mask=col_mask)")

    def open_finish_columns(self, out: Lines) -> bool:
        """The finish walks the row in chunks of BLOCK_D columns, as the passes do."""
        out("for chunk in range(0, D, BLOCK_D):")
        out.indent()
        out("cols = chunk + tl.arange(0, BLOCK_D)")
        out("col_mask = cols < D")
        return True

    def accumulate_online(self, out: Lines, online: OnlineSum) -> None:
        """The sum so far, restated against the moved shift, plus this chunk's terms; a row whose
        max is still -inf holds only -inf so far: its terms wait."""
        node = self.graph[online.sum]
        target, shift = self.reg(online.sum), self.reg(online.shift)
        terms = self.operand(node.inputs[0], Kind.FULL, torch.float32, node.value.dtype)
        waiting = f"({self.reg(online.max)} != float('-inf'))[:, None]"
        self.use("mf_online_rescale")
        out(f"{target}_acc = mf_online_rescale({target}_acc, {target}_shift_before, {shift}) + "
            f"tl.sum(tl.where(mask & {waiting}, {terms}, 0.0), axis=1)")

    def finish(self, out: Lines, node: Node) -> None:
        target = self.reg(node.name)
        if node.op in ARG_REDUCE:
            out(f"{target} = {target}_index.to(tl.int64)")
        elif node.name in self.online_of:
            online = self.online_of[node.name]
            out(f"# a row of -inf only: eager's sum of exp(-inf - {online.shift}) over D columns")
            out(f"{target} = tl.where({self.reg(online.max)} == float('-inf'), "
                f"D * tl.exp(float('-inf') - {self.reg(online.shift)}), {target}_acc)")
        else:
            out(f"{target} = {target}_acc")
        self.kinds[node.name] = Kind.ROW
        self.scaled_reciprocal(out, node.name)


def loop_block_d(max_row_length: int, loop_block_d: int) -> int:
    """Columns per chunk: a power of two no larger than the persistent limit."""
    return max(1, min(_prev_pow2(max_row_length), _prev_pow2(loop_block_d)))


def write_looped_kernel(graph: Graph, group: KernelGroup, block_d: int, seed_from_memory: bool = False) -> KernelSource:
    return LoopedKernelWriter(graph, group, block_d, seed_from_memory).write()
