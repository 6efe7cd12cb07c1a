"""GPU checks at real sizes: the seed's blocks on CUDA against eager, kernel counts, dropout,
bf16 at the large shape, and tensors past 2**31 elements (int64 offsets, plain and through views)."""
import contextlib

import pytest
import torch

import memfuse
from benchmarks.lib.workloads import layer_norm_block, primitive_layer_norm_block, rms_norm_block
from tests.ir.test_views import attention_block, fused_qkv_block, token_copy_kernels

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


def dropout_masks(fused, x, b, calls):
    """The forward masks of `calls` steps, each checked against the mask its backward used."""
    masks = []
    for _ in range(calls):
        out = fused(x, b)
        out.backward(torch.ones_like(out))
        kept = out != 0
        assert torch.equal(x.grad != 0, kept), "the backward regenerated another mask"
        x.grad = b.grad = None
        masks.append(kept)
    return masks


def test_dropout_seed_comes_from_the_cuda_generator():
    """On CUDA the seed is read from the device's default generator (runtime.philox_seed_draw):
    each call moves its offset by 4, torch.manual_seed and torch.cuda.manual_seed both reproduce
    the masks, successive calls draw new ones, and torch's own random ops in between move on."""
    x = (torch.rand(64, 128, 1024, device="cuda") + 0.5).requires_grad_()
    b = torch.zeros(1024, device="cuda", requires_grad=True)
    fused = memfuse.memory_efficient_fusion(bias_dropout)
    dropout_masks(fused, x, b, 2)           # compiled, launching directly from now on
    generator = torch.cuda.default_generators[x.device.index]
    offset = generator.get_offset()
    fused(x, b)
    assert generator.get_offset() == offset + 4
    torch.manual_seed(3)
    first = dropout_masks(fused, x, b, 3)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    torch.manual_seed(3)
    assert all(torch.equal(a, c) for a, c in zip(first, dropout_masks(fused, x, b, 3)))
    torch.cuda.manual_seed(3)               # the CPU generator is not reset: the CUDA one decides
    torch.rand(1)
    assert all(torch.equal(a, c) for a, c in zip(first, dropout_masks(fused, x, b, 3)))
    torch.cuda.manual_seed(3)
    torch.nn.functional.dropout(x, 0.5)     # torch's own draw moves the offset on
    assert not any(torch.equal(a, c) for a, c in zip(first, dropout_masks(fused, x, b, 3)))
    torch.manual_seed(4)
    assert not any(torch.equal(a, c) for a, c in zip(first, dropout_masks(fused, x, b, 3)))


@pytest.mark.parametrize("hooks", ["none", "save_on_cpu"])
def test_saved_tensors_reach_the_backward_with_or_without_hooks(hooks):
    """Without a saved-tensors hook the backward takes what the forward saved as raw pointers
    (Program.run_unhooked); under save_on_cpu they come back as new CUDA tensors, which Triton's
    launcher is handed as tensors. Gradients match eager's either way, on repeated steps."""
    fn, kwargs, n_params = BLOCKS["layer_norm"]
    inputs = make_inputs([64, 128, 1024], torch.float32, n_params)
    fused = memfuse.memory_efficient_fusion(fn)
    grad = torch.randn(64, 128, 1024, device="cuda")
    ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
    fn(*ref_inputs, dropout_prob=0.0, **kwargs).backward(grad)
    for _ in range(3):
        for t in inputs:
            t.grad = None
        context = torch.autograd.graph.save_on_cpu() if hooks == "save_on_cpu" else contextlib.nullcontext()
        with context:
            out = fused(*inputs, dropout_prob=0.0, **kwargs)
        out.backward(grad)
        for ours, theirs in zip([t.grad for t in inputs], [t.grad for t in ref_inputs]):
            assert relative_error(ours, theirs) < 1e-5


def test_fused_call_inside_a_users_cuda_graph_capture():
    """A capture keeps the generator's state off limits: the seed is drawn on the CPU and captured,
    a constant of the user's graph (memfuse's own cuda_graphs=True advances it per replay)."""
    x = torch.rand(64, 128, 1024, device="cuda") + 0.5
    b = torch.zeros(1024, device="cuda")
    fused = memfuse.memory_efficient_fusion(bias_dropout)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fused(x, b)                     # compiled and launched before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused(x, b)
    graph.replay()
    kept = out != 0
    assert abs(kept.float().mean().item() - 0.9) < 0.005
    torch.testing.assert_close(out[kept], x[kept] / 0.9)


def _counted_direct_launches(monkeypatch, module) -> list:
    """`module.launcher_call` (runtime's or launch's name for it) wrapped so that each direct launch
    appends to the returned list."""
    calls = []
    original = module.launcher_call

    def counted(compiled):
        call, leading = original(compiled)
        return (lambda *args: calls.append(1) or call(*args)), leading
    monkeypatch.setattr(module, "launcher_call", counted)
    return calls


def test_direct_launch_matches_triton_launch(monkeypatch):
    """The direct launch (runtime.DirectLaunch, every call after a function's first) computes
    bit-identical results to Triton's generic launch path."""
    from memfuse.runtime import program as runtime
    x = torch.randn(64, 128, 1024, device="cuda", requires_grad=True)
    b = torch.randn(1024, device="cuda", requires_grad=True)
    monkeypatch.setattr(runtime, "_draw_seed", lambda device: 1234)

    def step(fused):
        out = fused(x, b)
        out.backward(torch.ones_like(out))
        result = (out.detach().clone(), x.grad.clone(), b.grad.clone())
        x.grad = b.grad = None
        return result
    monkeypatch.setattr(runtime, "launch_hooks_installed", lambda: True)     # the generic path
    generic = step(memfuse.memory_efficient_fusion(bias_dropout))
    monkeypatch.setattr(runtime, "launch_hooks_installed", lambda: False)
    direct_calls = _counted_direct_launches(monkeypatch, runtime)
    fused = memfuse.memory_efficient_fusion(bias_dropout)
    results = [step(fused) for _ in range(3)]
    assert len(direct_calls) == 4       # forward and backward of the second and third steps
    for result in results:
        for a, c in zip(generic, result):
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


