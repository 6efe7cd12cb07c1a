"""The math helpers over their whole domains (tanh, atan, atan2, asin, acos, sinh, cosh, asinh,
acosh, atanh, erfc, erfinv, lgamma, digamma, trigamma), forward and backward, through the
generated kernels.

tests/ir/test_ops.py checks each target on a few ordinary samples; here every op meets tiny
(subnormal too), moderate and huge magnitudes, its tails, its exact special points and NaN/inf.
fp32 results must lie within RTOL of torch's fp64 result (plus an absolute floor: subnormal
results, and the zeros of lgamma and digamma, where fp32 cannot do better), or be no further from
it than torch's own fp32 result; NaN, infinities and the sign of zero and subnormal results exactly
as torch. The fp32 checks run again with the interpreter's arithmetic made to flush subnormals
and lose signed zeros as the GPU's may (`gpu_arithmetic`). bf16 within a bf16 rounding. fp64
inputs: the helpers that are accurate to fp32 only leave fp64 to aten (with the reason), the others
(tanh, sinh, cosh, asinh, acosh, atanh: identities over exp, log and log1p) are fused.
"""
from __future__ import annotations

import pytest
import torch

import memfuse

RTOL = 1e-5
TINY = 1e-37       # absolute floor for every op: results below fp32's normal range
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 3.0, -3.0, 10.0, -100.0, float("inf"), float("-inf"),
           float("nan"), 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, 1.0000001, 0.99999994, -0.99999994,
           5e-39, -3.2e-39]   # (subnormals whose digamma is finite: the H200 returned inf for -3.2e-39)


def magnitudes(low: float, high: float, n: int = 1500, signed: bool = True) -> torch.Tensor:
    """10**low .. 10**high, log-spaced (and negated too when `signed`), as fp32."""
    values = torch.logspace(low, high, n, dtype=torch.float64).float()
    return torch.cat([values, -values]) if signed else values


def span(low: float, high: float, n: int = 2001) -> torch.Tensor:
    return torch.linspace(low, high, n)


def domain(*parts) -> torch.Tensor:
    return torch.cat([torch.as_tensor(p, dtype=torch.float32).flatten() for p in parts + (SPECIAL,)])


def trigamma(x):
    return torch.polygamma(1, x)


def off_the_poles(values: torch.Tensor) -> torch.Tensor:
    """Without the values that are negative integers in fp32 or rounded to bf16: trigamma's poles,
    where torch returns pi^2 over a rounded sin(pi x)^2 (finite, and far from fp64's value) and
    memfuse +inf (test_trigamma_poles)."""
    def poles(v):
        return (v < 0) & (v == v.round())
    return values[~(poles(values) | poles(values.bfloat16().float()))]


