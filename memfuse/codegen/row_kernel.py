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

import os
from dataclasses import dataclass, field
from typing import Optional

import torch

from memfuse.ir.graph import Graph, Kind, Node, Op, ValueRef, column_padding
from memfuse.ir.ops import (ARG_REDUCE, DIVIDE_BY_RECIPROCAL, HELPER_GLOBALS, HELPERS, OPS, REDUCE, REDUCERS, SCALED_RECIPROCAL,
                   TRITON_DTYPES, accumulate_dtype, compute_dtype, helpers_for)
from memfuse.schedule.reads import stores_padded
from memfuse.schedule.steps import KernelGroup

RESERVED = {"pid", "num_programs", "cols", "col_mask", "rows", "row_mask", "mask", "offsets",
            "tile", "step", "tl", "triton", "M", "D", "BLOCK_M", "BLOCK_D", "seed", "tiles_per_program",
            "float", "range", "int", "partials", "partials_max", "partials_min",
            "ticket", "first", "programs", "partials_mask", "done", "stream_base"}


@dataclass(frozen=True)
class Arg:
    """One kernel argument, in launch order."""
    name: str                 # parameter name in the kernel
    role: str                 # "read", "in_place", "stride", "write", "scalar", "stream_base", "totals",
    #                           "partials", "counter", "rows", "tiles"
    value: Optional[str] = None   # the graph value it carries (tensor or scalar args)
    dim: Optional[int] = None     # "stride": which dim of the value
    constant: Optional[int] = None   # "stream_base": the int every launch passes


@dataclass
class KernelSource:
    name: str
    source: str
    args: list                                    # Arg, in order (constexprs excluded)
    constexprs: dict                              # D, BLOCK_D (BLOCK_M, NUM_STAGES come with the launch)
    persistent: bool                              # loops over tiles with a fixed grid
    column_sums: dict = field(default_factory=dict)   # reducer op -> [value names] in partial order
    partials_dtypes: dict = field(default_factory=dict)   # reducer op -> dtype of its partials buffer
    totals: dict = field(default_factory=dict)    # dtype -> [column-sum names], the rows of one [n, D] tensor
    bytes_per_row: int = 0                        # bytes moved per row (both directions)
    bytes_per_launch: int = 0                     # bytes moved once a launch: column vectors, scalars, totals
    summary: str = ""                             # what the kernel is, in one line (benchmarks/kernel_sol.py)
    passes: Optional[int] = None                  # looped kernels: walks over each row (one per phase)
    online: tuple = ()                            # looped kernels: the sums of exp carried with their max
    not_online: tuple = ()                        # looped kernels: (sum, why) for the sums of exp that are not


class _Lines:
    def __init__(self):
        self.lines, self.depth = [], 0

    def __call__(self, text: str = ""):
        self.lines.append("    " * self.depth + text if text else "")

    def indent(self):
        self.depth += 1

    def dedent(self):
        self.depth -= 1