def weighted_row_sum(x, w):
    return (x * w).sum(-1)


COLUMN_SUM_CASES = {   # fn, its constants, input shape, dtype, tensors that are parameters
    "layer_norm_fp32": (layer_norm_block, {"normalization_axis": 2, "dropout_prob": 0.0}, [64, 128, 1024],
                        torch.float32, 3),
    "rms_norm_bf16_4096": (rms_norm_block, {"normalization_axis": 2, "dropout_prob": 0.0, "keepdim": True},
                           [8, 512, 4096], torch.bfloat16, 2),
    "looped_fp32": (weighted_row_sum, {}, [512, 2 ** 15], torch.float32, 1),    # D past max_row_length
}


@pytest.mark.parametrize("programs_per_sm", [None, 8], ids=["tuned_grid", "8_programs_per_sm"])
@pytest.mark.parametrize("case", COLUMN_SUM_CASES)
def test_column_sums_finish_in_one_launch_with_the_same_bits_every_time(case, programs_per_sm):
    """The backward's column sums (weight and bias grads) are finished by the kernel's last
    program: one launch per backward, the same bits on every call whichever program finishes
    last, the ticket counter back at 0, and eager's values."""
    import dataclasses

    from memfuse.runtime.program import KernelLaunch
    fn, kwargs, shape, dtype, n_params = COLUMN_SUM_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(*shape, device="cuda", dtype=dtype, generator=g).requires_grad_()
    extra = [] if n_params == 1 else [torch.rand(*shape, device="cuda", dtype=dtype, generator=g).requires_grad_()]
    params = [torch.nn.Parameter(torch.randn(shape[-1], device="cuda", dtype=dtype, generator=g))
              for _ in range(n_params)]
    inputs = [x, *extra, *params]
    grad = torch.randn(shape[:-1] if fn is weighted_row_sum else shape, device="cuda", dtype=dtype, generator=g)
    fused = memfuse.memory_efficient_fusion(fn)
    backward = fused.compiled_for(*inputs, **kwargs).function.backward
    launch, = [s for s in backward.steps if isinstance(s, KernelLaunch) and s.reductions]
    device = x.device
    if programs_per_sm is not None:
        launch.configs[device] = dataclasses.replace(launch.launch_config(device, launch.config),
                                                     programs_per_sm=programs_per_sm)
    runs = []
    for _ in range(20):
        out = fused(*inputs, **kwargs)
        before = memfuse.stats()["kernels_launched"]
        out.backward(grad)
        assert memfuse.stats()["kernels_launched"] - before == 1
        runs.append([t.grad for t in inputs])
        for t in inputs:
            t.grad = None
    torch.cuda.synchronize()
    assert not launch.counter(device).any()
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    fn(*ref_inputs, **kwargs).backward(grad.float())
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for ours, theirs in zip(runs[0], [t.grad for t in ref_inputs]):
        assert relative_error(ours, theirs) < tolerance


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


def test_more_than_2_31_rows():
    """A row count past int32 (D = 2): the launch must pass it as a 64-bit scalar, on the first
    call (precompiled kernel) and on later ones (direct launch) alike."""
    rows = 2 ** 31 + 5
    x = torch.randn(rows, 2, device="cuda", dtype=torch.bfloat16)
    fused = memfuse.memory_efficient_fusion(lambda x: x * 2 + 1)
    with torch.no_grad():
        for _ in range(2):
            out = fused(x)
            tail = slice(rows - 5, rows)
            assert torch.equal(out[tail], x[tail] * 2 + 1)
            del out


def test_views_past_2_31_elements():
    """A strided read whose offset, a coefficient x stride product, passes 2**31 while both
    factors fit in 32 bits (strides are int64 kernel arguments): a select at index 2 of dim 0
    (2 x a stride of 2**30 + 8192) of a sliced, permuted input, and its backward."""
    rows, d = 2 ** 20, 1024
    base = torch.randn(3, rows + 8, d, device="cuda", dtype=torch.bfloat16)
    x = base[:, 8:].detach().requires_grad_()      # 3 * 2**30 elements, not contiguous

    def fn(x):
        return x.transpose(0, 1)[:, 2] * 2

    fused = memfuse.memory_efficient_fusion(fn)
    out = fused(x)
    grad = torch.randn_like(out)
    out.backward(grad)
    for part in (slice(0, 5), slice(rows - 5, rows)):
        assert torch.equal(out[part], x.detach()[2, part] * 2)      # doubling a bf16 is exact
        assert torch.equal(x.grad[2, part], grad[part] * 2)
        assert not x.grad[:2, part].any()
    assert memfuse.stats()["extern_calls"] == 0


def test_stepped_slice_past_2_31_elements():
    """A slice with a step along dim 0: its rows step by 2 x a stride of 2**30 + 8192 elements,
    a coefficient times a stride that each fit in 32 bits."""
    n, d = 2 ** 20 + 8, 1024
    x = torch.randn(4, n, d, device="cuda", dtype=torch.bfloat16)     # 2**32 + 32768 elements

    def fn(x):
        return x[::2].transpose(0, 1) * 2

    with torch.no_grad():
        out = memfuse.memory_efficient_fusion(fn)(x)
    for part in (slice(0, 5), slice(n - 5, n)):
        assert torch.equal(out[part], x[::2, part].transpose(0, 1) * 2)
    assert memfuse.stats()["extern_calls"] == 0


