"""Division by a value of fewer elements than the quotient (a row's norm dividing its row, a column
vector or a scalar dividing a tile): the kernel computes the divisor's scaled reciprocal once
(`mf_scaled_reciprocal`) and multiplies each element twice, never dividing per element.

Every quotient must be within 2 ulps of IEEE division (the analysis says 1: two roundings instead of
one) over every pair of adversarial dividends and divisors (subnormals, powers of two near fp32's
limits, huge and tiny values, quotients that overflow or land among the subnormals), with the sign
of every result and every quotient involving +-0, +-inf or NaN exactly torch's, under the
interpreter's arithmetic and under the GPU's as `gpu_arithmetic` (tests/conftest.py) models it.
"""
from __future__ import annotations

import re

import pytest
import torch

from helpers import BLOCKS, block_inputs, forward_backward, rel_error

import memfuse
from memfuse.base.config import Config

MAX_ULPS = 2
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]


def kernel_sources(fused) -> list:
    """The source of every kernel the compiled forward and backward programs launch."""
    entry, = fused.cache.values()
    programs = [entry.function.forward] + ([entry.function.backward] if entry.function.backward else [])
    return [step.kernel.source.source for program in programs for step in program.steps if hasattr(step, "kernel")]


def kernel_body(source: str) -> str:
    """The kernel function itself, without the helpers copied above it."""
    return source[source.index("\ndef memfuse_"):]


def tile_divisions(body: str) -> list:
    """Lines that divide by a row value or a column vector broadcast over the tile."""
    return re.findall(r".* / [\w.()]+\[(?::, None|None, :)\].*", body)


def near_powers_of_two(exponents, steps: int = 6) -> torch.Tensor:
    """The fp32 values within `steps` ulps of 2^e for each e, both signs."""
    values = []
    for e in exponents:
        bits = torch.tensor(2.0 ** e, dtype=torch.float64).float().view(torch.int32).long()
        values.append((bits + torch.arange(-steps, steps + 1)).clamp(1, 0x7F7FFFFF).int().view(torch.float32))
    values = torch.cat(values)
    return torch.cat([values, -values])


def random_bits(n: int, seed: int) -> torch.Tensor:
    """Finite fp32 values with uniformly random bit patterns: every exponent equally likely."""
    generator = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2 ** 31, 2 ** 31, (n,), generator=generator, dtype=torch.int64).int()
    values = bits.view(torch.float32)
    return values[values.isfinite()]


def adversarial() -> torch.Tensor:
    """Subnormals, 2^-127..2^-125, 1, 2^125..2^127, fp32's extremes, random exponents, the specials.
    About 500 values: the tests divide every one by every other (a quarter million quotients)."""
    return torch.cat([near_powers_of_two([-149, -140, -128, -127, -126, -125, -64, 0, 1, 64, 125, 126, 127]),
                      torch.tensor([1.1754942e-38, 3.4028235e38, -3.4028235e38, 0.1, 3.0, -7.0, 1e-45]),
                      random_bits(200, seed=1), torch.tensor(SPECIAL)])


def ordered(values: torch.Tensor) -> torch.Tensor:
    """fp32 values as integers in the order of the floats, one apart per ulp (inf one past the largest
    finite float, both zeros 0): the ulp distance is a difference."""
    bits = values.view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def assert_like_division(got: torch.Tensor, x: torch.Tensor, d: torch.Tensor, what: str) -> None:
    """got = x / d (broadcast) within MAX_ULPS of IEEE division (fp64's quotient rounded once to fp32:
    exact for a quotient of fp32 values), NaN where it is NaN, every sign as its sign, and quotients of
    +-0, +-inf and NaN exactly."""
    x, d = torch.broadcast_tensors(x, d)
    exact = (x.double() / d.double()).float()
    nan = exact.isnan()
    assert torch.equal(got.isnan(), nan), f"{what}: NaN at {(got.isnan() != nan).sum().item()} quotients where x / d has none"
    numbers = ~nan
    assert torch.equal(got[numbers].signbit(), exact[numbers].signbit()), f"{what}: a quotient's sign differs"
    special = ((x == 0) | x.isinf() | (d == 0) | d.isinf()) & numbers
    assert torch.equal(got[special], exact[special]), f"{what}: a quotient of a zero or infinity differs"
    if not numbers.any():
        return
    ulps = (ordered(got[numbers]) - ordered(exact[numbers])).abs()
    worst = ulps.argmax()
    assert ulps.max().item() <= MAX_ULPS, (
        f"{what}: {ulps.max().item()} ulps at {x[numbers][worst].item()!r} / {d[numbers][worst].item()!r}: "
        f"{got[numbers][worst].item()!r}, IEEE {exact[numbers][worst].item()!r}")


