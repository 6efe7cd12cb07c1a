"""CUDA-graph mode without a GPU: the seed-from-memory kernels through the interpreter, and the
graph bookkeeping (static buffers, borrowed and copied inputs, busy instances, the seed advance,
gradients) with graphs emulated by graphs.EagerRecorder: a replay reruns the captured programs
and copies their results into the tensors the capture returned, as a CUDA graph rewrites them.
tests/gpu/test_gpu.py runs the same checks with real CUDA graphs."""
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import memfuse
from memfuse.fronts import cuda_graphs as graphs
from memfuse.runtime import function as runtime
from memfuse.runtime import launchers
from memfuse.driver.fallback import StrictModeError
from helpers import BLOCKS, block_inputs, forward_backward, leaves_like, rel_error
from tests.ir.test_dropout import with_dropout_output, with_mask, within_rate


def bias_dropout(x, b, p):
    return F.dropout(x + b, p, training=True)


def make(rows=40, d=48):
    x = (torch.rand(rows, d) + 0.5).requires_grad_()       # x + b > 0: a zero output means dropped
    b = torch.nn.Parameter(torch.rand(d))
    return x, b


@pytest.fixture
def emulated(monkeypatch):
    """cuda_graphs=True captures and replays on CPU tensors, through the interpreter."""
    monkeypatch.setattr(graphs, "default_recorder", graphs.EagerRecorder)


def step(fused, tensors, grad_output, zero_grad=True, **consts):
    """One training step as a loop writes it: the output is dropped once the backward ran, and
    the gradients too unless they accumulate."""
    out = fused(*tensors, **consts)
    out.backward(grad_output)
    grads = [t.grad.clone() for t in tensors]
    if zero_grad:
        for t in tensors:
            t.grad = None
    return out.detach().clone(), grads


# -- the seed read from memory ----------------------------------------------------------------
@pytest.mark.parametrize("looped", [False, True], ids=["row", "looped"])
def test_seed_from_memory_matches_the_scalar_seed(monkeypatch, tmp_path, looped):
    """The same seed value gives bit-identical masks, forward and backward, whether the kernels
    take it as a scalar or load it from a [1] tensor."""
    extra = dict(max_row_length=16, loop_block_d=16) if looped else {}
    monkeypatch.setattr(runtime, "_draw_seed", lambda device: 1234)
    results = []
    x0, b0 = make()
    for from_memory in (False, True):
        x, b = x0.detach().requires_grad_(), b0.detach().requires_grad_()
        cache_dir = tmp_path / str(from_memory)
        config = memfuse.Config(seed_from_memory=from_memory, cache_dir=cache_dir, **extra)
        y = memfuse.memory_efficient_fusion(bias_dropout, config=config)(x, b, 0.3)
        y.backward(torch.ones_like(y))
        results.append((y.detach(), x.grad, b.grad))
        sources = [p.read_text() for p in (cache_dir / "kernels").glob("*.py")]
        assert len(sources) == 2
        assert all(("seed_v = tl.load(seed_ptr)" in s) == from_memory for s in sources)
        assert all(("chunk" in s) == looped for s in sources)
    for scalar, memory in zip(*results):
        assert torch.equal(scalar, memory)


def test_seed_from_memory_forward_and_backward_agree_and_a_new_seed_changes_the_mask(monkeypatch):
    config = memfuse.Config(seed_from_memory=True)
    fused = memfuse.memory_efficient_fusion(bias_dropout, config=config)
    masks = []
    for seed in (5, 6, 5):
        monkeypatch.setattr(runtime, "_draw_seed", lambda device, seed=seed: seed)
        x, b = make()
        y = fused(x, b, 0.3)
        keep = y.detach() != 0
        assert within_rate(keep, 0.3)
        y.backward(torch.ones_like(y))
        assert torch.equal(x.grad != 0, keep), "the backward regenerated another mask"
        masks.append(keep)
    assert not torch.equal(masks[0], masks[1])
    assert torch.equal(masks[0], masks[2])


def test_cuda_graphs_on_cpu_runs_without_graphs_and_says_so(caplog):
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    with caplog.at_level(logging.WARNING, logger="memfuse"):
        for _ in range(2):
            y = fused(x, b, 0.3)
            y.backward(torch.ones_like(y))
            assert torch.equal(x.grad != 0, y.detach() != 0)
            x.grad = None
    told = [r.getMessage() for r in caplog.records if "cuda_graphs=True ignored" in r.getMessage()]
    assert len(told) == 1, told
    assert memfuse.stats()["graph_captures"] == 0