def test_precompile_hands_every_kernel_to_its_launch():
    """memfuse.runtime.precompile builds every kernel when the program is built (or loads it through its
    index) and hands it to the launch: the first call's launches compile nothing, and Triton's
    kernel cache holds at most the one variant precompile built."""
    from memfuse.runtime.program import KernelLaunch
    inputs = make_inputs([8, 16, 1024], torch.float32, 3)
    fused = memfuse.memory_efficient_fusion(layer_norm_block)
    kwargs = dict(normalization_axis=2, dropout_prob=0.1)
    function = fused.compiled_for(*inputs, **kwargs).function
    device = torch.device("cuda", torch.cuda.current_device())
    launches = [step for program in (function.forward, function.backward)
                for step in program.steps if isinstance(step, KernelLaunch)]
    assert len(launches) >= 2
    for launch in launches:
        assert (device.index, launch.configs[device]) in launch.launcher.compiled
    before = [len(launch.kernel.fn.device_caches[device.index][0]) for launch in launches]
    assert all(n <= 1 for n in before)
    fused(*inputs, **kwargs).backward(torch.randn_like(inputs[0]))
    torch.cuda.synchronize()
    assert [len(launch.kernel.fn.device_caches[device.index][0]) for launch in launches] == before


_WARM_RUN = """
import sys, torch, memfuse
from benchmarks.lib.workloads import layer_norm_block
from memfuse.runtime.program import KernelLaunch
torch.manual_seed(0)
x = torch.randn(8, 16, 1024, device="cuda", requires_grad=True)
r = torch.randn(8, 16, 1024, device="cuda", requires_grad=True)
params = [torch.randn(1024, device="cuda", requires_grad=True) for _ in range(3)]
fused = memfuse.memory_efficient_fusion(layer_norm_block)
out = fused(x, r, *params, normalization_axis=2, dropout_prob=0.1)
out.backward(torch.ones_like(out))
function = fused.compiled_for(x, r, *params, normalization_axis=2, dropout_prob=0.1).function
launches = [s for p in (function.forward, function.backward) for s in p.steps if isinstance(s, KernelLaunch)]
compiled_by_triton = sum(len(s.kernel.fn.device_caches[0][0]) for s in launches)
torch.save({"out": out, "grads": [t.grad for t in (x, r, *params)], "kernels": len(launches),
            "loaded": memfuse.stats()["kernels_loaded"], "compiled_by_triton": compiled_by_triton}, sys.argv[1])
"""


def test_a_warm_disk_cache_loads_kernels_without_triton_compiling(tmp_path):
    """A second process with the same caches loads every kernel's binary through memfuse's
    BinaryIndex (Triton's compile, and its 0.3 s installation hash, never run) and computes the
    same bits as the process that compiled them."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "MEMFUSE_CACHE_DIR": str(tmp_path / "memfuse"), "TRITON_CACHE_DIR": str(tmp_path / "triton"),
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    runs = []
    for name in ("cold", "warm"):
        done = subprocess.run([sys.executable, "-c", _WARM_RUN, str(tmp_path / name)], env=env, cwd=root,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(torch.load(tmp_path / name))
    cold, warm = runs
    assert cold["loaded"] == 0 and cold["compiled_by_triton"] == cold["kernels"]
    assert warm["loaded"] == warm["kernels"] == cold["kernels"] and warm["compiled_by_triton"] == 0
    assert torch.equal(cold["out"], warm["out"])
    for a, b in zip(cold["grads"], warm["grads"]):
        assert torch.equal(a, b)


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
    # the trace guards on the sliced input's strides (not contiguous): they hold for both sizes
    assert memfuse.stats()["compiles"] == 1 and memfuse.stats()["extern_calls"] == 0


@pytest.mark.parametrize("name", ["tanh", "atan", "asin", "acos", "sinh", "cosh", "asinh", "acosh", "atanh", "erfc",
                                  "erfinv", "lgamma", "digamma", "trigamma"])
def test_math_helpers_over_their_domains_on_the_gpu(name):
    """The interpreter-tested math helpers compiled for real: tl.exp/log/sin/erf on the GPU are
    not numpy's (exp, for one, may go through ex2.approx), so the fp32 bound is checked here too."""
    from tests.ir.test_math_ops import OPS, RTOL, assert_accurate, grid
    fn, values, _, atol = OPS[name]
    x = grid(values).cuda()
    got = memfuse.memory_efficient_fusion(lambda a: fn(a))(x)
    assert_accurate(got.cpu(), fn(x).cpu(), fn(x.double()).cpu(), rtol=RTOL, atol=atol, what=f"{name} on the GPU")


def test_atan2_over_its_domain_on_the_gpu():
    from tests.ir.test_math_ops import RTOL, TINY, assert_accurate, atan2_domain, grid
    y, x = (grid(v).cuda() for v in atan2_domain())
    got = memfuse.memory_efficient_fusion(torch.atan2)(y, x)
    assert_accurate(got.cpu(), torch.atan2(y, x).cpu(), torch.atan2(y.double(), x.double()).cpu(), rtol=RTOL,
                    atol=TINY, what="atan2 on the GPU")


# -- cuda_graphs=True: the same checks with real CUDA graphs (tests/fronts/test_cuda_graphs.py emulates them) --
def graph_step(fused, inputs, grad, **kwargs):
    """One training step: forward, backward, then copies of the output and the grads, grads set
    to None (so the instance is free for the next step)."""
    out = fused(*inputs, **kwargs)
    out.backward(grad)
    grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    return out.detach().clone(), grads


@pytest.mark.parametrize("name", BLOCKS)
def test_cuda_graphs_match_the_normal_mode(name):
    fn, kwargs, n_params = BLOCKS[name]
    inputs = make_inputs([64, 128, 1024], torch.float32, n_params)
    grad = torch.randn(64, 128, 1024, device="cuda")
    ref_out, ref_grads = graph_step(memfuse.memory_efficient_fusion(fn), inputs, grad, dropout_prob=0.0, **kwargs)
    fused = memfuse.memory_efficient_fusion(fn, cuda_graphs=True)
    before = memfuse.stats()
    for _ in range(3):
        out, grads = graph_step(fused, inputs, grad, dropout_prob=0.0, **kwargs)
        assert relative_error(out, ref_out) < 1e-6
        for ours, theirs in zip(grads, ref_grads):
            assert relative_error(ours, theirs) < 1e-6
    after = memfuse.stats()
    assert after["graph_captures"] - before["graph_captures"] == 1
    assert after["graph_replays"] - before["graph_replays"] == 3


