"""The seed's three blocks end to end, dropout off: numerics against eager, kernel counts."""
import pytest
import torch

import memfuse
from helpers import BLOCKS, block_inputs, counters, delta, forward_backward, rel_error

SHAPES = [(3, 5, 32), (2, 7, 48)]     # D a power of two, and not; M = 15 and 14


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_fp32_output_and_every_grad_match_eager(name, shape):
    tensors, consts, grad_output = block_inputs(name, shape)
    block = BLOCKS[name].fn
    out, grads = forward_backward(memfuse.memory_efficient_fusion(block), tensors, consts, grad_output)
    ref_out, ref_grads = forward_backward(block, tensors, consts, grad_output)

    assert out.shape == ref_out.shape and out.dtype == torch.float32
    assert rel_error(out, ref_out) <= 1e-5
    assert len(grads) == len(tensors)
    for i, (grad, ref) in enumerate(zip(grads, ref_grads)):
        assert grad is not None, f"input {i} got no gradient"
        assert grad.shape == ref.shape and grad.dtype == ref.dtype, i
        assert rel_error(grad, ref) <= 1e-5, f"input {i}: {rel_error(grad, ref):.3g}"


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_bf16_error_is_no_worse_than_eager_bf16(name):
    """Both bf16 runs against an fp64 reference: memfuse within max(1e-2, 2x eager's error)."""
    tensors, consts, grad_output = block_inputs(name, (2, 7, 48), torch.bfloat16)
    block = BLOCKS[name].fn
    out, grads = forward_backward(memfuse.memory_efficient_fusion(block), tensors, consts, grad_output)
    eager_out, eager_grads = forward_backward(block, tensors, consts, grad_output)
    ref_out, ref_grads = forward_backward(block, [t.double() for t in tensors], consts, grad_output)

    assert out.dtype == torch.bfloat16
    pairs = [("output", out, eager_out, ref_out)] + \
        [(f"grad {i}", g, e, r) for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads))]
    for what, mine, eager, ref in pairs:
        assert mine.dtype == torch.bfloat16, what
        bound = max(1e-2, 2 * rel_error(eager, ref))
        assert rel_error(mine, ref) <= bound, f"{what}: {rel_error(mine, ref):.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("p", [0.0, 0.1], ids=["no_dropout", "dropout"])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_one_kernel_forward_one_kernel_backward_no_extern(name, p, dtype):
    tensors, consts, grad_output = block_inputs(name, (2, 7, 48), dtype, dropout_prob=p)
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    for step in range(2):                       # the compiling call, then a cached one
        leaves = [t.detach().requires_grad_() for t in tensors]
        before = counters()
        out = fused(*leaves, **consts)
        assert delta(before)["kernels_launched"] == 1, f"step {step}: forward"
        out.backward(grad_output)
        moved = delta(before)
        assert moved["kernels_launched"] == 2, f"step {step}: forward + backward"
        assert moved["extern_calls"] == 0 and moved["fallbacks"] == 0, moved
    entry, = fused.cache.values()
    assert len(entry.function.forward.schedule.kernels) == 1
    assert len(entry.function.backward.schedule.kernels) == 1
    assert memfuse.stats()["compiles"] == 1


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_fp64_computes_in_fp64(name):
    """fp64 values stay fp64 in registers, in reductions and in column partial sums."""
    tensors, consts, grad_output = block_inputs(name, (2, 7, 48), torch.float64)
    block = BLOCKS[name].fn
    out, grads = forward_backward(memfuse.memory_efficient_fusion(block), tensors, consts, grad_output)
    ref_out, ref_grads = forward_backward(block, tensors, consts, grad_output)
    assert out.dtype == torch.float64
    assert rel_error(out, ref_out) <= 1e-12
    for i, (grad, ref) in enumerate(zip(grads, ref_grads)):
        assert rel_error(grad, ref) <= 1e-12, f"input {i}: {rel_error(grad, ref):.3g}"


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_many_tiles_and_a_persistent_backward(name):
    """Small tiles: the forward launches one program per 2-row tile, the backward's 2 programs
    each walk several tiles (the last one partial) and finish the column sums from partials."""
    config = memfuse.Config(tile_elements=128)           # D = 48 -> BLOCK_D = 64, BLOCK_M = 2
    tensors, consts, grad_output = block_inputs(name, (3, 5, 48))
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn, config=config)
    out, grads = forward_backward(fused, tensors, consts, grad_output)
    ref_out, ref_grads = forward_backward(BLOCKS[name].fn, tensors, consts, grad_output)
    assert rel_error(out, ref_out) <= 1e-5
    for i, (grad, ref) in enumerate(zip(grads, ref_grads)):
        assert rel_error(grad, ref) <= 1e-5, f"input {i}: {rel_error(grad, ref):.3g}"
    entry, = fused.cache.values()
    bwd, = entry.function.backward.steps[:1]
    assert bwd.kernel.source.persistent and bwd.launch_config(torch.device("cpu"), config).block_m == 2


def test_a_pipeline_too_deep_for_shared_memory_runs_unpipelined():
    """A GPU compile that runs out of shared memory with NUM_STAGES > 1 (the launcher raises
    OutOfResources) is retried with one stage and as many programs an SM as tiles were in flight,
    which the kernel keeps from then on."""
    from triton.runtime.errors import OutOfResources

    from memfuse.codegen.tuning import LaunchConfig
    tensors, consts, grad_output = block_inputs("layer_norm_block", (3, 5, 48))
    fused = memfuse.memory_efficient_fusion(BLOCKS["layer_norm_block"].fn)
    forward_backward(fused, tensors, consts, grad_output)
    entry, = fused.cache.values()
    backward = entry.function.backward.steps[0]
    cpu = torch.device("cpu")
    backward.configs[cpu] = LaunchConfig(2, 4, 2, num_stages=3)
    launcher, stages = backward.launcher, []

    def launch(programs, args, device, config, aligned):
        stages.append(config.num_stages)
        if config.num_stages > 1:
            raise OutOfResources(300000, 232448, "shared memory")
        launcher(programs, args, device, config, aligned)

    backward.launcher = launch
    for _ in range(2):
        out, grads = forward_backward(fused, tensors, consts, grad_output)
    ref_out, ref_grads = forward_backward(BLOCKS["layer_norm_block"].fn, tensors, consts, grad_output)
    for grad, ref in zip(grads, ref_grads):
        assert rel_error(grad, ref) <= 1e-5
    assert stages == [3, 1, 1] and backward.configs[cpu] == LaunchConfig(2, 4, 6, num_stages=1)