# -- graph bookkeeping, emulated ------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_replays_match_the_normal_mode(emulated, name):
    tensors, consts, grad_output = block_inputs(name, (2, 5, 32))
    fn = BLOCKS[name].fn
    ref_out, ref_grads = forward_backward(memfuse.memory_efficient_fusion(fn), tensors, consts, grad_output)
    fused = memfuse.memory_efficient_fusion(fn, cuda_graphs=True)
    leaves = leaves_like(tensors)
    for _ in range(3):
        out, grads = step(fused, leaves, grad_output, **consts)
        assert rel_error(out, ref_out) <= 1e-6
        for grad, ref in zip(grads, ref_grads):
            assert rel_error(grad, ref) <= 1e-6
    assert memfuse.stats()["graph_captures"] == 1
    assert memfuse.stats()["graph_replays"] == 3


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_dropout_replays_draw_fresh_masks_that_the_backward_shares(emulated, name):
    """Each replay draws another mask; an eager block applying the mask a replay drew gives its
    output and gradients (so the backward graph regenerated the forward graph's mask)."""
    p = 0.1
    tensors, consts, grad_output = block_inputs(name, (2, 5, 32), dropout_prob=p)
    fused = memfuse.memory_efficient_fusion(with_dropout_output(BLOCKS[name].fn), cuda_graphs=True)
    leaves = leaves_like(tensors)
    masks = []
    for _ in range(2):
        out, dropped = fused(*leaves, **consts)
        out.backward(grad_output)
        mask = dropped.detach() != 0
        ref_out, ref_grads = forward_backward(with_mask(BLOCKS[name].fn, mask), tensors, consts, grad_output)
        assert rel_error(out.detach(), ref_out) <= 1e-5
        for leaf, ref in zip(leaves, ref_grads):
            assert rel_error(leaf.grad, ref) <= 1e-5
            leaf.grad = None
        masks.append(mask)
        del out, dropped
    assert not torch.equal(masks[0], masks[1]), "two replays drew the same mask"
    assert memfuse.stats()["graph_captures"] == 1


def test_manual_seed_reproduces_a_graphed_run(emulated):
    x, b = make()
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
        runs.append([step(fused, (x, b), torch.ones(40, 48), p=0.5)[0] for _ in range(2)])
    for first, second in zip(*runs):
        assert torch.equal(first, second)
    assert not torch.equal(runs[0][0], runs[0][1])


def test_grads_accumulate_over_steps_without_zeroing(emulated):
    """The first backward's gradients become the .grad tensors (no copy), so that instance stays
    busy while they are held: a second instance serves the next steps and adds into them."""
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    g = [torch.rand(40, 48) for _ in range(3)]
    for i in range(3):
        step(fused, (x, b), g[i], zero_grad=False, p=0.0)
        torch.testing.assert_close(b.grad, sum(g[:i + 1]).sum(0))
        torch.testing.assert_close(x.grad, sum(g[:i + 1]))
    assert memfuse.stats()["graph_captures"] == 2
    x.grad = b.grad = None                              # zero_grad(): the first instance is free again
    _, (x_grad, _) = step(fused, (x, b), g[0], p=0.0)
    torch.testing.assert_close(x_grad, g[0])
    assert memfuse.stats()["graph_captures"] == 2


def test_grads_from_autograd_grad_are_never_rewritten(emulated):
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    first = torch.autograd.grad(fused(x, b, 0.0), (x, b), torch.ones(40, 48))
    second = torch.autograd.grad(fused(x, b, 0.0), (x, b), torch.full((40, 48), 2.0))
    torch.testing.assert_close(first[1], torch.full((48,), 40.0))
    torch.testing.assert_close(second[1], torch.full((48,), 80.0))
    assert memfuse.stats()["graph_captures"] == 2


def test_input_changed_in_place_gives_new_results(emulated):
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    with torch.no_grad():
        first = fused(x, b, 0.0).clone()
        x.mul_(2)
        b.add_(1)
        second = fused(x, b, 0.0).clone()
    torch.testing.assert_close(first, (x / 2 + b - 1).detach())
    torch.testing.assert_close(second, (x + b).detach())
    assert memfuse.stats()["graph_captures"] == 1


def test_a_new_shape_captures_a_new_graph_and_an_old_one_replays(emulated):
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    small, b = make(rows=40)
    large, _ = make(rows=56)
    for x, captures in ((small, 1), (large, 2), (small, 2), (large, 2)):
        out, _ = step(fused, (x, b), torch.ones(x.shape), p=0.0)
        torch.testing.assert_close(out, (x + b).detach())
        assert memfuse.stats()["graph_captures"] == captures
    assert memfuse.stats()["compiles"] == 1           # one program: the shapes differ in M only


