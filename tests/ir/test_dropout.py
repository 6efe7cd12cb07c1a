"""Dropout: the drop rate, the 1/(1-p) scale, one mask shared by forward and backward (regenerated
from the seed, never saved), a fresh mask per call, torch.manual_seed reproducibility, and the
seed's blocks with p > 0 against eager blocks that apply the very mask memfuse drew."""
import functools
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import memfuse
from benchmarks.host_profile import StandInGenerator
from helpers import BLOCKS, block_inputs, forward_backward, rel_error


def bias_dropout(x, b, p):
    return F.dropout(x + b, p, training=True)


def make(rows=200, d=48, dtype=torch.float32):
    x = (torch.randn(rows, d).abs() + 0.5).to(dtype).requires_grad_()   # x + b > 0: a zero
    b = torch.rand(d, dtype=dtype, requires_grad=True)                   # output means dropped
    assert bool(((x + b) != 0).all()), "a zero pre-dropout value would hide the mask"
    return x, b


def within_rate(mask: torch.Tensor, p: float, sigmas: float = 5.0) -> bool:
    n = mask.numel()
    dropped = 1.0 - mask.float().mean().item()
    return abs(dropped - p) <= sigmas * math.sqrt(p * (1 - p) / n)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_drop_rate_and_scale(p):
    x, b = make()
    y = memfuse.memory_efficient_fusion(bias_dropout)(x, b, p).detach()
    keep = y != 0
    assert within_rate(keep, p), f"dropped {1 - keep.float().mean().item():.4f}, p = {p}"
    expected = (x + b).detach() / (1 - p)
    torch.testing.assert_close(y[keep], expected[keep], rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_uses_the_forward_mask(dtype):
    p = 0.3
    x, b = make(dtype=dtype)
    y = memfuse.memory_efficient_fusion(bias_dropout)(x, b, p)
    keep = y.detach() != 0
    assert within_rate(keep, p)
    grad_output = torch.rand_like(y) + 0.5          # nonzero everywhere
    y.backward(grad_output)
    assert torch.equal(x.grad != 0, keep), "grad of x is nonzero exactly where the output was kept"
    expected = grad_output.float() * keep / (1 - p)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(x.grad.float(), expected, rtol=tol, atol=0)
    torch.testing.assert_close(b.grad.float(), expected.sum(0), rtol=tol, atol=tol)


def test_mask_is_never_saved():
    p = 0.3
    x, b = make()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = memfuse.memory_efficient_fusion(bias_dropout)(x, b, p)
    assert y.requires_grad
    assert not any(t.dtype == torch.bool for t in saved), [t.dtype for t in saved]
    assert all(t.numel() <= b.numel() or t is x for t in saved), [tuple(t.shape) for t in saved]


def test_fresh_mask_on_every_call():
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout)
    masks = [fused(x, b, 0.5).detach() != 0 for _ in range(3)]
    assert memfuse.stats()["compiles"] == 1
    assert not torch.equal(masks[0], masks[1])
    assert not torch.equal(masks[1], masks[2])
    assert not torch.equal(masks[0], masks[2])


def test_manual_seed_reproduces_a_run_bit_exactly():
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout)
    grad_output = torch.randn(x.shape)
    runs = []
    for _ in range(2):
        torch.manual_seed(1234)
        xx, bb = x.detach().requires_grad_(), b.detach().requires_grad_()
        y = fused(xx, bb, 0.2)
        y.backward(grad_output)
        runs.append((y.detach(), xx.grad, bb.grad))
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    torch.manual_seed(4321)
    assert not torch.equal(fused(x, b, 0.2).detach(), runs[0][0]), "another seed, the same mask"


def test_philox_seed_draw_reserves_one_offset_step_per_draw():
    """On CUDA the seed comes from the device generator's (seed, offset): each draw moves the
    offset by 4, gives a seed in the kernels' int32 range, never a neighbour of the previous one
    (kernels draw from seed + stream index), and a generator reseeded the same draws the same."""
    from memfuse.runtime.program import SEED_LIMIT, philox_seed_draw
    generator = StandInGenerator(1234)
    draw = philox_seed_draw(generator)
    seeds = [draw() for _ in range(1000)]
    assert generator.offset == 4000
    assert all(0 <= s < SEED_LIMIT for s in seeds)
    assert len(set(seeds)) == len(seeds)
    assert min(abs(a - b) for a, b in zip(seeds, seeds[1:])) > 64
    assert [philox_seed_draw(StandInGenerator(1234))() for _ in range(3)] == [seeds[0]] * 3
    generator.seed, generator.offset = 1234, 0          # reseeded (torch.cuda.manual_seed(1234))
    assert [draw() for _ in range(1000)] == seeds
    other = philox_seed_draw(StandInGenerator(1235))
    assert [other() for _ in range(1000)] != seeds


def test_philox_seeds_are_the_same_in_every_process():
    """The seed is a hash of the generator's (seed, offset): the same in another process under
    another PYTHONHASHSEED (int and tuple hashes do not take it), so a reseeded run is reproduced."""
    from memfuse.runtime.program import philox_seed_draw
    script = ("from benchmarks.host_profile import StandInGenerator; from memfuse.runtime.program import philox_seed_draw; "
              "draw = philox_seed_draw(StandInGenerator(1234)); print([draw() for _ in range(5)])")
    root = Path(__file__).resolve().parents[2]
    ours = os.environ.get("PYTHONHASHSEED", "random")     # unset: random, each process its own
    other = "4242" if ours == "0" else "0"                  # one child, under another hash seed
    env = dict(os.environ, PYTHONPATH=str(root), PYTHONHASHSEED=other)
    result = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    draw = philox_seed_draw(StandInGenerator(1234))
    assert result.stdout.strip() == str([draw() for _ in range(5)])


