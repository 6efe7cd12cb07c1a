"""Emit one Triton kernel for a KernelGroup: rows of an [M, D] space, each row whole in registers.

The kernel walks tiles of BLOCK_M rows x BLOCK_D columns. Column vectors (weights) and scalars
are loaded once per program, before the rows. Reductions over D are `tl.sum(..., axis=1)` in
registers; reductions over M accumulate fp32 partial sums per program in registers, written
once at the end to a [programs, n, D] buffer; the last program to finish combines every
program's partials into the [n, D] totals (`finish_column_sums`), so the kernel is the whole
column sum. Kernels with such partials loop over tiles (a persistent grid); the others take one
tile per program. Every float is computed in fp32 and rounded once, at the store.
"""
from __future__ import annotations

from typing import Optional

import torch

from memfuse.base.source import Lines
from memfuse.codegen.column_sums import ColumnSums
from memfuse.codegen.emit import RESERVED, broadcast, interpreted, literal, next_pow2, register_kind
from memfuse.codegen.kernel_source import KernelSource
from memfuse.codegen.signature import KernelSignature
from memfuse.codegen.strided_reads import StridedReads
from memfuse.ir.graph import Graph, Kind, Node, Op, column_padding
from memfuse.ir.ops import (ARG_REDUCE, DIVIDE_BY_RECIPROCAL, HELPERS, HELPER_GLOBALS, OPS, REDUCE, REDUCERS,
                            SCALED_RECIPROCAL, TRITON_DTYPES, accumulate_dtype, compute_dtype, helpers_for)
from memfuse.schedule.reads import stores_padded
from memfuse.schedule.steps import KernelGroup