def fused_quotient(x: torch.Tensor, d: torch.Tensor):
    """x / d through memfuse, checked to run as one kernel that multiplies by a reciprocal and divides nothing."""
    fused = memfuse.memory_efficient_fusion(lambda a, b: a / b)
    before = memfuse.stats()["extern_calls"]
    got = fused(x, d)
    assert memfuse.stats()["extern_calls"] == before
    source, = kernel_sources(fused)
    body = kernel_body(source)
    assert re.search(r"\* \w+_reciprocal\b", body) and " / " not in body, body
    return got


@pytest.mark.parametrize("arithmetic", ["ieee", "flushing"])   # (an id "gpu" would mark it a GPU test)
def test_row_divisor_within_two_ulps_of_division(arithmetic, request):
    """Every adversarial divisor (one per row) against every adversarial dividend (one per column)."""
    if arithmetic == "flushing":
        request.getfixturevalue("gpu_arithmetic")
    values = adversarial()
    x = values.expand(values.numel(), -1).contiguous()
    d = values[:, None].clone()
    assert_like_division(fused_quotient(x, d), x, d, f"row divisor ({arithmetic} arithmetic)")


@pytest.mark.parametrize("arithmetic", ["ieee", "flushing"])   # (an id "gpu" would mark it a GPU test)
def test_column_divisor_within_two_ulps_of_division(arithmetic, request):
    """The same pairs with the divisor a column vector: its reciprocal once per program."""
    if arithmetic == "flushing":
        request.getfixturevalue("gpu_arithmetic")
    values = adversarial()
    x = values[:, None].expand(-1, values.numel()).contiguous()
    d = values.clone()
    got = fused_quotient(x, d)
    assert_like_division(got, x, d, f"column divisor ({arithmetic} arithmetic)")