def _interpreted() -> bool:
    """Kernels for Triton's CPU interpreter, whose fp32 -> bf16 conversion truncates."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _literal(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if value != value:
            return "float('nan')"
        if value in (float("inf"), float("-inf")):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    return str(value)


class RowKernelWriter:
    def __init__(self, graph: Graph, group: KernelGroup, seed_from_memory: bool = False):
        self.graph = graph
        self.group = group
        self.seed_from_memory = seed_from_memory   # the seed is a [1] tensor (CUDA graphs), not a scalar
        self.d = group.space.d
        self.has_rows = group.space.m is not None
        self.block_d = _next_pow2(self.d) if self.d else 1
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
            text = _literal(node.attr.value)
            if cast_to is not None and cast_to.is_floating_point and not isinstance(node.attr.value, float):
                text = f"{float(node.attr.value)!r}"
            return text
        text = self.reg(name)
        kind = self.kinds[name]
        if consumer is not None and consumer != node.value.dtype and name in self.members \
                and node.value.dtype in (torch.float16, torch.bfloat16):
            text = f"{self.narrow(text, node.value.dtype)}.to(tl.float32)"
        text = _broadcast(text, kind, want)
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
                kinds[name] = _register_kind([kinds.get(i, self.graph[i].value.kind) for i in node.inputs])
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
        body = _Lines()
        body.indent()
        self.body(body)
        out = _Lines()
        out("import triton")
        out("import triton.language as tl")
        out()
        self.write_helpers(out)
        out()
        self.header(out)
        scalars = [a.name for a in args if a.role in ("scalar", "stream_base", "stride", "rows", "tiles")]
        out(f"@triton.jit(do_not_specialize={scalars!r})")
        out(f"def {g.name}(")
        out.indent()
        for a in args:   # strides are int64: a coefficient x stride product may pass 2**31
            out(f"{a.name}{': tl.int64' if a.role == 'stride' else ''},{self.describe(a)}")
        out("D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,")
        out.dedent()
        out("):")
        out.lines.extend(body.lines)
        constexprs = {"D": self.d or 1, "BLOCK_D": self.block_d}   # BLOCK_M: the launch config's
        return KernelSource(g.name, "\n".join(out.lines) + "\n", args, constexprs, self.persistent,
                            {op: names for op, names in self.sums.items() if names}, self.partials_dtypes,
                            self.totals, self.bytes_per_row(), self.bytes_per_launch(), self.summary())

    def write_helpers(self, out: _Lines) -> None:
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

    def signature_args(self) -> list:
        args = []
        for name in self.group.inputs:
            node = self.graph[name]
            if node.op is Op.CONSTANT:
                continue
            if node.op is Op.SEED and self.seed_from_memory:
                args.append(Arg(f"{name}_ptr", "read", name))
            elif node.op in (Op.SYMBOL, Op.SEED):
                args.append(Arg(self.reg(name), "scalar", name))
            else:
                in_place = name in self.roots and not self.roots[name].contiguous_root
                args.append(Arg(f"{name}_ptr", "in_place" if in_place else "read", name))
            if node.op is Op.SEED and self.stream_base is not None:
                args.append(Arg("stream_base", "stream_base", constant=self.stream_base))
        for root, layout in self.roots.items():   # strides of the tensors read in place
            dims = len(self.graph[root].value.shape) - layout.last_stride_one   # (a last stride of 1 is no argument)
            args.extend(Arg(f"{root}_stride{j}", "stride", root, j) for j in range(dims))
        for name in self.group.outputs:
            args.append(Arg(f"{name}_ptr", "write", name))
        for dtype in self.totals:
            args.append(Arg(f"totals_{dtype_name(dtype)}_ptr", "totals", dtype_name(dtype)))
        for op, names in self.sums.items():
            if names:
                args.append(Arg(f"partials_{op.value}_ptr", "partials", op.value))
        if self.group.column_sums:
            args.append(Arg("done_ptr", "counter"))
        if self.has_rows:
            args.append(Arg("M", "rows"))
            if self.persistent:
                args.append(Arg("tiles_per_program", "tiles"))
        return args

    def describe(self, arg: Arg) -> str:
        if arg.role == "read" and self.graph[arg.value].op is Op.SEED:
            return "  # [1] int64 dropout seed, read from memory: a CUDA-graph replay advances it"
        if arg.role in ("read", "write", "in_place"):
            v = self.graph[arg.value].value
            shape = {Kind.FULL: "[M, D]", Kind.ROW: "[M]", Kind.COL: "[D]", Kind.SCALAR: "[1]"}.get(
                v.kind, f"[{len(v.shape)} dims]")
            what = {"read": "input", "write": "output", "in_place": "input, read by its own strides"}[arg.role]
            if arg.value in self.padded:
                shape, what = f"[M, {self.padded[arg.value]}]", "output, its columns past D zeros (a matmul operand)"
            if arg.value in self.roots_only and arg.role == "read":
                what += " read in place (views)"
            return f"  # {shape} {str(v.dtype).replace('torch.', '')} {what}"
        if arg.role == "stride":
            return f"  # elements between neighbours along dim {arg.dim} of {arg.value} (per call)"
        if arg.role == "totals":
            names = self.totals[getattr(torch, arg.value)]
            return f"  # [{len(names)}, D] {arg.value} column totals over M ({', '.join(names)}), by the last program"
        if arg.role == "partials":
            dtype = dtype_name(self.partials_dtypes[Op(arg.value)])
            return f"  # [programs, n, D] {dtype} partial {arg.value}s over M, one row of D per program and value"
        if arg.role == "counter":
            return "  # int32 tickets: [0] groups finished, [1 + g] programs of group g done; reset to 0"
        if arg.role == "scalar":
            return "  # per-call scalar"
        if arg.role == "stream_base":
            return f"  # the first random stream drawn here ({arg.constant}): streams are seed + stream_base + k"
        if arg.role == "rows":
            return "  # rows: a runtime value, so one kernel serves every batch size"
        return "  # tiles each program walks"

    def bytes_per_row(self) -> int:
        total = 0
        viewed = [n for n in self.group.nodes if self.graph[n].op is Op.STRIDED]
        for name in self.group.inputs + self.group.outputs + viewed:
            v = self.graph[name].value
            if v.dtype is None or self.graph[name].op in (Op.CONSTANT, Op.SYMBOL, Op.SEED) \
                    or name in self.roots_only:
                continue
            per_row = {Kind.FULL: self.d or 1, Kind.ROW: 1}.get(v.kind, 0)
            total += per_row * v.dtype.itemsize
        return total

    def bytes_per_launch(self) -> int:
        """Bytes a launch moves whatever M is: column vectors and scalars read or written once, and
        the column sums' totals (their fp32 partials are traffic on top: runtime.LaunchRecord)."""
        total = 0
        for name in self.group.inputs + self.group.outputs + self.group.column_sums:
            v = self.graph[name].value
            if v.dtype is None or self.graph[name].op in (Op.CONSTANT, Op.SYMBOL, Op.SEED) \
                    or v.kind not in (Kind.COL, Kind.SCALAR):
                continue
            total += ((self.d or 1) if v.kind is Kind.COL else 1) * v.dtype.itemsize
        return total

    def summary(self) -> str:
        """One line on what the kernel is: its walk over rows, its reductions, what it reads and writes
        (by kind and dtype), its ops by count."""
        g, graph = self.group, self.graph
        parts = [self.walk()]
        reductions = [f"{graph[n].op.value} over {'D' if graph[n].attr.axis is Kind.ROW else 'M'}"
                      for n in g.nodes if graph[n].op in REDUCE or graph[n].op in ARG_REDUCE]
        if reductions:
            parts.append("reduces " + ", ".join(_counted(reductions)))
        strided = [n for n in g.nodes if graph[n].op is Op.STRIDED and n not in self.padded]
        if strided:
            parts.append(f"{len(strided)} read(s) through access maps")
        for verb, names in (("reads", g.inputs), ("writes", g.outputs)):
            shapes = [f"{_SHAPES[graph[n].value.kind]} {dtype_name(graph[n].value.dtype)}" for n in names
                      if graph[n].op not in (Op.CONSTANT, Op.SYMBOL, Op.SEED) and graph[n].value.dtype is not None]
            if shapes:
                parts.append(f"{verb} " + ", ".join(_counted(shapes)))
        parts.append(f"{len(g.nodes)} ops: " + ", ".join(_counted([graph[n].op.value for n in g.nodes])))
        return "; ".join(parts)

    def walk(self) -> str:
        """How the kernel walks its rows (looped kernels say their passes)."""
        space = f"[M, {self.d}] rows whole" if self.d else "[M] elements"
        order = f", rows in order {self.group.row_order}" if self.group.row_order else ""
        return f"{space}{order}, " + ("a persistent grid" if self.persistent else "one tile per program")

    def header(self, out: _Lines) -> None:
        g = self.group
        out(f"# {g.name}: {len(g.nodes)} ops over [M, D={self.d}] "
            f"({'persistent grid, ' if self.persistent else ''}tiles of BLOCK_M rows x {self.block_d} columns)")
        out(f"# moves {self.bytes_per_row()} bytes per row (reads + writes of [M, D] and [M] tensors)")
        if g.row_order:
            out(f"# rows run in order {g.row_order} of the leading dims, as they lie in memory (memfuse.schedule.row_order): "
                f"its [M, D] outputs are written in that layout")
        out(f"# ops: {', '.join(self.graph[n].op.value for n in g.nodes)}")

    def body(self, out: _Lines) -> None:
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

    def finish_column_sums(self, out: _Lines) -> None:
        """The programs combine their partials into the totals themselves: the kernel is the
        whole column sum, one launch and no finishing call on the host. In two levels, so no
        single program reads every partial (one SM's share of L2 bandwidth would make that the
        kernel's tail): the programs form groups of about sqrt(programs); the last program of a
        group to write its partials combines the group's rows into the group's first row, and
        the last group to finish combines those rows into the totals.

        Memory model (PTX): a program's threads store their partials, meet at a barrier, and one
        thread takes a ticket with an acq_rel atomic at GPU scope: the barrier orders the other
        threads' stores before the atomic, whose release publishes them. The program that draws
        a group's last ticket has acquired every earlier release of the group; a second barrier
        orders all of its threads' loads after that acquire, and the loads read at L2 (`.cg`, the
        GPU's point of coherence), never a line this SM's L1 kept from earlier. The group's row
        is published to the last group the same way. Both levels combine rows in program order
        (deterministic, whichever program finished last) and set their counters back to 0 for
        the next launch or CUDA-graph replay."""
        out("# finish: the last program of each group combines the group's partials into its first row,")
        out("# then the last group to finish combines the groups' rows into the totals")
        out("group_size = tl.ceil(tl.sqrt(num_programs.to(tl.float32))).to(tl.int32)")
        out("groups = tl.cdiv(num_programs, group_size)")
        out("group = pid // group_size")
        out("group_first = group * group_size")
        out("group_end = tl.minimum(num_programs, group_first + group_size)")
        out("tl.debug_barrier()  # all threads' partial stores come before the ticket (its release)")
        out('ticket = tl.atomic_add(done_ptr + 1 + group, 1, sem="acq_rel", scope="gpu")')
        out("if ticket == group_end - group_first - 1:")
        out.indent()
        out("tl.debug_barrier()  # the ticket (its acquire) comes before any thread reads the group's partials")
        self.combine_level(out, "group_first", "group_end", "1", totals=False)
        out("tl.store(done_ptr + 1 + group, 0)  # the next launch (or graph replay) counts from zero")
        out("tl.debug_barrier()  # the group's row comes before its ticket for the last group")
        out('group_ticket = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")')
        out("if group_ticket == groups - 1:")
        out.indent()
        out("tl.debug_barrier()  # the ticket (its acquire) comes before any thread reads the groups' rows")
        self.combine_level(out, "0", "num_programs", "group_size", totals=True)
        out("tl.store(done_ptr, 0)")
        out.dedent()
        out.dedent()

    def combine_level(self, out: _Lines, first: str, end: str, step: str, totals: bool) -> None:
        """One level of the finish over the whole row (in chunks of columns where it has them)."""
        chunked = self.open_finish_columns(out)
        self.combine_partials(out, first, end, step, totals)
        if chunked:
            out.dedent()

    def combine_partials(self, out: _Lines, first: str, end: str, step: str, totals: bool) -> None:
        """Combine the partials rows first, first + step, ... (below `end`) of the columns `cols`
        covers, BLOCK_M rows at a time in order, in the partials' dtype; then store the result
        into row `first` (a group's row) or, rounded to each value's dtype, into the totals."""
        for op, names in self.sums.items():
            for name in names:
                acc = TRITON_DTYPES[self.partials_dtypes[op]]
                out(f"{self.reg(name)}_total = tl.full([BLOCK_D], {REDUCE[op].neutral}, {acc})")
        out(f"for block in range({first}, {end}, BLOCK_M * {step}):" if step != "1"
            else f"for block in range({first}, {end}, BLOCK_M):")
        out.indent()
        spacing = "" if step == "1" else f" * {step}"
        out(f"programs = (block + tl.arange(0, BLOCK_M){spacing}).to(tl.int64)")
        out(f"partials_mask = (programs < {end})[:, None] & col_mask[None, :]")
        for op, names in self.sums.items():
            info = REDUCE[op]
            for j, name in enumerate(names):
                self.use(info.helper)
                value = self.reg(name)
                out(f"{value}_partials = tl.load(partials_{op.value}_ptr + (programs[:, None] * {len(names)} + {j}) * D "
                    f"+ cols[None, :], mask=partials_mask, other={info.neutral}, cache_modifier=\".cg\")")
                out(f"{value}_total = {info.combine.format(f'{value}_total', info.triton.format(f'{value}_partials', 0))}")
        out.dedent()
        if not totals:
            for op, names in self.sums.items():
                for j, name in enumerate(names):
                    out(f"tl.store(partials_{op.value}_ptr + ({first} * {len(names)} + {j}) * D + cols, "
                        f"{self.reg(name)}_total, mask=col_mask)")
            return
        for dtype, names in self.totals.items():
            for j, name in enumerate(names):
                out(f"tl.store(totals_{dtype_name(dtype)}_ptr + {j} * D + cols, {self.finished(name)}, mask=col_mask)")

    def finished(self, name: str) -> str:
        """A totals row's value: its sum's total rounded to the sum's dtype (bf16 / fp16 values
        round once), then through each cast the kernel applies to it (KernelGroup.column_casts)."""
        total = self.summed.get(name, name)
        current = self.partials_dtypes[self.graph[total].op]
        text = f"{self.reg(total)}_total"
        for value in (total, *self.group.column_casts.get(total, ())):
            dtype = self.graph[value].value.dtype
            if dtype in (torch.bfloat16, torch.float16) and dtype != current:
                text = self.narrow(text if current == torch.float32 else f"{text}.to(tl.float32)", dtype)
            elif dtype != current:
                text = f"{text}.to({TRITON_DTYPES[dtype]})"
            current = dtype
        return text

    def open_finish_columns(self, out: _Lines) -> bool:
        """Open the finish's walk over columns; True when it opened a loop to close. A row is
        whole in registers here: `cols` already covers it."""
        return False

    def tile_walk(self, out: _Lines) -> None:
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

    def load(self, out: _Lines, name: str) -> None:
        self.load_register(out, name)
        self.scaled_reciprocal(out, name)

    def load_register(self, out: _Lines, name: str) -> None:
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

    def compute(self, out: _Lines, name: str) -> None:
        node = self.graph[name]
        target = self.reg(name)
        out_dtype = compute_dtype(node.value.dtype)
        shape = _register_kind([self.kinds[i] for i in node.inputs if i in self.kinds])
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

    def scaled_reciprocal(self, out: _Lines, name: str) -> None:
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
        return DIVIDE_BY_RECIPROCAL.format(dividend, _broadcast(f"{v}_reciprocal", kind, shape),
                                           _broadcast(f"{v}_scale", kind, shape))

    def strided(self, out: _Lines, node: Node) -> None:
        """A view read in place: the row index unravels over the value's leading dims, each
        index steps through the root by its stride, the columns by the last dim's."""
        a, v, root = node.attr, self.reg(node.name), node.inputs[0]
        kind, rank = node.value.kind, len(a.sizes)
        col = rank - 1 if kind in (Kind.FULL, Kind.COL) else None     # the dim the columns walk
        row_dims = [k for k in range(rank) if k != col and a.sizes[k] != 1]
        root_strides = [f"{root}_stride{j}" for j in range(len(a.index))]
        if a.last_stride_one:
            root_strides[-1] = "1"
        out(f"# {node.name}: {root} read in place through {a.describe}")
        start = _sum(_times(self.entry(const), s) for (_, const), s in zip(a.index, root_strides))
        strides = {}
        for k in row_dims + ([col] if col is not None else []):
            strides[k] = _sum(_times(self.entry(coeffs[k]), s) for (coeffs, _), s in zip(a.index, root_strides))
            if not _simple(strides[k]):
                out(f"{v}_stride{k} = {strides[k]}")
                strides[k] = f"{v}_stride{k}"
        index = {}
        if kind is not Kind.COL:
            inner = "1"
            walk = [k for k in self.group.row_order or range(rank) if k in row_dims]   # outermost first
            for k in reversed(walk):
                quotient = "rows" if inner == "1" else f"(rows // {_paren(inner)})"
                index[k] = f"{v}_i{k}"
                out(f"{index[k]} = {quotient}" + (f" % {self.row_size(a, k, row_dims)}" if k != walk[0] else ""))
                inner = _times(inner, self.row_size(a, k, row_dims))
            steps = [_times(index[k], strides[k]) for k in row_dims]
            # a vector even for one row, or where no dim steps the rows (a broadcast: stride 0)
            row = _sum([start] + (steps if any(step != "0" for step in steps) else ["0 * rows"]))
        if col is not None:
            index[col] = "cols"
            column = "cols" if strides[col] == "1" else f"(cols * {_paren(strides[col])})"
        inside = self.window(out, node, index, col)
        if kind is Kind.FULL:
            offsets, mask = f"{_paren(row)}[:, None] + {column}[None, :]", "mask"
        elif kind is Kind.ROW:
            offsets, mask = row, "row_mask"
        else:
            offsets, mask = _sum([start, column]), "col_mask"
        out(f"{v}_offsets = {offsets}")
        mask = mask if inside is None else f"{mask} & {inside}"
        if a.summed:
            self.summed_loads(out, node, root_strides, mask)
        else:
            to = "" if node.value.dtype == torch.bool else f".to({TRITON_DTYPES[compute_dtype(node.value.dtype)]})"
            out(f"{v} = tl.load({root}_ptr + {v}_offsets, mask={mask}, other=0){to}")
        if inside is not None:
            fallback = self.operand(node.inputs[1], kind, compute_dtype(node.value.dtype), node.value.dtype)
            out(f"{v} = tl.where({inside}, {v}, {fallback})")

    def row_size(self, a, k: int, row_dims: list) -> str:
        """The size of row dim k of a view read in place: its entry, or for the outermost (None in
        the map: the rest of M) M over the others' sizes, which rows in another order need."""
        if a.sizes[k] is not None:
            return self.entry(a.sizes[k])
        others = "1"
        for j in row_dims:
            if j != k:
                others = _times(others, self.entry(a.sizes[j]))
        return "M" if others == "1" else f"(M // {_paren(others)})"

    def summed_loads(self, out: _Lines, node: Node, root_strides: list, mask: str) -> None:
        """A sum over leading dims of the root: one load per index of the summed dims (their
        count a per-call size), accumulated in fp32 (fp64 and integers in their own dtype)."""
        a, v, root = node.attr, self.reg(node.name), node.inputs[0]
        rank = len(a.sizes)
        acc = TRITON_DTYPES[accumulate_dtype(node.value.dtype) if node.value.is_floating else node.value.dtype]
        block = {Kind.FULL: "[BLOCK_M, BLOCK_D]", Kind.ROW: "[BLOCK_M]", Kind.COL: "[BLOCK_D]"}[node.value.kind]
        count = "1"
        for size in a.summed:
            count = _times(count, self.entry(size))
        out(f"{v} = tl.zeros({block}, {acc})")
        out(f"for {v}_r in tl.range(0, {count}):")
        out.indent()
        steps, inner = [], "1"
        for n in reversed(range(len(a.summed))):   # the summed index unravels like the rows do
            stride = _sum(_times(self.entry(coeffs[rank + n]), s) for (coeffs, _), s in zip(a.index, root_strides))
            index = f"{v}_r" if inner == "1" else f"{v}_r // {_paren(inner)}"
            if n:
                index = f"{_paren(index)} % {self.entry(a.summed[n])}"
            steps.append(_times(index, stride))
            inner = _times(inner, self.entry(a.summed[n]))
        out(f"{v} += tl.load({root}_ptr + {v}_offsets + {_paren(_sum(steps))}, mask={mask}, other=0).to({acc})")
        out.dedent()

    def window(self, out: _Lines, node: Node, index: dict, col: Optional[int]) -> Optional[str]:
        """The mask of the elements the root covers (cat parts, scatters), None for all."""
        if node.attr.window is None:
            return None
        v = self.reg(node.name)
        rows, cols = [], []
        zero = "(cols * 0)" if node.value.kind is Kind.COL else "(rows * 0)"   # the index along a dim of size 1
        for k, w in enumerate(node.attr.window):
            if w is not None:
                i = index.get(k, zero)
                part = f"({i} >= {self.entry(w[0])}) & ({i} < {self.entry(w[1])})"
                (cols if k == col else rows).append(part)
        kind = node.value.kind
        if rows and kind is not Kind.COL:
            out(f"{v}_rows_inside = {' & '.join(rows)}")
        if cols:
            out(f"{v}_cols_inside = {' & '.join(cols)}")
        if kind is Kind.FULL:
            if rows and cols:
                return f"({v}_rows_inside[:, None] & {v}_cols_inside[None, :])"
            return f"{v}_rows_inside[:, None]" if rows else f"{v}_cols_inside[None, :]"
        return f"{v}_cols_inside" if kind is Kind.COL else f"{v}_rows_inside"

    def entry(self, item) -> str:
        """An access-map entry: an int literal, or the register of its SYMBOL input."""
        return self.reg(item.name) if isinstance(item, ValueRef) else str(item)

    def rand(self, out: _Lines, node: Node) -> None:
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
        if dtype == torch.bfloat16 and _interpreted():
            self.use("mf_rne_bf16")
            return f"mf_rne_bf16({text}).to(tl.bfloat16)"
        return f"{text}.to({TRITON_DTYPES[dtype]})"

    def reduce_types(self, node: Node) -> tuple:
        """(accumulator dtype, neutral literal) of a reduction: floats accumulate in fp32
        (fp64 stays fp64), integer sums in the result's int dtype."""
        src = self.graph[node.inputs[0]].value.dtype
        if node.value.is_floating or node.op in ARG_REDUCE:
            acc = torch.float64 if torch.float64 in (src, node.value.dtype) else torch.float32
        else:
            acc = node.value.dtype
        if node.op in ARG_REDUCE:
            return acc, "float('-inf')"
        return acc, REDUCE[node.op].neutral if acc.is_floating_point else "0"

    def reduce_source(self, node: Node) -> tuple:
        """(masked source expression, accumulator dtype, neutral literal) of a reduction."""
        acc, neutral = self.reduce_types(node)
        source = self.operand(node.inputs[0], Kind.FULL, acc, node.value.dtype)
        if node.op is Op.ARGMIN:
            source = f"-{source}"
        return f"tl.where(mask, {source}, {neutral})", acc, neutral

    def reduce(self, out: _Lines, node: Node) -> None:
        masked, _, _ = self.reduce_source(node)
        target = self.reg(node.name)
        if node.op in ARG_REDUCE:   # the first extreme of the row (NaN first): an int64 index
            self.use("mf_arg_best")
            out(f"{target}_best, {target} = mf_arg_best({masked}, cols)")
            out(f"{target} = {target}.to(tl.int64)")
            return
        info = REDUCE[node.op]
        self.use(info.helper)
        if node.attr.axis is Kind.ROW:
            out(f"{target} = {info.triton.format(masked, 1)}")
            return
        acc = f"{target}_acc"
        out(f"{acc} = {info.combine.format(acc, info.triton.format(masked, 0))}")

    def store(self, out: _Lines, name: str) -> None:
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