@pytest.mark.parametrize("name", BLOCKS)
def test_cuda_graphs_dropout_fresh_masks_shared_by_the_backward(name):
    """Each replay draws a new mask; the eager block applying the mask a replay drew gives the
    replay's output and gradients (the backward graph regenerated the forward graph's mask)."""
    from tests.ir.test_dropout import with_dropout_output, with_mask
    fn, kwargs, n_params = BLOCKS[name]
    inputs = make_inputs([64, 128, 1024], torch.float32, n_params)
    with torch.no_grad():
        inputs[0].abs_().add_(0.5)                  # input1 + bias1 != 0: a zero means dropped
        inputs[3].abs_()                            # bias1 (the RMSNorm block: bias)
    grad = torch.randn(64, 128, 1024, device="cuda")
    fused = memfuse.memory_efficient_fusion(with_dropout_output(fn), cuda_graphs=True)
    masks = []
    for _ in range(2):
        out, dropped = fused(*inputs, dropout_prob=0.1, **kwargs)
        out.backward(grad)
        mask = dropped.detach() != 0
        rate = mask.float().mean().item()
        assert abs(rate - 0.9) < 0.005, rate
        grads = [t.grad.clone() for t in inputs]
        for t in inputs:
            t.grad = None
        ref_inputs = [t.detach().clone().requires_grad_() for t in inputs]
        ref = with_mask(fn, mask)(*ref_inputs, dropout_prob=0.1, **kwargs)
        ref.backward(grad)
        assert relative_error(out.detach(), ref) < 1e-5
        for ours, theirs in zip(grads, [t.grad for t in ref_inputs]):
            assert relative_error(ours, theirs) < 1e-5
        masks.append(mask)
        del out, dropped
    assert not torch.equal(masks[0], masks[1]), "two replays drew the same mask"


def test_cuda_graphs_manual_seed_reproduces_a_run():
    x = (torch.rand(64, 128, 1024, device="cuda") + 0.5).requires_grad_()
    b = torch.nn.Parameter(torch.zeros(1024, device="cuda"))
    grad = torch.ones(64, 128, 1024, device="cuda")
    runs = []
    for _ in range(2):
        torch.manual_seed(11)
        fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
        runs.append([graph_step(fused, (x, b), grad) for _ in range(2)])
    for (out1, grads1), (out2, grads2) in zip(*runs):
        assert torch.equal(out1, out2)
        assert all(torch.equal(g1, g2) for g1, g2 in zip(grads1, grads2))
        assert torch.equal(grads1[0] != 0, out1 != 0), "the backward used another mask"
    assert not torch.equal(runs[0][0][0], runs[0][1][0])


def test_cuda_graphs_a_new_shape_captures_a_new_graph():
    fn, kwargs, n_params = BLOCKS["layer_norm"]
    params = make_inputs([64, 128, 1024], torch.float32, n_params)[2:]
    shapes = [(64, 128, 1024), (32, 128, 1024), (64, 128, 1024), (32, 128, 1024)]
    inputs = {s: make_inputs(s, torch.float32, 0, seed=len(s) + s[0]) + params for s in set(shapes)}
    normal = memfuse.memory_efficient_fusion(fn)
    fused = memfuse.memory_efficient_fusion(fn, cuda_graphs=True)
    before = memfuse.stats()["graph_captures"]
    for shape, captures in zip(shapes, (1, 2, 2, 2)):
        grad = torch.randn(*shape, device="cuda")
        out, grads = graph_step(fused, inputs[shape], grad, dropout_prob=0.0, **kwargs)
        ref_out, ref_grads = graph_step(normal, inputs[shape], grad, dropout_prob=0.0, **kwargs)
        assert relative_error(out, ref_out) < 1e-6
        assert all(relative_error(a, b) < 1e-6 for a, b in zip(grads, ref_grads))
        assert memfuse.stats()["graph_captures"] - before == captures


def test_cuda_graphs_parameter_grads_accumulate_without_zeroing():
    fn, kwargs, n_params = BLOCKS["layer_norm"]
    inputs = make_inputs([64, 128, 1024], torch.float32, n_params)
    grads = [torch.randn(64, 128, 1024, device="cuda") for _ in range(3)]
    expected = [torch.zeros_like(t) for t in inputs]
    normal = memfuse.memory_efficient_fusion(fn)
    for g in grads:
        _, step_grads = graph_step(normal, inputs, g, dropout_prob=0.0, **kwargs)
        expected = [e + s for e, s in zip(expected, step_grads)]
    fused = memfuse.memory_efficient_fusion(fn, cuda_graphs=True)
    for g in grads:                                 # no zeroing: .grad accumulates
        fused(*inputs, dropout_prob=0.0, **kwargs).backward(g)
    for t, e in zip(inputs, expected):
        assert relative_error(t.grad, e) < 1e-5


def test_cuda_graphs_see_an_input_changed_in_place():
    fn, kwargs, n_params = BLOCKS["rms_norm"]
    inputs = make_inputs([64, 128, 1024], torch.float32, n_params)
    grad = torch.randn(64, 128, 1024, device="cuda")
    normal = memfuse.memory_efficient_fusion(fn)
    fused = memfuse.memory_efficient_fusion(fn, cuda_graphs=True)
    for _ in range(3):
        out, grads = graph_step(fused, inputs, grad, dropout_prob=0.0, **kwargs)
        ref_out, ref_grads = graph_step(normal, inputs, grad, dropout_prob=0.0, **kwargs)
        assert relative_error(out, ref_out) < 1e-6
        assert all(relative_error(a, b) < 1e-6 for a, b in zip(grads, ref_grads))
        with torch.no_grad():                      # an optimizer step and a new batch, in place
            inputs[0].mul_(1.5).add_(0.25)
            inputs[2].sub_(0.1)
    assert memfuse.stats()["graph_captures"] == 1