def test_a_new_tensor_each_call_is_copied_in(emulated):
    """A borrowed argument that moves makes its position a copied one: one more capture, then
    every call copies it into the graph's buffer."""
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    _, b = make()
    keep = []
    for i in range(4):
        x = torch.full((40, 48), float(i + 1), requires_grad=True)
        keep.append(x)                                # distinct addresses on every call
        out, (x_grad, _) = step(fused, (x, b), torch.ones(40, 48), p=0.0)
        torch.testing.assert_close(out, (x + b).detach())
        assert torch.equal(x_grad, torch.ones(40, 48))
    assert memfuse.stats()["graph_captures"] == 2


def test_an_output_still_held_is_never_rewritten(emulated):
    x, b = make()
    x0 = x.detach().clone()
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    with torch.no_grad():
        first = fused(x, b, 0.0)
        x.mul_(2)
        second = fused(x, b, 0.0)
        torch.testing.assert_close(first, x0 + b)
        torch.testing.assert_close(second, x0 * 2 + b)
        assert memfuse.stats()["graph_captures"] == 2   # the first instance was busy
        del first
        x.mul_(1.5)
        third = fused(x, b, 0.0)
        torch.testing.assert_close(third, x0 * 3 + b)
        torch.testing.assert_close(second, x0 * 2 + b)
        assert memfuse.stats()["graph_captures"] == 2   # the first instance was free again


def test_two_calls_before_one_backward(emulated):
    """A fused function used twice in one forward (two layers): the second call finds the first
    instance waiting for its backward and captures another."""
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    for _ in range(2):
        y = fused(fused(x, b, 0.0), b, 0.0)
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(y.detach(), (x + 2 * b).detach())
        torch.testing.assert_close(x.grad, torch.ones_like(x))
        torch.testing.assert_close(b.grad, torch.full((48,), 80.0))
        x.grad = b.grad = None
        del y
    assert memfuse.stats()["graph_captures"] == 2


def test_past_the_limit_calls_run_without_graphs(emulated, caplog):
    config = memfuse.Config(cuda_graphs_limit=1)
    fused = memfuse.memory_efficient_fusion(bias_dropout, config=config, cuda_graphs=True)
    _, b = make()
    with caplog.at_level(logging.WARNING, logger="memfuse"):
        for rows in (40, 56, 64, 56):
            x, _ = make(rows=rows)
            out, _ = step(fused, (x, b), torch.ones(x.shape), p=0.0)
            torch.testing.assert_close(out, (x + b).detach())
    assert memfuse.stats()["graph_captures"] == 1
    assert len([r for r in caplog.records if "cuda_graphs_limit" in r.getMessage()]) == 1


def test_backward_after_a_later_replay_raises(emulated):
    x, b = make()
    fused = memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True)
    loss = fused(x, b, 0.0).sum()                       # the output itself is not held
    loss.backward(retain_graph=True)
    x.grad = b.grad = None
    fused(x, b, 0.0)                                    # the backward ran: the instance is replayed
    assert memfuse.stats()["graph_captures"] == 1
    with pytest.raises(RuntimeError, match="overwritten by a later forward replay"):
        loss.backward()


def test_fused_module(emulated):
    block = torch.nn.Sequential(torch.nn.LayerNorm(32), torch.nn.Dropout(0.0))
    fused = memfuse.memory_efficient_fusion(block, cuda_graphs=True)
    x = torch.randn(4, 5, 32, requires_grad=True)
    for _ in range(2):
        out = fused(x)
        out.backward(torch.ones_like(out))
        del out
    ref = block(x.detach())
    torch.testing.assert_close(fused(x).detach(), ref)
    weight_grad = torch.autograd.grad(block(x.detach()).sum(), block[0].weight)[0]
    torch.testing.assert_close(block[0].weight.grad, 2 * weight_grad)
    assert memfuse.stats()["graph_captures"] == 2       # the .grad tensors hold the first instance