_SHAPES = {Kind.FULL: "[M, D]", Kind.ROW: "[M]", Kind.COL: "[D]", Kind.SCALAR: "[1]"}


def _counted(items: list) -> list:
    """["a", "b", "a"] -> ["2x a", "b"], in first-seen order."""
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return [f"{n}x {item}" if n > 1 else item for item, n in counts.items()]


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": names of kernel arguments per dtype."""
    return str(dtype).replace("torch.", "")


def _simple(text: str) -> bool:
    return text.lstrip("-").replace("_", "").isalnum()


def _paren(text: str) -> str:
    return text if _simple(text) else f"({text})"


def _times(a: str, b: str) -> str:
    """a * b as text, with the products by 0 and 1 done."""
    if a == "0" or b == "0":
        return "0"
    if a == "1":
        return b
    if b == "1":
        return a
    return f"{_paren(a)} * {_paren(b)}"


def _sum(terms) -> str:
    terms = [t for t in terms if t != "0"]
    return " + ".join(terms) if terms else "0"


def _broadcast(text: str, have: Kind, want: Kind) -> str:
    """A register of kind `have` read where a `want` register is: rows and columns of a tile."""
    if want is Kind.FULL and have is Kind.ROW:
        return f"{text}[:, None]"
    if want is Kind.FULL and have is Kind.COL:
        return f"{text}[None, :]"
    return text


def _register_kind(kinds) -> Kind:
    """The shape of an elementwise result: FULL if any operand is, or ROW meets COL."""
    present = {k for k in kinds if k is not Kind.SCALAR}
    if not present:
        return Kind.SCALAR
    if len(present) == 1:
        return present.pop()
    return Kind.FULL


def write_row_kernel(graph: Graph, group: KernelGroup, seed_from_memory: bool = False) -> KernelSource:
    return RowKernelWriter(graph, group, seed_from_memory).write()
