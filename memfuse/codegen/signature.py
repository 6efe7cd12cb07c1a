"""A row kernel's signature: its arguments in launch order with their comments, the bytes it moves
per row and per launch, and its one-line summary."""
from __future__ import annotations

import torch

from memfuse.codegen.emit import dtype_name
from memfuse.codegen.kernel_source import Arg
from memfuse.ir.graph import Kind, Op
from memfuse.ir.ops import ARG_REDUCE, REDUCE


_SHAPES = {Kind.FULL: "[M, D]", Kind.ROW: "[M]", Kind.COL: "[D]", Kind.SCALAR: "[1]"}


def _counted(items: list) -> list:
    """["a", "b", "a"] -> ["2x a", "b"], in first-seen order."""
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return [f"{n}x {item}" if n > 1 else item for item, n in counts.items()]


class KernelSignature:
    """RowKernelWriter's arguments, parameter comments, bytes moved and summary."""

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
