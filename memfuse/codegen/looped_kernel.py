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
"""
from __future__ import annotations



from ..ir import Graph, Kind, Node, Op
from ..ops import ARG_REDUCE, REDUCE, TRITON_DTYPES
from ..schedule import KernelGroup
from .row_kernel import KernelSource, RowKernelWriter, _Lines

CHUNKED = (Kind.FULL, Kind.COL)      # register kinds that live in a chunk of columns


def _prev_pow2(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)


class LoopedKernelWriter(RowKernelWriter):
    def __init__(self, graph: Graph, group: KernelGroup, block_d: int, seed_from_memory: bool = False):
        super().__init__(graph, group, seed_from_memory)
        self.block_d = block_d
        self.column_origin = "chunk"
        self.reg_kind = self.register_kinds()
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
        phase = {}
        for name in self.group.nodes:
            inputs = max((phase.get(i, 0) for i in self.graph[name].inputs), default=0)
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
    def header(self, out: _Lines) -> None:
        g = self.group
        passes = self.last_pass() + 1
        out(f"# {g.name}: {len(g.nodes)} ops over [M, D={self.d}], looped: {passes} pass(es) over each row "
            f"in chunks of {self.block_d} columns, BLOCK_M rows a tile"
            f"{', persistent grid' if self.persistent else ''}")
        out(f"# moves at least {self.bytes_per_row()} bytes per row (every pass re-reads the inputs it needs)")
        out(f"# ops: {', '.join(self.graph[n].op.value for n in g.nodes)}")

    def body(self, out: _Lines) -> None:
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

    def row_values(self, out: _Lines, p: int) -> None:
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

    def chunk_pass(self, out: _Lines, p: int) -> None:
        needed = self.needed(p)
        reductions = self.accumulated(p)
        stores = self.chunk_stores(p)
        for name in reductions:
            self.start_accumulator(out, self.graph[name])
        out(f"# pass {p}: {self.describe_pass(needed, reductions, stores)}")
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
                self.compute(out, name)
            if name in stores:
                self.store(out, name)
        out.dedent()

    def describe_pass(self, needed, reductions, stores) -> str:
        parts = []
        if reductions:
            parts.append("accumulate " + ", ".join(reductions))
        if stores:
            parts.append("store " + ", ".join(stores))
        return "; ".join(parts) or "nothing"

    def chunk_indices(self, out: _Lines) -> None:
        out("cols = chunk + tl.arange(0, BLOCK_D)")
        out("col_mask = cols < D")
        if self.has_rows:
            out("mask = row_mask[:, None] & col_mask[None, :]")
            out("offsets = rows[:, None] * D + cols[None, :]")

    def column_pass(self, out: _Lines) -> None:
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
    def start_accumulator(self, out: _Lines, node: Node) -> None:
        target = self.reg(node.name)
        if self.is_col_reduction(node.name):
            return   # partials live in memory: the program's own row of the buffer
        acc, neutral = self.reduce_types(node)
        if node.op in ARG_REDUCE:
            out(f"{target}_best = tl.full([BLOCK_M], float('-inf'), {TRITON_DTYPES[acc]})")
            out(f"{target}_index = tl.zeros([BLOCK_M], tl.int32)")
        else:
            out(f"{target}_acc = tl.full([BLOCK_M], {neutral}, {TRITON_DTYPES[acc]})")

    def reduce(self, out: _Lines, node: Node) -> None:
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

    def open_finish_columns(self, out: _Lines) -> bool:
        """The finish walks the row in chunks of BLOCK_D columns, as the passes do."""
        out("for chunk in range(0, D, BLOCK_D):")
        out.indent()
        out("cols = chunk + tl.arange(0, BLOCK_D)")
        out("col_mask = cols < D")
        return True

    def finish(self, out: _Lines, node: Node) -> None:
        target = self.reg(node.name)
        if node.op in ARG_REDUCE:
            out(f"{target} = {target}_index.to(tl.int64)")
        else:
            out(f"{target} = {target}_acc")
        self.kinds[node.name] = Kind.ROW
        self.scaled_reciprocal(out, node.name)


def loop_block_d(max_row_length: int, loop_block_d: int) -> int:
    """Columns per chunk: a power of two no larger than the persistent limit."""
    return max(1, min(_prev_pow2(max_row_length), _prev_pow2(loop_block_d)))


def write_looped_kernel(graph: Graph, group: KernelGroup, block_d: int, seed_from_memory: bool = False) -> KernelSource:
    return LoopedKernelWriter(graph, group, block_d, seed_from_memory).write()
