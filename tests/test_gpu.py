"""GPU checks at real sizes: the seed's blocks on CUDA against eager, kernel counts, dropout,
bf16 at the large shape, and a tensor past 2**31 elements (int64 offsets)."""
import pytest
import torch

import memfuse
from benchmarks.workloads import layer_norm_block, primitive_layer_norm_block, rms_norm_block

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BLOCKS = {
    "layer_norm": (layer_norm_block, dict(normalization_axis=2), 3),
    "primitive_layer_norm": (primitive_layer_norm_block, dict(normalization_axis=2, keepdim=True), 3),
    "rms_norm": (rms_norm_block, dict(normalization_axis=2, keepdim=True), 2),
}


def make_inputs(shape, dtype, n_params, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", dtype=dtype, generator=g).requires_grad_()
    r = torch.rand(*shape, device="cuda", dtype=dtype, generator=g).requires_grad_()
    params = [torch.nn.Parameter(torch.randn(shape[-1], device="cuda", dtype=dtype, generator=g))
              for _ in range(n_params)]
    return [x, r, *params]


def relative_error(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("name", BLOCKS)
def test_seed_blocks_match_eager_fp32(name):
    fn, kwargs, n_params = BLOCKS[name]
    inputs = make_inputs([64, 128, 1024], torch.float32, n_params)
    fused = memfuse.memory_efficient_fusion(fn)
    grad = torch.randn(64, 128, 1024, device="cuda")
    fused(*inputs, dropout_prob=0.0, **kwargs).backward(grad)   # compile outside the count
    ours_grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    before = memfuse.stats()
    out = fused(*inputs, dropout_prob=0.0, **kwargs)
    out.backward(grad)
    after = memfuse.stats()
    ours_grads = [t.grad for t in inputs]
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    ref = fn(*ref_inputs, dropout_prob=0.0, **kwargs)
    ref.backward(grad)
    assert relative_error(out, ref) < 1e-5
    for ours, theirs in zip(ours_grads, [t.grad for t in ref_inputs]):
        assert relative_error(ours, theirs) < 1e-5
    assert after["kernels_launched"] - before["kernels_launched"] == 2   # one forward, one backward
    assert after["extern_calls"] == before["extern_calls"]


def bias_dropout(x, b):
    return torch.nn.functional.dropout(x + b, 0.1, training=True)


def test_dropout_one_mask_forward_and_backward():
    # strictly positive input: CUDA's randn can return an exact 0.0, which would read as dropped
    x = (torch.rand(64, 128, 1024, device="cuda") + 0.5).requires_grad_()
    b = torch.zeros(1024, device="cuda", requires_grad=True)
    fused = memfuse.memory_efficient_fusion(bias_dropout)
    for call in range(3):                      # the first call compiles; later ones launch directly
        out = fused(x, b)
        kept = out != 0
        rate = kept.float().mean().item()
        assert abs(rate - 0.9) < 0.005, f"call {call}: keep rate {rate}"
        torch.testing.assert_close(out[kept], x[kept] / 0.9)
        out.backward(torch.ones_like(out))
        same = ((x.grad != 0) == kept).float().mean().item()
        assert same == 1.0, f"call {call}: backward mask agrees with the forward's on {same:.4f} of elements"
        x.grad = None
        second = fused(x, b)
        assert not torch.equal(second != 0, kept), f"call {call}: the next call reused the mask"


def test_direct_launch_matches_triton_launch(monkeypatch):
    """The launch path that skips Triton's launcher computes bit-identical results."""
    from memfuse import runtime
    x = torch.randn(64, 128, 1024, device="cuda", requires_grad=True)
    b = torch.randn(1024, device="cuda", requires_grad=True)
    monkeypatch.setattr(runtime, "_draw_seed", lambda: 1234)
    results = []
    for hooks in (True, False, False):         # generic path, then direct twice
        monkeypatch.setattr(runtime, "_launch_hooks_installed", lambda hooks=hooks: hooks)
        fused = memfuse.memory_efficient_fusion(bias_dropout)
        out = fused(x, b)
        out.backward(torch.ones_like(out))
        results.append((out.detach().clone(), x.grad.clone(), b.grad.clone()))
        x.grad = b.grad = None
    for other in results[1:]:
        for a, c in zip(results[0], other):
            assert torch.equal(a, c)


def scale_tanh(x, w):
    return torch.tanh(x * w)


def test_unaligned_input_takes_the_generic_launch():
    """An input 4 bytes off 16-byte alignment matches the aligned call: the directly launched
    kernel was compiled for aligned pointers, so the program sends this call the generic way."""
    storage = torch.randn(64 * 128 * 1024 + 1, device="cuda")
    unaligned = storage[1:].view(64, 128, 1024).requires_grad_()
    aligned = unaligned.detach().clone().requires_grad_()
    w = torch.randn(1024, device="cuda", requires_grad=True)
    fused = memfuse.memory_efficient_fusion(scale_tanh)
    results = []
    for x in (aligned, unaligned, aligned):
        out = fused(x, w)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), x.grad, w.grad))
        x.grad = w.grad = None
    for a, c in zip(results[0], results[1]):
        assert torch.equal(a, c)
    launch = fused.compiled_for(aligned, w).function.forward.steps[0]
    assert launch.launcher.compiled, "the aligned calls took the direct path"


