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

from memfuse.ir.graph import Op

NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"


@dataclass(frozen=True)
class OpInfo:
    triton: str                 # format string over the operand expressions {0}, {1}, {2}
    torch: Callable
    helper: Optional[str] = None   # the HELPERS entry the expression calls
    fp64: bool = True              # False: the helper is accurate to fp32 only; fp64 values go to aten


def _trunc_divide(a, b):
    return torch.div(a, b, rounding_mode="trunc")


def _trigamma(x):
    return torch.polygamma(1, x)


OPS = {
    Op.NEG: OpInfo("({0} * -1)", torch.neg),   # Triton 3.6 compiles -x as 0 - x: +0 for +0, where torch gives -0
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
    # inverse trigonometric and hyperbolic functions, erfc, erfinv, lgamma, digamma, trigamma: helpers below
    Op.ATAN: OpInfo("mf_atan({0})", torch.atan, "mf_atan", fp64=False),
    Op.ASIN: OpInfo("mf_asin({0})", torch.asin, "mf_asin", fp64=False),
    Op.ACOS: OpInfo("mf_acos({0})", torch.acos, "mf_acos", fp64=False),
    Op.SINH: OpInfo("mf_sinh({0})", torch.sinh, "mf_sinh"),
    Op.COSH: OpInfo("mf_cosh({0})", torch.cosh, "mf_cosh"),
    Op.ASINH: OpInfo("mf_asinh({0})", torch.asinh, "mf_asinh"),
    Op.ACOSH: OpInfo("mf_acosh({0})", torch.acosh, "mf_acosh"),
    Op.ATANH: OpInfo("mf_atanh({0})", torch.atanh, "mf_atanh"),
    Op.ERFC: OpInfo("mf_erfc({0})", torch.erfc, "mf_erfc", fp64=False),
    Op.ERFINV: OpInfo("mf_erfinv({0})", torch.erfinv, "mf_erfinv", fp64=False),
    Op.LGAMMA: OpInfo("mf_lgamma({0})", torch.lgamma, "mf_lgamma", fp64=False),
    Op.DIGAMMA: OpInfo("mf_digamma({0})", torch.digamma, "mf_digamma", fp64=False),
    Op.TRIGAMMA: OpInfo("mf_trigamma({0})", _trigamma, "mf_trigamma", fp64=False),
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
    Op.ATAN2: OpInfo("mf_atan2({0}, {1})", torch.atan2, "mf_atan2", fp64=False),
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

# x / d where d has fewer elements than x (a row's norm dividing its row's tile; a column vector or a
# scalar dividing a tile or a row), in fp32: the divisor's scaled reciprocal once, on its own shape
# (SCALED_RECIPROCAL, into two registers), then two multiplies per element (DIVIDE_BY_RECIPROCAL),
# not a division. Within ~1 ulp of the division, special values exact (tests/ir/test_division.py). A
# divisor of the result's shape, a literal and fp64 values keep OPS[Op.DIV].
SCALED_RECIPROCAL = "mf_scaled_reciprocal"      # the HELPERS entry: d -> (reciprocal, scale)
DIVIDE_BY_RECIPROCAL = "(({0} * {1}) * {2})"


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
    if x.dtype == tl.float64:
        # tanh(|x|) = expm1(2|x|) / (expm1(2|x|) + 2), signed: accurate near 0 (2 sigmoid(2x) - 1 is
        # not), exactly 1 from |x| = 20 on, NaN kept; x itself below fp32's smallest normal (-0
        # included), where tanh(x) = x and e / (e + 2) would divide a subnormal
        a = tl.abs(x)
        a = tl.where(a > 20.0, 20.0, a)
        e = mf_expm1(2.0 * a)
        t = e / (e + 2.0)
        return tl.where(a < 1.1754943508222875e-38, x, tl.where(x < 0, -t, t))
    else:
        # Cephes' tanhf (a few fp32 ulps): below |x| = 0.625 an odd polynomial, x + x^3 P(x^2) (x
        # itself for tiny and signed-zero x); above, 1 - 2 / (exp(2|x|) + 1), signed (1 once exp
        # overflows; NaN kept). Half the instructions of the fp64 identity's: GELU kernels are
        # bound by their arithmetic, not by memory, with that one.
        a = tl.abs(x)
        z = x * x
        poly = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z
                + 1.33314422036e-1) * z - 3.33332819422e-1
        small = tl.where(a < 1.1754943508222875e-38, x, poly * z * x + x)
        large = 1.0 - 2.0 / (tl.exp(2.0 * a) + 1.0)
        return tl.where(a < 0.625, small, tl.where(x < 0, -large, large))''', ("mf_expm1",)),
    # -- inverse trigonometric and hyperbolic functions ---------------------------------------
    # fp32 algorithms (Cephes' single-precision ones where named); the tl.where chains keep
    # torch's NaN, inf and signed-zero results: NaN fails every comparison, so it takes the last
    # branch and flows through the arithmetic.
    "mf_atan": ('''def mf_atan(x):
    # Cephes atanf: |x| > tan(3pi/8): pi/2 + atan(-1/|x|); |x| > tan(pi/8): pi/4 + atan((|x|-1)/(|x|+1));
    # then an odd degree-9 polynomial on [-tan(pi/8), tan(pi/8)]. atan(+-inf) = +-pi/2, atan(-0) = -0
    a = tl.abs(x)
    big = a > 2.414213562373095
    mid = a > 0.41421356237309503
    t = tl.where(big, -1.0 / a, tl.where(mid, (a - 1.0) / (a + 1.0), a))
    base = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z = t * t
    p = (((8.05374449538e-2 * z - 1.38776856032e-1) * z + 1.99777106478e-1) * z - 3.33329491539e-1) * z * t + t
    r = base + p
    return tl.where(x < 0, -r, tl.where(x == 0, x, r))''', ()),
    "mf_copysign": ('''def mf_copysign(magnitude, sign):
    # |magnitude| with sign's sign bit (fp32), set on the bits: no arithmetic that could lose a zero's sign
    bits = (magnitude.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) | (sign.to(tl.uint32, bitcast=True) & 0x80000000)
    return bits.to(tl.float32, bitcast=True)''', ()),
    "mf_atan2": ('''def mf_atan2(y, x):
    # atan of min(|x|, |y|) / max(|x|, |y|) in [0, 1], then the octant: pi/2 - r where |y| > |x|,
    # pi - r where x is negative (-0 too, by its sign bit); C's atan2 at zeros and infs. On the GPU a
    # division may flush subnormal operands to 0 and -r compiles to 0 - r (+0 for r = 0), so operands
    # below 2^-64 are scaled by 2^64 (exact, same quotient) and y's sign bit is copied onto the result
    ax = tl.abs(x)
    ay = tl.abs(y)
    tiny = tl.maximum(ax, ay) < 5.421010862427522e-20
    ax = tl.where(tiny, ax * 1.8446744073709552e19, ax)
    ay = tl.where(tiny, ay * 1.8446744073709552e19, ay)
    steep = ay > ax
    t = tl.where(steep, ax / ay, ay / ax)
    t = tl.where(ax == float('inf'), tl.where(ay == float('inf'), 1.0, t), t)   # inf / inf
    t = tl.where(ax == 0, tl.where(ay == 0, 0.0, t), t)                         # 0 / 0
    r = mf_atan(t)
    r = tl.where(steep, 1.5707963267948966 - r, r)
    x_negative = x.to(tl.int32, bitcast=True) < 0
    r = tl.where(x_negative, 3.141592653589793 - r, r)
    return mf_copysign(r, y)''', ("mf_atan", "mf_copysign")),
    "mf_asin_kernel": ('''def mf_asin_kernel(s, z):
    # Cephes asinf's polynomial: asin(s) for |s| <= 0.5, z = s * s
    p = (((4.2163199048e-2 * z + 2.4181311049e-2) * z + 4.5470025998e-2) * z + 7.4953002686e-2) * z
    return s + s * (p + 1.6666752422e-1) * z''', ()),
    "mf_asin": ('''def mf_asin(x):
    # Cephes asinf: the polynomial up to |x| = 0.5, pi/2 - 2 asin(sqrt((1 - |x|) / 2)) beyond;
    # |x| > 1 makes the square root NaN, as torch
    a = tl.abs(x)
    big = a > 0.5
    z = tl.where(big, 0.5 * (1.0 - a), a * a)
    s = tl.where(big, tl.sqrt(z), a)
    p = mf_asin_kernel(s, z)
    r = tl.where(big, 1.5707963267948966 - 2.0 * p, p)
    return tl.where(x < 0, -r, tl.where(x == 0, x, r))''', ("mf_asin_kernel",)),
    "mf_acos": ('''def mf_acos(x):
    # Cephes acosf: pi/2 - asin(x) up to |x| = 0.5; beyond, with s = sqrt((1 - |x|) / 2),
    # 2 asin(s) for x > 0.5 and pi - 2 asin(s) for x < -0.5 (no cancellation near +-1)
    a = tl.abs(x)
    big = a > 0.5
    z = tl.where(big, 0.5 * (1.0 - a), x * x)
    s = tl.where(big, tl.sqrt(z), x)
    p = mf_asin_kernel(s, z)
    return tl.where(big, tl.where(x > 0, 2.0 * p, 3.141592653589793 - 2.0 * p), 1.5707963267948966 - p)''',
                ("mf_asin_kernel",)),
    "mf_sinh": ('''def mf_sinh(x):
    # (e + e / (e + 1)) / 2 with e = expm1(|x|): no cancellation near 0; from |x| = 20 on
    # (exp(|x|/2) / 2) * exp(|x|/2), finite up to the dtype's largest sinh; x itself below fp32's
    # smallest normal (-0 included), where sinh(x) = x and e / (e + 1) would divide a subnormal
    a = tl.abs(x)
    e = mf_expm1(tl.where(a > 20.0, 20.0, a))
    half = tl.exp(0.5 * a)
    r = tl.where(a > 20.0, (0.5 * half) * half, 0.5 * (e + e / (e + 1.0)))
    return tl.where(a < 1.1754943508222875e-38, x, tl.where(x < 0, -r, r))''', ("mf_expm1",)),
    "mf_cosh": ('''def mf_cosh(x):
    # (exp(|x|) + exp(-|x|)) / 2; from |x| = 20 on (exp(|x|/2) / 2) * exp(|x|/2), finite as far as cosh is
    a = tl.abs(x)
    e = tl.exp(tl.where(a > 20.0, 20.0, a))
    half = tl.exp(0.5 * a)
    return tl.where(a > 20.0, (0.5 * half) * half, 0.5 * e + 0.5 / e)''', ()),
    "mf_asinh": ('''def mf_asinh(x):
    # (glibc asinhf) log1p(a + a^2 / (1 + sqrt(1 + a^2))) up to a = |x| = 2, log(2a + 1 / (a + sqrt(a^2 + 1)))
    # up to 2^28, log(a) + log(2) beyond (a^2 would overflow); signed, -0 kept
    a = tl.abs(x)
    square = a * a
    root = tl.sqrt(square + 1.0)
    small = mf_log1p(a + square / (1.0 + root))
    medium = tl.log(2.0 * a + 1.0 / (a + root))
    large = tl.log(a) + 0.6931471805599453
    r = tl.where(a > 268435456.0, large, tl.where(a > 2.0, medium, small))
    return tl.where(x < 0, -r, tl.where(x == 0, x, r))''', ("mf_log1p",)),
    "mf_acosh": ('''def mf_acosh(x):
    # (glibc acoshf) log1p(t + sqrt(2t + t^2)), t = x - 1, up to x = 2; log(2x - 1 / (x + sqrt(x^2 - 1)))
    # up to 2^28; log(x) + log(2) beyond; NaN below 1
    t = x - 1.0
    small = mf_log1p(t + tl.sqrt(2.0 * t + t * t))
    medium = tl.log(2.0 * x - 1.0 / (x + tl.sqrt(x * x - 1.0)))
    large = tl.log(x) + 0.6931471805599453
    r = tl.where(x > 268435456.0, large, tl.where(x > 2.0, medium, small))
    return tl.where(x < 1.0, float('nan'), r)''', ("mf_log1p",)),
    "mf_atanh": ('''def mf_atanh(x):
    # log1p(2a / (1 - a)) / 2, a = |x|: +-inf at +-1, NaN beyond; signed; x itself below fp32's
    # smallest normal (-0 included), where atanh(x) = x and 2a / (1 - a) would divide a subnormal
    a = tl.abs(x)
    r = 0.5 * mf_log1p(2.0 * a / (1.0 - a))
    return tl.where(a < 1.1754943508222875e-38, x, tl.where(x < 0, -r, r))''', ("mf_log1p",)),
    # -- error and gamma functions -------------------------------------------------------------
    "mf_erfc": ('''def mf_erfc(x):
    # Numerical Recipes' erfcc (a Chebyshev fit, relative error < 1.2e-7 for z >= 0):
    # erfc(z) = t exp(-z^2 + P(t)), t = 1 / (1 + z/2); erfc(-z) = 2 - erfc(z). exp(-z^2) is taken as
    # exp(-m^2) exp((m - z)(m + z)), m = z rounded to 1/64 (m^2 exact): z^2 rounded would move the
    # exponent by ~z^2 * 6e-8 (5e-6 relative at z = 9). erfc is 0 in fp32 from z = 10.1 on.
    z = tl.abs(x)
    z = tl.where(z > 12.0, 12.0, z)
    t = 1.0 / (1.0 + 0.5 * z)
    p = 1.48851587 + t * (-0.82215223 + t * 0.17087277)
    p = -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * p))
    p = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * p)))
    m = tl.floor(z * 64.0 + 0.5) * 0.015625
    r = t * (tl.exp(-m * m) * tl.exp((m - z) * (m + z) + p))
    return tl.where(x < 0, 2.0 - r, r)''', ()),
    "mf_erfinv": ('''def mf_erfinv(x):
    # Giles, "Approximating the erfinv function" (GPU Gems 4), single precision: polynomials in
    # w = -log(1 - x^2), central (w < 5) and tail; +-inf at +-1, NaN beyond
    w = -tl.log((1.0 - x) * (1.0 + x))
    c = w - 2.5
    central = 2.81022636e-08
    central = 3.43273939e-07 + central * c
    central = -3.5233877e-06 + central * c
    central = -4.39150654e-06 + central * c
    central = 0.00021858087 + central * c
    central = -0.00125372503 + central * c
    central = -0.00417768164 + central * c
    central = 0.246640727 + central * c
    central = 1.50140941 + central * c
    s = tl.sqrt(w) - 3.0
    tail = -0.000200214257
    tail = 0.000100950558 + tail * s
    tail = 0.00134934322 + tail * s
    tail = -0.00367342844 + tail * s
    tail = 0.00573950773 + tail * s
    tail = -0.0076224613 + tail * s
    tail = 0.00943887047 + tail * s
    tail = 1.00167406 + tail * s
    tail = 2.83297682 + tail * s
    r = tl.where(w < 5.0, central, tail) * x
    return tl.where(tl.abs(x) == 1.0, x * float('inf'), r)''', ()),
    "mf_lgamma_near2": ('''def mf_lgamma_near2(t):
    # lgamma(2 + t) for |t| <= 0.5: its Taylor series, coefficient k = (-1)^k (zeta(k) - 1) / k
    # (k >= 2) and 1 - euler_gamma (k = 1), to degree 14 (truncation below 1e-10)
    p = 4.374866789907488e-06
    p = -9.439488275268397e-06 + p * t
    p = 2.050721277567069e-05 + p * t
    p = -4.492623673813314e-05 + p * t
    p = 9.945751278180853e-05 + p * t
    p = -0.00022315475845357939 + p * t
    p = 0.0005096695247430425 + p * t
    p = -0.001192753911703261 + p * t
    p = 0.0028905103307415234 + p * t
    p = -0.007385551028673986 + p * t
    p = 0.020580808427784546 + p * t
    p = -0.0673523010531981 + p * t
    p = 0.3224670334241132 + p * t
    p = 0.42278433509846713 + p * t
    return p * t''', ()),
    "mf_lgamma": ('''def mf_lgamma(x):
    # log|Gamma(x)|. For a > 0 (a = x, or 1 - x for x <= 0): below 0.5 lgamma(a + 2) - log(a) - log1p(a);
    # below 1.5 lgamma(a + 1) - log1p(a - 1); below 8 the recurrence lgamma(a) = lgamma(a - 1) + log(a - 1)
    # down into [1.5, 2.5); lgamma(2 + t) by its series; from 8 on Stirling's series. For x <= 0 the
    # reflection log(pi / |sin(pi x)|) - lgamma(1 - x): +inf at the non-positive integers, as torch
    a = tl.where(x <= 0, 1.0 - x, x)
    # log|x| for the branches of tiny |x|: a subnormal |x| scaled by 2^64 first (the GPU may flush it to 0)
    magnitude = tl.abs(x)
    scaled = magnitude < 1.1754943508222875e-38
    log_magnitude = tl.log(tl.where(scaled, magnitude * 1.8446744073709552e19, magnitude))
    log_magnitude = log_magnitude - tl.where(scaled, 44.3614195558365, 0.0)
    z = a
    product = tl.full(a.shape, 1.0, a.dtype)
    for _ in tl.static_range(6):
        down = z >= 2.5
        product = tl.where(down, product * (z - 1.0), product)
        z = tl.where(down, z - 1.0, z)
    t = tl.where(a < 0.5, a, tl.where(a < 1.5, a - 1.0, z - 2.0))
    shift = tl.where(a < 0.5, -log_magnitude - mf_log1p(a), tl.where(a < 1.5, -mf_log1p(a - 1.0), tl.log(product)))
    near = mf_lgamma_near2(t) + shift
    log_a = tl.log(a)
    inverse_square = 1.0 / (a * a)
    series = (0.08333333333333333 - inverse_square * (0.002777777777777778 - inverse_square * (
        0.0007936507936507937 - inverse_square * 0.0005952380952380953))) / a
    stirling = a * (log_a - 1.0) - 0.5 * log_a + 0.9189385332046728 + series
    positive = tl.where(a < 8.0, near, stirling)
    positive = tl.where(a == float('inf'), a, positive)
    # x - its nearest integer (0 from 2^23 on, where every float is one): |sin(pi x)| = |sin(pi r)|
    r = tl.where(tl.abs(x) < 8388608.0, x - tl.floor(x + 0.5), 0.0)
    reflected = 1.1447298858494002 - tl.log(tl.abs(tl.sin(3.141592653589793 * r))) - positive
    reflected = tl.where(r == 0, float('inf'), reflected)
    reflected = tl.where(x > -5.960464477539063e-08, -log_magnitude, reflected)   # sin(pi x) would be subnormal
    return tl.where(x <= 0, reflected, positive)''', ("mf_log1p", "mf_lgamma_near2")),
    "mf_digamma": ('''def mf_digamma(x):
    # psi(x): the recurrence psi(a) = psi(a + 1) - 1/a up to a >= 6, then the asymptotic series
    # log(a) - 1/(2a) - sum B_2k / (2k a^2k); for x < 0 the reflection psi(1 - x) - pi cot(pi x), NaN at
    # the negative integers; -inf at +0 and +inf at -0, as torch. The GPU may flush subnormal operands of
    # a division or of sin to 0 (cot(pi x) then comes out infinite for subnormal x): 1/a is taken
    # as (1 / (2^24 a)) 2^24, exact, and pi cot(pi r) = 1/r - pi^2 r / 3 (to fp32) for |r| < 2^-12
    negative = x < 0
    a = tl.where(negative, 1.0 - x, x)
    acc = tl.zeros(a.shape, a.dtype)
    for _ in tl.static_range(6):
        up = a < 6.0
        acc = tl.where(up, acc - (1.0 / (a * 16777216.0)) * 16777216.0, acc)
        a = tl.where(up, a + 1.0, a)
    z = 1.0 / (a * a)
    tail = z * (0.08333333333333333 - z * (0.008333333333333333 - z * (
        0.003968253968253968 - z * (0.004166666666666667 - z * 0.007575757575757576))))
    psi = acc + (tl.log(a) - 0.5 / a - tail)
    r = tl.where(tl.abs(x) < 8388608.0, x - tl.floor(x + 0.5), 0.0)   # cot(pi x) = cot(pi r)
    angle = 3.141592653589793 * r
    near_pole = tl.abs(r) < 2.44140625e-4
    cot = tl.where(near_pole, (1.0 / (r * 16777216.0)) * 16777216.0 - 3.2898681336964524 * r,
                   3.141592653589793 * tl.cos(angle) / tl.sin(angle))
    reflected = tl.where(r == 0, float('nan'), psi - cot)
    return tl.where(negative, reflected, psi)''', ()),
    "mf_trigamma": ('''def mf_trigamma(x):
    # psi'(x) = polygamma(1, x): the recurrence psi'(a) = psi'(a + 1) + 1/a^2 up to a >= 6, then the
    # asymptotic series 1/a + 1/(2a^2) + sum B_2k / a^(2k+1); for x <= 0 the reflection
    # (pi / sin(pi x))^2 - psi'(1 - x). +inf at the poles 0, -1, -2, ... (torch returns pi^2 over a rounded
    # sin(pi x)^2 there: 1.3e15 at -1 in fp32), NaN at -inf. 1/a is squared after the division, so no
    # division sees a subnormal unless the result overflows anyway
    negative = x <= 0
    a = tl.where(negative, 1.0 - x, x)
    acc = tl.zeros(a.shape, a.dtype)
    for _ in tl.static_range(6):
        up = a < 6.0
        inverse = 1.0 / a
        acc = tl.where(up, acc + inverse * inverse, acc)
        a = tl.where(up, a + 1.0, a)
    inverse = 1.0 / a
    z = inverse * inverse
    tail = 0.16666666666666666 - z * (0.03333333333333333 - z * (0.023809523809523808 - z * 0.03333333333333333))
    psi1 = acc + inverse * (1.0 + inverse * (0.5 + inverse * tail))
    r = tl.where(tl.abs(x) < 8388608.0, x - tl.floor(x + 0.5), 0.0)   # sin(pi x)^2 = sin(pi r)^2
    cosecant = 3.141592653589793 / tl.sin(3.141592653589793 * r)
    reflected = tl.where(r == 0, float('inf'), cosecant * cosecant - psi1)
    reflected = tl.where(x == float('-inf'), float('nan'), reflected)
    return tl.where(negative, reflected, psi1)''', ()),
    # -- division by a value of fewer elements (SCALED_RECIPROCAL) -----------------------------
    "mf_scaled_reciprocal": ('''def mf_scaled_reciprocal(d):
    # 1 / d as (reciprocal, scale): x / d is (x * reciprocal) * scale, within ~1 ulp of the division.
    # d = m 2^n with |m| in [1, 2) (a subnormal d is scaled by 2^64 first, exactly): 1 / m is one IEEE
    # division, in (0.5, 1]; reciprocal = (1 / m) 2^k1 exactly, with k1 = -n clamped to [-125, 127] so
    # that it stays normal, and scale = 2^(-n - k1): 1 except for |d| >= 2^126 (scale 1/2 or 1/4: the
    # product only rounds again where x / d is subnormal) and subnormal d (up to 2^22: x * reciprocal is
    # normal for any nonzero x and overflows only where x / d does). d = +-0, +-inf, NaN: 1 / d and
    # scale 1 (x * (1 / d) is then x / d: its infinities, NaNs and signed zeros)
    tiny = tl.abs(d) < 1.1754943508222875e-38
    bits = tl.where(tiny, d * 1.8446744073709552e19, d).to(tl.int32, bitcast=True)
    n = ((bits >> 23) & 0xFF) - tl.where(tiny, 127 + 64, 127)
    m = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
    k1 = tl.minimum(tl.maximum(0 - n, -125), 127)
    k2 = (0 - n) - k1
    reciprocal = tl.div_rn(tl.where(d < 0, -1.0, 1.0), m) * ((k1 + 127) << 23).to(tl.float32, bitcast=True)
    scale = ((k2 + 127) << 23).to(tl.float32, bitcast=True)
    ordinary = tl.where(d != 0, tl.abs(d) < float('inf'), False)
    return tl.where(ordinary, reciprocal, 1.0 / d), tl.where(ordinary, scale, 1.0)''', ()),
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
    # truncates fp32 -> bf16 where the GPU's cast (cvt.rn) rounds, so there the rounding is done
    # here first and the cast is then exact; compiled, the cast alone (the bit arithmetic was 28%
    # of the SASS in the tile loop of GPT-2's bf16 GELU backward: 1183 instructions, now 847)
    if MF_INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    else:
        return x''', ()),
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
    "mf_online_rescale": ('''def mf_online_rescale(total, shift_before, shift_after):
    # a running sum of exp(x - shift_before) restated against shift_after (the row max grew): times
    # exp(shift_before - shift_after); unchanged where the shift did not move, and a zero stays zero
    # (no 0 * inf where a shift leaves an infinity for a constant, as logsumexp's does)
    moved = (shift_before != shift_after) & (total != 0)
    return tl.where(moved, total * tl.exp(shift_before - shift_after), total)''', ()),
}

# Module-level lines a helper's source reads, written once above the helpers of a kernel file.
HELPER_GLOBALS = {
    "mf_rne_bf16": ("from triton import knobs",
                    "MF_INTERPRETED = tl.constexpr(bool(knobs.runtime.interpret))  # Triton's interpreter runs it"),
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