def test_two_dropouts_draw_independent_masks():
    def twice(x, p):
        return F.dropout(x, p, training=True), F.dropout(x, p, training=True)

    x = torch.rand(200, 48) + 0.5
    y1, y2 = memfuse.memory_efficient_fusion(twice)(x, 0.5)
    k1, k2 = y1 != 0, y2 != 0
    assert within_rate(k1, 0.5) and within_rate(k2, 0.5)
    both = (k1 & k2).float().mean().item()           # 0.25 when independent
    assert abs(both - 0.25) <= 5 * math.sqrt(0.25 * 0.75 / k1.numel()), both


# -- the seed's blocks with dropout on ---------------------------------------------------------
def with_dropout_output(block):
    """block, also returning the output of its F.dropout call, traced as a second output."""
    original = F.dropout

    @functools.wraps(block)        # memfuse binds arguments by the block's own signature
    def block_and_dropout(*args, **kwargs):
        recorded = []

        def recording(*a, **k):
            # F.dropout re-enters through handle_torch_function, which looks `dropout` up in
            # its module (patched): the outermost call is the block's, and it returns last.
            recorded.append(original(*a, **k))
            return recorded[-1]

        with mock.patch.object(F, "dropout", recording):
            out = block(*args, **kwargs)
        assert recorded, "the block never called F.dropout"
        return out, recorded[-1]

    return block_and_dropout


def with_mask(block, mask):
    """The eager block with F.dropout applying `mask` (scaled by 1/(1-p)) instead of a fresh one."""
    def masked_dropout(t, p, training=True, inplace=False):
        return t * mask.to(t.dtype) / (1 - p)

    def masked_block(*args, **kwargs):
        with mock.patch.object(F, "dropout", masked_dropout):
            return block(*args, **kwargs)

    return masked_block


@pytest.mark.parametrize("tiles", ["one_tile", "small_tiles"])
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_block_with_dropout_matches_eager_with_the_same_mask(name, tiles):
    """Run the fused block (forward + backward) from a seed; then, from the same seed, a fused
    variant that also returns the dropout output: its zeros are the mask both drew. An eager
    block applying that mask must give the same output and the same gradients, which holds only
    if the backward regenerated the forward's mask. With small tiles the forward runs one
    program per 2-row tile and the backward 2 programs walking several tiles each."""
    config = memfuse.Config(tile_elements=128) if tiles == "small_tiles" else memfuse.Config()
    p = 0.1
    tensors, consts, grad_output = block_inputs(name, (4, 7, 48), dropout_prob=p)
    block = BLOCKS[name].fn

    torch.manual_seed(99)
    out, grads = forward_backward(memfuse.memory_efficient_fusion(block, config=config), tensors, consts,
                                  grad_output)
    torch.manual_seed(99)
    out2, dropped = memfuse.memory_efficient_fusion(with_dropout_output(block), config=config)(*tensors, **consts)

    pre_dropout = (tensors[0] + tensors[3]).detach()     # input1 + bias1 (the RMSNorm block: + bias)
    assert bool((pre_dropout != 0).all())
    mask = dropped.detach() != 0
    assert within_rate(mask, p), mask.float().mean()
    torch.testing.assert_close(dropped.detach()[mask], pre_dropout[mask] / (1 - p), rtol=1e-6, atol=0)
    assert rel_error(out2.detach(), out) <= 1e-6, "the same seed drew another mask"

    ref_out, ref_grads = forward_backward(with_mask(block, mask), tensors, consts, grad_output)
    assert rel_error(out, ref_out) <= 1e-5
    for i, (grad, ref) in enumerate(zip(grads, ref_grads)):
        assert rel_error(grad, ref) <= 1e-5, f"input {i}: {rel_error(grad, ref):.3g}"
    # the check can fail: eager without dropout is far from the fused result
    no_drop_out, no_drop_grads = forward_backward(block, tensors, dict(consts, dropout_prob=0.0), grad_output)
    assert rel_error(out, no_drop_out) > 1e-3 and rel_error(grads[0], no_drop_grads[0]) > 1e-3


@pytest.mark.parametrize("shape", [(4, 0), (2, 3, 0), (0, 8)], ids=str)
def test_dropout_of_an_empty_tensor(shape):
    """Rows of length 0 run through aten (no kernel to walk them); dropout there draws nothing
    and returns the empty result, forward and backward, as eager does."""
    def fn(x, b):
        return F.dropout(x + b, 0.5) * 2
    x, b = torch.randn(*shape, requires_grad=True), torch.randn(shape[-1], requires_grad=True)
    out = memfuse.memory_efficient_fusion(fn)(x, b)
    want = fn(x.detach(), b.detach())
    assert (out.shape, out.dtype) == (want.shape, want.dtype)
    out.sum().backward()
    assert x.grad.shape == x.shape and b.grad.shape == b.shape
    assert not x.grad.any() and not b.grad.any()