def test_rms_norm_bf16_large_shape():
    inputs = make_inputs([256, 512, 4096], torch.bfloat16, 2)
    fused = memfuse.memory_efficient_fusion(rms_norm_block)
    kwargs = dict(normalization_axis=2, dropout_prob=0.0, keepdim=True)
    grad = torch.randn(256, 512, 4096, device="cuda", dtype=torch.bfloat16)
    out = fused(*inputs, **kwargs)
    out.backward(grad)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    ref = rms_norm_block(*ref_inputs, **kwargs)
    ref.backward(grad.float())
    assert relative_error(out, ref) < 1e-2
    for ours, theirs in zip([t.grad for t in inputs], [t.grad for t in ref_inputs]):
        assert relative_error(ours, theirs) < 1e-2


def test_more_than_2_31_elements():
    rows, d = 2 ** 21 + 3, 1024                  # 2**31 + 3072 elements
    x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(d, device="cuda", dtype=torch.bfloat16))

    def rms(x, w):
        return w * x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)

    fused = memfuse.memory_efficient_fusion(rms)
    out = fused(x, w)
    grad = torch.ones_like(out)
    out.backward(grad)
    tail = slice(rows - 5, rows)                 # rows whose offsets are past 2**31
    x_tail = x[tail].detach().clone().requires_grad_()
    ref = rms(x_tail, w.detach())
    ref.backward(grad[tail])
    assert relative_error(out[tail], ref) < 1e-2
    assert relative_error(x.grad[tail], x_tail.grad) < 1e-2


def test_precompile_leaves_the_first_launch_nothing_to_compile():
    """memfuse.precompile builds every kernel when the program is built; the first call's
    launches must find them in Triton's kernel cache (same key: argument types, constexprs,
    warps, alignment), not compile a second variant."""
    from memfuse.runtime import KernelLaunch
    inputs = make_inputs([8, 16, 1024], torch.float32, 3)
    fused = memfuse.memory_efficient_fusion(layer_norm_block)
    kwargs = dict(normalization_axis=2, dropout_prob=0.1)
    function = fused.compiled_for(*inputs, **kwargs).function
    device = torch.cuda.current_device()
    kernels = [step.kernel.fn for program in (function.forward, function.backward)
               for step in program.steps if isinstance(step, KernelLaunch)]
    assert len(kernels) >= 2
    before = [len(fn.device_caches[device][0]) for fn in kernels]
    assert before == [1] * len(kernels)       # each compiled once, before any launch
    fused(*inputs, **kwargs).backward(torch.randn_like(inputs[0]))
    torch.cuda.synchronize()
    assert [len(fn.device_caches[device][0]) for fn in kernels] == before


def test_views_on_gpu_with_unaligned_and_non_contiguous_inputs():
    """Strided reads through the direct launch path: a sliced (unaligned, non-contiguous) input,
    a SwiGLU chunk, a cat of the parts and a transpose of leading dims, over two batch sizes."""
    def fn(x, h):
        a, b = h.chunk(2, -1)
        gated = torch.nn.functional.silu(a) * b
        return torch.cat([gated, x.transpose(0, 1)], -1).softmax(-1)

    fused = memfuse.memory_efficient_fusion(fn)
    for batch in (16, 48):
        x = torch.randn(64, batch, 1024 + 1, device="cuda")[..., 1:].requires_grad_()   # unaligned
        h = torch.randn(batch, 64, 2048, device="cuda", dtype=torch.float32).requires_grad_()
        xe, he = x.detach().requires_grad_(), h.detach().requires_grad_()
        out, want = fused(x, h), fn(xe, he)
        grad = torch.randn_like(want)
        out.backward(grad)
        want.backward(grad)
        assert relative_error(out, want) < 1e-5
        assert relative_error(x.grad, xe.grad) < 1e-5 and relative_error(h.grad, he.grad) < 1e-5
    # (no compile count: a sliced input's strides are symbols the trace guards on, one compile per size)
    assert memfuse.stats()["extern_calls"] == 0


@pytest.mark.parametrize("name", ["atan", "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh", "erfc",
                                  "erfinv", "lgamma", "digamma"])
def test_math_helpers_over_their_domains_on_the_gpu(name):
    """The interpreter-tested math helpers compiled for real: tl.exp/log/sin/erf on the GPU are
    not numpy's (exp, for one, may go through ex2.approx), so the fp32 bound is checked here too."""
    from test_math_ops import OPS, RTOL, assert_accurate, grid
    fn, values, _, atol = OPS[name]
    x = grid(values).cuda()
    got = memfuse.memory_efficient_fusion(lambda a: fn(a))(x)
    assert_accurate(got.cpu(), fn(x).cpu(), fn(x.double()).cpu(), rtol=RTOL, atol=atol, what=f"{name} on the GPU")


def test_atan2_over_its_domain_on_the_gpu():
    from test_math_ops import RTOL, TINY, assert_accurate, atan2_domain, grid
    y, x = (grid(v).cuda() for v in atan2_domain())
    got = memfuse.memory_efficient_fusion(torch.atan2)(y, x)
    assert_accurate(got.cpu(), torch.atan2(y, x).cpu(), torch.atan2(y.double(), x.double()).cpu(), rtol=RTOL,
                    atol=TINY, what="atan2 on the GPU")