def test_cuda_graphs_without_grad_and_with_a_new_tensor_each_call():
    fn, kwargs, n_params = BLOCKS["layer_norm"]
    params = make_inputs([64, 128, 1024], torch.float32, n_params)[2:]
    normal = memfuse.memory_efficient_fusion(fn)
    fused = memfuse.memory_efficient_fusion(fn, cuda_graphs=True)
    with torch.no_grad():
        for seed in range(4):
            inputs = make_inputs([64, 128, 1024], torch.float32, 0, seed=seed) + params
            out = fused(*inputs, dropout_prob=0.0, **kwargs)
            ref = normal(*inputs, dropout_prob=0.0, **kwargs)
            assert relative_error(out, ref) < 1e-6
            del out
    assert memfuse.stats()["graph_captures"] <= 2


def test_cuda_graphs_fused_module():
    block = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024),
                                torch.nn.Dropout(0.0)).cuda()
    fused = memfuse.memory_efficient_fusion(block, cuda_graphs=True)
    x = torch.randn(64, 128, 1024, device="cuda")
    grad = torch.randn(64, 128, 1024, device="cuda")
    for _ in range(3):
        out = fused(x)
        out.backward(grad)
        ours = [p.grad.clone() for p in block.parameters()]
        block.zero_grad()
        ref = block(x)
        ref.backward(grad)
        assert relative_error(out.detach(), ref.detach()) < 1e-4
        for a, b in zip(ours, [p.grad for p in block.parameters()]):
            assert relative_error(a, b) < 1e-4
        block.zero_grad()
        del out
    assert memfuse.stats()["graph_captures"] == 1


@pytest.mark.parametrize("divisor_kind", ["row", "column"])
def test_division_by_a_scaled_reciprocal_on_gpu(divisor_kind):
    """mf_scaled_reciprocal compiled for the GPU (div.rn, subnormals as the hardware keeps them):
    every adversarial pair within 2 ulps of IEEE division, zeros, infinities and NaN exact."""
    from tests.ir.test_division import adversarial, assert_like_division
    values = adversarial().cuda()
    if divisor_kind == "row":
        x, d = values.expand(values.numel(), -1).contiguous(), values[:, None].clone()
    else:
        x, d = values[:, None].expand(-1, values.numel()).contiguous(), values.clone()
    got = memfuse.memory_efficient_fusion(lambda a, b: a / b)(x, d)
    assert memfuse.stats()["extern_calls"] == 0
    assert_like_division(got.cpu(), x.cpu(), d.cpu(), f"{divisor_kind} divisor on the GPU")


