"""padding: align the operands of extern matmuls so that cuBLAS runs its aligned kernels.

cuBLAS picks its fast tensor-core kernels only when the rows of every operand and of the result
start on 16-byte boundaries. A static size that is not a multiple of 8 fp16/bf16 elements (4 fp32)
-- a vocabulary of 50257 -- sends the matmul to `align1` kernels, several times slower (GPT-2's LM
head then takes a large part of its step). torch.compile's `pad_mm` pass pads such operands with
zeros and slices the result back; this pass does the same to a program's graph (forward or
backward) before its kernels are grouped (`schedule.schedule` calls it):

    mm(a [M, K], b [K, N]) [M, N]   ->   mm(a' [M', K'], b' [K', N']) [M', N'], read as [M, N]

`decide` says, per extern matmul (ir.Matmul: mm, bmm, addmm), which of M, N and K to pad and to
what, with a reason for each (MatmulPadding: `explain` prints them). pad_mm's rules: only static
dims (M, the tokens, is a size symbol: one program serves every size), not a size of 1, fp16/bf16
to multiples of 8 and fp32 of 4; K padded in both operands (zeros add nothing to the sums), M and
N in the one operand that has them (and in addmm's bias). `Config.pad_matmuls` (auto | force | off)
and `Config.pad_matmul_min_intensity` say when it pays.

`pad_matmuls` rewrites the graph. A padded operand is made where it is cheapest:
- a transposed operand (an aten permute, as the weight of a linear): its base is padded, then
  permuted;
- a cast or reshape of a tensor in memory (an input, an aten result: a weight cast to bf16): one
  kernel reads that tensor through a window (zeros outside it) and casts, writing the padded value
  directly;
- anything else: a windowed read of it with zeros outside (a STRIDED node). When a kernel computes
  the value (the gradient of the logits) and only its columns are padded, that kernel stores it
  padded itself (`schedule.stores_padded`: zero columns past D, no second pass, the unpadded value
  not written unless something else reads it); an input, an aten result or a row pad is copied by
  a kernel, one read and one write of it.
The result is read back without a copy where the readers allow: slicing away trailing rows or
columns keeps every index, so a kernel reads the padded result in place through its strides (a
STRIDED node, or a STRIDED reader moved onto the padded result) and an aten call that takes any
strides gets an aten slice view. A graph output, or an aten call that needs a contiguous tensor,
gets the slice written out by a kernel (as the readers of a plain view do).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch

from memfuse.ir import views
from memfuse.ir.aten import MATMUL_ATEN, reads_any_strides
from memfuse.base.config import Config
from memfuse.ir.graph import EXTERNAL, Constant, Extern, Graph, Kind, Matmul, Node, Op, Symbol, Value, ValueRef, place, renamed
from memfuse.ir.views import strided_attr

aten = torch.ops.aten

# Elements per 16 bytes: the alignment cuBLAS's fast kernels want (pad_mm's get_alignment_size).
ALIGNMENT = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}
MODES = ("auto", "force", "off")


@dataclass(frozen=True)
class DimPadding:
    """One of a matmul's M, N and K: its size, the aligned size it would take (None: left as is)."""
    dim: str                       # "M", "N" or "K"
    size: Any                      # an int, or a sympy expression over the size symbols
    aligned: Optional[int]
    reason: str

    def __str__(self) -> str:
        return f"{self.dim}={self.size}" + (f" -> {self.aligned}" if self.aligned is not None else "")


@dataclass(frozen=True)
class MatmulPadding:
    """The padding decision for one extern matmul, and why."""
    name: str
    target: str
    dtype: Optional[torch.dtype]
    dims: tuple                    # DimPadding for M, N, K
    padded: bool                   # the graph computes it on padded operands
    reason: str

    def padded_dims(self) -> dict:
        """dim -> (size, aligned size) of the dims padded; empty when not padded."""
        return {d.dim: (d.size, d.aligned) for d in self.dims if d.aligned is not None} if self.padded else {}

    def __str__(self) -> str:
        dims = ", ".join(str(d) if self.padded else f"{d.dim}={d.size}" for d in self.dims)
        return f"{self.name} ({self.target}, {str(self.dtype).replace('torch.', '')}; {dims}): {self.reason}"