# op -> (torch function, forward domain, backward domain (finite gradients), absolute floor)
NEAR_POLES = span(-9.95, 9.95, 1991)[span(-9.95, 9.95, 1991).frac().abs() > 0.02]
OPS = {
    "tanh": (torch.tanh, domain(magnitudes(-40, 2), span(-10, 10)), torch.cat([span(-2, 2), magnitudes(-18, 0)]),
             TINY),
    "atan": (torch.atan, domain(magnitudes(-40, 38), span(-10, 10)), magnitudes(-18, 18), TINY),
    "asin": (torch.asin, domain(span(-1, 1), magnitudes(-40, 0.5)), span(-0.999, 0.999), TINY),
    "acos": (torch.acos, domain(span(-1, 1), magnitudes(-40, 0.5)), span(-0.999, 0.999), TINY),
    "sinh": (torch.sinh, domain(magnitudes(-40, 2), span(-90, 90)), span(-80, 80), TINY),
    "cosh": (torch.cosh, domain(magnitudes(-40, 2), span(-90, 90)), span(-80, 80), TINY),
    "asinh": (torch.asinh, domain(magnitudes(-40, 38), span(-10, 10)), magnitudes(-18, 18), TINY),
    "acosh": (torch.acosh, domain(1 + magnitudes(-7, 38, signed=False), span(-2, 10)),
              1 + magnitudes(-6, 18, signed=False), TINY),
    "atanh": (torch.atanh, domain(span(-1, 1), 1 - magnitudes(-7.2, 0, signed=False), magnitudes(-40, 0.5)),
              span(-0.999, 0.999), TINY),
    "erfc": (torch.erfc, domain(magnitudes(-40, 1.2), span(-12, 12)), span(-10, 10), TINY),
    "erfinv": (torch.erfinv, domain(span(-1, 1), 1 - magnitudes(-7.2, 0, signed=False),
                                    -1 + magnitudes(-7.2, 0, signed=False), magnitudes(-40, 0.3)),
               span(-0.999, 0.999), TINY),
    "lgamma": (torch.lgamma, domain(magnitudes(-40, 38), span(-20, 20), span(0.5, 3), span(-10, 10, 21)),
               torch.cat([NEAR_POLES, magnitudes(-6, 6, signed=False)]), 1e-5),
    "digamma": (torch.digamma, domain(magnitudes(-40, 38), span(-20, 20), span(0.5, 3), span(-10, 10, 21)),
                torch.cat([NEAR_POLES, magnitudes(-3, 3, signed=False)]), 1e-5),
    "trigamma": (trigamma, off_the_poles(domain(magnitudes(-40, 38), span(-20, 20), span(0.5, 3), span(-3, 0.5, 3001))),
                 torch.cat([NEAR_POLES, magnitudes(-3, 3, signed=False)]), TINY),
}
PAIRS = domain(magnitudes(-40, 38, 400), span(-5, 5, 401))   # atan2(y, x): y from a shuffle of these


def atan2_domain() -> tuple:
    generator = torch.Generator().manual_seed(0)
    special = torch.tensor(SPECIAL)
    y = torch.cat([PAIRS[torch.randperm(PAIRS.numel(), generator=generator)], special.repeat_interleave(len(SPECIAL))])
    x = torch.cat([PAIRS, special.repeat(len(SPECIAL))])
    return y, x


def grid(values: torch.Tensor, d: int = 61) -> torch.Tensor:
    """The values as an [M, d] tensor (an odd row length), padded with the last value."""
    pad = (-values.numel()) % d
    return torch.cat([values, values[-1:].expand(pad)]).reshape(-1, d)


def fused_call(fn, *args):
    """fn through memfuse, and the extern (aten) calls it made on the way."""
    before = memfuse.stats()["extern_calls"]
    out = memfuse.memory_efficient_fusion(lambda *a: fn(*a))(*args)
    return out, memfuse.stats()["extern_calls"] - before


def assert_accurate(got, eager, reference, *, rtol: float, atol: float, what: str) -> None:
    """`got` within rtol/atol of the fp64 `reference`, or no further from it than `eager`;
    NaN where eager has NaN, torch's infinities, and the sign of every zero or subnormal result."""
    exact = reference.to(got.dtype).double()
    smallest_normal = torch.finfo(got.dtype).tiny
    got, eager = got.double(), eager.double()
    assert torch.equal(got.isnan(), eager.isnan()), \
        f"{what}: NaN at {(got.isnan() != eager.isnan()).sum().item()} elements where eager disagrees"
    infinite = exact.isinf()
    assert torch.equal(got[infinite], exact[infinite]), f"{what}: infinities differ from torch's"
    tiny = exact.abs() < smallest_normal
    differ = (got[tiny].signbit() != eager[tiny].signbit()).sum().item()
    assert not differ, f"{what}: the sign of a zero or subnormal result differs from eager's at {differ} elements"
    finite = exact.isfinite()
    error = (got - reference).abs()[finite]
    bound = (rtol * reference.abs() + atol)[finite]
    bound = torch.maximum(bound, (eager - reference).abs()[finite])
    worst = (error / bound).argmax()
    assert (error <= bound).all(), (f"{what}: error {error[worst].item():.3g} > bound {bound[worst].item():.3g} "
                                    f"at reference {reference[finite][worst].item()!r}")