def test_accumulate_grad_adopts_a_returned_gradient_and_the_use_count_shows_it():
    """The premise of returning graph memory as gradients: AccumulateGrad makes a detached view of
    it the .grad (no copy), and the storage's use count tells while that .grad is held."""
    from torch.multiprocessing.reductions import StorageWeakRef
    held = torch.ones(4)
    ref = StorageWeakRef(held.untyped_storage())
    alone = torch._C._storage_Use_Count(ref.cdata)

    class Returns(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return held.detach()

    x = torch.zeros(4, requires_grad=True)
    Returns.apply(x).sum().backward()
    assert x.grad.data_ptr() == held.data_ptr()
    assert torch._C._storage_Use_Count(ref.cdata) > alone
    x.grad = None
    assert torch._C._storage_Use_Count(ref.cdata) == alone


def test_one_gradient_buffer_for_two_inputs_gives_them_separate_grads(emulated):
    """Without dropout the block's backward returns one buffer as the gradient of x and of the
    residual. Each .grad must still be its own memory: accumulated without zeroing, x.grad and
    residual.grad each get one share (two views of one buffer would both be adopted and every
    later accumulation would land in both)."""
    from benchmarks.lib.workloads import layer_norm_block

    def leaves():
        torch.manual_seed(0)
        return [torch.randn(2, 4, 32, requires_grad=True), torch.randn(2, 4, 32, requires_grad=True),
                *[torch.nn.Parameter(torch.randn(32)) for _ in range(3)]]

    fused_leaves, eager_leaves = leaves(), leaves()
    fused = memfuse.memory_efficient_fusion(layer_norm_block, cuda_graphs=True)
    for step in range(3):
        g = torch.randn(2, 4, 32)
        fused(*fused_leaves, normalization_axis=2, dropout_prob=0.0).backward(g)
        layer_norm_block(*eager_leaves, normalization_axis=2, dropout_prob=0.0).backward(g)
    assert fused_leaves[0].grad.data_ptr() != fused_leaves[1].grad.data_ptr()
    for got, expected in zip(fused_leaves, eager_leaves):
        torch.testing.assert_close(got.grad, expected.grad)
    assert memfuse.stats()["graph_replays"] == 3


def test_generated_seed_kernel_is_readable(tmp_path):
    """The variant's parameter comment says where the seed comes from."""
    config = memfuse.Config(seed_from_memory=True, cache_dir=tmp_path)
    x, b = make()
    memfuse.memory_efficient_fusion(bias_dropout, config=config)(x, b, 0.3)
    text = "\n".join(p.read_text() for p in Path(tmp_path, "kernels").glob("*.py"))
    assert "seed_ptr,  # [1] int64 dropout seed, read from memory" in text


# -- failures: the first run's rules, and a capture that fails ------------------------------------
def two_steps_match_eager(fused) -> None:
    """Two steps of bias_dropout without dropout: x + b, and its gradients."""
    x, b = make()
    for _ in range(2):
        out, grads = step(fused, (x, b), torch.ones(x.shape), p=0.0)
        torch.testing.assert_close(out, (x + b).detach())
        torch.testing.assert_close(grads, [torch.ones(x.shape), torch.full(b.shape, float(x.shape[0]))])


@pytest.mark.parametrize("program", ["forward", "backward"])
def test_a_warm_up_that_fails_runs_the_call_through_torch(emulated, monkeypatch, program):
    """The warm-up is the programs' first run: its failure retires the compiled entry, and this
    call and the later ones run through torch with eager's results, counted."""
    launch = launchers.KernelLaunch._launch

    def failing(self, device, rows, aligned, values):
        if f"_{program}_" in self.kernel.source.name:
            raise RuntimeError(f"injected: launching {self.kernel.source.name} failed")
        return launch(self, device, rows, aligned, values)
    monkeypatch.setattr(launchers.KernelLaunch, "_launch", failing)
    two_steps_match_eager(memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True))
    stats = memfuse.stats()
    assert stats["first_run_fallbacks"] == 1 and stats["graph_captures"] == 0 and stats["eager_calls"] == 2


def test_a_capture_that_fails_runs_without_graphs_and_says_so(emulated, monkeypatch, caplog):
    def failing_capture(self, body, device):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(graphs.EagerRecorder, "capture", failing_capture)
    with caplog.at_level(logging.WARNING, logger="memfuse"):
        two_steps_match_eager(memfuse.memory_efficient_fusion(bias_dropout, cuda_graphs=True))
    stats = memfuse.stats()
    assert stats["graph_captures"] == 0 and stats["eager_calls"] == 0 and stats["compiles"] == 1
    [said] = [r.getMessage() for r in caplog.records if "capturing its programs" in r.getMessage()]
    assert "running without graphs" in said and "stream is capturing" in said

    strict = memfuse.memory_efficient_fusion(bias_dropout, config=memfuse.Config(strict=True), cuda_graphs=True)
    x, b = make()
    with pytest.raises(StrictModeError, match="capturing its programs"):
        strict(x, b, p=0.0)