def intensity(sizes) -> float:
    """Arithmetic intensity MNK / (MK + KN + MN) of a matmul (elements), with every symbolic size
    taken as large: 1 / (sum of 1/size over the static ones)."""
    static = [int(s) for s in sizes if _static(s)]
    if not static or 0 in static:
        return math.inf if not static else 0.0
    return 1.0 / sum(1.0 / s for s in static)


def decide(name: str, target, a_shape: tuple, b_shape: tuple, dtype, device: str, config: Config) -> MatmulPadding:
    """Which of M, N, K to pad (a: [.., M, K], b: [.., K, N]), as pad_mm decides from the shapes;
    auto mode also asks the device and whether the matmul is compute-bound enough to pay."""
    mode = config.pad_matmuls
    if mode not in MODES:
        raise ValueError(f"memfuse: Config.pad_matmuls={mode!r} (MEMFUSE_PAD_MATMULS): expected one of {', '.join(MODES)}")
    align = ALIGNMENT.get(dtype, 0)
    sizes = {"M": a_shape[-2], "N": b_shape[-1], "K": a_shape[-1]}
    dims = tuple(_dim(label, size, align) for label, size in sizes.items())
    flops = intensity(sizes.values())
    reason = None
    if mode == "off":
        reason = "Config.pad_matmuls is 'off'"
    elif align == 0:
        reason = f"{_name(dtype)}: pad_mm aligns fp16/bf16 (to 8 elements) and fp32 (to 4) only"
    elif any(_static(s) and int(s) == 0 for s in sizes.values()):
        reason = "an empty dim: nothing to compute"
    elif all(d.aligned is None for d in dims):
        reason = "nothing to pad: every dim is aligned, symbolic or 1"
    elif mode == "auto" and device != "cuda":
        reason = f"traced on {device}: the alignment pays for cuBLAS (CUDA); Config.pad_matmuls='force' pads anyway"
    elif mode == "auto" and flops < config.pad_matmul_min_intensity:
        reason = (f"does not pay: arithmetic intensity {flops:.0f} (symbolic dims taken as large) is below "
                  f"Config.pad_matmul_min_intensity={config.pad_matmul_min_intensity:g}: too little compute "
                  f"to win back the pad")
    if reason is not None:
        return MatmulPadding(name, str(target), dtype, dims, False, reason)
    padded = ", ".join(str(d) for d in dims if d.aligned is not None)
    why = "forced (Config.pad_matmuls='force')" if mode == "force" else \
        f"compute-bound: intensity {flops:.0f} >= {config.pad_matmul_min_intensity:g}"
    return MatmulPadding(name, str(target), dtype, dims, True,
                         f"pads {padded} to multiples of {align} {_name(dtype)} elements (16 bytes) so cuBLAS "
                         f"runs its aligned kernels; {why}")