@pytest.mark.parametrize("name", OPS)
def test_forward_fp32_over_the_domain(name):
    fn, values, _, atol = OPS[name]
    x = grid(values)
    got, externs = fused_call(fn, x)
    assert externs == 0, f"{name} ran through aten"
    assert_accurate(got, fn(x), fn(x.double()), rtol=RTOL, atol=atol, what=name)


def test_atan2_forward_fp32_every_quadrant_and_special_pair():
    y, x = (grid(v) for v in atan2_domain())
    got, externs = fused_call(torch.atan2, y, x)
    assert externs == 0
    assert_accurate(got, torch.atan2(y, x), torch.atan2(y.double(), x.double()), rtol=RTOL, atol=TINY, what="atan2")


@pytest.mark.parametrize("name", OPS)
def test_forward_bf16(name):
    fn, values, _, atol = OPS[name]
    # (no subnormal inputs: the interpreter's bf16 -> fp32 conversion flushes or garbles them)
    x = grid(values[~((values.abs() < 1.2e-38) & (values != 0))]).bfloat16()
    got, externs = fused_call(fn, x)
    assert externs == 0 and got.dtype == torch.bfloat16
    assert_accurate(got, fn(x), fn(x.double()), rtol=1e-2, atol=max(atol, 1e-2) if atol > TINY else TINY,
                    what=f"{name} bf16")


