"""Memory kept alive between forward and backward, measured with saved-tensor hooks: memfuse
keeps at most the row statistics beyond the inputs, far less than eager; no_grad saves nothing."""
import pytest
import torch

import memfuse
from helpers import BLOCKS, block_inputs, counters, delta, leaves_like, rel_error

SHAPE = (2, 7, 48)
ROWS = SHAPE[0] * SHAPE[1]


def saved_beyond_inputs(fn, tensors, consts) -> int:
    """Bytes of the storages autograd saved for backward that are not the inputs' storages."""
    leaves = leaves_like(tensors)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*leaves, **consts)
    assert out.requires_grad
    inputs = {t.untyped_storage().data_ptr() for t in leaves}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in packed}
    return sum(size for ptr, size in storages.items() if ptr not in inputs)


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_saves_at_most_row_statistics_and_less_than_eager(name, p):
    tensors, consts, _ = block_inputs(name, SHAPE, dropout_prob=p)
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    mine = saved_beyond_inputs(fused, tensors, consts)
    eager = saved_beyond_inputs(BLOCKS[name].fn, tensors, consts)
    assert mine <= 2 * ROWS * 4, f"memfuse saved {mine} bytes beyond the inputs"
    assert mine < eager, (mine, eager)
    entry, = fused.cache.values()
    assert mine == entry.plan.saved_bytes, "the plan's saved bytes are what the runtime keeps"


def test_eager_measure_sees_intermediates():
    """The measure itself: eager LayerNorm block keeps at least its pre-norm [M, D] tensor."""
    tensors, consts, _ = block_inputs("layer_norm_block", SHAPE)
    assert saved_beyond_inputs(BLOCKS["layer_norm_block"].fn, tensors, consts) >= ROWS * SHAPE[-1] * 4


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_no_grad_runs_forward_only_and_saves_nothing(name):
    tensors, consts, _ = block_inputs(name, SHAPE)
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    packed = []
    before = counters()
    with torch.no_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        out = fused(*tensors, **consts)
        ref = BLOCKS[name].fn(*tensors, **consts)
    assert packed == []
    assert not out.requires_grad and out.grad_fn is None
    assert rel_error(out, ref) <= 1e-5
    moved = delta(before)
    assert moved["kernels_launched"] == 1 and moved["extern_calls"] == 0, moved
    entry, = fused.cache.values()
    assert entry.function.backward is None and entry.plan.saved == []

    # with grad on, the same inputs compile a training program (grad mode is in the key)
    out = fused(*tensors, **consts)
    assert out.requires_grad and memfuse.stats()["compiles"] == 2


def test_inputs_without_grad_run_forward_only():
    tensors, consts, _ = block_inputs("layer_norm_block", SHAPE)
    plain = [t.detach() for t in tensors]
    fused = memfuse.memory_efficient_fusion(BLOCKS["layer_norm_block"].fn)
    out = fused(*plain, **consts)
    assert not out.requires_grad
    entry, = fused.cache.values()
    assert entry.function.backward is None and entry.plan.saved == []
    assert rel_error(out, BLOCKS["layer_norm_block"].fn(*plain, **consts)) <= 1e-5