@pytest.mark.parametrize("vocabulary", [32000, 50257])
def test_online_cross_entropy_at_a_vocabulary_matches_eager(vocabulary):
    """Rows as long as a vocabulary: looped kernels whose max and sum of exps share a pass (two
    passes forward, two backward), eager's loss and gradient, masked (-inf) logits included."""
    import torch.nn.functional as F

    def loss(logits, target):
        return F.cross_entropy(logits.float(), target, ignore_index=-100)

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (4 * torch.randn(512, vocabulary, device="cuda", generator=g)).to(torch.bfloat16)
    logits[::3, : vocabulary // 2] = float("-inf")     # whole leading chunks at -inf
    logits.requires_grad_()
    target = torch.randint(vocabulary // 2, vocabulary, (512,), device="cuda", generator=g)
    target[7] = -100
    fused = memfuse.memory_efficient_fusion(loss)
    ours = fused(logits, target)
    ours_grad, = torch.autograd.grad(ours, logits)
    eager = loss(logits, target)
    eager_grad, = torch.autograd.grad(eager, logits)
    assert abs(ours.item() - eager.item()) <= 1e-5 * abs(eager.item())
    assert relative_error(ours_grad, eager_grad) < 1e-2
    entry, = fused.cache.values()
    for program in (entry.function.forward, entry.function.backward):
        passes = [s.kernel.source.passes for s in program.steps if getattr(s, "kernel", None) is not None]
        assert 2 in passes and max(p or 0 for p in passes) == 2, passes


def _head_inputs(device):
    """(generator, hidden [3000, 256], weight [4001, 256] in fp64, targets with every 7th ignored):
    the chunked loss head's GPU tests' inputs, an odd vocabulary (the padded weight)."""
    generator = torch.Generator(device=device).manual_seed(0)
    tokens, hidden, vocab = 3000, 256, 4001
    x = torch.randn(tokens, hidden, device=device, dtype=torch.float64, generator=generator)
    weight = torch.randn(vocab, hidden, device=device, dtype=torch.float64, generator=generator) / 16
    target = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    target[::7] = -100
    return generator, x, weight, target


# the chunked loss head's forms: the gradients formed by the backward (rows) or by the forward (in chunks
# of token rows, or by the vocabulary-major plan)
HEAD_FORMS = pytest.mark.parametrize("with_gradients, plan", [(False, "rows"), (True, "rows"), (True, "vocabulary")],
                                     ids=["backward_recomputes", "forward_forms", "vocabulary_major"])


def _vocabulary_plan_runs(x, weight, dtype, chunk) -> None:
    """The vocabulary-major plan runs at these sizes, not the rows plan in its place."""
    choice = memfuse.patterns.loss_head.op.choose_plan(x.shape[0], x.shape[1], weight.shape[0], dtype, weight.dtype, x.dtype,
                                           chunk, "vocabulary")
    assert choice.vocabulary is not None and len(choice.vocabulary.steps) > 2


@pytest.mark.parametrize("master_fp32", [False, True], ids=["bf16_weight", "fp32_weight"])
@pytest.mark.parametrize("return_logits, with_gradients, plan", [
    (False, False, "rows"), (False, True, "rows"), (False, True, "vocabulary"), (True, False, "rows"),
    (True, True, "rows")])
def test_chunked_loss_head_bf16_on_the_gpu(return_logits, with_gradients, plan, master_fp32):
    """memfuse.patterns.loss_head.op's op with its Triton kernels compiled for the GPU: an odd vocabulary (the
    padded weight), 3000 tokens in chunks of 504 rows, bf16 operands: loss and gradients no
    further from fp64 than eager's bf16 linear + fp32 cross-entropy (3x margin)."""
    import torch.nn.functional as F
    generator, x, weight, target = _head_inputs("cuda")
    tokens, vocab = x.shape[0], weight.shape[0]
    upstream = torch.randn(tokens, vocab, device="cuda", dtype=torch.float64, generator=generator) / tokens

    def run(x, weight, chunked):
        """fp32_weight: autocast's master weight, cast to the matmul's dtype (its gradient in fp32)."""
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        if chunked:
            loss, _, logits, *_ = torch.ops.memfuse.linear_cross_entropy(
                x, weight, None, target, -100, "mean", 0.0, x.dtype, return_logits, with_gradients, 8 * 2**20, True,
                plan)
        else:
            logits = F.linear(x, weight.to(x.dtype))
            loss = F.cross_entropy(logits.float(), target)
        total = loss + ((logits.double() * upstream).sum() if return_logits else 0)
        return (loss.double(), *torch.autograd.grad(total, (x, weight)))

    exact = run(x, weight, chunked=False)
    matmul_weight = weight.float() if master_fp32 else weight.bfloat16()
    if plan == "vocabulary":
        _vocabulary_plan_runs(x.bfloat16(), matmul_weight, torch.bfloat16, 8 * 2**20)
    eager = run(x.bfloat16(), matmul_weight, chunked=False)
    ours = run(x.bfloat16(), matmul_weight, chunked=True)
    for mine, theirs, truth in zip(ours, eager, exact):
        assert relative_error(mine.double(), truth) <= 3 * relative_error(theirs.double(), truth) + 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("steps", [(("div", 30.0), ("tanh", None), ("mul", 30.0)), (("mul", 0.0625),),
                                   (("div", 7.0),)], ids=["soft_cap", "scale", "divisor"])
def test_the_loss_heads_logit_transform_is_eagers_bit_for_bit_on_the_gpu(dtype, steps):
    """The kernels' transform of the logits (loss_head.LogitTransform) against eager's ops on CUDA:
    a divide by a number as its multiply by the fp32 reciprocal, tanh as CUDA's tanhf, each step
    rounded to the logits' dtype."""
    from memfuse.patterns.loss_head.op import LogitTransform
    from tests.patterns.loss_head.test_transform import written_transformed
    transform = LogitTransform(steps, None if dtype == torch.float32 else dtype)
    generator = torch.Generator(device="cuda").manual_seed(0)
    logits = (torch.randn(64, 4096, device="cuda", generator=generator) * 40).to(dtype)
    assert torch.equal(written_transformed(logits, transform), transform.apply(logits))


@pytest.mark.parametrize("return_logits, with_gradients, plan", [
    (False, False, "rows"), (False, True, "rows"), (False, True, "vocabulary"), (True, True, "rows")])
def test_soft_capped_loss_head_bf16_on_the_gpu(return_logits, with_gradients, plan):
    """The head through Gemma's soft cap (`5 * tanh(logits / 5)` in bf16, loss_head.LogitTransform)
    with its kernels compiled for the GPU: loss and gradients no further from fp64 than eager's
    (3x margin), returned logits the transformed ones, their gradient back through the cap."""
    import torch.nn.functional as F
    from memfuse.patterns.loss_head.op import LogitTransform
    generator, x, weight, target = _head_inputs("cuda")
    tokens, vocab = x.shape[0], weight.shape[0]
    upstream = torch.randn(tokens, vocab, device="cuda", dtype=torch.float64, generator=generator) / tokens
    cap = (("div", 5.0), ("tanh", None), ("mul", 5.0))

    def run(x, weight, chunked):
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        transform = LogitTransform(cap, x.dtype if x.dtype != torch.float64 else None)
        if chunked:
            loss, _, logits, *_ = torch.ops.memfuse.linear_cross_entropy(
                x, weight, None, target, -100, "mean", 0.0, x.dtype, return_logits, with_gradients, 8 * 2**20, True,
                plan, transform.spec)
        else:
            logits = transform.apply(F.linear(x, weight))
            loss = F.cross_entropy(logits.float(), target)
        total = loss + ((logits.double() * upstream).sum() if return_logits else 0)
        return (loss.double(), *torch.autograd.grad(total, (x, weight)), logits.double() if return_logits else None)

    exact = run(x, weight, chunked=False)
    if plan == "vocabulary":
        _vocabulary_plan_runs(x.bfloat16(), weight.bfloat16(), torch.bfloat16, 8 * 2**20)
    eager = run(x.bfloat16(), weight.bfloat16(), chunked=False)
    ours = run(x.bfloat16(), weight.bfloat16(), chunked=True)
    for mine, theirs, truth in zip(ours, eager, exact):
        if truth is not None:
            assert relative_error(mine.double(), truth) <= 3 * relative_error(theirs.double(), truth) + 1e-6


@HEAD_FORMS
def test_chunked_loss_head_fp32_hidden_under_a_bf16_matmul_on_the_gpu(with_gradients, plan, device="cuda"):
    """fp32 hidden states and weight, the matmuls in bf16 (autocast's head, as in Llama): the hidden
    states' gradient rows written by the matmul (fp32 in the recomputing backward; bf16 formed in
    the forward, as eager's product, and scaled into fp32 in the backward), the weight's added up
    in fp32; 3000 tokens in three chunks, the last one short. Loss and gradients no further from
    fp64 than eager's bf16 head (3x margin)."""
    import torch.nn.functional as F
    _, x, weight, target = _head_inputs(device)
    tokens, vocab = x.shape[0], weight.shape[0]
    assert -(-tokens // memfuse.patterns.loss_head.op.chunk_rows(tokens, vocab, torch.bfloat16, 8 * 2**20)) == 3

    def run(x, weight, matmul_dtype, chunked):
        x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
        if chunked:
            loss, *_ = torch.ops.memfuse.linear_cross_entropy(
                x, weight, None, target, -100, "mean", 0.0, matmul_dtype, False, with_gradients, 8 * 2**20, True,
                plan)
        else:
            loss = F.cross_entropy(F.linear(x.to(matmul_dtype), weight.to(matmul_dtype)).float(), target)
        return (loss.double(), *torch.autograd.grad(loss, (x, weight)))

    if plan == "vocabulary":
        _vocabulary_plan_runs(x.float(), weight.float(), torch.bfloat16, 8 * 2**20)
    exact = run(x, weight, torch.float64, chunked=False)
    eager = run(x.float(), weight.float(), torch.bfloat16, chunked=False)
    ours = run(x.float(), weight.float(), torch.bfloat16, chunked=True)
    assert ours[1].dtype == ours[2].dtype == torch.float32
    for mine, theirs, truth in zip(ours, eager, exact):
        assert relative_error(mine.double(), truth) <= 3 * relative_error(theirs.double(), truth) + 1e-6


@pytest.mark.parametrize("smoothing, masked", [(0.0, True), (0.1, False)], ids=["masked_words", "smoothing"])
@HEAD_FORMS
def test_chunked_loss_head_rows_wider_than_a_block_on_the_gpu(with_gradients, plan, smoothing, masked):
    """fp32, rows of 2 blocks and an odd tail (the whole blocks loaded unmasked, compiled for the
    GPU): masked words (a -inf bias over the first block) or label smoothing; loss and every
    gradient within 1e-5 of fp64's, none NaN."""
    import torch.nn.functional as F
    from memfuse.patterns.loss_head import op as loss_head
    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, vocab = 600, 64, 2 * loss_head.BLOCK_COLUMNS + 13
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.float64, generator=generator)
    weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.float64, generator=generator) / 8
    bias = torch.randn(vocab, device="cuda", dtype=torch.float64, generator=generator)
    target = torch.randint(loss_head.BLOCK_COLUMNS, vocab, (tokens,), device="cuda", generator=generator)
    target[::7] = -100
    if masked:
        bias[:loss_head.BLOCK_COLUMNS] = float("-inf")

    def run(operands, chunked):
        operands = [t.detach().requires_grad_() for t in operands]
        if chunked:
            loss, *_ = torch.ops.memfuse.linear_cross_entropy(*operands, target, -100, "mean", smoothing,
                                                              torch.float32, False, with_gradients, 2**20, True, plan)
        else:
            loss = F.cross_entropy(F.linear(*operands), target, label_smoothing=smoothing)
        return (loss, *torch.autograd.grad(loss, operands))

    if plan == "vocabulary":
        _vocabulary_plan_runs(x.float(), weight.float(), torch.float32, 2**20)
    exact = run((x, weight, bias), chunked=False)
    ours = run((x.float(), weight.float(), bias.float()), chunked=True)
    for mine, truth in zip(ours, exact):
        assert not mine.isnan().any()
        assert relative_error(mine.double(), truth) < 1e-5


@HEAD_FORMS
def test_chunked_loss_head_direct_launches_match_tritons_own(monkeypatch, with_gradients, plan):
    """The loss head's row kernels launched straight through their compiled launchers
    (memfuse.base.launch.DirectKernel, once a chunk) give bit for bit what Triton's launch path gives,
    and the later chunks and calls do take that path."""
    from memfuse.base import launch
    from memfuse.patterns.loss_head import op as loss_head
    _, x, weight, target = _head_inputs("cuda")
    x, weight = x.bfloat16(), weight.bfloat16()
    if plan == "vocabulary":
        _vocabulary_plan_runs(x, weight, torch.bfloat16, 8 * 2**20)

    def run():
        x_, weight_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
        loss, *_ = torch.ops.memfuse.linear_cross_entropy(
            x_, weight_, None, target, -100, "mean", 0.0, torch.bfloat16, False, with_gradients, 8 * 2**20, True, plan)
        return (loss, *torch.autograd.grad(loss, (x_, weight_)))

    monkeypatch.setattr(launch, "launch_hooks_installed", lambda: True)      # Triton's own path
    generic = run()
    monkeypatch.setattr(launch, "launch_hooks_installed", lambda: False)
    direct_calls = _counted_direct_launches(monkeypatch, launch)
    for kernel in loss_head.direct_kernels():
        monkeypatch.setattr(kernel, "compiled", {})
    results = [run() for _ in range(2)]
    assert len(direct_calls) >= 4, "the chunks after each kernel's first launch go direct"
    for result in results:
        for a, b in zip(generic, result):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_head_cast_with_padding_rows_is_tensor_to_bit_for_bit_on_the_gpu(dtype):
    """The loss head's one-launch cast (and padding) rounds as Tensor.to on the GPU, bf16 included
    (Triton's interpreter truncates bf16, so the CPU test allows an ulp there)."""
    from tests.patterns.loss_head.test_op import check_cast_with_padding_rows
    check_cast_with_padding_rows(dtype, "cuda", exact=True)


def _drops_its_mask_as_eager(fused, attention, tensors: tuple) -> None:
    """The fused call runs its attention forward and backward without the mask (the counter), and
    its output and gradients stay within bf16 noise of eager's."""
    before = memfuse.stats()["attention_masks_dropped"]
    out = fused(*tensors)
    out.float().square().sum().backward()
    got = [out.detach()] + [t.grad for t in tensors]
    assert memfuse.stats()["attention_masks_dropped"] >= before + 2
    for t in tensors:
        t.grad = None
    want = attention(*tensors)
    want.float().square().sum().backward()
    for a, b in zip(got, [want.detach()] + [t.grad for t in tensors]):
        assert relative_error(a, b) < 1e-2


@pytest.mark.parametrize("path", ["function", "backend"])
def test_a_causal_mask_built_from_sizes_runs_the_causal_kernel_on_gpu(path):
    """bf16 attention with a [batch, 1, q, kv] causal mask built from aranges (as HuggingFace's
    traced mask code builds it), GQA keys repeated as transformers repeats them: memfuse runs the
    attention op with is_causal and no mask (memfuse.patterns.attention), output and gradients as eager's."""
    import torch.nn.functional as F

    def attention(q, k, v):
        i = torch.arange(q.shape[-2], device=q.device)[:, None]
        j = torch.arange(k.shape[-2], device=q.device)[None, :]
        mask = (j <= i)[None, None].expand(q.shape[0], 1, -1, -1)
        k, v = (t[:, :, None].expand(-1, -1, 4, -1, -1).reshape(q.shape) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(2, 2, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    fused = memfuse.memory_efficient_fusion(attention) if path == "function" else \
        torch.compile(attention, backend="memfuse", dynamic=True)
    _drops_its_mask_as_eager(fused, attention, (q, k, v))


def test_a_broadcast_bidirectional_mask_keeps_a_fused_attention_on_gpu():
    """BERT's traced mask: a [1, 1, q, 1] compare broadcast along kv. Broadcast, it sends SDPA to
    its math path (fp32 matmuls, a softmax whose weights the backward keeps); memfuse traces it
    dense, so a fused attention op stays in the graph and its mask (masking nothing) is dropped."""
    import torch.nn.functional as F

    def attention(q, k, v):
        keep = (torch.arange(q.shape[-2], device=q.device)[None, None, :, None] >= 0)
        keep = keep.expand(q.shape[0], 1, q.shape[-2], k.shape[-2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(4, 12, 512, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    fused = memfuse.memory_efficient_fusion(attention)
    _drops_its_mask_as_eager(fused, attention, (q, k, v))


@pytest.mark.parametrize("block", ["separate projections", "split projection"])
def test_attention_reads_heads_in_place_on_gpu(block):
    """bf16 attention blocks (BERT's, GPT-2's) whose query, key, value, output and gradients stay
    views of the matmuls' outputs: GPU's attention (cuDNN or flash) takes them in those strides and
    lays its output out as the query. Output and gradients as eager's, no kernel copies heads."""
    g = torch.Generator(device="cuda").manual_seed(0)
    d = 768
    bias = torch.randn(d) * d ** 0.5            # a weight's scale, as the weights are scaled below
    weights = [torch.randn(d, d), bias, torch.randn(d, d), torch.randn(d, d), -bias, torch.randn(d, d)] \
        if block == "separate projections" else [torch.randn(3 * d, d), torch.randn(d, d)]
    fn = attention_block if block == "separate projections" else fused_qkv_block
    x = torch.randn(4, 512, d, device="cuda", dtype=torch.bfloat16, generator=g)
    params = [torch.nn.Parameter((w / d ** 0.5).to("cuda", torch.bfloat16)) for w in weights]
    fused = memfuse.memory_efficient_fusion(lambda *a: fn(*a, heads=12))
    grads = []
    for call in (fused, lambda *a: fn(*a, heads=12)):
        inputs = [x.clone().requires_grad_()] + [torch.nn.Parameter(p.detach().clone()) for p in params]
        out = call(*inputs)
        out.float().square().sum().backward()
        grads.append([out] + [t.grad for t in inputs])
    for got, want in zip(*grads):
        assert relative_error(got, want) < 2e-2
    copies = token_copy_kernels(fused)
    assert all("3x strided" in summary for _, summary in copies) and len(copies) <= 1


def autocast_mlp(x, w1, w2):
    with torch.autocast("cuda", torch.bfloat16):
        return torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, w1)), w2).float()


def test_autocast_weight_gradients_are_fp32_matmul_outputs_on_the_gpu():
    """On CUDA the fp32 weights' gradients under bf16 autocast (a bf16 product, then a cast) are
    one matmul writing fp32 (aten.mm.dtype), in the backward the program runs; every gradient
    within bf16's tolerance of eager's (the product is rounded once, not to bf16 first)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 256, 512, device="cuda", generator=g).requires_grad_()
    w1 = (torch.randn(1024, 512, device="cuda", generator=g) * 0.05).requires_grad_()
    w2 = (torch.randn(512, 1024, device="cuda", generator=g) * 0.05).requires_grad_()
    grad = torch.randn(8, 256, 512, device="cuda", generator=g)
    fused = memfuse.memory_efficient_fusion(autocast_mlp)
    out = fused(x, w1, w2)
    out.backward(grad)
    ours = [t.grad for t in (x, w1, w2)]
    joint = fused.compiled_for(x, w1, w2).captured.joint
    products = [n for n in joint.nodes.values() if n.attr is not None and getattr(n.attr, "target", None)
                is torch.ops.aten.mm.dtype]
    assert len(products) == 2
    refs = [t.detach().clone().requires_grad_() for t in (x, w1, w2)]
    ref = autocast_mlp(*refs)
    ref.backward(grad)
    assert relative_error(out, ref) < 1e-2
    for mine, theirs in zip(ours, [t.grad for t in refs]):
        assert mine.dtype == theirs.dtype == torch.float32
        assert relative_error(mine, theirs) < 1e-2
