"""capture: trace a function's joint forward+backward graph and lower it to memfuse's IR.

AOTAutograd (`aot_export_joint_simple`) traces on fake tensors whose leading dims are size
symbols and whose last dim is static, so every constant that depends on the batch or sequence
size stays symbolic (a SYMBOL node) instead of being baked in. The aten graph, decomposed to
primitives, is then lowered node by node; random ops become RAND nodes fed by one seed.
Anything the kernels cannot take becomes an EXTERN node with the reason recorded.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import sympy
import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from memfuse.ir import views
from memfuse.base.debug import timed
from memfuse.base.launch import outside_trace
from memfuse.capture.indexing import index_by_aranges
from memfuse.ir.graph import (BINARY, COMPARISON, EXTERNAL, FUSIBLE, RANDOM, UNARY, Cast, Constant, Extern, Graph, Index, Kind,
                 Matmul, Node, Op, Reduce, Seeded, Strided, Symbol, Value, ValueRef, fits, renamed, value_refs, verify)
from memfuse.ir.ops import OPS, accumulate_dtype
from memfuse.ir.patterns import RULES, Reads, called_op, rewrite_aten, rule, trace_modes

aten = torch.ops.aten
prims = torch.ops.prims


def decomposition_table() -> dict:
    """core ATen plus the composites memfuse wants as primitives (norms, dropout, activations).
    Built once per process (30-80 ms); callers get their own copy of the dict."""
    return dict(_decomposition_table())


@functools.cache
def _decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions([
        aten.native_layer_norm, aten.native_layer_norm_backward, aten.native_dropout,
        aten.native_dropout_backward, aten._softmax, aten._softmax_backward_data,
        aten._log_softmax, aten._log_softmax_backward_data, aten.gelu, aten.gelu_backward,
        aten.silu, aten.silu_backward, aten.sigmoid_backward, aten.tanh_backward,
        aten.threshold_backward, aten.rms_norm, aten.elu, aten.leaky_relu, aten.hardtanh,
        aten.linalg_vector_norm,
    ]))
    # core ATen decomposes CPU flash attention into math that returns the attention weights
    # where the op returns its logsumexp; the (undecomposed) backward then reads the weights as
    # the logsumexp: wrong gradients. torch's comment says inductor must exclude it; so do we.
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    # select's backward is one windowed read (memfuse.ir.views); decomposed, it becomes arange/where
    # over shapes outside the [M, D] space
    table.pop(aten.select_backward.default, None)
    # An embedding's backward stays aten's own kernel. Decomposed, it is an index_put with
    # accumulate, which CUDA runs by sorting the indices and adding each run of duplicates in turn:
    # BERT's token-type table (2 rows read 16384 times) took 11.6 ms a step on an H100 that way.
    table.pop(aten.embedding_dense_backward.default, None)
    return table


@dataclass
class Captured:
    """The joint graph in memfuse IR, with what the later stages need to know about it."""
    joint: Graph                       # inputs: primals, [seed], tangents
    num_primals: int
    num_tangents: int
    num_fwd_outputs: int
    symbols: dict                      # sympy.Symbol -> (primal index, dim): read per call
    hints: dict                        # sympy.Symbol -> traced size
    has_seed: bool
    fallbacks: list = field(default_factory=list)   # (node name, target, reason)
    specialized: Optional[str] = None  # why leading shapes became part of the compile key
    layout_guards: list = field(default_factory=list)   # guards on strides, checked per call (api)
    stride_symbols: dict = field(default_factory=dict)  # sympy.Symbol -> (primal index, dim) of a stride
    differentiable_outputs: list = field(default_factory=list)   # forward outputs with a tangent
    aten_graph: Optional[torch.fx.GraphModule] = None
    merged: dict = field(default_factory=dict)   # a node dropped as a duplicate -> the one kept (explain)
    decisions: dict = field(default_factory=dict)     # pattern name -> its decisions (memfuse.ir.patterns)
    # patterns.OutputHooks: what the caller's outputs need after a run (its last outputs are for them)
    output_hooks: list = field(default_factory=list)


class MutatedInputError(RuntimeError):
    """The traced function writes into one of its inputs (an argument, a module's buffer) in place."""


@timed("capture")
def capture(fn: Callable, args: Sequence[torch.Tensor], *, trace_joint: bool,
            static_inputs: Sequence[bool] = ()) -> Captured:
    """Trace `fn(*args)` (tensor args only) and lower it. `static_inputs[i]`: keep all dims of
    input i static (parameters)."""
    shape_env = ShapeEnv()
    # allow_non_fake_inputs: tensors the function closes over become graph constants
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    fakes = [_fake_input(fake_mode, t, static=i < len(static_inputs) and static_inputs[i])
             for i, t in enumerate(args)]
    with compiling(), trace_modes():
        gm = _export(fn, tuple(fakes), trace_joint)
    symbols, hints = _symbol_sources(fakes)
    # read in place, by their strides; a last stride of 1 is part of the compile key (api._key)
    strided = {i: t.stride(-1) == 1 for i, t in enumerate(args) if not t.is_contiguous()}
    captured = _Lowering(gm, symbols, hints, strided).run(num_primals=len(args), trace_joint=trace_joint)
    captured.stride_symbols = _stride_sources(fakes, symbols)
    captured.specialized, captured.layout_guards = _guards(shape_env, symbols, captured.stride_symbols)
    captured.aten_graph = gm
    captured.differentiable_outputs = _differentiable_outputs(captured, fn, fakes)
    return captured


def lower_graph(gm: torch.fx.GraphModule, symbols: dict, hints: dict, *, num_primals: int,
                trace_joint: bool) -> Captured:
    """Lower an AOTAutograd graph traced elsewhere (memfuse.fronts.backend: Dynamo's), already decomposed
    with `decomposition_table()`: a joint graph (primals, tangents) or a forward-only one.
    `symbols` maps each size symbol to where a call reads it; `hints` gives its traced value."""
    return _Lowering(gm, symbols, hints).run(num_primals=num_primals, trace_joint=trace_joint)


@contextlib.contextmanager
def compiling():
    """`torch.compiler.is_compiling()` answers True while memfuse traces, as it does under
    torch.compile and torch.export (non-strict export sets the same flag): libraries then take
    their trace-friendly paths. HuggingFace's attention-mask code, for one, otherwise branches on
    `mask.all()`, a data-dependent value no trace can follow."""
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before


@timed("trace")
def _export(fn: Callable, fakes: tuple, trace_joint: bool) -> torch.fx.GraphModule:
    """The decomposed aten graph of `fn`. Outputs that alias an input (`return x`, a view of
    x) are returned as copies; a function that mutates an input is refused with the reason."""
    try:
        return _without_unused(aot_export_joint_simple(fn, fakes, trace_joint=trace_joint,
                                                       decompositions=decomposition_table()))
    except RuntimeError as e:
        if "does not support input mutations" in str(e):
            raise MutatedInputError("memfuse: the function modifies one of its input tensors in place (x.add_(...), "
                                    "x[...] = ...); memfuse compiles functions that leave their inputs unchanged") from e
        if "does not support outputs that alias inputs" not in str(e):
            raise

    def copying_outputs(*args):
        return tuple(o.clone() for o in fn(*args))
    return _without_unused(aot_export_joint_simple(copying_outputs, fakes, trace_joint=trace_joint,
                                                   decompositions=decomposition_table()))


def _without_unused(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` without the values nothing reads (a pattern's swap, memfuse.patterns, leaves what it
    replaced in the trace). Random draws stay (they advance the generator as in eager), and so
    do checks, but for NOOP_ATEN's checks of a value that only they read (the trace made them)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        checks_the_unused = node.target in NOOP_ATEN and all(
            set(i.users) == {node} for i in node.all_input_nodes)
        if checks_the_unused or (not node.is_impure() and _pure(node.target)):
            gm.graph.erase_node(node)
    return gm


def _composed_permutes(gm: torch.fx.GraphModule) -> bool:
    """A permute of a permute becomes one permute of the first one's input, or that input itself
    where the two undo each other: the joint graph transposes a linear's weight for the forward
    and that transpose back for the input's gradient (a call on the host each), and returns the
    weight's gradient as a transpose of a transposed matmul (a copy kernel, where the matmul's
    output has the weight's layout already). A returned pair returns its input then, as a graph
    that returns an input does (export copies a forward output that aliases an input first).
    Whether any changed (their inner permutes may be unread now)."""
    permute = torch.ops.aten.permute.default
    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=permute):
        inner = node.args[0]
        if not isinstance(inner, torch.fx.Node) or inner.target is not permute:
            continue
        rank = len(node.args[1])
        dims = [inner.args[1][d % rank] % rank for d in node.args[1]]
        if dims == list(range(rank)):
            node.replace_all_uses_with(inner.args[0])
        else:
            node.args = (inner.args[0], dims)
        changed = True
    return changed


def _pure(target) -> bool:
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)


def _differentiable_outputs(captured: "Captured", fn: Callable, fakes: list) -> list:
    """Forward outputs that receive a tangent (the outputs AOTAutograd made tangents for, in
    order): floating values that depend on an input that requires grad, read off the graph.
    Where that count disagrees with the tangents (an output autograd tracks although its value
    is constant, like x ** 0), eager autograd decides, on the fake inputs."""
    if captured.num_tangents == 0:
        return []
    chosen = _dependent_outputs(captured, [t.requires_grad for t in fakes])
    if len(chosen) == captured.num_tangents:
        return chosen
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        outputs = fn(*fakes)     # the no-op hooks keep this run out of any hooks the user set
    chosen = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if len(chosen) != captured.num_tangents:
        raise RuntimeError(f"memfuse: found {len(chosen)} differentiable outputs but the trace has "
                           f"{captured.num_tangents} tangents")
    return chosen


def _dependent_outputs(captured: "Captured", requires_grad: list) -> list:
    graph = captured.joint
    tracked = {name for name, rg in zip(graph.inputs, requires_grad) if rg}
    for name, node in graph.nodes.items():
        if any(i in tracked for i in node.inputs) and not _untracked(graph, node):
            tracked.add(name)
    outputs = graph.outputs[:captured.num_fwd_outputs]
    return [i for i, o in enumerate(outputs) if o in tracked and graph[o].value.is_floating]


def _untracked(graph: Graph, node: Node) -> bool:
    """A value autograd does not track though it reads tracked ones: an output of a registered op
    its rule says so of (memfuse.ir.patterns, ExternRule.untracked: the chunked loss head's
    log-sum-exps and formed gradients)."""
    if node.op is not Op.GETITEM:
        return False
    call = graph[node.inputs[0]]
    untracked = rule(call.attr.target).untracked if call.op is Op.EXTERN else None
    return untracked is not None and node.attr.index in untracked(call.attr)


def _fake_input(mode: FakeTensorMode, t: torch.Tensor, static: bool) -> torch.Tensor:
    dims = [DimDynamic.STATIC if static or i == t.dim() - 1 else DimDynamic.DYNAMIC
            for i in range(t.dim())]
    return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def _symbol_sources(fakes) -> tuple[dict, dict]:
    symbols, hints = {}, {}
    for i, fake in enumerate(fakes):
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol) and expr not in symbols:
                    symbols[expr] = (i, d)
                    hints[expr] = size.node.hint
    return symbols, hints


def _stride_sources(fakes, sizes: dict) -> dict:
    """symbol -> (input, dim) of the strides that are symbols of their own (a non-contiguous
    input's: a slice's row stride is not D)."""
    strides = {}
    for i, fake in enumerate(fakes):
        for d, stride in enumerate(fake.stride()):
            expr = stride.node.expr if isinstance(stride, torch.SymInt) else None
            if isinstance(expr, sympy.Symbol) and expr not in sizes and expr not in strides:
                strides[expr] = (i, d)
    return strides


def _guards(shape_env: ShapeEnv, sizes: dict, strides: dict) -> tuple:
    """(why leading shapes join the compile key, or None; the layout guards). `s_a == s_b` over
    sizes is implied by the compile key. A guard that reads strides (a contiguity check inside a
    decomposition: Ne(row stride, D)) holds for any batch size of the same layout: the caller
    checks it per call (api) instead of specializing. Any other guard specializes. (The program
    itself reads every stride per call; what the trace assumed of them picks between branches
    that compute the same values, like the layout of a decomposition's output.)"""
    # sizes found equal are one symbol now (the key holds equal sizes equal); a size found to be
    # a constant stays itself, and its guard specializes
    renamed = {s: r for s, r in shape_env.replacements.items() if isinstance(r, sympy.Symbol)}
    specialized, layout = None, []
    for guard in shape_env.guards:
        expr = guard.expr.xreplace(renamed)
        free = expr.free_symbols
        if expr == sympy.true or isinstance(expr, sympy.Eq) and all(
                isinstance(a, sympy.Symbol) and a not in strides for a in expr.args):
            continue
        if free & strides.keys() and free <= sizes.keys() | strides.keys():
            layout.append(expr)
        elif specialized is None:
            specialized = f"the trace guards on {expr}"
    return specialized, layout


def to_expr(size) -> sympy.Expr:
    if isinstance(size, (torch.SymInt, torch.SymFloat)):
        return plain_sympy(size.node.expr)
    return sympy.Integer(size) if isinstance(size, int) else sympy.Float(size)


def plain_sympy(expr: sympy.Expr) -> sympy.Expr:
    """torch's sympy functions (FloatTrueDiv, FloorDiv, ToFloat, ...) as plain sympy, which
    the runtime turns into Python with lambdify."""
    from torch.utils._sympy import functions as F
    rules = [
        ((F.FloatTrueDiv, F.IntTrueDiv), lambda a, b: a / b),
        ((F.FloorDiv,), lambda a, b: sympy.floor(a / b)),
        ((F.CeilDiv,), lambda a, b: sympy.ceiling(a / b)),
        ((F.ToFloat, F.Identity), lambda a: a),
        ((F.TruncToFloat, F.TruncToInt), lambda a: sympy.sign(a) * sympy.floor(sympy.Abs(a))),
        ((F.FloorToInt,), lambda a: sympy.floor(a)),
        ((F.CeilToInt,), lambda a: sympy.ceiling(a)),
        ((F.PowByNatural, F.FloatPow), lambda a, b: a ** b),
        ((F.Mod, F.PythonMod), lambda a, b: sympy.Mod(a, b)),
        ((F.Max,), lambda *a: sympy.Max(*a)),
        ((F.Min,), lambda *a: sympy.Min(*a)),
    ]
    for classes, plain in rules:
        for cls in classes:
            expr = expr.replace(cls, plain)
    return expr


def classify(fake) -> Value:
    """Place a traced tensor in the [M, D] space (module docstring of ir.py)."""
    if not isinstance(fake, torch.Tensor):
        return Value(None, Kind.TENSOR)
    return place(fake.dtype, tuple(to_expr(s) for s in fake.shape))


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


POINTWISE_ATEN = {
    aten.add.Tensor: Op.ADD, aten.add.Scalar: Op.ADD, aten.sub.Tensor: Op.SUB,
    aten.sub.Scalar: Op.SUB, aten.mul.Tensor: Op.MUL, aten.mul.Scalar: Op.MUL,
    aten.div.Tensor: Op.DIV, aten.div.Scalar: Op.DIV, aten.neg.default: Op.NEG,
    aten.abs.default: Op.ABS, aten.exp.default: Op.EXP, aten.log.default: Op.LOG,
    aten.sqrt.default: Op.SQRT, aten.rsqrt.default: Op.RSQRT, aten.sigmoid.default: Op.SIGMOID,
    aten.tanh.default: Op.TANH, aten.erf.default: Op.ERF, aten.reciprocal.default: Op.RECIPROCAL,
    aten.sin.default: Op.SIN, aten.cos.default: Op.COS, aten.tan.default: Op.TAN,
    aten.exp2.default: Op.EXP2, aten.expm1.default: Op.EXPM1, aten.log1p.default: Op.LOG1P,
    aten.log2.default: Op.LOG2, aten.log10.default: Op.LOG10, aten.floor.default: Op.FLOOR,
    aten.ceil.default: Op.CEIL, aten.round.default: Op.ROUND, aten.trunc.default: Op.TRUNC,
    aten.sign.default: Op.SIGN, aten.isnan.default: Op.ISNAN, aten.isinf.default: Op.ISINF,
    aten.pow.Tensor_Tensor: Op.POW, aten.pow.Scalar: Op.POW,
    aten.fmod.Tensor: Op.FMOD, aten.fmod.Scalar: Op.FMOD, aten.remainder.Tensor: Op.REMAINDER,
    aten.remainder.Scalar: Op.REMAINDER, aten.remainder.Scalar_Tensor: Op.REMAINDER,
    aten.maximum.default: Op.MAXIMUM, aten.minimum.default: Op.MINIMUM,
    aten.eq.Tensor: Op.EQ, aten.eq.Scalar: Op.EQ, aten.ne.Tensor: Op.NE, aten.ne.Scalar: Op.NE,
    aten.lt.Tensor: Op.LT, aten.lt.Scalar: Op.LT, aten.le.Tensor: Op.LE, aten.le.Scalar: Op.LE,
    aten.gt.Tensor: Op.GT, aten.gt.Scalar: Op.GT, aten.ge.Tensor: Op.GE, aten.ge.Scalar: Op.GE,
    aten.logical_not.default: Op.LOGICAL_NOT, aten.logical_and.default: Op.LOGICAL_AND,
    aten.logical_or.default: Op.LOGICAL_OR, aten.logical_xor.default: Op.LOGICAL_XOR,
    aten.bitwise_not.default: Op.BITWISE_NOT, aten.bitwise_and.Tensor: Op.BITWISE_AND,
    aten.bitwise_and.Scalar: Op.BITWISE_AND, aten.bitwise_or.Tensor: Op.BITWISE_OR,
    aten.bitwise_or.Scalar: Op.BITWISE_OR, aten.bitwise_xor.Tensor: Op.BITWISE_XOR,
    aten.bitwise_xor.Scalar: Op.BITWISE_XOR, aten.where.self: Op.WHERE,
    aten.atan.default: Op.ATAN, aten.atan2.default: Op.ATAN2, aten.asin.default: Op.ASIN,
    aten.acos.default: Op.ACOS, aten.sinh.default: Op.SINH, aten.cosh.default: Op.COSH,
    aten.asinh.default: Op.ASINH, aten.acosh.default: Op.ACOSH, aten.atanh.default: Op.ATANH,
    aten.erfc.default: Op.ERFC, aten.erfinv.default: Op.ERFINV, aten.lgamma.default: Op.LGAMMA,
    aten.digamma.default: Op.DIGAMMA,
    prims.add.default: Op.ADD, prims.sub.default: Op.SUB, prims.mul.default: Op.MUL,
    prims.neg.default: Op.NEG, prims.rsqrt.default: Op.RSQRT, prims.sqrt.default: Op.SQRT,
    prims.exp.default: Op.EXP, prims.log.default: Op.LOG, prims.abs.default: Op.ABS,
    prims.sin.default: Op.SIN, prims.cos.default: Op.COS, prims.tan.default: Op.TAN,
    prims.exp2.default: Op.EXP2, prims.expm1.default: Op.EXPM1, prims.log1p.default: Op.LOG1P,
    prims.log2.default: Op.LOG2, prims.log10.default: Op.LOG10, prims.floor.default: Op.FLOOR,
    prims.ceil.default: Op.CEIL, prims.trunc.default: Op.TRUNC, prims.sign.default: Op.SIGN,
    prims.tanh.default: Op.TANH, prims.erf.default: Op.ERF, prims.reciprocal.default: Op.RECIPROCAL,
    prims.maximum.default: Op.MAXIMUM, prims.minimum.default: Op.MINIMUM, prims.pow.default: Op.POW,
    prims.eq.default: Op.EQ, prims.ne.default: Op.NE, prims.lt.default: Op.LT, prims.le.default: Op.LE,
    prims.gt.default: Op.GT, prims.ge.default: Op.GE, prims.where.default: Op.WHERE,
    prims.bitwise_and.default: Op.BITWISE_AND, prims.bitwise_or.default: Op.BITWISE_OR,
    prims.bitwise_xor.default: Op.BITWISE_XOR, prims.bitwise_not.default: Op.BITWISE_NOT,
    prims.atan.default: Op.ATAN, prims.atan2.default: Op.ATAN2, prims.asin.default: Op.ASIN,
    prims.acos.default: Op.ACOS, prims.sinh.default: Op.SINH, prims.cosh.default: Op.COSH,
    prims.asinh.default: Op.ASINH, prims.acosh.default: Op.ACOSH, prims.atanh.default: Op.ATANH,
    prims.erfc.default: Op.ERFC, prims.erf_inv.default: Op.ERFINV, prims.lgamma.default: Op.LGAMMA,
    prims.digamma.default: Op.DIGAMMA,
}
# prims.div divides integers with truncation: a float quotient only for float operands.
DIVIDE_ATEN = {aten.div.Tensor_mode, aten.div.Scalar_mode, prims.div.default, prims.fmod.default}
# (Targets the decomposition table rewrites, like reshape or zeros_like, never arrive: no rows.)
# Views that move elements: read in place from memory through an access map (memfuse.ir.views).
STRIDED_ATEN = {aten.permute.default, aten.slice.Tensor, aten.select.int, aten.cat.default,
                aten.slice_scatter.default, aten.select_backward.default, aten.constant_pad_nd.default}
VIEW_ATEN = {aten.view.default, aten.expand.default, aten.clone.default, aten.alias.default,
             aten.squeeze.dims, aten.unsqueeze.default, aten.lift_fresh_copy.default}
CAST_ATEN = {aten._to_copy.default, prims.convert_element_type.default, aten.copy.default}
RAND_ATEN = {aten.rand_like.default, aten.rand.default}
# Tensors filled with one value (empty ones hold whatever: 0): a broadcast scalar.
FILL_ATEN = {aten.full.default, aten.full_like.default, aten.empty_permuted.default, aten.empty.memory_format,
             aten.scalar_tensor.default, aten._efficientzerotensor.default}
NOOP_ATEN = {aten._assert_tensor_metadata.default}   # checks the trace already made; no value
# aten calls that read a tensor of any strides where it lies (aten.view does not: it may need a copy)
ANY_STRIDES_ATEN = {aten.mm.default, aten.mm.dtype, aten.bmm.default, aten.addmm.default, aten.permute.default,
                    aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.expand.default,
                    aten.unsqueeze.default, aten.squeeze.dims, aten.alias.default}
# Ops a pattern registered say how they read (memfuse.ir.patterns, ExternRule.reads): through any
# strides (reads_any_strides), or any whose last is 1 (attention).


def reads_any_strides(target) -> bool:
    """Whether an extern call reads its tensor operands in any strides, where they lie."""
    return target in ANY_STRIDES_ATEN or rule(target).reads is Reads.ANY_STRIDES


# aten views of a view kept in its strides, made reshapes (a view of them may need a copy)
RESHAPED_ATEN = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Matmuls: extern (cuBLAS) calls whose operands memfuse.schedule.padding may align (ir.Matmul).
MATMUL_ATEN = {aten.mm.default, aten.bmm.default, aten.addmm.default}
REDUCE_ATEN = {aten.sum.dim_IntList: Op.SUM, aten.amax.default: Op.MAX, aten.amin.default: Op.MIN,
               prims.sum.default: Op.SUM, aten.prod.dim_int: Op.PROD, aten.argmax.default: Op.ARGMAX,
               aten.argmin.default: Op.ARGMIN, aten.prod.default: Op.PROD}
# A reduction over every dim finishes its M row results with one of these.
TOTALS = {Op.SUM: aten.sum.default, Op.MAX: aten.amax.default, Op.MIN: aten.amin.default,
          Op.PROD: aten.prod.default}
EXTREME_ATEN = {aten.max.dim: (Op.MAX, Op.ARGMAX), aten.min.dim: (Op.MIN, Op.ARGMIN)}
POLYGAMMA_ORDERS = {0: Op.DIGAMMA, 1: Op.TRIGAMMA}   # polygamma(n, x): the orders with a helper
# x ** c for the exponents torch's pow kernel special-cases (0, 2 and 3 have rules of their own)
POW_AS_OP = {0.5: Op.SQRT, -0.5: Op.RSQRT, 1: Op.VIEW, -1: Op.RECIPROCAL}

# Targets with a rule of their own in _Lowering.lower_tensor_op: what each becomes.
SPECIAL_ATEN = {
    aten.relu.default: "maximum(x, 0)",
    aten.clamp.default: "maximum, minimum", aten.clamp.Tensor: "maximum, minimum",
    aten.pow.Tensor_Scalar: "x*x, x*x*x, sqrt, rsqrt, reciprocal, a fill of 1, or pow",
    aten.mean.dim: "sum * 1/count, over D, over M, or over some leading dims (a summed strided read)",
    aten.sum.dim_IntList: "sum over D or over M; over some leading dims, a strided read that adds up their rows "
                          "(a broadcast's gradient)",
    aten.expand.default: "view; a strided read with stride 0 along the leading dims it repeats",
    aten.mean.default: "row sums * 1/D in the kernel, then aten's mean of the M row results",
    aten.var.correction: "sum -> mean, then the sum of squared deviations (over D)",
    aten.var_mean.correction: "sum -> mean, then the sum of squared deviations (over D)",
    aten.permute.default: "view when only size-1 dims move; else a strided read of a tensor in memory "
                          "(columns by a stride when the last dim moves)",
    aten.slice.Tensor: "view when it keeps a whole dim; else a strided read of a tensor in memory",
    aten.select.int: "a strided read of a tensor in memory",
    aten.split_with_sizes.default: "strided reads of a tensor in memory, one per part",
    aten.cat.default: "windowed strided reads of the parts in memory, each where its range lies (a slice of the cat "
                      "moves their windows: torch.diff's prepend); along D, a part computed from reads "
                      "(rotate_half's -x2) is computed at its columns",
    aten.slice_scatter.default: "a windowed strided read of the source over the base (step 1; else an extern); "
                                "along D, a source computed from reads is computed at its columns",
    aten.any.dim: "sum of the booleans as fp32 > 0, over D or over M",
    aten.select_backward.default: "a windowed strided read of the gradient over zeros",
    aten.constant_pad_nd.default: "a windowed strided read of the source, shifted by each dim's pad, over the "
                                  "fill value (a negative pad crops; a slice of the pad moves the window); pads by "
                                  "size symbols: an extern",
    aten.scatter.src: "where(column == index, src, self) for an index known to lie in [0, D): from argmax/argmin "
                      "over D (max.dim's backward) or checked by a gather of the graph (its IndexCheck, or aten's); "
                      "else an extern",
    aten.scatter.value: "where(column == index, value, self) for an index known to lie in [0, D): from "
                        "argmax/argmin over D or checked by a gather of the graph (cross-entropy's one-hot: its "
                        "forward's IndexCheck); else an extern",
    aten.gather.default: "one index per row of an [M, D] value: the row's sum of where(column == index, x, 0), "
                         "fused where x is computed (cross-entropy's pick of the target's log-probability: no "
                         "[M, D] write); an index not known to lie in [0, D) is checked in the same call "
                         "(IndexCheck: an error, as aten's); else an extern",
    aten.polygamma.default: "digamma (order 0), trigamma (order 1: digamma's derivative); higher orders: an extern",
}

# Ops memfuse knows it does not fuse, and why (the coverage table lists them too).
EXTERN_REASONS = {
    aten.mm.default: "matrix multiply: an aten (cuBLAS) call",
    aten.bmm.default: "batched matrix multiply: an aten (cuBLAS) call",
    aten.addmm.default: "matrix multiply: an aten (cuBLAS) call",
    aten.flip.default: "flip reverses element order",
    aten.scatter.src: "scatter: data-dependent addressing",
    aten.scatter.value: "scatter: data-dependent addressing",
    aten.gather.default: "gather: data-dependent addressing (fused only along the last dim of an [M, D] value, "
                         "one index per row)",
    aten.index.Tensor: "indexing: data-dependent addressing (by aranges along distinct dims it is a view: "
                       "memfuse.capture.indexing)",
    aten.cumsum.default: "scan along a dim",
    aten.cumprod.default: "scan along a dim",
}


def extern_reasons() -> dict:
    """EXTERN_REASONS and the reasons of the ops patterns registered (memfuse.ir.patterns)."""
    return {**EXTERN_REASONS, **{op: r.reason for op, r in RULES.items() if r.reason}}


def lowering_table() -> dict:
    """Every aten/prims target capture lowers to IR nodes -> what it becomes, ordered by name (the
    same in every process: several of the tables are sets)."""
    table = {t: op.value for t, op in POINTWISE_ATEN.items()}
    table.update({t: "div, trunc_divide, floor_divide or fmod" for t in DIVIDE_ATEN})
    table.update({t: "view" for t in VIEW_ATEN})
    table.update({t: "cast (view when the dtype stays)" for t in CAST_ATEN})
    table.update({t: "view of a scalar constant" for t in FILL_ATEN})
    table.update({t: "rand: philox(seed, element index)" for t in RAND_ATEN})
    table.update({t: "nothing (a check the trace already made)" for t in NOOP_ATEN})
    table.update({t: op.value for t, op in REDUCE_ATEN.items()})
    table.update({t: f"{a.value} and {b.value}" for t, (a, b) in EXTREME_ATEN.items()})
    table.update(SPECIAL_ATEN)
    return dict(sorted(table.items(), key=lambda row: str(row[0])))


class NotFusible(Exception):
    """Raised inside a lowering rule: the node becomes an EXTERN, with this reason."""


# How many pointwise ops deep a cat's part is rebuilt in registers (columns_in_registers).
COLUMN_DEPTH = 6
# A view of a sum over leading dims of at most this many terms sums again through the view
# (_Lowering.view_of_small_sum): each reader repeats the sum, which a handful of loads allows.
SMALL_SUM = 8
# How many ops deep a permuted read of a computed value is rebuilt at the permuted index.
PERMUTE_DEPTH = 12


@dataclass(frozen=True)
class AtenView:
    """An aten view no fx node names (a split's part as `aten.narrow`), as keep_aten_views reads
    one: its target, fx arguments and fake value."""
    target: object
    args: tuple
    meta: dict
    kwargs: dict = field(default_factory=dict)


class _Lowering:
    def __init__(self, gm: torch.fx.GraphModule, symbols: dict, hints: dict, strided_inputs=None):
        self.gm = gm
        # primal positions passed in with non-contiguous strides -> whether their last stride is 1
        self.strided_inputs = strided_inputs or {}
        self.last_stride_one: dict = {}   # non-contiguous input -> whether its last stride is 1
        self.maps: dict = {}           # STRIDED node -> its views.AccessMap (sympy), for composing views
        self.windowed: dict = {}       # windowed STRIDED read (a pad, a cat part over the parts before it)
        #                                -> (its AccessMap, window, fallback), for slices of it
        self.summed: dict = {}         # summed STRIDED read (no window) -> (its AccessMap over the value's dims
        #                                then the summed ones, the summed sizes), to read it at a window
        self.reads: dict = {}          # every STRIDED node -> (AccessMap, window, fallback, summed sizes), to
        #                                read it again through a permute of a value computed from it
        self.in_place: dict = {}       # non-contiguous input -> the STRIDED node that reads it
        self.broadcasts: dict = {}     # (value, shape) -> the STRIDED node that reads it broadcast
        self.aten_views: dict = {}     # STRIDED node lowered from an aten view op -> its fx node
        self.size_symbols: dict = {}   # sympy expression -> SYMBOL node
        self.symbols = symbols
        self.hints = hints
        self.graph = Graph()
        self.env: dict = {}            # fx node -> value name (or tuple of names)
        self.constants: dict = {}
        self.fallbacks: list = []
        self.rng_streams = 0
        self.tensor_constants: dict = {}   # constant name -> the 0-d tensor it came from

    def run(self, num_primals: int, trace_joint: bool) -> Captured:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        rewritten, decisions = rewrite_aten(self.gm)      # the patterns' (memfuse.ir.patterns)
        if rewritten | _composed_permutes(self.gm) | index_by_aranges(self.gm):
            _without_unused(self.gm)          # the nodes nothing reads now
        for position, node in enumerate(placeholders):
            self.env[node] = self.graph.add(Node(node.name, Op.INPUT, (), classify(node.meta["val"])))
            self.graph.inputs.append(node.name)
            if position in self.strided_inputs and position < num_primals:
                self.in_place[node.name] = None   # wrapped on first use (operand)
                self.last_stride_one[node.name] = self.strided_inputs[position]
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                self.env[node] = self.lower(node)
            elif node.op == "get_attr":
                self.env[node] = self.lower_tensor_constant(node)
            elif node.op == "output":
                outs = node.args[0]
                self.graph.outputs = [self.env[o] if o is not None else None for o in outs]
        self.graph, merged = merge_stored_duplicates(self.graph)
        self.env = {fx: _merged_name(name, merged) for fx, name in self.env.items()}
        self.keep_aten_views()
        has_seed = self.rng_streams > 0
        if has_seed:   # the seed sits between primals and tangents in the call order
            self.graph.inputs.insert(num_primals, "seed")
        num_tangents = len(placeholders) - num_primals
        verify(self.graph)
        # a joint trace whose outputs need no gradient (ints, bools) holds the forward only
        has_grads = trace_joint and num_tangents > 0
        return Captured(self.graph, num_primals, num_tangents,
                        len(self.graph.outputs) - (num_primals if has_grads else 0),
                        self.symbols, self.hints, has_seed, self.fallbacks, merged=merged,
                        decisions=decisions)

    # -- helpers ---------------------------------------------------------------------
    def add(self, op: Op, inputs, value: Value, attr=None, name: Optional[str] = None) -> str:
        base = name or op.value
        unique, k = base, 0
        while unique in self.graph.nodes:
            k += 1
            unique = f"{base}_{k}"
        return self.graph.add(Node(unique, op, tuple(inputs), value, attr))

    def const(self, value, dtype: Optional[torch.dtype] = None) -> str:
        """A scalar constant; with `dtype`, the value rounded to it as a 0-d tensor of that dtype."""
        if dtype is None:
            dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) \
                else torch.float32
        else:
            value = torch.tensor(value, dtype=dtype).item()
        key = (type(value), value, dtype)
        if key not in self.constants:
            self.constants[key] = self.add(Op.CONSTANT, (), Value(dtype, Kind.SCALAR), Constant(value),
                                           name="const")
        return self.constants[key]

    def operand(self, arg) -> str:
        """The value name of an fx argument: a traced value, a Python number, or a size."""
        if isinstance(arg, torch.fx.Node):
            name = self.env[arg]
            if isinstance(name, str) and name in self.in_place:
                return self.read_in_place(name)
            return name
        if isinstance(arg, (bool, int, float)):
            return self.const(arg)
        raise NotFusible(f"argument {arg!r} is not a tensor or number")

    def seed(self) -> str:
        if "seed" not in self.graph.nodes:
            self.graph.add(Node("seed", Op.SEED, (), Value(torch.int64, Kind.SCALAR)))
        return "seed"

    def check_fits(self, op: Op, inputs, value: Value) -> None:
        for inp in inputs:
            if not fits(self.graph[inp].value, value, op):
                raise NotFusible(f"{self.graph[inp].value.kind.value} input {inp} does not fit a "
                                 f"{value.kind.value} result in one [M, D] space")

    # -- lowering rules ----------------------------------------------------------------
    def lower(self, node: torch.fx.Node):
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            return self.lower_symbol(node, val)
        try:
            name = self.lower_tensor_op(node, val)
        except NotFusible as reason:
            return self.lower_extern(node, val, str(reason))
        if getattr(node.target, "is_view", False) and name == node.name and \
                self.graph[name].op in (Op.STRIDED, Op.VIEW):
            self.aten_views[name] = node
        return name

    def lower_symbol(self, node, val) -> str:
        expr = to_expr(val) if not isinstance(val, (torch.SymBool, bool)) else None
        if expr is None:
            raise NotImplementedError(f"memfuse: boolean size expression {node.format_node()}")
        if expr.free_symbols:
            dtype = torch.float32 if isinstance(val, (torch.SymFloat, float)) else torch.int64
            return self.add(Op.SYMBOL, (), Value(dtype, Kind.SCALAR), Symbol(expr), name=node.name)
        number = float(expr) if isinstance(val, (torch.SymFloat, float)) else int(expr)
        return self.const(number)

    def lower_tensor_op(self, node, val):
        target = node.target
        if target is operator.getitem:
            source = self.env[node.args[0]]
            if isinstance(source, tuple):
                return source[node.args[1]]
            return self.add(Op.GETITEM, (source,), classify(val), Index(node.args[1]), name=node.name)
        if target in NOOP_ATEN:
            return None
        if target in (aten.var_mean.correction, aten.var.correction):
            return self.lower_var_mean(node, val)
        if target in EXTREME_ATEN:
            return self.lower_extreme(node, val)
        if target is aten.split_with_sizes.default:
            return self.lower_split(node, val)
        if not isinstance(val, torch.Tensor):
            raise NotFusible(extern_reasons().get(target, "produces a tuple"))
        value = classify(val)
        if value.kind is Kind.TENSOR:
            raise NotFusible(f"shape {tuple(val.shape)} is outside the [M, D] space")
        if target in POINTWISE_ATEN:
            return self.lower_pointwise(node, POINTWISE_ATEN[target], value)
        if target in DIVIDE_ATEN:
            return self.lower_divide(node, value)
        if target is aten.relu.default:
            return self.pointwise(Op.MAXIMUM, [self.operand(node.args[0]), self.const(0.0)], value, node.name)
        if target in (aten.clamp.default, aten.clamp.Tensor):
            return self.lower_clamp(node, value)
        if target is aten.pow.Tensor_Scalar:
            return self.lower_pow(node, value)
        if target in VIEW_ATEN or self.keeps_order(node):
            return self.lower_view(node, value)
        if target in STRIDED_ATEN:
            return self.lower_strided(node, val, value)
        if target in CAST_ATEN:
            return self.lower_cast(node, value)
        if target in FILL_ATEN:
            return self.lower_fill(node, value)
        if target in RAND_ATEN:
            return self.lower_rand(node, value)
        if target in REDUCE_ATEN:
            return self.lower_reduction(node, REDUCE_ATEN[target], value)
        if target is aten.any.dim:
            return self.lower_any(node, value)
        if target in (aten.scatter.src, aten.scatter.value):
            return self.lower_scatter(node, value)
        if target is aten.gather.default:
            return self.lower_gather(node, value)
        if target in (aten.mean.dim, aten.mean.default):
            return self.lower_mean(node, value)
        if target is aten.polygamma.default:
            return self.lower_polygamma(node, value)
        raise NotFusible(extern_reasons().get(target, f"no lowering for {target}"))

    def keeps_order(self, node) -> bool:
        """A permute or slice that leaves every element where it was (moves size-1 dims, or
        slices a whole dim): a plain view."""
        source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(source, torch.Tensor):
            return False
        if node.target is aten.permute.default:
            # (static 1s only: comparing a size symbol would add a guard to the trace)
            moved = [d % source.dim() for d in node.args[1] if not (isinstance(source.shape[d], int)
                                                                   and source.shape[d] == 1)]
            return moved == sorted(moved)
        if node.target is aten.slice.Tensor:
            dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
            size = source.shape[dim]
            whole_end = end is None or (isinstance(end, int) and isinstance(size, int) and end >= size) \
                or (isinstance(end, int) and end >= 2 ** 62)
            return start in (0, None) and step == 1 and whole_end
        return False

    # -- views read in place (memfuse.ir.views) ---------------------------------------------
    def lower_view(self, node, value: Value) -> str:
        """A view that keeps the [M, D] order is a register copy; one that does not (a reshape
        that splits D, a size-1 dim that changes the space) reads its source in place."""
        x = self.operand(node.args[0])
        if fits(self.graph[x].value, value, Op.VIEW):
            return self.add(Op.VIEW, [x], value, name=node.name)
        read = self.broadcast(x, value) if node.target is aten.expand.default else x
        if read != x:
            return read if self.graph[read].value.shape == value.shape else \
                self.add(Op.VIEW, [read], value, name=node.name)
        if node.target is aten.expand.default or self.graph[x].value.dtype != value.dtype:
            raise NotFusible(f"{self.graph[x].value.kind.value} input {x} does not fit a "
                             f"{value.kind.value} result in one [M, D] space")
        source = self.access(x)
        step = views.reshape(source.shape, value.shape)
        if step is None:
            raise NotFusible(f"a reshape that is not provably a split of dims ({_shape(source.shape)} -> "
                             f"{_shape(value.shape)}: merged dims, or sizes the trace does not relate, as from a -1): "
                             f"not a strided view")
        return self.strided(node.name, source.then(*step, value.shape), value, f"view{_shape(value.shape)}")

    def access(self, name: str) -> "views.AccessMap":
        """How `name` reads from memory: through the views it came from, down to a tensor the
        program holds (an input, an extern result) or to a value a kernel must write first."""
        if name in self.maps:
            return self.maps[name]
        node = self.graph[name]
        if node.op is Op.VIEW and self.graph[node.inputs[0]].op is not Op.CONSTANT:
            source = self.access(node.inputs[0])
            # a reshape of its source, or a broadcast of it (an expand: stride 0 along the repeated dims)
            step = views.reshape(source.shape, node.value.shape) or views.expand(source.shape, node.value.shape)
            if step is not None:
                return source.then(*step, node.value.shape)
        return self.in_memory(name)

    def in_memory(self, name: str) -> views.AccessMap:
        """The identity map of a tensor in memory: made contiguous, or an input read by its strides."""
        return views.identity(name, self.graph[name].value.shape, name not in self.in_place,
                              self.last_stride_one.get(name, True))

    def read_in_place(self, name: str) -> str:
        """The STRIDED node that reads a non-contiguous input by its own strides (no copy)."""
        if self.in_place[name] is None:
            value = self.graph[name].value
            if value.kind in (Kind.SCALAR, Kind.TENSOR):
                return name
            self.in_place[name] = self.strided(f"{name}_in_place", self.in_memory(name),
                                               value, "its own strides")
        return self.in_place[name]

    def broadcast(self, name: str, value: Value) -> str:
        """An operand whose leading dims broadcast against `value`'s ([B, D], [1, B, D] or [T, 1, D]
        against [T, B, D]): read in place with stride 0 along the repeated dims, to `value`'s
        leading dims and, for an [M, D] result, its own last dim (a [..., 1] operand stays a row
        value, broadcast over the columns in registers). An operand that fits, or does not
        broadcast, comes back as is."""
        src = self.graph[name].value
        if src.kind in (Kind.SCALAR, Kind.TENSOR) or value.kind not in (Kind.FULL, Kind.ROW) \
                or fits(src, value, Op.VIEW):
            return name
        shape = tuple(value.shape[:-1]) + (src.shape[-1] if value.kind is Kind.FULL else value.shape[-1],)
        key = (name, shape)
        if key not in self.broadcasts:
            step = views.expand(src.shape, shape)
            if step is None or not fits(place(src.dtype, shape), value, Op.VIEW):
                return name
            self.broadcasts[key] = self.strided(f"{name}_broadcast", self.access(name).then(*step, shape),
                                                place(src.dtype, shape), f"broadcast to {_shape(shape)}")
        return self.broadcasts[key]

    def size_operand(self, expr):
        """An access-map entry as the IR holds it: an int, or a ValueRef to a SYMBOL node."""
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_number:
            return int(expr)
        if expr not in self.size_symbols:
            label = re.sub(r"\W+", "_", str(expr).replace("-", "minus").replace("+", "plus")).strip("_")
            self.size_symbols[expr] = self.add(Op.SYMBOL, (), Value(torch.int64, Kind.SCALAR), Symbol(expr),
                                               name=f"size_{label}")
        return ValueRef(self.size_symbols[expr])

    def strided(self, name: str, m: "views.AccessMap", value: Value, describe: str,
                window: Optional[tuple] = None, fallback: Optional[str] = None, summed: tuple = ()) -> str:
        """A STRIDED node reading `m.root` through `m`; `summed`: the sizes of the dims after the
        value's that the read adds up (a sum over leading dims)."""
        if value.kind in (Kind.SCALAR, Kind.TENSOR):
            raise NotFusible(f"a view of shape {_shape(value.shape)} is outside the [M, D] space")
        attr = strided_attr(m, value, describe, self.size_operand, window, summed)
        if fallback is not None:
            self.check_fits(Op.STRIDED, [fallback], value)
        inputs = [m.root] + ([fallback] if fallback is not None else []) + attr.scalars()
        out = self.add(Op.STRIDED, inputs, value, attr, name=name)
        self.reads[out] = (m, window, fallback, tuple(summed))
        if window is None and not summed:
            self.maps[out] = views.AccessMap(m.root, tuple(value.shape), m.coeffs, m.consts, m.contiguous_root,
                                             m.last_stride_one)
        elif window is None:
            self.summed[out] = (m, tuple(summed))
        return out

    def lower_strided(self, node, val, value: Value) -> str:
        target = node.target
        if target is aten.cat.default:
            return self.lower_cat(node, value)
        if target is aten.slice_scatter.default:
            return self.lower_slice_scatter(node, value)
        if target is aten.select_backward.default:
            return self.lower_select_backward(node, value)
        if target is aten.constant_pad_nd.default:
            return self.lower_constant_pad(node, value)
        windowed = self.windowed_read(self.env_name(node.args[0]))
        if target is aten.slice.Tensor and windowed is not None and (list(node.args[4:5]) + [1])[0] == 1:
            return self.lower_slice_of_windowed(node, windowed, value)
        source = self.access(self.env_name(node.args[0]))
        rank = len(source.shape)
        if target is aten.permute.default:
            step = views.permute(source.shape, node.args[1])
            summed = self.view_of_small_sum(source, step, value, node.name, f"permute{tuple(node.args[1])}")
            computed = summed or self.permute_of_computed(node, value)
            return computed or self.strided(node.name, source.then(*step), value, f"permute{tuple(node.args[1])}")
        dim = node.args[1] % rank
        if target is aten.select.int:
            index = self.index_expr(node.args[2], source.shape[dim])
            return self.strided(node.name, source.then(*views.select(source.shape, dim, index)), value,
                                f"select(dim={dim})")
        start, step = self.index_expr((list(node.args[2:3]) + [None])[0] or 0, source.shape[dim]),             (list(node.args[4:5]) + [1])[0]
        if not isinstance(step, int) or step < 1:
            raise NotFusible(f"a slice with step {step}")
        length = value.shape[dim]
        return self.strided(node.name, source.then(*views.slice_(source.shape, dim, start, step, length)), value,
                            f"slice(dim={dim})")

    def env_name(self, arg) -> str:
        """The value an fx argument names, past the in-place wrapper (views compose their maps)."""
        if not isinstance(arg, torch.fx.Node) or not isinstance(self.env[arg], str):
            raise NotFusible(f"argument {arg!r} is not a tensor")
        return self.env[arg]

    @staticmethod
    def index_expr(index, size):
        """A start or index as sympy, negative ones counted from the end."""
        expr = to_expr(index.meta["val"]) if isinstance(index, torch.fx.Node) else to_expr(index)
        if expr.is_number and expr < 0:
            expr = expr + size
        return expr

    def lower_split(self, node, val) -> tuple:
        """split_with_sizes (chunk, split): one strided read per part."""
        source = self.access(self.env_name(node.args[0]))
        dim = (node.args[2] if len(node.args) > 2 else 0) % len(source.shape)
        parts, start = [], sympy.Integer(0)
        for k, part in enumerate(val):
            value = classify(part)
            length = value.shape[dim]
            step = views.slice_(source.shape, dim, start, 1, length)
            name = self.strided(f"{node.name}_{k}", source.then(*step), value, f"split part {k} (dim={dim})")
            if start.is_Integer and sympy.sympify(length).is_Integer:   # aten's own view of the part
                self.aten_views[name] = AtenView(aten.narrow.default, (node.args[0], dim, int(start), int(length)),
                                                 {"val": part})
            parts.append(name)
            start = start + length
        return tuple(parts)

    def lower_cat(self, node, value: Value) -> str:
        """Each part read where its range along `dim` lies, over the parts before it."""
        rank = len(value.shape)
        dim = (node.args[1] if len(node.args) > 1 else 0) % rank
        result, start = self.const(0, value.dtype), sympy.Integer(0)
        for k, part in enumerate(node.args[0]):
            name = self.env_name(part)
            shape = self.graph[name].value.shape
            if len(shape) != rank or part.meta["val"].dtype != value.dtype:
                raise NotFusible("a cat of parts of other ranks or dtypes")
            end = start + shape[dim]
            window = tuple((start, end) if j == dim else None for j in range(rank))
            step = views.shift(rank, dim, start)
            computed = self.columns_in_registers(name, step, value, window, f"{node.name}_part{k}")
            if computed is not None:
                result = self.pointwise(Op.WHERE, [self.column_window(start, end, value), computed, result], value,
                                        f"{node.name}_part{k}")
            else:
                before, access = result, self.access(name).then(*step, value.shape)
                result = self.strided(f"{node.name}_part{k}", access, value, f"cat part {k} (dim={dim})", window,
                                      before)
                if self.graph[before].op is Op.CONSTANT or before in self.windowed:    # a chain a slice can move
                    self.windowed[result] = (access, window, before)
            start = end
        return result

    # -- a cat or slice_scatter along D of values computed from reads ---------------------
    def columns_in_registers(self, name: str, step: tuple, value: Value, window: tuple, label: str,
                             depth: int = COLUMN_DEPTH) -> Optional[str]:
        """`name` placed at its window of a [M, D] `value` (a cat's part, a slice_scatter's source,
        along the last dim), computed there in registers: its pointwise ops over reads of tensors
        in memory, each read shifted to the window (0 outside it), through slices along D of such
        ops. RoPE's rotate_half is cat(-x2, x1): read this way, -x2 needs no kernel of half the row
        writing it first, and its backward no kernel writing the gradient times sin. None
        where `name` is not such a value (a reduction, a value a kernel computes from another
        space), or the cat is not along D."""
        node = self.graph[name]
        if value.kind is not Kind.FULL or window[-1] is None or any(w is not None for w in window[:-1]) \
                or not all(isinstance(b, int) or sympy.sympify(b).is_Integer for b in window[-1]):
            return None
        if depth > 0 and self.shifts_columns_of_computed(name):
            # a slice along D of a value computed from reads: that value, read at the slice's place
            through = self.maps[name].then(*step, value.shape)
            return self.columns_in_registers(self.maps[name].root, (through.coeffs, through.consts), value, window,
                                             label, depth - 1)
        in_memory = node.op in (Op.INPUT, Op.EXTERN, Op.GETITEM) or (node.op is Op.STRIDED and name in self.maps)
        if in_memory and depth == COLUMN_DEPTH:
            return None        # read where it lies: the windowed read over the fallback is one node
        if name in self.summed and depth < COLUMN_DEPTH:
            return self.summed_at_window(name, step, value, window, label)
        if node.op is Op.VIEW and node.inputs[0] in self.summed and depth < COLUMN_DEPTH:
            # a register copy of a sum (its kept size-1 dim dropped): the sum, through the reshape
            source = self.graph[node.inputs[0]].value.shape
            reshape = views.reshape(source, node.value.shape)
            if reshape is None:
                return None
            through = views.identity(node.inputs[0], source, True).then(*reshape, node.value.shape).then(
                *step, value.shape)
            return self.summed_at_window(node.inputs[0], (through.coeffs, through.consts), value, window, label)
        if in_memory:
            read = Value(node.value.dtype, Kind.FULL, value.shape, value.m, value.d)
            return self.strided(f"{label}_{name}", self.access(name).then(*step, value.shape), read,
                                f"{name} read at its window", window, self.const(0, node.value.dtype))
        if node.op not in UNARY | BINARY | {Op.WHERE} or node.value.kind is not Kind.FULL or depth == 0:
            return None
        inputs = []
        for i in node.inputs:
            kind = self.graph[i].value.kind
            moved = i if kind in (Kind.SCALAR, Kind.ROW) else \
                self.columns_in_registers(i, step, value, window, label, depth - 1) if kind is Kind.FULL else None
            if moved is None:
                return None
            inputs.append(moved)
        computed = Value(node.value.dtype, Kind.FULL, value.shape, value.m, value.d)
        return self.add(node.op, inputs, computed, node.attr, name=f"{label}_{name}")

    def summed_at_window(self, name: str, step: tuple, value: Value, window: tuple, label: str) -> str:
        """A sum over leading dims (grouped-query attention's key gradient, summed over the heads
        that share a key) read at a window of a pointwise value computed from it, 0 outside: the
        same sum at the moved index. Llama's rotary backward rotates the summed gradient times
        sin; read so, that product needs no kernel writing it for the rotation to slice."""
        read = Value(self.graph[name].value.dtype, Kind.FULL, value.shape, value.m, value.d)
        return self.summed_through(name, step, read, f"{label}_{name}", f"{name} summed at its window", window,
                                   self.const(0, read.dtype))

    def summed_through(self, name: str, step: tuple, value: Value, label: str, describe: str,
                       window: Optional[tuple] = None, fallback: Optional[str] = None) -> str:
        """Sum `name` (a summed read) again at `step`'s index: the step moves the sum's value dims
        (coefficients per its dim, then per `value`'s), the summed dims carried through."""
        access, summed = self.summed[name]
        through = access.then(*views.carrying(step, len(value.shape), len(summed)), tuple(value.shape) + summed)
        return self.strided(label, through, value, describe, window, fallback, summed=summed)

    def view_of_small_sum(self, source: "views.AccessMap", step: tuple, value: Value, label: str,
                          describe: str) -> Optional[str]:
        """A view (`step` after `source`) of a sum over leading dims of at most SMALL_SUM terms,
        summed again through the view instead of written for it to read: grouped-query attention's
        value gradient, summed over the query heads that share a value, read transposed for its
        projection's matmul, in one kernel, not a sum written and a copy. None for other views."""
        if source.root not in self.summed or value.kind is not Kind.FULL:
            return None
        terms = sympy.Mul(*self.summed[source.root][1])
        if not terms.is_Integer or terms > SMALL_SUM:
            return None
        through = source.then(*step)
        return self.summed_through(source.root, (through.coeffs, through.consts), value, label,
                                   f"{describe} of {source.root}")

    def permute_of_computed(self, node, value: Value) -> Optional[str]:
        """A permute of leading dims (the last stays) of a pointwise value computed from reads, which
        nothing else reads: that value computed again at the permuted index, its reads moved through
        the permute (`permuted`), in the kernel that reads it, instead of written for that kernel to
        read through the permute. Llama's rotary backward: the query's and the key's gradients, read
        transposed into the projections' [batch x seq, heads x dim], in the kernel that writes that
        copy. None where the value is not such (a reduction, a read from another space, a value
        read elsewhere too)."""
        source = node.args[0]
        name = self.env_name(source)
        dims = [d % len(value.shape) for d in node.args[1]]
        if dims[-1] != len(dims) - 1 or len(source.users) != 1 or value.kind is not Kind.FULL \
                or self.graph[name].op not in UNARY | BINARY | {Op.WHERE}:
            return None
        return self.permuted(name, dims, value, node.name, PERMUTE_DEPTH)

    def permuted(self, name: str, dims: list, value: Value, label: str, depth: int) -> Optional[str]:
        """`name` at the index `dims` permutes (value dim k is `name`'s dim dims[k]): a pointwise op
        over its inputs so permuted, a read through its map followed by the permute (its window and
        fallback moved alike, its summed dims carried); None where a part is neither."""
        node = self.graph[name]
        kind = node.value.kind
        constant = node.op is Op.VIEW and self.graph[node.inputs[0]].value.kind is Kind.SCALAR   # a fill
        if kind in (Kind.SCALAR, Kind.COL) or constant:
            return name                       # the same at every row: the columns stay in place
        if kind is not Kind.FULL or depth == 0 or len(node.value.shape) != len(dims):
            return None
        shape = tuple(node.value.shape[d] for d in dims)
        moved_value = Value(node.value.dtype, Kind.FULL, shape, value.m, value.d)
        step = views.permute(node.value.shape, dims)
        read_copied = self.reads.get(node.inputs[0]) if node.op is Op.VIEW else None
        if read_copied is not None and read_copied[1] is None:
            # a register copy of a read (a sum's kept size-1 dim dropped): the read, reshaped, permuted
            source = self.graph[node.inputs[0]].value.shape
            reshape = views.reshape(source, node.value.shape)
            if reshape is None:
                return None
            through = views.identity(name, source, True).then(*reshape, node.value.shape).then(*step)
            name, node, step = node.inputs[0], self.graph[node.inputs[0]], (through.coeffs, through.consts, shape)
        if node.op is Op.STRIDED and name in self.reads:
            access, window, fallback, summed = self.reads[name]
            if fallback is not None and self.graph[fallback].op is not Op.CONSTANT:
                fallback = self.permuted(fallback, dims, value, label, depth - 1)
                if fallback is None:
                    return None
            through = access.then(*views.carrying(step[:2], len(dims), len(summed)), shape + summed)
            moved_window = None if window is None else tuple(window[d] for d in dims)
            return self.strided(f"{label}_{name}", through, moved_value, f"{node.attr.describe}, permuted",
                                moved_window, fallback, summed=summed)
        if node.op in (Op.INPUT, Op.EXTERN, Op.GETITEM):
            return self.strided(f"{label}_{name}", self.access(name).then(*views.permute(node.value.shape, dims)),
                                moved_value, f"{name} permuted")
        if node.op not in UNARY | BINARY | {Op.WHERE}:
            return None
        inputs = []
        for i in node.inputs:
            moved_input = self.permuted(i, dims, value, label, depth - 1)
            if moved_input is None:
                return None
            inputs.append(moved_input)
        return self.add(node.op, inputs, moved_value, node.attr, name=f"{label}_{name}")

    def shifts_columns_of_computed(self, name: str) -> bool:
        """Whether `name` is a view that only moves along D (a slice of the last dim: rows kept,
        so row values still line up) of a pointwise value no kernel has to write."""
        view = self.maps.get(name)
        if view is None or self.graph[view.root].op not in UNARY | BINARY | {Op.WHERE}:
            return False
        rank = len(view.shape)
        return len(view.coeffs) == rank and all(
            views.same(view.coeffs[j][k], 1 if j == k else 0) for j in range(rank) for k in range(rank)) \
            and all(views.same(c, 0) for c in view.consts[:-1])

    def column_window(self, start, end, value: Value) -> str:
        """The COL mask of the columns [start, end) of a [M, D] value."""
        column = self.add(Op.IOTA, [], Value(torch.int64, Kind.COL, (sympy.Integer(value.d),), d=value.d),
                          name="column")
        mask = Value(torch.bool, Kind.COL, (sympy.Integer(value.d),), d=value.d)
        after = self.pointwise(Op.GE, [column, self.const(int(start))], mask, "column_from")
        before = self.pointwise(Op.LT, [column, self.const(int(end))], mask, "column_before")
        return self.pointwise(Op.LOGICAL_AND, [after, before], mask, "column_window")

    def lower_slice_scatter(self, node, value: Value) -> str:
        base, name = self.operand(node.args[0]), self.env_name(node.args[1])
        rank = len(value.shape)
        dim, start, end, step = (list(node.args[2:]) + [0, None, None, 1][len(node.args) - 2:])[:4]
        dim = dim % rank
        if step != 1:
            raise NotFusible(f"a slice_scatter with step {step}")
        start = self.index_expr(start or 0, value.shape[dim])
        end = start + self.graph[name].value.shape[dim]
        window = tuple((start, end) if j == dim else None for j in range(rank))
        shift = views.shift(rank, dim, start)
        computed = self.columns_in_registers(name, shift, value, window, node.name) \
            if self.graph[base].value.kind in (Kind.FULL, Kind.SCALAR) else None
        if computed is not None:
            return self.pointwise(Op.WHERE, [self.column_window(start, end, value), computed, base], value, node.name)
        return self.strided(node.name, self.access(name).then(*shift, value.shape), value,
                            f"slice_scatter(dim={dim})", window, base)

    def lower_constant_pad(self, node, value: Value) -> str:
        """F.pad's constant mode (HuggingFace pads the labels it shifts for a causal LM's loss): the
        source read at index i - before along each padded dim, where that lies inside it, the fill
        value elsewhere; a negative pad crops, a read with no window."""
        name, pads = self.env_name(node.args[0]), list(node.args[1])
        fill = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        shape = self.graph[name].value.shape
        rank = len(value.shape)
        if len(pads) % 2 or len(pads) > 2 * rank or not all(isinstance(p, int) for p in pads):
            raise NotFusible(f"a pad by {pads}: whole numbers, two a dim, expected")
        access, window = self.access(name), [None] * rank
        for k in range(len(pads) // 2):
            dim, before, after = rank - 1 - k, pads[2 * k], pads[2 * k + 1]
            if before == after == 0:
                continue
            access = access.then(*views.shift(rank, dim, before), value.shape)
            if before > 0 or after > 0:
                window[dim] = (before, before + shape[dim])
        if all(w is None for w in window):
            return self.strided(node.name, access, value, f"constant_pad_nd({pads}) crop")
        fill = self.const(fill, value.dtype)
        out = self.strided(node.name, access, value, f"constant_pad_nd({pads})", tuple(window), fill)
        self.windowed[out] = (access, tuple(window), fill)
        return out

    def windowed_read(self, name: str) -> Optional[str]:
        """The windowed read `name` is, through register copies of it (a whole slice: `x[:, 1:-1]`
        slices dim 0 whole first), or None."""
        while name not in self.windowed and self.graph[name].op is Op.VIEW \
                and self.graph[self.graph[name].inputs[0]].value.shape == self.graph[name].value.shape:
            name = self.graph[name].inputs[0]
        return name if name in self.windowed else None

    def lower_slice_of_windowed(self, node, name: str, value: Value) -> str:
        """A slice (step 1) of a windowed read (a pad, a cat): the same reads of the sources, their
        windows moved by the slice's start, the parts before a cat's part sliced alike. HuggingFace's
        shifted labels, `pad(labels, (0, 1), -100)[..., 1:]`, are one read of the labels, and
        torch.diff's `cat([first, x])[..., 1:] - cat(...)[..., :-1]` two reads of each part, not a
        padded or concatenated copy written and read again."""
        rank = len(value.shape)
        dim = node.args[1] % rank
        start = self.index_expr((list(node.args[2:3]) + [None])[0] or 0, self.graph[name].value.shape[dim])
        return self.sliced_window(name, node.name, dim, start, value)

    def sliced_window(self, name: str, label: str, dim: int, start, value: Value) -> str:
        """`name` sliced from `start` along `dim`, its fallback chain (a cat's earlier parts) first."""
        access, window, fallback = self.windowed[name]
        if fallback in self.windowed:
            fallback = self.sliced_window(fallback, f"{label}_{fallback}", dim, start, value)
        step = views.slice_(access.shape, dim, start, 1, value.shape[dim])
        moved = tuple(w if w is None or j != dim else (w[0] - start, w[1] - start) for j, w in enumerate(window))
        out = self.strided(label, access.then(*step), value, f"slice(dim={dim}) of {name}", moved, fallback)
        self.windowed[out] = (access.then(*step), moved, fallback)
        return out

    def lower_select_backward(self, node, value: Value) -> str:
        grad = self.access(self.env_name(node.args[0]))
        rank = len(value.shape)
        dim = node.args[2] % rank
        index = self.index_expr(node.args[3], value.shape[dim])
        window = tuple((index, index + 1) if j == dim else None for j in range(rank))
        return self.strided(node.name, grad.then(*views.unselect(grad.shape, dim), value.shape), value,
                            f"select_backward(dim={dim})", window, self.const(0, value.dtype))

    def pointwise(self, op: Op, inputs, value: Value, name: str) -> str:
        inputs = [self.broadcast(i, value) for i in inputs]
        self.check_fits(op, inputs, value)
        return self.add(op, inputs, value, name=name)

    def lower_pointwise(self, node, op: Op, value: Value, args: Optional[list] = None) -> str:
        """`op` over the node's arguments (or over `args`, when some of them are attributes)."""
        args = [self.operand(a) for a in node.args] if args is None else args
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            scaled = self.graph[args[1]].value
            args[1] = self.pointwise(Op.MUL, [args[1], self.operand(alpha)], scaled, f"{node.name}_alpha")
        if value.dtype == torch.bool:   # bitwise ops on booleans are the logical ones
            op = {Op.BITWISE_NOT: Op.LOGICAL_NOT, Op.BITWISE_AND: Op.LOGICAL_AND, Op.BITWISE_OR: Op.LOGICAL_OR,
                  Op.BITWISE_XOR: Op.LOGICAL_XOR}.get(op, op)
        if op in (Op.FMOD, Op.REMAINDER, Op.FLOOR_DIVIDE) and not value.is_floating:
            raise NotFusible(f"integer {op.value}: eager raises on a zero divisor, a kernel cannot")
        if op is Op.POW and not value.is_floating:
            raise NotFusible("integer pow: integer results (and errors for negative exponents) as eager")
        if not OPS[op].fp64 and torch.float64 in [value.dtype] + [self.graph[a].value.dtype for a in args]:
            raise NotFusible(f"fp64 {op.value}: its helper ({OPS[op].helper}) is accurate to fp32 only")
        if op in COMPARISON:
            args = self.promote(node, args)
        return self.pointwise(op, args, value, node.name)

    def promote(self, node, args: list) -> list:
        """Comparisons run in the operands' common dtype (torch.result_type): a float scalar or
        0-d tensor compared with a bf16 tensor is first rounded to bf16, as eager does."""
        common = torch.result_type(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a
                                     for a in node.args[:2]])
        promoted = []
        for fx_arg, name in zip(node.args[:2], args):
            have = self.graph[name].value
            if not common.is_floating_point:   # integers: widen to the common type (uint8 vs int8)
                if have.dtype is not None and have.dtype != common and self.graph[name].op is not Op.CONSTANT:
                    widened = Value(common, have.kind, have.shape, have.m, have.d)
                    name = self.add(Op.CAST, [name], widened, Cast(common), name=f"{node.name}_operand")
            elif isinstance(fx_arg, (int, float)) and not isinstance(fx_arg, bool):
                name = self.const(float(fx_arg), common)
            elif self.graph[name].op is Op.CONSTANT and have.dtype != common:   # a 0-d tensor constant
                name = self.const(float(self.graph[name].attr.value), common)
            elif have.is_floating and have.dtype.itemsize > common.itemsize:
                rounded = Value(common, have.kind, have.shape, have.m, have.d)
                name = self.add(Op.CAST, [name], rounded, Cast(common), name=f"{node.name}_operand")
            promoted.append(name)
        return promoted + args[2:]

    def lower_divide(self, node, value: Value) -> str:
        """div with a rounding mode, and prims' div/fmod (truncating for integers)."""
        mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
        if node.target is prims.fmod.default:
            op = Op.FMOD
        elif node.target is prims.div.default:
            op = Op.DIV if value.is_floating else Op.TRUNC_DIVIDE
        else:
            op = {None: Op.DIV, "trunc": Op.TRUNC_DIVIDE, "floor": Op.FLOOR_DIVIDE}[mode]
        if op is not Op.DIV and not value.is_floating:
            raise NotFusible(f"integer {op.value}: eager raises on a zero divisor, a kernel cannot")
        args = [self.operand(a) for a in node.args[:2]]
        return self.pointwise(op, args, value, node.name)

    def lower_polygamma(self, node, value: Value) -> str:
        """polygamma(n, x): orders 0 and 1 have helpers (digamma and trigamma, digamma's derivative)."""
        order, x = node.args
        op = POLYGAMMA_ORDERS.get(order)
        if op is None:
            raise NotFusible(f"polygamma of order {order}: only orders 0 and 1 (digamma, trigamma) have helpers")
        return self.lower_pointwise(node, op, value, [self.operand(x)])

    def lower_clamp(self, node, value: Value) -> str:
        """clamp(x, min, max) = minimum(maximum(x, min), max), NaN kept (scalar or tensor bounds)."""
        x = self.operand(node.args[0])
        low, high = (list(node.args[1:]) + [None, None])[:2]
        low, high = node.kwargs.get("min", low), node.kwargs.get("max", high)
        if low is not None:
            x = self.pointwise(Op.MAXIMUM, [x, self.operand(low)], value, f"{node.name}_min")
        if high is not None:
            x = self.pointwise(Op.MINIMUM, [x, self.operand(high)], value, f"{node.name}_max")
        return x

    def lower_pow(self, node, value: Value) -> str:
        """x ** c: the exponents torch special-cases become the same ops; others call mf_pow."""
        x, exponent = self.operand(node.args[0]), node.args[1]
        if not isinstance(exponent, (int, float)):
            raise NotFusible(f"pow with a symbolic exponent {exponent}")
        if exponent == 0:
            return self.lower_fill(node, value, fill=1)
        if exponent == 2:
            return self.pointwise(Op.MUL, [x, x], value, node.name)
        if exponent == 3:
            square = self.pointwise(Op.MUL, [x, x], value, f"{node.name}_square")
            return self.pointwise(Op.MUL, [square, x], value, node.name)
        op = POW_AS_OP.get(exponent)
        if op is not None and (value.is_floating or op is Op.VIEW):
            return self.pointwise(op, [x], value, node.name)
        if not value.is_floating:
            raise NotFusible(f"integer pow with exponent {exponent}")
        return self.pointwise(Op.POW, [x, self.const(float(exponent))], value, node.name)

    def lower_cast(self, node, value: Value) -> str:
        source = node.args[1] if node.target is aten.copy.default else node.args[0]
        device = node.kwargs.get("device")
        if device is not None and device != source.meta["val"].device:
            raise NotFusible(f"copies to device {device}")
        x = self.operand(source)
        if self.product_in_fp32(source, x, value):
            return x
        op = Op.VIEW if self.graph[x].value.dtype == value.dtype else Op.CAST
        self.check_fits(op, [x], value)
        return self.add(op, [x], value, Cast(value.dtype) if op is Op.CAST else None, name=node.name)

    def product_in_fp32(self, source, x: str, value: Value) -> bool:
        """An fp32 cast of a bf16 or fp16 `mm` product nothing else reads becomes the matmul's own
        output dtype (`aten.mm.dtype`): cuBLAS writes the fp32 product, one call where a matmul, a
        [M, N] product in memory and a cast kernel were three (autocast's weight gradients: a
        Llama layer's backward cast seven of them, each its own launch). The product is rounded
        once, to fp32, instead of to bf16 first: nearer fp64 than eager, not bit for bit eager's.
        Where the build has that op on the device (CUDA since torch 2.9; not the CPU): `x` is
        rewritten in place, and True."""
        node = self.graph[x]
        if not (isinstance(source, torch.fx.Node) and source.target is aten.mm.default and len(source.users) == 1
                and node.op is Op.EXTERN and isinstance(node.attr, Matmul) and value.dtype == torch.float32
                and node.value.dtype in (torch.bfloat16, torch.float16)
                and matmul_writes_fp32(node.attr.device, node.value.dtype)):
            return False
        attr = dataclasses.replace(node.attr, target=aten.mm.dtype, args=(*node.attr.args, torch.float32))
        self.graph.nodes[x] = Node(x, Op.EXTERN, node.inputs, dataclasses.replace(node.value, dtype=torch.float32),
                                   attr)
        return True

    def lower_fill(self, node, value: Value, fill=None) -> str:
        """full/full_like/empty/scalar_tensor: one value broadcast over the result."""
        if fill is None:
            if node.target in (aten.full.default, aten.full_like.default):
                fill = node.args[1]
            elif node.target is aten.scalar_tensor.default:
                fill = node.args[0]
            else:
                fill = 0    # empty: any value is right
        if isinstance(fill, torch.fx.Node):   # a size-derived fill value
            scalar = self.operand(fill)
            if self.graph[scalar].value.dtype == value.dtype:
                return self.add(Op.VIEW, [scalar], value, name=node.name)
            return self.add(Op.CAST, [scalar], value, Cast(value.dtype), name=node.name)
        if not isinstance(fill, (bool, int, float)):
            raise NotFusible(f"fill value {fill!r}")
        return self.add(Op.VIEW, [self.const(fill, value.dtype)], value, name=node.name)

    def lower_tensor_constant(self, node) -> str:
        """A tensor the function closed over: a scalar constant when it has one element,
        else an extern step that hands the tensor out."""
        tensor = getattr(self.gm, node.target)
        value = classify(tensor)
        if value.kind is Kind.SCALAR and tensor.dim() == 0 and tensor.dtype in (
                torch.float32, torch.bool, torch.int64, torch.int32):
            name = self.const(tensor.item(), tensor.dtype)
            self.tensor_constants[name] = tensor
            return name
        return self.add(Op.EXTERN, [], value, Extern(TensorConstant(tensor), (), ()), name=node.name)

    def lower_rand(self, node, value: Value) -> str:
        if value.kind is not Kind.FULL or not value.is_floating:
            raise NotFusible("random values outside a FULL float [M, D] tensor")
        stream = self.rng_streams
        self.rng_streams += 1
        return self.add(Op.RAND, [self.seed()], value, Seeded(stream), name=node.name)

    @staticmethod
    def leading_subset(dims, source: Value) -> tuple | None:
        """(dims, whether D is summed too) of a sum over some, not all, of the leading dims of
        `source` (for a row value: of its dims other than a last 1), dims sorted; None for a
        reduction over all of them, over D alone, or over everything."""
        rank = len(source.shape)
        if source.kind not in (Kind.FULL, Kind.ROW) or dims is None or isinstance(dims, int) or not dims:
            return None
        dims = sorted(d % rank for d in dims)
        with_d = source.kind is Kind.FULL and dims[-1] == rank - 1
        leading = [j for j in range(rank) if (j < rank - 1 or source.kind is Kind.ROW)
                   and not views.same(source.shape[j], 1)]
        subset = dims[:-1] if with_d else dims
        return (subset, with_d) if subset and set(subset) < set(leading) else None

    def leading_sum(self, node, x: str, dims: list, value: Value, keepdim: bool, name: str | None = None) -> str:
        """A sum over some of the leading dims ([T, B, D] -> [B, D]: a broadcast's gradient): each
        element of the result adds up its T elements of `x`, read in place (x is written first
        when a kernel computes it)."""
        if node.kwargs.get("dtype") not in (None, value.dtype):
            raise NotFusible("reduction with a dtype argument")
        source = self.access(x)
        coeffs, consts, shape = views.sum_over(source.shape, dims, keepdim)
        summed = shape[len(shape) - len(dims):]
        return self.strided(name or node.name, source.then(coeffs, consts, shape), value, f"sum over dims {dims}",
                            summed=tuple(summed))

    def lower_leading_sum(self, node, x: str, dims: list, with_d: bool, value: Value, name: str) -> str:
        """A sum over some leading dims, and over D when `with_d` ([T, B, D] -> [B, 1]: the gradient
        of a [B, 1] operand): the rows are summed in a kernel first, as fp32, into a row value."""
        source = self.graph[x].value
        keepdim = len(value.shape) == len(source.shape)
        if not with_d:
            return self.leading_sum(node, x, dims, value, keepdim, name)
        acc = accumulate_dtype(value.dtype) if value.is_floating else value.dtype
        rows = self.add(Op.SUM, [x], place(acc, tuple(source.shape[:-1]) + (sympy.Integer(1),)), Reduce(Kind.ROW),
                        name=f"{name}_rows")
        kept = tuple(sympy.Integer(1) if j in dims else s for j, s in enumerate(self.graph[rows].value.shape))
        total = self.leading_sum(node, rows, dims, place(acc, kept), True, f"{name}_total")
        if acc == value.dtype:
            return self.add(Op.VIEW, [total], value, name=name)
        return self.add(Op.CAST, [total], value, Cast(value.dtype), name=name)

    def reduction_axis(self, dims, source: Value) -> Kind:
        rank = len(source.shape)
        dims = [dims] if isinstance(dims, int) else dims
        if source.kind is not Kind.FULL or dims is None:
            raise NotFusible("reduction over a non-[M, D] tensor or over every dim")
        dims = sorted(d % rank for d in dims)
        if dims == [rank - 1]:
            return Kind.ROW
        if dims == list(range(rank - 1)):
            return Kind.COL
        raise NotFusible(f"reduction over dims {dims} of a rank-{rank} tensor")

    def lower_reduction(self, node, op: Op, value: Value) -> str:
        x = self.operand(node.args[0])
        source = self.graph[x].value
        if op in (Op.ARGMAX, Op.ARGMIN):
            if len(node.args) < 2 or node.args[1] is None:
                raise NotFusible(f"{op.value} over every dim (a flat index)")
            dims = [node.args[1]]
        else:
            dims = node.args[1] if len(node.args) > 1 else None
            if self.everything(dims, source):
                return self.lower_total(node, op, x, value)
            subset = self.leading_subset(dims, source)
            if subset is not None and op is Op.SUM:
                return self.lower_leading_sum(node, x, *subset, value, node.name)
        axis = self.reduction_axis(dims, source)
        if node.kwargs.get("dtype") not in (None, value.dtype):
            raise NotFusible("reduction with a dtype argument")
        self.check_reducible(op, axis, source, value)
        self.check_fits(op, [x], value)
        return self.add(op, [x], value, Reduce(axis), name=node.name)

    def lower_any(self, node, value: Value) -> str:
        """any over D or over the leading dims (all arrives decomposed, as not any of not): the
        count of true elements, a fp32 sum of the booleans, above 0. _safe_softmax asks
        any(x != -inf) of every attention row: fused, the row's softmax kernel answers it
        instead of writing a bool [batch, heads, seq, seq] for aten to read."""
        x = self.operand(node.args[0])
        source = self.graph[x].value
        dims = node.args[1] if len(node.args) > 1 else None
        if self.everything(dims, source):
            raise NotFusible("any over every dim")
        axis = self.reduction_axis(dims, source)
        if value.kind is not axis:
            raise NotFusible("any whose result does not keep the [M, D] place of its rows or columns")
        ones = self.add(Op.CAST, [x], Value(torch.float32, source.kind, source.shape, source.m, source.d),
                        Cast(torch.float32), name=f"{node.name}_ones")
        counted = Value(torch.float32, value.kind, value.shape, value.m, value.d)
        count = self.add(Op.SUM, [ones], counted, Reduce(axis), name=f"{node.name}_count")
        return self.pointwise(Op.GT, [count, self.const(0.0)], value, node.name)

    @staticmethod
    def check_reducible(op: Op, axis: Kind, source: Value, value: Value) -> None:
        if op in (Op.ARGMAX, Op.ARGMIN) and axis is not Kind.ROW:
            raise NotFusible(f"{op.value} over the leading dims")
        if not source.is_floating and op is not Op.SUM:
            raise NotFusible(f"{op.value} of integers: the kernels reduce floats")
        if axis is Kind.COL and not (value.is_floating and value.dtype.itemsize <= 4):
            raise NotFusible(f"a {value.dtype} reduction over the leading dims: partials are fp32")

    def lower_extreme(self, node, val):
        """max.dim / min.dim: the row's extreme and its first index, both over D."""
        if len(node.args) < 2:
            raise NotFusible("max/min over every dim")
        x = self.operand(node.args[0])
        source = self.graph[x].value
        axis = self.reduction_axis([node.args[1]], source)
        extreme, index = EXTREME_ATEN[node.target]
        values, indices = classify(val[0]), classify(val[1])
        self.check_reducible(index, axis, source, indices)
        self.check_fits(extreme, [x], values)
        return (self.add(extreme, [x], values, Reduce(axis), name=f"{node.name}_values"),
                self.add(index, [x], indices, Reduce(axis), name=f"{node.name}_indices"))

    def count_reduced(self, source: Value, axis: Kind) -> str:
        """1 / (number of elements reduced): a constant over D, a SYMBOL over M."""
        return self.inverse(sympy.Integer(source.d) if axis is Kind.ROW else source.m)

    def inverse(self, count: sympy.Expr) -> str:
        """1 / count as a scalar: a constant, or a SYMBOL when it depends on the sizes."""
        inverse = 1 / count
        if inverse.free_symbols:
            return self.add(Op.SYMBOL, (), Value(torch.float32, Kind.SCALAR), Symbol(inverse), name="inv_count")
        return self.const(float(inverse))

    @staticmethod
    def everything(dims, source: Value) -> bool:
        """Whether `dims` (None and [] mean all) covers every dim of an [M, D] value."""
        if source.kind is not Kind.FULL:
            return False
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            return True
        dims = [dims] if isinstance(dims, int) else dims
        return sorted(d % len(source.shape) for d in dims) == list(range(len(source.shape)))

    def lower_total(self, node, op: Op, x: str, value: Value, mean: bool = False) -> str:
        """A reduction to one value (a loss): each row reduced over D inside the kernel, then
        one small aten call over the M row results."""
        source = self.graph[x].value
        if not source.is_floating and op is not Op.SUM:
            raise NotFusible(f"{op.value} of integers: the kernels reduce floats")
        dtype = value.dtype if not value.is_floating else \
            torch.float64 if value.dtype == torch.float64 else torch.float32
        row = Value(dtype, Kind.ROW, tuple(source.shape[:-1]) + (sympy.Integer(1),), m=source.m)
        rows = self.add(op, [x], row, Reduce(Kind.ROW), name=f"{node.name}_rows")
        if mean:
            rows = self.add(Op.MUL, [rows, self.const(1.0 / source.d)], row, name=f"{node.name}_row_means")
        finish = aten.mean.default if mean else TOTALS[op]
        args = (ValueRef(rows), []) if op in (Op.MAX, Op.MIN) else (ValueRef(rows),)
        total = self.add(Op.EXTERN, [rows], Value(dtype, Kind.SCALAR, ()), Extern(finish, args, ()),
                         name=f"{node.name}_total")
        if dtype == value.dtype:
            return self.add(Op.VIEW, [total], value, name=node.name)
        return self.add(Op.CAST, [total], value, Cast(value.dtype), name=node.name)

    def lower_mean(self, node, value: Value) -> str:
        x = self.operand(node.args[0])
        source = self.graph[x].value
        if not source.is_floating:
            raise NotFusible("mean of integers")
        dims = node.args[1] if len(node.args) > 1 else None
        if self.everything(dims, source):
            return self.lower_total(node, Op.SUM, x, value, mean=True)
        subset = self.leading_subset(dims, source)
        if subset is not None:
            dims, with_d = subset
            total = self.lower_leading_sum(node, x, dims, with_d, value, f"{node.name}_sum")
            count = sympy.Mul(*[source.shape[j] for j in dims]) * (source.d if with_d else 1)
            return self.pointwise(Op.MUL, [total, self.inverse(count)], value, node.name)
        axis = self.reduction_axis(dims, source)
        if axis is Kind.COL and source.dtype.itemsize > 4:
            raise NotFusible(f"a {source.dtype} mean over the leading dims: partials are fp32")
        total = self.add(Op.SUM, [x], value, Reduce(axis), name=f"{node.name}_sum")
        return self.pointwise(Op.MUL, [total, self.count_reduced(source, axis)], value, node.name)

    def lower_var_mean(self, node, val):
        """Two passes over the row in registers: mean, then the sum of squared deviations."""
        x = self.operand(node.args[0])
        source = self.graph[x].value
        axis = self.reduction_axis(node.args[1] if len(node.args) > 1 else None, source)
        if axis is not Kind.ROW:
            raise NotFusible("variance over the leading dims")
        correction = node.kwargs.get("correction", 1)
        correction = 1 if correction is None else correction
        var_fake = val[0] if isinstance(val, (tuple, list)) else val
        stat = classify(var_fake)
        full = Value(torch.float32 if source.dtype != torch.float64 else source.dtype, Kind.FULL,
                     source.shape, source.m, source.d)
        total = self.add(Op.SUM, [x], stat, Reduce(Kind.ROW), name=f"{node.name}_sum")
        mean = self.add(Op.MUL, [total, self.const(1.0 / source.d)], stat, name=f"{node.name}_mean")
        diff = self.add(Op.SUB, [x, mean], full, name=f"{node.name}_diff")
        square = self.add(Op.MUL, [diff, diff], full, name=f"{node.name}_sq")
        squares = self.add(Op.SUM, [square], stat, Reduce(Kind.ROW), name=f"{node.name}_sqsum")
        var = self.add(Op.MUL, [squares, self.const(1.0 / max(source.d - correction, 0) if source.d > correction
                                                    else float("nan"))], stat, name=f"{node.name}_var")
        return (var, mean) if node.target is aten.var_mean.correction else var

    def lower_scatter(self, node, value: Value) -> str:
        """scatter(self, -1, index, src) and scatter(self, -1, index, value) with one index per
        row: where(column == index, src, self), when every index is known to lie in [0, D)
        (`index_in_range`: an argmax/argmin over rows of D, or an index a gather over rows of D
        checked, as nll_loss's backward scatters its one-hot at the targets its forward gathered).
        Any other index could be out of range, which eager reports: that stays an extern."""
        base, dim, index, src = (self.operand(a) if isinstance(a, torch.fx.Node) else a for a in node.args[:4])
        if value.kind is not Kind.FULL or dim % len(value.shape) != len(value.shape) - 1 \
                or self.graph[index].value.kind is not Kind.ROW or not index_in_range(self.graph, index, value.d):
            raise NotFusible(EXTERN_REASONS[node.target])
        if not isinstance(src, str):     # scatter.value: a number
            src = self.const(src, value.dtype)
        if self.graph[src].value.kind not in (Kind.ROW, Kind.SCALAR):
            # row i takes src[i][0], the element beside its one index, not src[i][index]
            raise NotFusible(f"a scatter of a {self.graph[src].value.kind.value} source: one index per row "
                             "takes the row's first source element")
        full_bool = Value(torch.bool, Kind.FULL, value.shape, value.m, value.d)
        self.check_fits(Op.EQ, [index], full_bool)
        column = self.add(Op.IOTA, [], Value(torch.int64, Kind.COL, (sympy.Integer(value.d),), d=value.d),
                          name=f"{node.name}_column")
        hit = self.pointwise(Op.EQ, [column, index], full_bool, f"{node.name}_hit")
        return self.pointwise(Op.WHERE, [hit, src, base], value, node.name)

    def lower_gather(self, node, value: Value) -> str:
        """gather(x, -1, index) with one index per row of a FULL x: the row's sum of
        where(column == index, x, 0), a row reduction fused into the kernel that computes x, so
        x need not be written (cross-entropy picks the target's log-probability this way). The
        index is computed in that kernel too where it is an elementwise function of one tensor
        in memory (`index_in_rows`). aten's gather raises on an index outside [0, D): unless
        `index_in_range` knows it is inside, an IndexCheck of the index runs in the same call
        and its 0 is added to the picked values (the result waits for the check)."""
        source, dim, index = (self.operand(a) if isinstance(a, torch.fx.Node) else a for a in node.args[:3])
        x, picks = self.graph[source].value, self.graph[index].value
        if node.kwargs.get("sparse_grad", False) or not isinstance(dim, int) or x.kind is not Kind.FULL \
                or dim % len(x.shape) != len(x.shape) - 1 or picks.kind is not Kind.ROW \
                or len(picks.shape) != len(x.shape) or not all(views.same(a, b) for a, b in zip(picks.shape, x.shape[:-1])):
            raise NotFusible(EXTERN_REASONS[node.target])
        if x.dtype == torch.bool:
            raise NotFusible("a gather of booleans: the pick is a row sum")
        checked = index_in_range(self.graph, index, x.d)
        column = self.add(Op.IOTA, [], Value(torch.int64, Kind.COL, (sympy.Integer(x.d),), d=x.d),
                          name=f"{node.name}_column")
        hit = self.pointwise(Op.EQ, [column, self.index_in_rows(index, picks) or index],
                             Value(torch.bool, Kind.FULL, x.shape, x.m, x.d), f"{node.name}_hit")
        picked = self.pointwise(Op.WHERE, [hit, source, self.const(0, x.dtype)], Value(x.dtype, Kind.FULL, x.shape, x.m, x.d),
                                f"{node.name}_picked")
        if checked:
            return self.add(Op.SUM, [picked], value, Reduce(Kind.ROW), name=node.name)
        picks_sum = self.add(Op.SUM, [picked], value, Reduce(Kind.ROW), name=f"{node.name}_sum")
        return self.pointwise(Op.ADD, [picks_sum, self.index_check(node, index, x.d, value.dtype)], value, node.name)

    def index_check(self, node, index: str, width: int, dtype: torch.dtype) -> str:
        """An extern IndexCheck of the tensor `index` reads (through reads that keep every
        element: a check of the same values): a 0 of `dtype`."""
        checked = _through_reads(self.graph, index, covering=True)
        return self.add(Op.EXTERN, [checked], Value(dtype, Kind.SCALAR, ()),
                        Extern(IndexCheck(width, dtype), (ValueRef(checked),), ()), name=f"{node.name}_check")

    def index_in_rows(self, index: str, rows: Value) -> Optional[str]:
        """`index` rebuilt as ROW values over reads of the tensor in memory it is an elementwise
        function of (cross-entropy's where(t != ignore, t, 0), unsqueezed), so the kernel of the
        rows computes it instead of reading it from a kernel of another space; None where it is
        not such a function. Only order-keeping steps (VIEW nodes, same element count) are looked
        through, so the rebuilt read visits the tensor's elements in the index's order."""
        node = self.graph[index]
        if node.op is Op.STRIDED and node.attr.window is None and not node.attr.summed \
                and _reads_each_once(self.graph, node) and views.reshape(self.graph[node.inputs[0]].value.shape,
                                                                     rows.shape) is not None:
            return self.elementwise_in_rows(node.inputs[0], rows)
        return None

    def elementwise_in_rows(self, name: str, rows: Value) -> Optional[str]:
        node = self.graph[name]
        if node.value.kind is Kind.SCALAR or node.op in (Op.CONSTANT, Op.SYMBOL):
            return name
        if not views.same(sympy.Mul(*node.value.shape), sympy.Mul(*rows.shape)):
            return None
        if node.op is Op.VIEW:
            return self.elementwise_in_rows(node.inputs[0], rows)
        value = Value(node.value.dtype, rows.kind, rows.shape, rows.m, rows.d)
        if node.op in UNARY | BINARY | {Op.WHERE}:
            inputs = [self.elementwise_in_rows(i, rows) for i in node.inputs]
            return None if None in inputs else self.add(node.op, inputs, value, node.attr, name=f"{name}_rows")
        if node.op in (Op.INPUT, Op.EXTERN, Op.GETITEM):
            step = views.reshape(node.value.shape, rows.shape)
            source = self.access(name)
            return None if step is None else self.strided(f"{name}_rows", source.then(*step, rows.shape), value,
                                                          f"view{_shape(rows.shape)}")
        return None

    def keep_aten_views(self) -> None:
        """A view that only aten calls read, and read in any strides (a transposed weight for mm;
        attention's query, key, value and gradients, whose last dim stays in place), stays an
        aten view: a strided read is a kernel that copies it, aten reads it where it lies. An
        `aten.view` of it becomes `aten.reshape`, which copies only where the strides need it
        (attention's output, laid out as its query, needs none). Not a fallback. A reshape (VIEW)
        stays one only for ops registered as reading any strides (memfuse.ir.patterns): a matmul operand's reshape is the producing
        kernel's to write (padding.py)."""
        users = self.graph.users()
        outputs = set(self.graph.outputs)
        for name in reversed([n for n in self.aten_views if n in self.graph.nodes]):   # a view of such a view first
            readers = [self.graph[u] for u in users[name]]
            strided = self.graph[name].op is Op.STRIDED
            registered = {op for op, r in RULES.items() if r.reads is Reads.ANY_STRIDES}
            in_any_strides = ANY_STRIDES_ATEN | registered if strided else registered
            if self.last_dim_in_place(name if strided else self.graph[name].inputs[0]):
                in_any_strides = in_any_strides | {op for op, r in RULES.items() if r.reads is Reads.LAST_DIM_IN_PLACE} \
                    | (RESHAPED_ATEN if strided else set())
            if not readers or name in outputs or any(
                    r.op is not Op.EXTERN or called_op(r.attr.target) not in in_any_strides for r in readers):
                continue
            for r in readers:
                if r.attr.target in RESHAPED_ATEN:
                    self.graph.nodes[r.name] = Node(r.name, r.op, r.inputs, r.value,
                                                    dataclasses.replace(r.attr, target=aten.reshape.default))
            node = self.aten_views[name]
            inputs, value, attr = self.extern_call(node, node.meta["val"])
            if not strided and any(rule(r.attr.target).reads is Reads.LAST_DIM_IN_PLACE for r in readers):
                attr = dataclasses.replace(attr, target=aten.reshape.default)   # of a view kept in its strides
            self.graph.nodes[name] = Node(name, Op.EXTERN, tuple(inputs), value, attr)
            for inp in inputs:
                users[inp].append(name)

    def last_dim_in_place(self, name: str) -> bool:
        """Whether view `name` keeps its root's last dim last, stride 1 (attention reads it so)."""
        m = self.maps.get(name)
        if m is None or not m.last_stride_one or not m.shape or not m.coeffs:
            return False
        last = len(m.shape) - 1       # the view's last index moves the root's last by 1, no other
        return m.coeffs[-1][last] == 1 and all(row[last] == 0 for row in m.coeffs[:-1])

    def lower_extern(self, node, val, reason: str) -> str:
        self.fallbacks.append((node.name, str(node.target), reason))
        return self.add(Op.EXTERN, *self.extern_call(node, val), name=node.name)

    def extern_call(self, node, val) -> tuple:
        """(inputs, value, Extern) of `node` as an aten call on the lowered values."""
        def ref(arg):
            if isinstance(arg, torch.fx.Node):
                name = self.env[arg]
                if isinstance(name, tuple):
                    raise NotImplementedError(f"memfuse: extern {node.target} reads a lowered tuple")
                if name in self.tensor_constants:   # aten wants the tensor, not its value
                    return self.tensor_constants[name]
                return ValueRef(name)
            if isinstance(arg, (list, tuple)):
                return type(arg)(ref(a) for a in arg)
            return arg
        args = tuple(ref(a) for a in node.args)
        kwargs = tuple((k, ref(v)) for k, v in node.kwargs.items())
        inputs = value_refs(args) + value_refs(tuple(v for _, v in kwargs))
        value = classify(val) if isinstance(val, torch.Tensor) else Value(None, Kind.TENSOR)
        if node.target in MATMUL_ATEN and isinstance(val, torch.Tensor):   # the device decides padding
            return list(dict.fromkeys(inputs)), value, Matmul(node.target, args, kwargs, val.device.type)
        return list(dict.fromkeys(inputs)), value, Extern(node.target, args, kwargs)


@functools.cache
def matmul_writes_fp32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch's `aten.mm.dtype` writes the fp32 product of `dtype` operands on the device
    type (CUDA builds since torch 2.9; not the CPU): tried once on an 8x8 product, outside any fake
    mode the trace runs in."""
    if device_type != "cuda" or not hasattr(aten.mm, "dtype") or not torch.cuda.is_available():
        return False

    def product_of_ones():
        operand = torch.ones(8, 8, device="cuda", dtype=dtype)
        return aten.mm.dtype(operand, operand, torch.float32)
    try:
        product = outside_trace(product_of_ones)
    except (RuntimeError, NotImplementedError):
        return False
    return product.dtype == torch.float32 and bool((product == 8).all())



# -- one node for a value computed twice -------------------------------------------------------
def merge_stored_duplicates(graph: Graph) -> tuple:
    """(graph, merged): `graph` with one node for each value that several nodes compute and each
    writes to memory: autocast casts a layer's normalized input once per linear layer that reads
    it (three bf16 copies for q, k and v), and each layer builds the same attention mask for its
    own attention call. A duplicate read only in registers stays: the backward recomputing a forward value next
    to the derivative that reads it is one kernel, not one value written by another (merge_key
    says what counts as the same value). `merged`: each dropped node -> the node kept for it."""
    stored, constant = _stored(graph), _from_constants(graph)
    returned = set(graph.outputs)       # each returned tensor stays a tensor of its own
    names: dict = {}      # dropped duplicate -> the node that computes its value
    first: dict = {}      # merge key -> the first node with it
    merged = Graph(inputs=list(graph.inputs))
    for name, node in graph.nodes.items():
        inputs = tuple(names.get(i, i) for i in node.inputs)
        attr = node.attr
        if isinstance(attr, Extern):
            attr = dataclasses.replace(attr, args=renamed(attr.args, names), kwargs=renamed(attr.kwargs, names))
        mergeable = (name in stored or name in constant) and name not in returned
        key = merge_key(node.op, inputs, node.value, attr) if mergeable else None
        if key is not None and key in first:
            names[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        merged.add(Node(name, node.op, inputs, node.value, attr))
    merged.outputs = list(graph.outputs)
    return merged, names


def _merged_name(name, merged: dict):
    """A lowered fx node's value name (or tuple of them, or None) after merge_stored_duplicates."""
    if isinstance(name, tuple):
        return tuple(_merged_name(n, merged) for n in name)
    return merged.get(name, name) if isinstance(name, str) else name


def merge_key(op: Op, inputs: tuple, value: Value, attr) -> Optional[tuple]:
    """What makes two nodes compute the same values: op, inputs, result and attribute (a STRIDED
    node's description aside). None for nodes never merged: inputs, random draws (each its own
    stream) and aten calls (memfuse cannot tell which of them are pure)."""
    if op not in FUSIBLE or op in RANDOM:
        return None
    if isinstance(attr, Strided):
        attr = dataclasses.replace(attr, describe="")
    return op, inputs, value, attr


def _from_constants(graph: Graph) -> set:
    """The fusible values computed from constants and sizes alone (a scalar tensor, a fill, an
    iota): every kernel that reads one computes it, so one node serves them all."""
    constant: set = set()
    for name, node in graph.nodes.items():
        if node.op in FUSIBLE and node.op not in RANDOM and node.op is not Op.STRIDED and all(
                graph[i].op in (Op.CONSTANT, Op.SYMBOL) or i in constant for i in node.inputs):
            constant.add(name)
    return constant


def _stored(graph: Graph) -> set:
    """The fusible values that go to memory whatever the schedule: read by an aten call, read in
    place by a strided view, or reshaped (VIEW) into such a value."""
    users = graph.users()
    stored: set = set()
    for name in reversed(graph.nodes):
        for u in users[name]:
            reader = graph[u]
            if reader.op in EXTERNAL or (reader.op is Op.STRIDED and reader.inputs[0] == name) \
                    or (reader.op is Op.VIEW and u in stored):
                stored.add(name)
                break
    return stored


def strided_attr(m: "views.AccessMap", value: Value, describe: str, size_operand: Callable,
                 window: Optional[tuple] = None, summed: tuple = ()) -> Strided:
    """The access map of a STRIDED node reading `m.root` through `m` as `value` (FULL, ROW or COL).
    `size_operand` turns a sympy entry into an int or a ValueRef to a SYMBOL node of the graph
    being built (capture's, or a later pass's: memfuse.schedule.padding)."""
    # the rows unravel over the leading dims (all dims of a row value): the outermost size is not needed
    col = len(value.shape) - 1 if value.kind in (Kind.FULL, Kind.COL) else None
    outer = next((k for k, s in enumerate(value.shape) if k != col and not views.same(s, 1)), None)
    sizes = tuple(None if k == outer else size_operand(s) for k, s in enumerate(value.shape))
    index = tuple((tuple(size_operand(c) for c in row), size_operand(const)) for row, const in zip(m.coeffs, m.consts))
    win = None if window is None else tuple(
        None if w is None else (size_operand(w[0]), size_operand(w[1])) for w in window)
    return Strided(sizes, index, win, m.contiguous_root, describe, tuple(size_operand(s) for s in summed),
                   m.last_stride_one)


@dataclass(frozen=True)
class IndexCheck:
    """An extern target that checks an index tensor lies in [0, width) and returns a 0: a fused
    gather adds it to the values it picked, so its result waits for the check. An index outside raises as
    aten's gather does: on the CPU at once, on CUDA as a device assert (`torch._assert_async`)."""
    width: int
    dtype: torch.dtype                 # of the 0 it returns: the gathered values'

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        inside = ((index >= 0) & (index < self.width)).all()
        torch._assert_async(inside, f"memfuse: gather index out of bounds: an index lies outside [0, {self.width}) "
                                    "(eager's gather, or cross_entropy's target check, raises here too)")
        return torch.zeros((), dtype=self.dtype, device=index.device)

    def __repr__(self) -> str:
        return f"IndexCheck(0 <= index < {self.width})"


class TensorConstant:
    """An extern target that returns a tensor the traced function closed over."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __call__(self) -> torch.Tensor:
        return self.tensor

    def __repr__(self) -> str:
        return f"constant{tuple(self.tensor.shape)}"


def _shape(shape) -> str:
    return f"[{', '.join(str(s) for s in shape)}]"


# -- index ranges: when a scatter's index is known to lie in [0, D) ------------------------------
def index_in_range(graph: Graph, index: str, width: int) -> bool:
    """Whether every value of `index` lies in [0, width): it is an argmax/argmin over rows of
    `width`, or the same elementwise function of the same tensor as an index checked against
    `width` in this graph: by an IndexCheck (a fused gather's) or by an aten gather over rows of
    `width` (each raises on an index outside; AOTAutograd's graphs hold no dead code, so the
    check runs in the same call, in the forward: cross-entropy's forward gathers the target
    logit at where(t != ignore, t, 0), its backward scatters the one-hot at the same values)."""
    origin = index
    while graph[origin].op is Op.VIEW:
        origin = graph[origin].inputs[0]
    producer = graph[origin]
    if producer.op in (Op.ARGMAX, Op.ARGMIN) and graph[producer.inputs[0]].value.d == width:
        return True
    mine = elementwise_of_one(graph, index, covering=False)
    return mine is not None and any(elementwise_of_one(graph, checked, covering=True) == mine
                                    for checked in _checked_indices(graph, width))


def _checked_indices(graph: Graph, width: int):
    """The index tensors that an IndexCheck or an aten gather over rows of `width` checks."""
    for node in graph.nodes.values():
        if node.op is not Op.EXTERN:
            continue
        if isinstance(node.attr.target, IndexCheck) and node.attr.target.width == width:
            yield node.attr.args[0].name
        elif node.attr.target is aten.gather.default:
            source, dim, checked = node.attr.args[:3]
            if not (isinstance(source, ValueRef) and isinstance(checked, ValueRef) and isinstance(dim, int)):
                continue
            shape = graph[source.name].value.shape
            if shape and dim % len(shape) == len(shape) - 1 and shape[-1] == width:
                yield checked.name


def elementwise_of_one(graph: Graph, name: str, covering: bool) -> Optional[tuple]:
    """(root, expression) when `name` is a pointwise function, element by element, of one tensor
    read in one way (the `entry`: a read of `root`) and of scalars; else None. Reads (VIEW,
    STRIDED without a window or sums) above the expression and at its entry are looked through:
    every value `name` holds is then the expression of a value `root` holds. With `covering`, only
    reads that keep every element of their source are looked through, so the converse holds too."""
    entries, roots = set(), set()

    def form(n: str):
        node = graph[n]
        if node.op in UNARY | BINARY | {Op.WHERE}:
            return (node.op, node.attr, node.value.dtype, tuple(form(i) for i in node.inputs))
        root = _through_reads(graph, n, covering)
        if graph[root].op in (Op.CONSTANT, Op.SYMBOL):
            return (graph[root].op, graph[root].attr)
        entries.add(n)
        roots.add(root)
        return ("entry",)

    expression = form(_through_reads(graph, name, covering))
    return (roots.pop(), expression) if len(entries) == 1 else None


def _through_reads(graph: Graph, name: str, covering: bool) -> str:
    while True:
        node = graph[name]
        plain_read = node.op is Op.STRIDED and node.attr.window is None and not node.attr.summed
        if node.op is Op.VIEW or plain_read and (not covering or _reads_each_once(graph, node)):
            name = node.inputs[0]
        else:
            return name


def _reads_each_once(graph: Graph, node: Node) -> bool:
    """A STRIDED read that visits every element of its root once: a permute, or a reshape that
    adds or drops size-1 dims (each root dim of size > 1 is one value dim of the same size)."""
    value_shape, root_shape = node.value.shape, graph[node.inputs[0]].value.shape
    used = set()
    for j, (coefficients, constant) in enumerate(node.attr.index):
        if views.same(root_shape[j], 1):
            continue
        hits = [k for k, c in enumerate(coefficients) if not (isinstance(c, int) and c == 0)]
        if constant != 0 or len(hits) != 1 or hits[0] in used or hits[0] >= len(value_shape):
            return False
        k = hits[0]
        unit = isinstance(coefficients[k], int) and coefficients[k] == 1
        if not unit or not views.same(value_shape[k], root_shape[j]):
            return False
        used.add(k)
    return all(views.same(value_shape[k], 1) for k in range(len(value_shape)) if k not in used)