def _dim(label: str, size, align: int) -> DimPadding:
    if not _static(size):
        return DimPadding(label, size, None, "symbolic: one program serves every size; only static dims are padded")
    size = int(size)
    if size <= 1:
        return DimPadding(label, size, None, f"size {size}")
    if align == 0 or size % align == 0:
        return DimPadding(label, size, None, "aligned" if align else "no alignment rule for the dtype")
    aligned = -(-size // align) * align
    return DimPadding(label, size, aligned, f"not a multiple of {align}: padded to {aligned}")


def _static(size) -> bool:
    return isinstance(size, int) or sympy.sympify(size).is_number


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def matmul_decisions(graph: Graph, config: Config) -> list:
    """A MatmulPadding for every extern matmul of the graph, in graph order."""
    decisions = []
    for node in graph.nodes.values():
        if node.op is Op.EXTERN and isinstance(node.attr, Matmul) and node.attr.target in MATMUL_ATEN:
            a, b = _operands(node)
            if a is None:
                continue
            va, vb = graph[a.name].value, graph[b.name].value
            decisions.append(decide(node.name, node.attr.target, tuple(va.shape), tuple(vb.shape), va.dtype,
                                    node.attr.device, config))
    return decisions


def _operands(node: Node) -> tuple:
    """(a, b) of a matmul node as ValueRefs: mm(a, b), bmm(a, b), addmm(bias, a, b)."""
    args = node.attr.args
    a, b = args[1:3] if node.attr.target is aten.addmm.default else args[:2]
    if not isinstance(a, ValueRef) or not isinstance(b, ValueRef):
        return None, None
    return a, b


def pad_matmuls(graph: Graph, config: Config) -> tuple:
    """(graph, [MatmulPadding]): the graph with every matmul `decide` pads computed on padded
    operands (the graph itself when none is), and the decisions."""
    decisions = matmul_decisions(graph, config)
    padded = {d.name: d for d in decisions if d.padded}
    if not padded:
        return graph, decisions
    return _Rewrite(graph, padded).run(), decisions


class _Rewrite:
    """Builds the padded graph node by node (module docstring: how operands are padded and results
    read back). Names of the original graph stay; new nodes are named after the value they pad."""

    def __init__(self, graph: Graph, padded: dict):
        self.old = graph
        self.padded = padded
        self.new = Graph(inputs=list(graph.inputs), outputs=list(graph.outputs))
        self.users = graph.users()
        self.outputs = {o for o in graph.outputs if o is not None}
        self.pads: dict = {}           # (value, ((dim, size), ...)) -> its padded value
        self.roots: dict = {}          # matmul -> its padded result, for STRIDED readers moved onto it
        self.views: dict = {}          # matmul -> the aten slice view its any-strides aten readers get
        self.symbols = {n.attr.expr: name for name, n in graph.nodes.items() if n.op is Op.SYMBOL}
        self.zeros: dict = {}          # dtype -> a 0 constant of it

    def run(self) -> Graph:
        for name, node in self.old.nodes.items():
            if name in self.padded:
                self.matmul(node, self.padded[name])
            else:
                self.new.add(self.reroute(node))
        self.drop_unread([r.name for name in self.padded for r in _operands(self.old[name])
                          + (self.old[name].attr.args[0],) if isinstance(r, ValueRef)])
        return self.new

    def drop_unread(self, names: list) -> None:
        """Drop what only the unpadded matmuls read (a transpose of the unpadded operand, the
        operand itself when its kernel now stores only the padded one), and what only that read."""
        users = self.new.users()
        keep = set(self.new.inputs) | self.outputs
        while names:
            name = names.pop()
            node = self.new.nodes.get(name)
            if node is None or users[name] or name in keep or node.op in (Op.INPUT, Op.SEED):
                continue
            del self.new.nodes[name]
            for i in node.inputs:
                users[i] = [u for u in users[i] if u != name]
                names.append(i)

    # -- names, constants, sizes ---------------------------------------------------------------
    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.old.nodes or name in self.new.nodes:
            k += 1
            name = f"{base}_{k}"
        return name

    def zero(self, dtype) -> str:
        if dtype not in self.zeros:
            value = 0.0 if dtype.is_floating_point else 0
            self.zeros[dtype] = self.new.add(Node(self.fresh("pad_zero"), Op.CONSTANT, (), Value(dtype, Kind.SCALAR),
                                                  Constant(value)))
        return self.zeros[dtype]

    def size_operand(self, expr):
        """An access-map entry: an int, or a ValueRef to a SYMBOL node (made here if the graph has none)."""
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_number:
            return int(expr)
        if expr not in self.symbols:
            name = self.fresh("pad_size")
            self.symbols[expr] = self.new.add(Node(name, Op.SYMBOL, (), Value(torch.int64, Kind.SCALAR), Symbol(expr)))
        return ValueRef(self.symbols[expr])

    # -- the matmul and its result ---------------------------------------------------------------
    def matmul(self, node: Node, decision: MatmulPadding) -> None:
        sizes = decision.padded_dims()
        a, b = _operands(node)
        rank = len(self.old[a.name].value.shape)
        m, n, k = (sizes.get(d, (None, None))[1] for d in "MNK")
        args = list(node.attr.args)
        position = 1 if node.attr.target is aten.addmm.default else 0
        args[position] = ValueRef(self.pad(a.name, {rank - 2: m, rank - 1: k}))
        args[position + 1] = ValueRef(self.pad(b.name, {rank - 2: k, rank - 1: n}))
        if node.attr.target is aten.addmm.default and isinstance(args[0], ValueRef):
            bias = self.old[args[0].name].value.shape
            wanted = {len(bias) - 1: n if not _is_one(bias[-1]) else None}
            if len(bias) == 2 and not _is_one(bias[0]):
                wanted[0] = m
            args[0] = ValueRef(self.pad(args[0].name, wanted))
        shape = list(node.value.shape)
        if m is not None:
            shape[-2] = sympy.Integer(m)
        if n is not None:
            shape[-1] = sympy.Integer(n)
        value = place(node.value.dtype, tuple(shape))
        inputs = list(dict.fromkeys(r.name for r in args if isinstance(r, ValueRef)))
        padded = self.new.add(Node(self.fresh(f"{node.name}_padded"), Op.EXTERN, tuple(inputs), value,
                                   Matmul(node.attr.target, tuple(args), node.attr.kwargs, node.attr.device)))
        self.read_back(node, padded, {len(shape) - 2: m, len(shape) - 1: n})

    def read_back(self, node: Node, padded: str, dims: dict) -> None:
        """`node`'s value (the unpadded result) for its readers, from the padded result."""
        dims = {d: s for d, s in dims.items() if s is not None}
        if list(dims) == [0]:      # only the rows of an mm: the first rows are a contiguous tensor
            self.aten_slice(node, padded, dims, node.name)
            return
        readers = [self.old[u] for u in self.users[node.name]]
        moved = [r for r in readers if r.op is Op.STRIDED and r.inputs[0] == node.name
                 and node.name not in r.inputs[1:]]
        any_strides = [r for r in readers if r.op is Op.EXTERN and reads_any_strides(r.attr.target)]
        in_place = node.name in self.outputs or any(r not in moved and r not in any_strides for r in readers)
        if moved:
            self.roots[node.name] = padded
        if any_strides:
            self.views[node.name] = self.aten_slice(node, padded, dims,
                                                    self.fresh(f"{node.name}_view") if in_place else node.name)
        if in_place:    # kernels read the padded result in place, through its strides
            m = views.identity(padded, tuple(node.value.shape), True)
            attr = strided_attr(m, node.value, "the matmul's result without its padding", self.size_operand)
            self.new.add(Node(node.name, Op.STRIDED, tuple([padded] + attr.scalars()), node.value, attr))

    def aten_slice(self, node: Node, padded: str, dims: dict, name: str) -> str:
        """aten slice views of `padded` back to `node`'s shape, one per padded dim; the last is `name`."""
        source, shape = padded, list(self.new[padded].value.shape)
        for position, (dim, _) in enumerate(sorted(dims.items())):
            shape[dim] = node.value.shape[dim]
            last = position == len(dims) - 1
            value = node.value if last else place(node.value.dtype, tuple(shape))
            source = self.new.add(Node(name if last else self.fresh(f"{node.name}_slice"), Op.EXTERN, (source,),
                                       value, Extern(aten.slice.Tensor, (ValueRef(source), dim, 0,
                                                                         int(node.value.shape[dim])), ())))
        return source

    def reroute(self, node: Node) -> Node:
        """A reader of a padded matmul's result: a STRIDED read moves onto the padded result (a slice
        from 0 keeps every index), an any-strides aten call takes the slice view."""
        if node.op is Op.STRIDED and node.inputs[0] in self.roots and node.inputs[0] not in node.inputs[1:]:
            return Node(node.name, node.op, (self.roots[node.inputs[0]],) + node.inputs[1:], node.value, node.attr)
        if node.op is Op.EXTERN and reads_any_strides(node.attr.target) and any(i in self.views for i in node.inputs):
            inputs = tuple(self.views.get(i, i) for i in node.inputs)
            attr = dataclasses.replace(node.attr, args=renamed(node.attr.args, self.views),
                                       kwargs=renamed(node.attr.kwargs, self.views))
            return Node(node.name, node.op, inputs, node.value, attr)
        return node

    # -- padded operands ---------------------------------------------------------------------------
    def pad(self, name: str, sizes: dict) -> str:
        """`name` with zeros appended along the dims of `sizes` (dim -> new size; None: as is)."""
        key = (name, tuple(sorted((d, s) for d, s in sizes.items() if s is not None)))
        if not key[1]:
            return name
        if key not in self.pads:
            self.pads[key] = self.make_pad(name, dict(key[1]))
        return self.pads[key]

    def make_pad(self, name: str, sizes: dict) -> str:
        node = self.new[name]
        shape = tuple(sympy.Integer(sizes[d]) if d in sizes else s for d, s in enumerate(node.value.shape))
        value = place(node.value.dtype, shape)
        if node.op is Op.EXTERN and node.attr.target is aten.permute.default:
            # a transposed operand (a linear's weight): pad its base, permute that
            dims = [d % len(shape) for d in node.attr.args[1]]
            base = self.pad(node.attr.args[0].name, {dims[d]: s for d, s in sizes.items()})
            return self.new.add(Node(self.fresh(f"{name}_padded"), Op.EXTERN, (base,), value,
                                     Extern(aten.permute.default, (ValueRef(base), node.attr.args[1]), ())))
        source = self.pushed(node, sizes)
        if source is not None:
            # a cast or reshape of a tensor in memory: computed from that tensor's padded read
            return self.new.add(Node(self.fresh(f"{name}_padded"), node.op,
                                     (self.pad(node.inputs[0], source),) + node.inputs[1:], value, node.attr))
        # a kernel copies the value into the padded shape: a windowed read, zeros outside it
        window = tuple((0, int(node.value.shape[d])) if d in sizes else None for d in range(len(shape)))
        m = views.identity(name, shape, True)
        attr = strided_attr(m, value, f"zero padding to {_shape(shape)}", self.size_operand, window)
        zero = self.zero(value.dtype)
        return self.new.add(Node(self.fresh(f"{name}_padded"), Op.STRIDED, tuple([name, zero] + attr.scalars()),
                                 value, attr))

    def pushed(self, node: Node, sizes: dict) -> Optional[dict]:
        """The pads of the input of a cast or reshape that computes `node` from a tensor in memory
        (so the padded value is computed from the padded read, and a zero casts to a zero); None
        when the pad is not moved there."""
        if node.op not in (Op.CAST, Op.VIEW) or len(node.inputs) != 1 or not self.from_memory(node.name):
            return None
        src = self.new[node.inputs[0]].value
        if node.op is Op.CAST and not (src.is_floating and node.value.is_floating):
            return None
        shape, src_shape = node.value.shape, src.shape
        if len(shape) == len(src_shape) and all(views.same(x, y) for x, y in zip(shape, src_shape)):
            return dict(sizes)
        last = len(shape) - 1
        if list(sizes) == [last] and src_shape and views.same(src_shape[-1], shape[-1]) and src.kind is Kind.FULL:
            return {len(src_shape) - 1: sizes[last]}
        return None

    def from_memory(self, name: str) -> bool:
        """Whether `name` is a chain of casts and reshapes of an input or an aten result."""
        node = self.new[name]
        while node.op in (Op.CAST, Op.VIEW) and len(node.inputs) == 1:
            node = self.new[node.inputs[0]]
        return node.op is Op.INPUT or node.op in EXTERNAL


def _is_one(size) -> bool:
    return views.same(size, 1)


def _shape(shape) -> str:
    return f"[{', '.join(str(s) for s in shape)}]"