class RowKernelWriter(KernelSignature, StridedReads, ColumnSums):
    def __init__(self, graph: Graph, group: KernelGroup, seed_from_memory: bool = False):
        self.graph = graph
        self.group = group
        self.seed_from_memory = seed_from_memory   # the seed is a [1] tensor (CUDA graphs), not a scalar
        self.d = group.space.d
        self.has_rows = group.space.m is not None
        self.block_d = next_pow2(self.d) if self.d else 1
        self.column_origin = "0"     # first column of the block `cols` covers (looped kernels: chunk)
        self.members = set(group.nodes)
        self.names: dict = {}
        self.kinds: dict = {}     # value name -> Kind of its register value
        self.sums = {op: [n for n in group.column_sums if graph[n].op is op] for op in REDUCE}
        self.partials_dtypes = {op: max((accumulate_dtype(graph[n].value.dtype) for n in names), key=lambda t: t.itemsize)
                                for op, names in self.sums.items() if names}
        self.totals = group.totals(graph)   # dtype -> column values of that dtype: the rows of one [n, D] output
        self.summed = {casts[-1]: total for total, casts in group.column_casts.items()}   # a last cast -> its sum
        self.persistent = bool(group.column_sums)
        self.helpers: list = []   # HELPERS entries the kernel calls
        # zero paddings of values this kernel computes (a matmul operand): value -> its padded row length
        self.padded = {n: column_padding(graph, graph[n]) for n in group.nodes
                       if stores_padded(graph, graph[n], self.members)}
        # tensors that STRIDED views read in place -> a read's Strided attr (it says how the root is laid out)
        self.roots = {graph[n].inputs[0]: graph[n].attr for n in group.nodes
                      if graph[n].op is Op.STRIDED and n not in self.padded}
        plain = {i for n in group.nodes for i in graph[n].inputs[graph[n].op is Op.STRIDED:]}
        self.roots_only = set(self.roots) - plain - set(group.outputs)   # never loaded as [M, D]
        self.divisors = self.scaled_divisors()   # value -> (kind, dtype) it divides: each gets a scaled reciprocal
        self.reciprocals: dict = {}   # divisor -> the fp32 expression its reciprocal registers were computed from
        # the first random stream the kernel draws from, passed at launch (an argument, not a literal: a
        # model's layers draw from other streams with the same code, and share one binary)
        self.stream_base = min((graph[n].attr.stream for n in group.nodes if graph[n].op is Op.RAND), default=None)

    def use(self, helper: Optional[str]) -> None:
        if helper is not None and helper not in self.helpers:
            self.helpers.append(helper)

    # -- names and shapes ----------------------------------------------------------------
    def reg(self, name: str) -> str:
        if name not in self.names:
            self.names[name] = f"{name}_v" if name in RESERVED else name
        return self.names[name]

    def operand(self, name: str, want: Kind, cast_to: Optional[torch.dtype],
                consumer: Optional[torch.dtype] = None) -> str:
        """The register expression of `name`, broadcast to `want` and cast to `cast_to`. A bf16 or
        fp16 value computed here (held in fp32) is first rounded to its dtype when the consumer's
        result has another dtype: eager materializes it there (x_bf16 * y).float())."""
        node = self.graph[name]
        if node.op is Op.CONSTANT:
            text = literal(node.attr.value)
            if cast_to is not None and cast_to.is_floating_point and not isinstance(node.attr.value, float):
                text = f"{float(node.attr.value)!r}"
            return text
        text = self.reg(name)
        kind = self.kinds[name]
        if consumer is not None and consumer != node.value.dtype and name in self.members \
                and node.value.dtype in (torch.float16, torch.bfloat16):
            text = f"{self.narrow(text, node.value.dtype)}.to(tl.float32)"
        text = broadcast(text, kind, want)
        have = compute_dtype(node.value.dtype) if node.value.dtype is not None else None
        if cast_to is not None and have is not None and have != cast_to:
            text = f"{text}.to({TRITON_DTYPES[cast_to]})"
        return text

    def tensor_operand(self, name: str, text: str, cast_to: Optional[torch.dtype]) -> str:
        node = self.graph[name]
        if node.op is not Op.CONSTANT:
            return text
        dtype = cast_to or compute_dtype(node.value.dtype)
        return f"tl.full([], {text}, {TRITON_DTYPES[dtype]})"

    def register_kinds(self) -> dict:
        """Each node's register kind, before any code is written: a broadcast (expand) of a row
        value stays a [BLOCK_M] register, read as `[:, None]` where a tile needs it."""
        kinds = {}
        for name in self.group.nodes:
            node = self.graph[name]
            if node.op is Op.RAND:
                kinds[name] = Kind.FULL
            elif node.op is Op.IOTA:
                kinds[name] = Kind.COL
            elif node.op is Op.STRIDED:
                kinds[name] = node.value.kind
            elif node.op in REDUCE or node.op in ARG_REDUCE:
                kinds[name] = node.attr.axis
            else:
                kinds[name] = register_kind([kinds.get(i, self.graph[i].value.kind) for i in node.inputs])
        return kinds

    def scaled_divisors(self) -> dict:
        """The values that divide fp32 values of more elements in this kernel (a row's norm
        dividing its row's tile), each with the kind and dtype of its widest such quotient: their
        reciprocals are computed once, where they are defined (ops.SCALED_RECIPROCAL)."""
        kinds = self.register_kinds()
        divisors = {}
        for name in self.group.nodes:
            node = self.graph[name]
            if node.op is not Op.DIV or compute_dtype(node.value.dtype) != torch.float32:
                continue
            divisor = self.copied_register(node.inputs[1])
            have = kinds.get(divisor, self.graph[divisor].value.kind)
            if self.graph[divisor].op is Op.CONSTANT or have in (Kind.FULL, kinds[name]):
                continue   # a literal, or a divisor of the result's shape: a division per element either way
            widest = divisors.get(divisor)
            if widest is None or (kinds[name] is Kind.FULL and widest[0] is not Kind.FULL):
                divisors[divisor] = (kinds[name], node.value.dtype)
        return divisors

    def copied_register(self, name: str) -> str:
        """The value whose register `name`'s only copies (views here that keep the dtype, as an
        autograd alias or an expand of a row value): one reciprocal serves both."""
        while name in self.members and self.graph[name].op is Op.VIEW:
            source = self.graph[name].inputs[0]
            if self.graph[source].op is Op.CONSTANT or self.graph[source].value.dtype != self.graph[name].value.dtype:
                break
            name = source
        return name

    # -- the kernel ----------------------------------------------------------------------
    def write(self) -> KernelSource:
        g = self.group
        args = self.signature_args()
        body = Lines(depth=1)
        self.body(body)
        out = Lines()
        out("import triton")
        out("import triton.language as tl")
        out()
        self.write_helpers(out)
        out()
        self.header(out)
        scalars = [a.name for a in args if a.role in ("scalar", "stream_base", "stride", "rows", "tiles")]
        out(f"@triton.jit(do_not_specialize={scalars!r})")
        out(f"def {g.name}(")
        with out.indented():
            for a in args:   # strides are int64: a coefficient x stride product may pass 2**31
                out(f"{a.name}{': tl.int64' if a.role == 'stride' else ''},{self.describe(a)}")
            out("D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,")
        out("):")
        out.extend(body)
        constexprs = {"D": self.d or 1, "BLOCK_D": self.block_d}   # BLOCK_M: the launch config's
        return KernelSource(g.name, out.text(), args, constexprs, self.persistent,
                            {op: names for op, names in self.sums.items() if names}, self.partials_dtypes,
                            self.totals, self.bytes_per_row(), self.bytes_per_launch(), self.summary())

    def write_helpers(self, out: Lines) -> None:
        needed = helpers_for(self.helpers)
        globals_needed = [line for name in needed for line in HELPER_GLOBALS.get(name, ())]
        if globals_needed:
            out()
            for line in dict.fromkeys(globals_needed):
                out(line)
        for name in needed:
            out()
            out("@triton.jit")
            for line in HELPERS[name][0].splitlines():
                out(line)
            out()

    def walk(self) -> str:
        """How the kernel walks its rows (looped kernels say their passes)."""
        space = f"[M, {self.d}] rows whole" if self.d else "[M] elements"
        order = f", rows in order {self.group.row_order}" if self.group.row_order else ""
        return f"{space}{order}, " + ("a persistent grid" if self.persistent else "one tile per program")

    def header(self, out: Lines) -> None:
        g = self.group
        out(f"# {g.name}: {len(g.nodes)} ops over [M, D={self.d}] "
            f"({'persistent grid, ' if self.persistent else ''}tiles of BLOCK_M rows x {self.block_d} columns)")
        out(f"# moves {self.bytes_per_row()} bytes per row (reads + writes of [M, D] and [M] tensors)")
        if g.row_order:
            out(f"# rows run in order {g.row_order} of the leading dims, as they lie in memory (memfuse.schedule.row_order): "
                f"its [M, D] outputs are written in that layout")
        out(f"# ops: {', '.join(self.graph[n].op.value for n in g.nodes)}")

    def body(self, out: Lines) -> None:
        g = self.group
        out("pid = tl.program_id(0)")
        if self.d:
            out("cols = tl.arange(0, BLOCK_D)")
            out("col_mask = cols < D")
        before = [n for n in g.inputs if self.graph[n].value.kind in (Kind.COL, Kind.SCALAR)]
        row_nodes = [n for n in g.nodes if self.graph[n].value.kind in (Kind.FULL, Kind.ROW)
                     or n in g.column_sums]
        col_nodes = [n for n in g.nodes if n not in row_nodes]
        out("# column vectors and scalars: loaded once per program")
        for name in before:
            self.load(out, name)
        for name in col_nodes:
            self.compute(out, name)
            if name in g.outputs:
                self.store(out, name)
        if not self.has_rows:
            return
        for op, names in self.sums.items():
            for name in names:
                acc = TRITON_DTYPES[accumulate_dtype(self.graph[name].value.dtype)]
                out(f"{self.reg(name)}_acc = tl.full([BLOCK_D], {REDUCERS[op][1]}, {acc})")
        self.tile_walk(out)
        if self.d:
            out("mask = row_mask[:, None] & col_mask[None, :]")
            out("offsets = rows.to(tl.int64)[:, None] * D + cols[None, :]")
        out("# rows: load, compute, store")
        for name in g.inputs:
            if self.graph[name].value.kind in (Kind.FULL, Kind.ROW):
                self.load(out, name)
        for name in row_nodes:
            self.compute(out, name)
            if name in g.outputs:
                self.store(out, name)
        if self.persistent:
            out.dedent()
            out("# partials over M: one row of D per program and reduction")
            for op, names in self.sums.items():
                for j, name in enumerate(names):
                    out(f"tl.store(partials_{op.value}_ptr + (pid.to(tl.int64) * {len(names)} + {j}) * D + cols, "
                        f"{self.reg(name)}_acc, mask=col_mask)")
            self.finish_column_sums(out)

    def tile_walk(self, out: Lines) -> None:
        """Open the walk over row tiles: a loop on a persistent grid (closed by the caller's
        dedent), else one tile per program; then the tile's row indices. The loop is software
        pipelined NUM_STAGES deep (a launch choice): the next tiles' loads are in flight while
        this one computes."""
        if self.persistent:
            out("num_programs = tl.num_programs(0)")
            out("for step in tl.range(0, tiles_per_program, num_stages=NUM_STAGES):")
            out.indent()
            out("tile = pid + step * num_programs")
        else:
            out("tile = pid")
        out("rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)")   # int64: M may pass 2**31
        out("row_mask = rows < M")

    def load(self, out: Lines, name: str) -> None:
        self.load_register(out, name)
        self.scaled_reciprocal(out, name)

    def load_register(self, out: Lines, name: str) -> None:
        node = self.graph[name]
        kind = node.value.kind
        self.kinds[name] = kind
        if node.op is Op.SEED and self.seed_from_memory:
            out(f"{self.reg(name)} = tl.load({name}_ptr)")
            return
        if node.op in (Op.CONSTANT, Op.SYMBOL, Op.SEED) or name in self.roots_only:
            return
        cast = compute_dtype(node.value.dtype)
        to = "" if node.value.dtype == torch.bool else f".to({TRITON_DTYPES[cast]})"
        ptr = f"{name}_ptr"
        if kind is Kind.FULL:
            out(f"{self.reg(name)} = tl.load({ptr} + offsets, mask=mask, other=0){to}")
        elif kind is Kind.ROW:
            out(f"{self.reg(name)} = tl.load({ptr} + rows, mask=row_mask, other=0){to}")
        elif kind is Kind.COL:
            out(f"{self.reg(name)} = tl.load({ptr} + cols, mask=col_mask, other=0){to}")
        else:
            out(f"{self.reg(name)} = tl.load({ptr}){to}")

    def compute(self, out: Lines, name: str) -> None:
        node = self.graph[name]
        target = self.reg(name)
        out_dtype = compute_dtype(node.value.dtype)
        shape = register_kind([self.kinds[i] for i in node.inputs if i in self.kinds])
        if node.op is Op.VIEW and self.graph[node.inputs[0]].op is Op.CONSTANT:   # a fill: a tensor, not a literal
            out(f"{target} = tl.full([], {self.operand(node.inputs[0], shape, out_dtype)}, {TRITON_DTYPES[out_dtype]})")
        elif node.op is Op.VIEW:
            out(f"{target} = {self.operand(node.inputs[0], shape, out_dtype)}")
        elif node.op is Op.CAST:
            out(f"{target} = {self.cast(node, shape)}")
        elif node.op is Op.IOTA:
            shape = Kind.COL
            out(f"{target} = cols.to(tl.int64)")
        elif name in self.padded:   # the columns past D are zeros (whatever masked loads made of them)
            shape = Kind.FULL
            out(f"# {name}: {node.inputs[0]} with zero columns up to {self.padded[name]} (a matmul operand)")
            out(f"{target} = tl.where(col_mask[None, :], {self.operand(node.inputs[0], shape, out_dtype)}, 0)")
        elif node.op is Op.STRIDED:
            shape = node.value.kind
            self.strided(out, node)
        elif node.op is Op.RAND:
            shape = Kind.FULL
            self.rand(out, node)
        elif node.op in REDUCE or node.op in ARG_REDUCE:
            shape = node.attr.axis
            self.reduce(out, node)
        elif node.op is Op.WHERE:
            condition = self.operand(node.inputs[0], shape, None)
            branches = [self.operand(i, shape, out_dtype, node.value.dtype) for i in node.inputs[1:]]
            out(f"{target} = {OPS[node.op].triton.format(condition, *branches)}")
        else:   # operands in the result's compute dtype (ints too: uint8 + int8 is int16)
            cast_to = None if out_dtype == torch.bool else out_dtype
            operands = [self.operand(i, shape, cast_to, node.value.dtype) for i in node.inputs]
            if OPS[node.op].helper is not None:   # helpers take tensors, not Python numbers
                operands = [self.tensor_operand(i, text, cast_to) for i, text in zip(node.inputs, operands)]
                self.use(OPS[node.op].helper)
            scaled = self.divide_by_reciprocal(node, shape, operands[0])
            out(f"{target} = {scaled or OPS[node.op].triton.format(*operands)}")
        self.kinds[name] = shape
        if self.defined_by_compute(name):
            self.scaled_reciprocal(out, name)

    def defined_by_compute(self, name: str) -> bool:
        """Whether compute() leaves `name`'s register defined (in a looped kernel it only
        accumulates a row reduction, which `finish` defines between passes)."""
        return True

    def scaled_reciprocal(self, out: Lines, name: str) -> None:
        """Right after a divisor is defined (in its scope: once per program for column vectors
        and scalars, once per tile for row values): its reciprocal, as two registers."""
        kind = self.kinds.get(name)
        if name not in self.divisors or kind is Kind.FULL:
            return
        divided, dtype = self.divisors[name]
        text = self.operand(name, kind, torch.float32, dtype)   # as that quotient reads it (a bf16 value rounded)
        v = self.reg(name)
        divided = {Kind.FULL: "[BLOCK_M, BLOCK_D] tiles", Kind.ROW: "rows", Kind.COL: "columns"}[divided]
        once = {Kind.ROW: "once per row", Kind.COL: "once per column", Kind.SCALAR: "once"}[kind]
        self.use(SCALED_RECIPROCAL)
        out(f"# {name} divides {divided}: its reciprocal {once}, so each element pays two multiplies, not a division")
        out(f"{v}_reciprocal, {v}_scale = {SCALED_RECIPROCAL}({text})")
        self.reciprocals[name] = text

    def divide_by_reciprocal(self, node: Node, shape: Kind, dividend: str) -> Optional[str]:
        """`dividend / divisor` as two multiplies by the divisor's scaled reciprocal, where the
        divisor has one (in fp32, of fewer elements than the result); None otherwise."""
        divisor = self.copied_register(node.inputs[1]) if node.op is Op.DIV else None
        if divisor not in self.reciprocals or compute_dtype(node.value.dtype) != torch.float32:
            return None
        kind = self.kinds[divisor]
        if kind is shape or self.operand(divisor, kind, torch.float32, node.value.dtype) != self.reciprocals[divisor]:
            return None   # (a bf16 divisor that eager rounds first, for a result of another dtype)
        v = self.reg(divisor)
        return DIVIDE_BY_RECIPROCAL.format(dividend, broadcast(f"{v}_reciprocal", kind, shape),
                                           broadcast(f"{v}_scale", kind, shape))

    def rand(self, out: Lines, node: Node) -> None:
        """Uniform [0, 1) per element, a pure function of (seed, row * D + col): the backward
        regenerates exactly the forward's values. Philox yields four numbers per call, so each
        call serves four neighbouring columns when D allows (a quarter of the arithmetic)."""
        target = self.reg(node.name)
        past_base = node.attr.stream - self.stream_base
        seed = f"{self.reg(node.inputs[0])} + stream_base" + (f" + {past_base}" if past_base else "")
        if self.d % 4 or self.block_d < 4:
            out(f"{target} = tl.rand({seed}, offsets)")
            return
        out("# one philox call per 4 neighbouring elements")
        quads = "tl.arange(0, BLOCK_D // 4)" if self.column_origin == "0" else \
            f"({self.column_origin} // 4 + tl.arange(0, BLOCK_D // 4))"
        out(f"{target}_quads = rows.to(tl.int64)[:, None] * (D // 4) + {quads}[None, :]")
        out(f"{target}_0, {target}_1, {target}_2, {target}_3 = tl.rand4x({seed}, {target}_quads)")
        out(f"{target} = tl.reshape(tl.join(tl.join({target}_0, {target}_1), tl.join({target}_2, {target}_3)), "
            f"[BLOCK_M, BLOCK_D])")

    def cast(self, node: Node, shape: Kind) -> str:
        src = node.inputs[0]
        target = node.attr.dtype
        if self.graph[src].op is Op.CONSTANT:    # a literal is no tensor to call .to on (`8.to(...)`)
            text = self.tensor_operand(src, self.operand(src, shape, None, None), None)
        else:
            text = self.operand(src, shape, None, target)
        if target == torch.bool:
            return f"({text} != 0)"
        if target in (torch.float16, torch.bfloat16):
            if compute_dtype(self.graph[src].value.dtype) != torch.float32:   # ints, bools, fp64
                text = f"{text}.to(tl.float32)"
            return f"{self.narrow(text, target)}.to(tl.float32)"
        return f"{text}.to({TRITON_DTYPES[compute_dtype(target)]})"

    def narrow(self, text: str, dtype: torch.dtype) -> str:
        """`text` (fp32) converted to `dtype`, rounding to nearest even as the GPU does."""
        if dtype == torch.bfloat16 and interpreted():
            self.use("mf_rne_bf16")
            return f"mf_rne_bf16({text}).to(tl.bfloat16)"
        return f"{text}.to({TRITON_DTYPES[dtype]})"

    def store(self, out: Lines, name: str) -> None:
        node = self.graph[name]
        kind = node.value.kind
        value = self.reg(name)
        value = f"({value} != 0)" if node.value.dtype == torch.bool else self.narrow(value, node.value.dtype)
        if self.kinds[name] is not kind:   # a broadcast (expand) that was never materialized
            block = {Kind.FULL: "[BLOCK_M, BLOCK_D]", Kind.ROW: "[BLOCK_M]", Kind.COL: "[BLOCK_D]"}[kind]
            value = self.narrow(f"tl.broadcast_to({self.operand(name, kind, None)}, {block})", node.value.dtype)
        ptr = f"{name}_ptr"
        if name in self.padded:    # rows of the padded length, its columns past D included
            padded = self.padded[name]
            out(f"tl.store({ptr} + rows.to(tl.int64)[:, None] * {padded} + cols[None, :], {value}, "
                f"mask=row_mask[:, None] & (cols < {padded})[None, :])")
        elif kind is Kind.FULL:
            out(f"tl.store({ptr} + offsets, {value}, mask=mask)")
        elif kind is Kind.ROW:
            out(f"tl.store({ptr} + rows, {value}, mask=row_mask)")
        elif kind is Kind.COL:   # every program holds the same values: identical writes
            out(f"tl.store({ptr} + cols, {value}, mask=col_mask)")
        else:
            out(f"tl.store({ptr}, {value})")


def write_row_kernel(graph: Graph, group: KernelGroup, seed_from_memory: bool = False) -> KernelSource:
    return RowKernelWriter(graph, group, seed_from_memory).write()
