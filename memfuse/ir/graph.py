"""memfuse's IR: a small typed graph over the [M, D] iteration space.

Every value is placed in the iteration space of docs/architecture.md: a FULL value is [M, D] (M rows of
D elements), a ROW value has one element per row ([M]: mean, rstd), a COL value one per column
([D]: weight, bias and their gradients), a SCALAR one element. Values of any other shape are
TENSOR: only extern (aten) steps touch them. M is a sympy expression over the size symbols of
the inputs' leading dims, so one compiled program serves every batch and sequence size; D is
a plain int, part of the compile key.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import sympy
import torch

from memfuse.base.debug import timed


class Kind(enum.Enum):
    FULL = "full"
    ROW = "row"
    COL = "col"
    SCALAR = "scalar"
    TENSOR = "tensor"


class Op(enum.Enum):
    INPUT = "input"
    SEED = "seed"            # the per-call random seed: all that dropout needs to regenerate
    CONSTANT = "constant"
    SYMBOL = "symbol"        # a size-derived scalar, evaluated from the input shapes per call
    VIEW = "view"            # reshape/expand/clone that keeps the [M, D] element order
    STRIDED = "strided"      # a view read in place from a tensor in memory, through an access map
                             # (or a sum over leading dims of one: Strided.summed)
    CAST = "cast"
    NEG = "neg"; ABS = "abs"; EXP = "exp"; LOG = "log"; SQRT = "sqrt"; RSQRT = "rsqrt"
    SIGMOID = "sigmoid"; TANH = "tanh"; ERF = "erf"; RECIPROCAL = "reciprocal"
    SIN = "sin"; COS = "cos"; TAN = "tan"; EXP2 = "exp2"; EXPM1 = "expm1"; LOG1P = "log1p"
    LOG2 = "log2"; LOG10 = "log10"; FLOOR = "floor"; CEIL = "ceil"; ROUND = "round"; TRUNC = "trunc"
    SIGN = "sign"; ISNAN = "isnan"; ISINF = "isinf"
    ATAN = "atan"; ASIN = "asin"; ACOS = "acos"; SINH = "sinh"; COSH = "cosh"; ASINH = "asinh"
    ACOSH = "acosh"; ATANH = "atanh"; ERFC = "erfc"; ERFINV = "erfinv"; LGAMMA = "lgamma"; DIGAMMA = "digamma"
    TRIGAMMA = "trigamma"     # polygamma(1, x): digamma's derivative
    LOGICAL_NOT = "logical_not"; BITWISE_NOT = "bitwise_not"
    ADD = "add"; SUB = "sub"; MUL = "mul"; DIV = "div"; POW = "pow"; ATAN2 = "atan2"
    FMOD = "fmod"; REMAINDER = "remainder"; FLOOR_DIVIDE = "floor_divide"; TRUNC_DIVIDE = "trunc_divide"
    MAXIMUM = "maximum"; MINIMUM = "minimum"
    EQ = "eq"; NE = "ne"; LT = "lt"; LE = "le"; GT = "gt"; GE = "ge"
    LOGICAL_AND = "logical_and"; LOGICAL_OR = "logical_or"; LOGICAL_XOR = "logical_xor"
    BITWISE_AND = "bitwise_and"; BITWISE_OR = "bitwise_or"; BITWISE_XOR = "bitwise_xor"
    WHERE = "where"
    RAND = "rand"            # uniform [0, 1) from philox(seed, element index)
    SUM = "sum"; MAX = "max"; MIN = "min"; PROD = "prod"   # over D (ROW result) or over M (COL result)
    ARGMAX = "argmax"; ARGMIN = "argmin"                   # over D only: the first extreme's index
    IOTA = "iota"            # the column index 0..D-1 (a COL int64 value)
    EXTERN = "extern"        # an aten call the code generator does not take
    GETITEM = "getitem"      # one element of an extern's tuple result


UNARY = {Op.NEG, Op.ABS, Op.EXP, Op.LOG, Op.SQRT, Op.RSQRT, Op.SIGMOID, Op.TANH, Op.ERF,
         Op.RECIPROCAL, Op.SIN, Op.COS, Op.TAN, Op.EXP2, Op.EXPM1, Op.LOG1P, Op.LOG2, Op.LOG10,
         Op.FLOOR, Op.CEIL, Op.ROUND, Op.TRUNC, Op.SIGN, Op.ISNAN, Op.ISINF, Op.LOGICAL_NOT,
         Op.BITWISE_NOT, Op.CAST, Op.ATAN, Op.ASIN, Op.ACOS, Op.SINH, Op.COSH, Op.ASINH, Op.ACOSH,
         Op.ATANH, Op.ERFC, Op.ERFINV, Op.LGAMMA, Op.DIGAMMA, Op.TRIGAMMA}
BINARY = {Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.POW, Op.ATAN2, Op.FMOD, Op.REMAINDER, Op.FLOOR_DIVIDE,
          Op.TRUNC_DIVIDE, Op.MAXIMUM, Op.MINIMUM, Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE,
          Op.LOGICAL_AND, Op.LOGICAL_OR, Op.LOGICAL_XOR, Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR}
COMPARISON = {Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE}
POINTWISE = UNARY | BINARY | {Op.WHERE, Op.VIEW, Op.IOTA}
REDUCTION = {Op.SUM, Op.MAX, Op.MIN, Op.PROD, Op.ARGMAX, Op.ARGMIN}
RANDOM = {Op.RAND}
LEAF = {Op.INPUT, Op.SEED, Op.CONSTANT, Op.SYMBOL}
EXTERNAL = {Op.EXTERN, Op.GETITEM}
MEMORY_VIEWS = {Op.STRIDED}   # read their first input (the root) from memory, not from registers
FUSIBLE = POINTWISE | REDUCTION | RANDOM | MEMORY_VIEWS


@dataclass(frozen=True)
class Value:
    """What a node produces: dtype, place in the iteration space, and its traced shape."""
    dtype: Optional[torch.dtype]
    kind: Kind
    shape: tuple = ()                   # sympy expressions / ints; for allocation and views
    m: Optional[sympy.Expr] = None      # rows, for FULL and ROW
    d: Optional[int] = None             # columns, for FULL and COL

    @property
    def is_floating(self) -> bool:
        return self.dtype is not None and self.dtype.is_floating_point


@dataclass(frozen=True)
class Cast:
    dtype: torch.dtype


@dataclass(frozen=True)
class Constant:
    value: Union[float, int, bool]


@dataclass(frozen=True)
class Symbol:
    expr: sympy.Expr


@dataclass(frozen=True)
class Seeded:
    stream: int                         # which random op of the graph: seed + stream


@dataclass(frozen=True)
class Reduce:
    axis: Kind                          # Kind.ROW: over D; Kind.COL: over M


@dataclass(frozen=True)
class Extern:
    target: Any                         # an OpOverload or operator.getitem
    args: tuple                         # with ValueRef in place of graph values
    kwargs: tuple                       # ((key, value), ...)


def aten_schema(target) -> Optional[torch.FunctionSchema]:
    """The aten schema an extern's target calls by: an OpOverload's, or that of the op a wrapper
    calls (attention.AttentionCall), else None (a callable of memfuse's own)."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema
    return getattr(target, "schema", None)


@dataclass(frozen=True)
class Matmul(Extern):
    """An aten matmul (mm, bmm, addmm): an Extern that also says which device type it was traced
    on, which decides whether aligning its operands pays (memfuse.schedule.padding)."""
    device: str = "cpu"


@dataclass(frozen=True)
class Reshape:
    """On a VIEW node: the runtime's `.reshape` of a tensor already in memory, which only aten
    calls read (schedule.reshapes_for_aten), not a kernel copying it."""


@dataclass(frozen=True)
class Index:
    index: int


@dataclass(frozen=True)
class ValueRef:
    name: str


@dataclass(frozen=True)
class Strided:
    """The access map of a STRIDED node: how element (i_0, ..., i_{r-1}) of the node's value is
    found in its root (the node's first input, a tensor in memory). Root index j is
    `sum_k index[j][0][k] * i_k + index[j][1]`; its memory offset multiplies those by the
    root's strides, read per call, so permutes, slices and selects of any layout share it.
    Entries are ints, or ValueRefs to SYMBOL inputs of the node (sizes known per call).

    `window` (cat, slice_scatter, select_backward): per value dim, the range [start, end) the
    root covers, or None for all of it; elsewhere the value is the node's second input (the
    fallback), or 0 without one. `contiguous_root`: the root is made contiguous before the
    read (its last stride is 1); False for an input passed in with other strides, whose last
    stride is still 1 when `last_stride_one` (the compile key says so: columns load as a block).

    `summed` (a sum over some leading dims, a broadcast's gradient): the sizes of extra index
    dims, after the value's, that the read sums over; their coefficients follow the value
    dims' in `index`. Each element of the value adds up the root elements of all their indices."""
    sizes: tuple                        # the value's dims: int or ValueRef (None: the outermost row dim)
    index: tuple                        # per root dim: (coefficients per value dim, then per summed dim, constant)
    window: Optional[tuple] = None      # per value dim: None or (start, end)
    contiguous_root: bool = True
    describe: str = ""                  # what it came from, for comments: "permute(1, 0, 2)"
    summed: tuple = ()                  # sizes of the dims summed over: int or ValueRef
    last_stride_one: bool = True

    @property
    def has_fallback(self) -> bool:
        return self.window is not None

    def scalars(self) -> list:
        """The SYMBOL inputs the map reads (its ValueRefs), in order of first use."""
        refs = list(self.sizes) + list(self.summed) + [c for coeffs, const in self.index for c in (*coeffs, const)]
        refs += [b for w in (self.window or ()) if w is not None for b in w]
        return list(dict.fromkeys(r.name for r in refs if isinstance(r, ValueRef)))


Attr = Union[None, Cast, Constant, Symbol, Seeded, Reduce, Extern, Matmul, Index, Strided, Reshape]


@dataclass(frozen=True)
class Node:
    name: str
    op: Op
    inputs: tuple
    value: Value
    attr: Attr = None


@dataclass
class Graph:
    """Nodes in topological order; `outputs` may hold None for a gradient nobody needs."""
    nodes: dict = field(default_factory=dict)        # name -> Node
    inputs: list = field(default_factory=list)       # names of INPUT / SEED nodes, in call order
    outputs: list = field(default_factory=list)      # names (or None)

    def add(self, node: Node) -> str:
        assert node.name not in self.nodes, node.name
        self.nodes[node.name] = node
        return node.name

    def users(self) -> dict:
        users = {name: [] for name in self.nodes}
        for node in self.nodes.values():
            for inp in node.inputs:
                users[inp].append(node.name)
        return users

    def __getitem__(self, name: str) -> Node:
        return self.nodes[name]


def value_bytes(value: Value, hints: dict) -> int:
    """Bytes a value occupies when materialized, with size symbols at their hinted values."""
    if value.dtype is None:
        return 0
    numel = 1
    for size in value.shape:
        numel *= int(sympy.sympify(size).subs(hints)) if not isinstance(size, int) else size
    return numel * value.dtype.itemsize


def format_graph(graph: Graph) -> str:
    """One line per node: `name: kind[dtype] = op(inputs) attr`."""
    lines = []
    for node in graph.nodes.values():
        v = node.value
        dtype = str(v.dtype).replace("torch.", "") if v.dtype is not None else "-"
        attr = "" if node.attr is None else f"  {_format_attr(node.attr)}"
        lines.append(f"  {node.name}: {v.kind.value}[{dtype}] = {node.op.value}({', '.join(node.inputs)}){attr}")
    lines.append(f"  outputs: {', '.join(str(o) for o in graph.outputs)}")
    return "\n".join(lines)


def _format_attr(attr) -> str:
    if isinstance(attr, Extern):
        return f"{attr.target}"
    return repr(attr)


def column_padding(graph: "Graph", node: Node) -> Optional[int]:
    """The row length of `node` when it is its root with zero columns appended (memfuse.schedule.padding's
    pad of a matmul operand: an identity read of a FULL value, windowed to the root's D along the
    last dim, 0 outside): the kernel that computes the root can store it padded itself. None for
    any other node."""
    a = node.attr
    if node.op is not Op.STRIDED or node.value.kind is not Kind.FULL or a.summed or a.window is None \
            or len(node.inputs) < 2:
        return None
    root, fill = graph[node.inputs[0]], graph[node.inputs[1]]
    rank = len(a.index)
    if root.value.kind is not Kind.FULL or root.value.m != node.value.m or not root.value.d \
            or node.value.d <= root.value.d or fill.op is not Op.CONSTANT or fill.attr.value != 0 \
            or len(root.value.shape) != rank or len(a.window) != rank:
        return None
    identity = all(const == 0 and all(c == (1 if j == k else 0) for k, c in enumerate(coeffs))
                   for j, (coeffs, const) in enumerate(a.index))
    window = all(w is None for w in a.window[:-1]) and a.window[-1] == (0, root.value.d)
    return node.value.d if identity and window else None


class GraphError(AssertionError):
    pass


@timed("verify")
def verify(graph: Graph) -> None:
    """Check topological order and the [M, D] rules every fusible node obeys."""
    seen = set()
    for node in graph.nodes.values():
        for inp in node.inputs:
            if inp not in seen:
                raise GraphError(f"memfuse IR: {node.name} reads {inp} before it is defined\n{format_graph(graph)}")
        if node.op in FUSIBLE:
            # a STRIDED node's root is read from memory, in whatever shape it has
            for inp in node.inputs[1:] if node.op in MEMORY_VIEWS else node.inputs:
                if not fits(graph[inp].value, node.value, node.op):
                    raise GraphError(f"memfuse IR: {node.name} ({node.op.value}, {node.value.kind.value}) "
                                     f"cannot read {inp} ({graph[inp].value.kind.value}) in one [M, D] space")
        seen.add(node.name)
    for out in graph.outputs:
        if out is not None and out not in graph.nodes:
            raise GraphError(f"memfuse IR: output {out} is not a node")


def fits(src: Value, dst: Value, op: Op) -> bool:
    """Whether `src` can be read by a fusible node producing `dst` inside one kernel."""
    if src.kind is Kind.TENSOR or dst.kind is Kind.TENSOR:
        return False
    if src.kind is Kind.SCALAR:
        return True
    if op in REDUCTION:
        return src.kind is Kind.FULL and dst.kind in (Kind.ROW, Kind.COL) and \
            ((dst.kind is Kind.ROW and dst.m == src.m) or (dst.kind is Kind.COL and dst.d == src.d))
    if dst.kind is Kind.FULL:
        if src.kind is Kind.FULL:
            return src.m == dst.m and src.d == dst.d
        if src.kind is Kind.ROW:
            return src.m == dst.m
        return src.d == dst.d
    if dst.kind is Kind.ROW:
        return src.kind is Kind.ROW and src.m == dst.m
    if dst.kind is Kind.COL:
        return src.kind is Kind.COL and src.d == dst.d
    return False


def renamed(arg, names: dict):
    """An extern's (nested) argument with each ValueRef to a name in `names` pointing at its new name."""
    if isinstance(arg, ValueRef):
        return ValueRef(names.get(arg.name, arg.name))
    if isinstance(arg, (list, tuple)):
        return type(arg)(renamed(a, names) for a in arg)
    return arg


def value_refs(args) -> list:
    """The names of the values an extern call's (nested) arguments refer to, in order."""
    out = []
    for a in args:
        if isinstance(a, ValueRef):
            out.append(a.name)
        elif isinstance(a, (list, tuple)):
            out.extend(value_refs(a))
    return out


def place(dtype: torch.dtype, shape: tuple) -> Value:
    """The Value of a tensor of this dtype and (sympy) shape."""
    if len(shape) == 0 or all(s == 1 for s in shape):
        return Value(dtype, Kind.SCALAR, shape)
    last = shape[-1]
    lead = shape[:-1]
    m = sympy.Mul(*lead) if lead else sympy.Integer(1)
    if not last.is_number:
        return Value(dtype, Kind.ROW, shape, m=sympy.Mul(*shape))
    if last == 1:
        return Value(dtype, Kind.ROW, shape, m=m)
    if all(s == 1 for s in lead):
        return Value(dtype, Kind.COL, shape, d=int(last))
    return Value(dtype, Kind.FULL, shape, m=m, d=int(last))