@pytest.mark.parametrize("divisor", [3.0, -0.1, 1e-45, -3e-39, 2.0 ** -127, 3e38, 0.0, -0.0, float("inf"), float("nan")])
def test_scalar_divisor(divisor):
    """A 0-d tensor divisor: one reciprocal for the whole kernel."""
    values = adversarial()
    x = values[:values.numel() // 8 * 8].reshape(-1, 8)
    d = torch.tensor(divisor)
    assert_like_division(fused_quotient(x, d), x, d, f"scalar divisor {divisor!r}")


def test_normalize_by_the_row_norm_forward_and_backward():
    """x / ||x||: no per-element division in either kernel, results as eager's."""
    x = torch.randn(6, 5, 97) * torch.logspace(-15, 15, 6)[:, None, None]
    fused = memfuse.memory_efficient_fusion(lambda a: a / a.norm(dim=-1, keepdim=True))
    grad = torch.randn_like(x)
    ours = forward_backward(lambda a: fused(a), [x.requires_grad_()], {}, grad)
    eager = forward_backward(lambda a: a / a.norm(dim=-1, keepdim=True), [x], {}, grad)
    for k in range(x.shape[0]):   # rows of magnitudes 1e-15 .. 1e15
        assert rel_error(ours[0][k], eager[0][k]) < 1e-6 and rel_error(ours[1][0][k], eager[1][0][k]) < 1e-6
    sources = kernel_sources(fused)
    assert len(sources) == 2
    for source in sources:
        body = kernel_body(source)
        assert not tile_divisions(body), body
        assert body.count("mf_scaled_reciprocal(") == 1, body   # one per kernel: the norm's (and its aliases')


def test_primitive_layer_norm_block_divides_by_reciprocals():
    """The seed's hand-written LayerNorm: `(x - mean) / sqrt(var + eps)` and its gradients multiply
    by the per-row reciprocal of sqrt, in both kernels; results as eager's."""
    name = "primitive_layer_norm_block"
    tensors, consts, grad_output = block_inputs(name, (3, 5, 96))
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    out, grads = forward_backward(fused, tensors, consts, grad_output)
    eager_out, eager_grads = forward_backward(BLOCKS[name].fn, tensors, consts, grad_output)
    assert rel_error(out, eager_out) < 1e-6
    for ours, theirs in zip(grads, eager_grads):
        assert rel_error(ours, theirs) < 1e-5
    forward, backward = (kernel_body(s) for s in kernel_sources(fused))
    for body in (forward, backward):
        assert not tile_divisions(body), body
        reciprocal, = re.findall(r"^ *(\w+)_reciprocal, \1_scale = mf_scaled_reciprocal\((\w+)\)$", body, re.MULTILINE)
        assert reciprocal[0] == reciprocal[1] and re.search(rf"^ *{reciprocal[0]} = tl\.sqrt\(", body, re.MULTILINE)
    # the forward's one quotient; the backward's four (the forward's, recomputed, and three of the gradient)
    quotient = r"^ *\w+ = \(\(\w+ \* sqrt_reciprocal\[:, None\]\) \* sqrt_scale\[:, None\]\)$"
    assert len(re.findall(quotient, forward, re.MULTILINE)) == 1, forward
    assert len(re.findall(quotient, backward, re.MULTILINE)) == 4, backward


def test_looped_kernel_takes_the_reciprocal_between_passes():
    """Rows longer than the persistent limit: softmax's sum is finished between passes, and its
    reciprocal with it, outside the loop over chunks."""
    x = torch.randn(5, 300) * 4
    fused = memfuse.memory_efficient_fusion(lambda a: torch.softmax(a, -1), config=Config(max_row_length=64))
    grad = torch.randn_like(x)
    ours = forward_backward(lambda a: fused(a), [x.requires_grad_()], {}, grad)
    eager = forward_backward(lambda a: torch.softmax(a, -1), [x], {}, grad)
    torch.testing.assert_close(ours[0], eager[0], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ours[1][0], eager[1][0], rtol=1e-5, atol=1e-8)
    for source in kernel_sources(fused):
        body = kernel_body(source)
        assert "for chunk in range(0, D, BLOCK_D):" in body and not tile_divisions(body), body
        line, = [line for line in body.splitlines() if "= mf_scaled_reciprocal(" in line]
        chunk_loop = next(line for line in body.splitlines() if line.strip().startswith("for chunk in"))
        assert len(line) - len(line.lstrip()) == len(chunk_loop) - len(chunk_loop.lstrip()), body


def test_divisors_that_keep_the_division():
    """A divisor of the quotient's own shape (no reciprocal to share), and fp64 values."""
    x, y = torch.randn(4, 33), torch.rand(4, 33) + 0.5
    fused = memfuse.memory_efficient_fusion(lambda a, b: a / b)
    torch.testing.assert_close(fused(x, y), x / y, rtol=0, atol=0)
    body = kernel_body(kernel_sources(fused)[0])
    assert "mf_scaled_reciprocal" not in body and re.search(r"= \(\w+ / \w+\)$", body, re.MULTILINE), body
    x64 = x.double()
    fused = memfuse.memory_efficient_fusion(lambda a: a / a.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(fused(x64), x64 / x64.norm(dim=-1, keepdim=True), rtol=1e-15, atol=0)
    body = kernel_body(kernel_sources(fused)[0])
    assert "mf_scaled_reciprocal" not in body and tile_divisions(body), body


def test_bf16_quotients_within_one_bf16_rounding():
    """bf16 values divide in fp32 and round once at the store: at most one bf16 ulp from eager's
    (which rounds the IEEE quotient), where the fp32 quotient's last bit moves a rounding."""
    x = torch.randn(16, 200).bfloat16()
    fused = memfuse.memory_efficient_fusion(lambda a: a / a.float().norm(dim=-1, keepdim=True).bfloat16())
    got, eager = fused(x), x / x.float().norm(dim=-1, keepdim=True).bfloat16()
    assert got.dtype == torch.bfloat16
    body = kernel_body(kernel_sources(fused)[0])
    assert "mf_scaled_reciprocal(" in body and not tile_divisions(body), body
    bf16_ulps = (got.float().view(torch.int32) - eager.float().view(torch.int32)).abs() >> 16
    assert bf16_ulps.max().item() <= 1


def test_size_divisor_serves_every_batch_size():
    """x / x.shape[0]: the divisor is a size read per call (an int): its reciprocal once per program."""
    fused = memfuse.memory_efficient_fusion(lambda a: a / a.shape[0])
    for rows in (3, 7, 96):
        x = torch.randn(rows, 40)
        assert_like_division(fused(x), x, torch.tensor(float(rows)), f"x / {rows}")
    body = kernel_body(kernel_sources(fused)[0])
    assert re.search(r"_reciprocal, \w+_scale = mf_scaled_reciprocal\(\w+\.to\(tl\.float32\)\)", body), body
    assert " / " not in body, body