def gradients(fn, *inputs):
    """(memfuse's, eager fp32's, eager fp64's) input gradients for a ones output gradient."""
    def grads(call, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
        out = call(*leaves)
        return torch.autograd.grad(out, leaves, torch.ones_like(out))
    fused = memfuse.memory_efficient_fusion(lambda *a: fn(*a))
    return grads(fused, torch.float32), grads(fn, torch.float32), grads(fn, torch.float64)


@pytest.mark.parametrize("name", OPS)
def test_backward_fp32_is_fused_and_accurate(name):
    fn, _, values, atol = OPS[name]
    before = memfuse.stats()["extern_calls"]
    ours, eager, reference = gradients(fn, grid(values[values.isfinite()]))
    # trigamma's derivative is polygamma(2, x), which has no helper: the one aten call left
    assert memfuse.stats()["extern_calls"] - before == (1 if name == "trigamma" else 0)
    assert_accurate(ours[0], eager[0], reference[0], rtol=2 * RTOL, atol=atol, what=f"{name} gradient")


def test_atan2_backward_fp32():
    y, x = (grid(v) for v in atan2_domain())
    # (x^2 + y^2 in the formula over- and underflows in fp32 beyond these magnitudes, in eager too)
    keep = ((y.abs() < 1e18) & (x.abs() < 1e18) & (y.abs() + x.abs() > 1e-18))
    y, x = torch.where(keep, y, 1.0), torch.where(keep, x, 1.0)
    before = memfuse.stats()["extern_calls"]
    ours, eager, reference = gradients(torch.atan2, y, x)
    assert memfuse.stats()["extern_calls"] == before
    for k, which in enumerate("yx"):
        assert_accurate(ours[k], eager[k], reference[k], rtol=2 * RTOL, atol=TINY, what=f"atan2 gradient {which}")


def test_lgamma_backward_is_digamma_in_the_kernel(capsys):
    x = (torch.rand(8, 16) * 5 + 0.1).requires_grad_()
    report = memfuse.explain(torch.lgamma, x)
    assert not report.fallbacks and not report.externs
    assert [op for k in report.kernels_of("forward") for _, op in k.ops] == ["lgamma"]
    assert [op for k in report.kernels_of("backward") for _, op in k.ops] == ["digamma", "mul"]
    ours, _, reference = gradients(torch.lgamma, x)
    torch.testing.assert_close(ours[0], reference[0].float(), rtol=2e-5, atol=2e-5)


def test_digamma_backward_is_trigamma_in_the_kernel():
    x = (torch.rand(8, 16) * 5 - 2.5).requires_grad_()
    report = memfuse.explain(torch.digamma, x)
    assert not report.fallbacks and not report.externs
    assert [op for k in report.kernels_of("backward") for _, op in k.ops] == ["trigamma", "mul"]


def test_trigamma_poles():
    """+inf at 0 and the negative integers (torch: pi^2 over a rounded sin(pi x)^2, 1.3e15 at -1 in
    fp32), NaN at -inf and 0 at +inf as torch."""
    x = torch.tensor([0.0, -0.0, -1.0, -2.0, -100.0, -8388608.0, -3.4e38, float("-inf"), float("inf")])
    got, externs = fused_call(trigamma, x.reshape(1, -1))
    assert externs == 0
    inf, nan = float("inf"), float("nan")
    torch.testing.assert_close(got.flatten(), torch.tensor([inf] * 7 + [nan, 0.0]), equal_nan=True, rtol=0, atol=0)


FP64_GENERIC = ["tanh", "sinh", "cosh", "asinh", "acosh", "atanh"]


@pytest.mark.parametrize("name", OPS)
def test_fp64(name):
    """fp64: fused and accurate to a few ulps where the helper is an identity over exp/log
    (FP64_GENERIC), else left to aten with the reason."""
    fn, values, _, _ = OPS[name]
    x = grid(values).double()
    fused = memfuse.memory_efficient_fusion(lambda a: fn(a))
    before = memfuse.stats()["extern_calls"]
    got = fused(x)
    externs = memfuse.stats()["extern_calls"] - before
    reasons = [f[2] for entry in fused.cache.values() for f in entry.captured.fallbacks]
    if name in FP64_GENERIC:
        assert externs == 0 and not reasons
        assert_accurate(got, fn(x), fn(x), rtol=1e-15, atol=1e-300, what=f"{name} fp64")
    else:
        assert externs == 1 and reasons == [f"fp64 {name}: its helper (mf_{name}) is accurate to fp32 only"]
        torch.testing.assert_close(got, fn(x), equal_nan=True, rtol=0, atol=0)


# -- the GPU's arithmetic, modelled in the interpreter (`gpu_arithmetic`: tests/conftest.py) --------------
@pytest.mark.parametrize("name", [*OPS, "atan2"])
def test_forward_fp32_with_the_gpus_arithmetic(name, gpu_arithmetic):
    """The fp32 checks again with subnormals flushed and signed zeros lost as on the GPU: the H200
    returned inf for digamma of subnormal negatives and +0 for atan2(-0, 1); both fail here with the
    helpers as they were."""
    if name == "atan2":
        fn, inputs, atol = torch.atan2, [grid(v) for v in atan2_domain()], TINY
    else:
        fn, values, _, atol = OPS[name]
        inputs = [grid(values)]
    got, externs = fused_call(fn, *inputs)
    assert externs == 0
    assert_accurate(got, fn(*inputs), fn(*(v.double() for v in inputs)), rtol=RTOL, atol=atol, what=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
def test_negation_keeps_signed_zeros_with_the_gpus_arithmetic(dtype, gpu_arithmetic):
    """neg(+0) is -0 in torch; Triton 3.6's unary minus (0 - x) gives +0, so memfuse negates by
    multiplying with -1 (exact, NaN and integers included)."""
    x = torch.tensor([0.0, -0.0, 1.5, -2.0, float("inf"), float("nan")]).to(dtype).repeat(8, 1)
    got, externs = fused_call(lambda a: -torch.neg(torch.neg(a)) * 3, x)
    expected = -torch.neg(torch.neg(x)) * 3
    assert externs == 0
    torch.testing.assert_close(got, expected, equal_nan=True)
    if dtype.is_floating_point:       # a NaN's sign bit means nothing
        numbers = ~expected.isnan()
        assert torch.equal(torch.signbit(got[numbers]), torch.signbit(expected[numbers]))
