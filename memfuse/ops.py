"""Per-op knowledge, one row per op: the Triton expression and the torch reference.

Operands reach the Triton expression already in the node's compute dtype (fp32 for every
floating value, see `compute_dtype`). The torch column runs a node on real tensors where a
group is executed through aten instead of a generated kernel. Expressions use only what the
Triton interpreter runs too (tl.exp/log/sqrt/sin/cos/floor/erf, no libdevice, no inline asm);
where one expression is not enough, the row names a `@triton.jit` helper from HELPERS, which
the code generator copies into the kernel file.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .ir import Op

NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"


@dataclass(frozen=True)
class OpInfo:
    triton: str                 # format string over the operand expressions {0}, {1}, {2}
    torch: Callable
    helper: Optional[str] = None   # the HELPERS entry the expression calls


def _trunc_divide(a, b):
    return torch.div(a, b, rounding_mode="trunc")


OPS = {
    Op.NEG: OpInfo("-{0}", torch.neg),
    Op.ABS: OpInfo("tl.abs({0})", torch.abs),
    Op.EXP: OpInfo("tl.exp({0})", torch.exp),
    Op.LOG: OpInfo("tl.log({0})", torch.log),
    Op.SQRT: OpInfo("tl.sqrt({0})", torch.sqrt),
    Op.RSQRT: OpInfo("tl.rsqrt({0})", torch.rsqrt),
    Op.SIGMOID: OpInfo("tl.sigmoid({0})", torch.sigmoid),
    Op.TANH: OpInfo("mf_tanh({0})", torch.tanh, "mf_tanh"),
    Op.ERF: OpInfo("tl.erf({0})", torch.erf),
    Op.RECIPROCAL: OpInfo("(1.0 / {0})", torch.reciprocal),
    Op.SIN: OpInfo("tl.sin({0})", torch.sin),
    Op.COS: OpInfo("tl.cos({0})", torch.cos),
    Op.TAN: OpInfo("(tl.sin({0}) / tl.cos({0}))", torch.tan),
    Op.EXP2: OpInfo("tl.exp2({0})", torch.exp2),
    Op.EXPM1: OpInfo("mf_expm1({0})", torch.expm1, "mf_expm1"),
    Op.LOG1P: OpInfo("mf_log1p({0})", torch.log1p, "mf_log1p"),
    Op.LOG2: OpInfo("tl.log2({0})", torch.log2),
    Op.LOG10: OpInfo("(tl.log({0}) * 0.4342944819032518)", torch.log10),
    Op.FLOOR: OpInfo("tl.floor({0})", torch.floor),
    Op.CEIL: OpInfo("tl.ceil({0})", torch.ceil),
    Op.ROUND: OpInfo("mf_round({0})", torch.round, "mf_round"),
    Op.TRUNC: OpInfo("mf_trunc({0})", torch.trunc, "mf_trunc"),
    Op.SIGN: OpInfo("mf_sign({0})", torch.sign, "mf_sign"),
    Op.ISNAN: OpInfo("({0} != {0})", torch.isnan),
    Op.ISINF: OpInfo("(tl.abs({0}) == float('inf'))", torch.isinf),
    Op.LOGICAL_NOT: OpInfo("({0} == 0)", torch.logical_not),
    Op.BITWISE_NOT: OpInfo("(~{0})", torch.bitwise_not),
    Op.ADD: OpInfo("({0} + {1})", torch.add),
    Op.SUB: OpInfo("({0} - {1})", torch.sub),
    Op.MUL: OpInfo("({0} * {1})", torch.mul),
    Op.DIV: OpInfo("({0} / {1})", torch.div),
    Op.POW: OpInfo("mf_pow({0}, {1})", torch.pow, "mf_pow"),
    Op.FMOD: OpInfo("({0} % {1})", torch.fmod),          # float %: C fmod, exact
    Op.REMAINDER: OpInfo("mf_remainder({0}, {1})", torch.remainder, "mf_remainder"),
    Op.FLOOR_DIVIDE: OpInfo("mf_floor_divide({0}, {1})", torch.floor_divide, "mf_floor_divide"),
    Op.TRUNC_DIVIDE: OpInfo("mf_trunc({0} / {1})", _trunc_divide, "mf_trunc"),
    Op.MAXIMUM: OpInfo("tl.maximum({0}, {1}, " + NAN_ALL + ")", torch.maximum),
    Op.MINIMUM: OpInfo("tl.minimum({0}, {1}, " + NAN_ALL + ")", torch.minimum),
    Op.EQ: OpInfo("({0} == {1})", torch.eq),
    Op.NE: OpInfo("({0} != {1})", torch.ne),
    Op.LT: OpInfo("({0} < {1})", torch.lt),
    Op.LE: OpInfo("({0} <= {1})", torch.le),
    Op.GT: OpInfo("({0} > {1})", torch.gt),
    Op.GE: OpInfo("({0} >= {1})", torch.ge),
    # (where, not & | ^, between booleans: the interpreter cannot mix a 0-d boolean with a block)
    Op.LOGICAL_AND: OpInfo("tl.where({0} != 0, {1} != 0, False)", torch.logical_and),
    Op.LOGICAL_OR: OpInfo("tl.where({0} != 0, True, {1} != 0)", torch.logical_or),
    Op.LOGICAL_XOR: OpInfo("(({0} != 0) != ({1} != 0))", torch.logical_xor),
    Op.BITWISE_AND: OpInfo("({0} & {1})", torch.bitwise_and),
    Op.BITWISE_OR: OpInfo("({0} | {1})", torch.bitwise_or),
    Op.BITWISE_XOR: OpInfo("({0} ^ {1})", torch.bitwise_xor),
    Op.WHERE: OpInfo("tl.where({0}, {1}, {2})", torch.where),
}


@dataclass(frozen=True)
class ReduceInfo:
    """A reduction: `triton` reduces a masked block {0} over axis {1} (masked lanes hold
    `neutral`); `combine` merges two partial results (chunks of a looped row, tiles of a
    column sum); `torch` is the reference, called as torch(x, dim, keepdim=True)."""
    triton: str
    neutral: str
    combine: str
    torch: Callable
    helper: Optional[str] = None


REDUCE = {
    Op.SUM: ReduceInfo("tl.sum({0}, axis={1})", "0.0", "({0} + {1})", torch.sum),
    # tl.max / tl.min drop NaN (maxnum on the GPU, and in the interpreter): mf_max puts it back
    Op.MAX: ReduceInfo("mf_max({0}, {1})", "float('-inf')", "tl.maximum({0}, {1}, " + NAN_ALL + ")",
                       torch.amax, "mf_max"),
    Op.MIN: ReduceInfo("mf_min({0}, {1})", "float('inf')", "tl.minimum({0}, {1}, " + NAN_ALL + ")",
                       torch.amin, "mf_min"),
    Op.PROD: ReduceInfo("tl.reduce({0}, {1}, mf_mul)", "1.0", "({0} * {1})", torch.prod, "mf_mul"),
}

# Index reductions (over D only): torch's first extreme, NaN counting as the extreme.
ARG_REDUCE = {Op.ARGMAX: torch.argmax, Op.ARGMIN: torch.argmin}

# The runtime's view of the reductions: (Triton reducer, neutral element, torch reference).
REDUCERS = {op: (r.triton, r.neutral, r.torch) for op, r in REDUCE.items()}
REDUCERS.update({op: ("mf_arg_best", "float('-inf')", reference) for op, reference in ARG_REDUCE.items()})


# @triton.jit helpers, copied into each kernel file that uses them: name -> (source, helpers it calls).
HELPERS = {
    "mf_expm1": ('''def mf_expm1(x):
    # exp(x) - 1 without cancellation near 0 (Kahan): (u - 1) * x / log(u), u = exp(x)
    u = tl.exp(x)
    near_zero = tl.where(u == 1.0, x, (u - 1.0) * x / tl.log(u))
    return tl.where(tl.abs(x) < 0.5, near_zero, u - 1.0)''', ()),
    "mf_log1p": ('''def mf_log1p(x):
    # log(1 + x) without cancellation near 0 (Kahan): log(u) * x / (u - 1), u = 1 + x
    u = 1.0 + x
    near_zero = tl.where(u == 1.0, x, tl.log(u) * (x / (u - 1.0)))
    return tl.where(tl.abs(x) < 0.5, near_zero, tl.log(u))''', ()),
    "mf_tanh": ('''def mf_tanh(x):
    # tanh(|x|) = expm1(2|x|) / (expm1(2|x|) + 2), signed: accurate near 0 (2 sigmoid(2x) - 1 is
    # not), exactly 1 from |x| = 20 on, NaN kept
    a = tl.abs(x)
    a = tl.where(a > 20.0, 20.0, a)
    e = mf_expm1(2.0 * a)
    t = e / (e + 2.0)
    return tl.where(x < 0, -t, t)''', ("mf_expm1",)),
    "mf_round": ('''def mf_round(x):
    # round half to even, as torch.round: ties go to the even neighbour
    down = tl.floor(x)
    frac = x - down
    odd = (down - 2.0 * tl.floor(down * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    rounded = tl.where(up, down + 1.0, down)
    return tl.where(rounded == 0, x * 0.0, rounded)   # -0.4 rounds to -0.0, as in torch''', ()),
    "mf_trunc": ('''def mf_trunc(x):
    return tl.where(x >= 0, tl.floor(x), tl.ceil(x))''', ()),
    "mf_sign": ('''def mf_sign(x):
    # torch.sign: -1, 0 or 1 in x's dtype, and 0 for NaN
    return tl.where(x > 0, 1, tl.where(x < 0, -1, 0)).to(x.dtype)''', ()),
    "mf_pow": ('''def mf_pow(x, y):
    # x ** y as exp2(y * log2|x|) in fp64, with C pow's signs and special cases
    x64 = x.to(tl.float64)
    y64 = y.to(tl.float64)
    magnitude = tl.exp2(y64 * tl.log2(tl.abs(x64)))
    y_integral = tl.floor(y64) == y64
    y_odd = y_integral & ((y64 - 2.0 * tl.floor(y64 * 0.5)) != 0.0)
    negative_base = tl.where(y_integral, tl.where(y_odd, -magnitude, magnitude), float('nan'))
    result = tl.where(x64 < 0, negative_base, magnitude)
    one = tl.where(y64 == 0, True, x64 == 1)    # where, not |: x or y may be a 0-d scalar
    one = tl.where(one, True, tl.where(x64 == -1, tl.abs(y64) == float('inf'), False))
    return tl.where(one, 1.0, result).to(x.dtype)''', ()),
    "mf_remainder": ('''def mf_remainder(a, b):
    # Python's %: the result takes the divisor's sign
    r = a % b
    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)''', ()),
    "mf_floor_divide": ('''def mf_floor_divide(a, b):
    # torch's div_floor_floating: floor of the exact quotient, via fmod
    mod = a % b
    div = (a - mod) / b
    div = tl.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1.0, div)
    floor = tl.floor(div)
    floor = tl.where(div - floor > 0.5, floor + 1.0, floor)
    zero = (a / b) * 0.0
    return tl.where(b == 0, a / b, tl.where(div != 0, floor, zero))''', ()),
    "mf_max": ('''def mf_max(x, axis: tl.constexpr):
    # tl.max ignores NaN; torch.amax returns NaN for a row that holds one
    nan = tl.max((x != x).to(tl.int32), axis=axis)
    return tl.where(nan > 0, float('nan'), tl.max(x, axis=axis))''', ()),
    "mf_min": ('''def mf_min(x, axis: tl.constexpr):
    nan = tl.max((x != x).to(tl.int32), axis=axis)
    return tl.where(nan > 0, float('nan'), tl.min(x, axis=axis))''', ()),
    "mf_rne_bf16": ('''def mf_rne_bf16(x):
    # fp32 rounded to the nearest bf16 (ties to even), still as fp32: Triton's interpreter
    # truncates fp32 -> bf16, the GPU's cvt.rn rounds; after this both convert exactly
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))''', ()),
    "mf_mul": ('''def mf_mul(a, b):
    return a * b''', ()),
    "mf_arg_best": ('''def mf_arg_best(key, cols):
    # per row: the largest key and its first column, NaN counting as largest (torch.argmax)
    nan = key != key
    any_nan = tl.max(nan.to(tl.int32), axis=1) > 0
    best = tl.where(any_nan, float('nan'), tl.max(key, axis=1))
    hit = tl.where(any_nan[:, None], nan, key == best[:, None])
    index = tl.min(tl.where(hit, cols[None, :], 2147483647), axis=1)
    return best, index''', ()),
    "mf_arg_merge": ('''def mf_arg_merge(best, index, chunk_best, chunk_index):
    # keep the earlier chunk's answer unless the later one is strictly better (or the first NaN)
    take = (chunk_best > best) | ((chunk_best != chunk_best) & (best == best))
    return tl.where(take, chunk_best, best), tl.where(take, chunk_index, index)''', ()),
}


def helpers_for(names) -> list:
    """The helper names `names` need, callees first, each once."""
    ordered = []

    def visit(name):
        if name in ordered:
            return
        for callee in HELPERS[name][1]:
            visit(callee)
        ordered.append(name)

    for name in names:
        visit(name)
    return ordered


TRITON_DTYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Registers hold fp32 for every float narrower than fp64: one rounding, at the store."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    return dtype


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions (and column partial sums) accumulate in fp32, and fp64 values in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32
