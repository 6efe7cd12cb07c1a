"""What capture lowers each aten/prims target to, as tables: the op families, the targets with a
rule of their own (SPECIAL_ATEN: what each becomes), and the reasons an op stays an aten call."""
from __future__ import annotations

import torch

from memfuse.ir.graph import Op
from memfuse.ir.patterns import RULES

aten = torch.ops.aten
prims = torch.ops.prims


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
# Ops a pattern registered say how they read (memfuse.ir.patterns, ExternRule.reads): through any
# strides (memfuse.ir.aten.reads_any_strides), or any whose last is 1 (attention).
# aten views of a view kept in its strides, made reshapes (a view of them may need a copy)
RESHAPED_ATEN = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
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

# Targets with a rule of their own (memfuse.capture.lower.RULES): what each becomes.
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
    aten.var_mean.correction: "sum -> mean, then the sum of squared deviations (over D; over some leading dims "
                              "and D, each a sum of rows finished over the leading dims: BatchNorm's statistics)",
    aten.permute.default: "view when only size-1 dims move; else a strided read of a tensor in memory "
                          "(columns by a stride when the last dim moves)",
    aten.slice.Tensor: "view when it keeps a whole dim; else a strided read of a tensor in memory",
    aten.select.int: "a strided read of a tensor in memory",
    aten.split_with_sizes.default: "strided reads of a tensor in memory, one per part",
    aten.cat.default: "windowed strided reads of the parts in memory, each where its range lies (a slice of the cat "
                      "moves their windows: torch.diff's prepend); along D, a part computed from reads "
                      "(rotate_half's -x2) is computed at its columns",
    aten.slice_scatter.default: "the source itself where it fills the whole base (a whole-dim slice's gradient); "
                                "else a windowed strided read of the source over the base (step 1; else an "
                                "extern); along D, a source computed from reads is computed at its columns",
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

