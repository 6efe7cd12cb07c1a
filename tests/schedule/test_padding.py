"""memfuse.schedule.padding: extern matmul operands aligned as torch.compile's pad_mm aligns them.

The decisions come from shapes alone (which of M, N, K, to what, why); forced on the CPU
(Config.pad_matmuls="force"), padded matmuls give eager's results and gradients for odd vocabularies
and hidden sizes, forward and backward (grad_logits^T @ hidden and grad_logits @ W included), in
fp32 and under bf16 autocast; aligned sizes are left alone; a tiny GPT-2 with a vocabulary of 1001
matches eager.
"""
import pytest
import sympy
import torch
from torch import nn

import memfuse
from memfuse.base.config import Config
from memfuse.reports.explain import build_report, padding_lines
from memfuse.ir.graph import Op
from memfuse.schedule.padding import decide, intensity

aten = torch.ops.aten
FORCE = Config(pad_matmuls="force")
TOKENS = sympy.Symbol("s0") * sympy.Symbol("s1")      # M of a linear over [batch, sequence, hidden]


def padded(decision) -> dict:
    return {dim: aligned for dim, (_, aligned) in decision.padded_dims().items()}


# -- the decisions: pad_mm's rules, from the shapes ---------------------------------------------
def test_the_lm_head_pads_the_vocabulary_on_cuda():
    """GPT-2's LM head and the two products of its backward: the vocabulary (50257) is N, K and M."""
    forward = decide("mm", aten.mm.default, (TOKENS, 768), (768, 50257), torch.bfloat16, "cuda", Config())
    assert forward.padded and padded(forward) == {"N": 50264}
    m, n, k = forward.dims
    assert "symbolic" in m.reason and k.reason == "aligned" and "padded to 50264" in n.reason
    assert "intensity 756" in forward.reason and "cuBLAS" in forward.reason
    grad_hidden = decide("mm_2", aten.mm.default, (TOKENS, 50257), (50257, 768), torch.bfloat16, "cuda", Config())
    assert padded(grad_hidden) == {"K": 50264}
    grad_weight = decide("mm_1", aten.mm.default, (50257, TOKENS), (TOKENS, 768), torch.bfloat16, "cuda", Config())
    assert padded(grad_weight) == {"M": 50264}


def test_auto_pads_cuda_matmuls_only_and_force_pads_anywhere():
    shapes = ((TOKENS, 768), (768, 50257))
    on_cpu = decide("mm", aten.mm.default, *shapes, torch.bfloat16, "cpu", Config(pad_matmuls="auto"))
    assert not on_cpu.padded and "traced on cpu" in on_cpu.reason and "'force'" in on_cpu.reason
    assert on_cpu.padded_dims() == {}
    forced = decide("mm", aten.mm.default, *shapes, torch.bfloat16, "cpu", FORCE)
    assert padded(forced) == {"N": 50264} and "forced" in forced.reason
    off = decide("mm", aten.mm.default, *shapes, torch.bfloat16, "cuda", Config(pad_matmuls="off"))
    assert not off.padded and "'off'" in off.reason
    with pytest.raises(ValueError, match="pad_matmuls='sometimes'.*auto, force, off"):
        decide("mm", aten.mm.default, *shapes, torch.bfloat16, "cuda", Config(pad_matmuls="sometimes"))


@pytest.mark.parametrize("dtype, size, aligned", [
    (torch.bfloat16, 101, 104), (torch.float16, 101, 104), (torch.float32, 101, 104),
    (torch.bfloat16, 100, 104), (torch.float32, 100, None), (torch.float32, 102, 104),
    (torch.bfloat16, 104, None), (torch.float64, 101, None),
])
def test_alignment_is_16_bytes_per_dtype(dtype, size, aligned):
    """8 elements for fp16/bf16, 4 for fp32, none for other dtypes (pad_mm's alignment)."""
    decision = decide("mm", aten.mm.default, (64, size), (size, 64), dtype, "cpu", FORCE)
    assert padded(decision) == ({"K": aligned} if aligned else {})
    if dtype == torch.float64:
        assert "pad_mm aligns fp16/bf16" in decision.reason


def test_symbols_ones_and_empty_dims_are_left_alone():
    s = sympy.Symbol("s0")
    symbolic = decide("mm", aten.mm.default, (s, s), (s, s), torch.bfloat16, "cuda", FORCE)
    assert not symbolic.padded and "nothing to pad" in symbolic.reason
    assert all("symbolic" in d.reason for d in symbolic.dims)
    vector = decide("mm", aten.mm.default, (1, 13), (13, 1), torch.float32, "cuda", FORCE)
    assert padded(vector) == {"K": 16} and [d.reason for d in vector.dims[:2]] == ["size 1", "size 1"]
    empty = decide("mm", aten.mm.default, (0, 13), (13, 7), torch.float32, "cuda", FORCE)
    assert not empty.padded and "empty" in empty.reason


def test_auto_pads_only_matmuls_with_enough_compute():
    """Intensity MNK / (MK + KN + MN) with symbolic dims taken as large: [tokens, 64] @ [64, 101] is
    39, below the default 100; the LM head of GPT-2 is 756."""
    assert intensity((TOKENS, 101, 64)) == pytest.approx(1 / (1 / 101 + 1 / 64))
    assert intensity((TOKENS, 50257, 768)) == pytest.approx(756.4, abs=0.1)
    small = decide("mm", aten.mm.default, (TOKENS, 64), (64, 101), torch.float32, "cuda", Config())
    assert not small.padded and "does not pay: arithmetic intensity 39" in small.reason
    lower = Config(pad_matmul_min_intensity=30.0)
    assert decide("mm", aten.mm.default, (TOKENS, 64), (64, 101), torch.float32, "cuda", lower).padded


# -- padded programs against eager -----------------------------------------------------------------
class Head(nn.Module):
    """An LM head: LayerNorm, the vocabulary projection (a transposed weight: mm, or addmm with a
    bias), log-softmax. Returns the logits too, so the unpadded result is also an output."""

    def __init__(self, hidden: int, vocab: int, bias: bool):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.proj = nn.Linear(hidden, vocab, bias=bias)

    def forward(self, x):
        logits = self.proj(self.norm(x).reshape(-1, x.shape[-1]))
        return logits, logits.float().log_softmax(-1)


def programs(fused):
    """The forward and backward Programs of a FusedModule's one compiled call."""
    (call,) = fused._memfuse_calls.values()
    (entry,) = call.fused.cache.values()
    return entry, entry.function.forward, entry.function.backward


def run_both(make, x, config, autocast=None):
    """(fused outputs, fused grads, eager outputs, eager grads, FusedModule): one forward + backward
    each, with the same weights and output gradients."""
    torch.manual_seed(0)
    eager = make()
    fused = memfuse.memory_efficient_fusion(make(), config=config)
    fused.load_state_dict(eager.state_dict())
    results = []
    for model in (fused, eager):
        leaf = x.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            outs = model(leaf)
        torch.manual_seed(1)
        grads = [torch.randn(o.shape, dtype=o.dtype) for o in outs]
        torch.autograd.backward(outs, grads)
        results.append(([o.detach().float() for o in outs],
                         [leaf.grad] + [p.grad for p in (model.original if model is fused else model).parameters()]))
    return results[0], results[1], fused


def assert_matches(got, want, rtol, atol):
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("hidden, vocab, bias", [(16, 101, False), (16, 1001, True), (13, 101, True)])
def test_padded_head_matches_eager_in_fp32(hidden, vocab, bias):
    x = torch.randn(2, 5, hidden)
    got, want, fused = run_both(lambda: Head(hidden, vocab, bias), x, FORCE)
    assert_matches(got, want, rtol=1e-5, atol=1e-5)
    _, forward, backward = programs(fused)
    (head,) = forward.schedule.paddings
    aligned_vocab = -(-vocab // 4) * 4
    assert padded(head) == {"N": aligned_vocab, **({"K": 16} if hidden % 4 else {})}
    # the backward's grad_logits @ W (K: the vocabulary) and grad_logits^T @ hidden (M: the vocabulary)
    by_dims = sorted(padded(p).get("M", 0) for p in backward.schedule.paddings)
    assert aligned_vocab in by_dims
    assert any(padded(p).get("K") == aligned_vocab for p in backward.schedule.paddings)
    for program in (forward, backward):
        externs = [n for n in program.graph.nodes.values() if n.op is Op.EXTERN and n.name.endswith("_padded")]
        assert len(externs) >= len([p for p in program.schedule.paddings if p.padded])


@pytest.mark.parametrize("hidden, vocab", [(16, 1001), (20, 101)])
def test_padded_head_matches_eager_under_bf16_autocast(hidden, vocab):
    """bf16 pads to multiples of 8: the hidden size 20 (K) is padded too."""
    x = torch.randn(2, 5, hidden)
    got, want, fused = run_both(lambda: Head(hidden, vocab, True), x, FORCE, autocast=torch.bfloat16)
    assert_matches(got, want, rtol=2e-2, atol=2e-2)
    _, forward, _ = programs(fused)
    (head,) = forward.schedule.paddings
    assert head.dtype == torch.bfloat16
    assert padded(head) == {"N": -(-vocab // 8) * 8, **({"K": 24} if hidden % 8 else {})}


def test_aligned_sizes_are_not_padded():
    x = torch.randn(2, 5, 16)
    got, want, fused = run_both(lambda: Head(16, 104, True), x, FORCE)
    assert_matches(got, want, rtol=1e-5, atol=1e-5)
    entry, forward, backward = programs(fused)
    decisions = forward.schedule.paddings + backward.schedule.paddings
    assert decisions and not any(p.padded for p in decisions)
    assert all("nothing to pad" in p.reason for p in decisions)
    assert forward.graph is entry.plan.forward and backward.graph is entry.plan.backward   # not rewritten


def test_auto_leaves_cpu_programs_unpadded():
    x = torch.randn(2, 5, 16)
    got, want, fused = run_both(lambda: Head(16, 101, False), x, Config(pad_matmuls="auto"))
    assert_matches(got, want, rtol=1e-5, atol=1e-5)
    entry, forward, _ = programs(fused)
    (head,) = forward.schedule.paddings
    assert not head.padded and "traced on cpu" in head.reason
    assert forward.graph is entry.plan.forward


class Batched(nn.Module):
    """bmm with a static batch: [2, S, 13] @ [2, 13, 7] (K and N odd); its backward pads M too."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 13, 7))

    def forward(self, x):
        return (torch.bmm(x, self.w).tanh(),)


def test_padded_bmm_matches_eager():
    x = torch.randn(2, 6, 13)
    got, want, fused = run_both(Batched, x, FORCE)
    assert_matches(got, want, rtol=1e-5, atol=1e-5)
    _, forward, backward = programs(fused)
    assert [padded(p) for p in forward.schedule.paddings] == [{"N": 8, "K": 16}]
    assert {"M": 16, "N": 8} in [padded(p) for p in backward.schedule.paddings]


class Chain(nn.Module):
    """Two projections back to back: the first one's padded result is the second one's operand (read
    by an aten call), and the backward's transposes read the padded gradients."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 37, bias=False)
        self.b = nn.Linear(37, 11, bias=True)

    def forward(self, x):
        return (self.b(self.a(x)).relu(),)


def test_chained_padded_matmuls_match_eager():
    x = torch.randn(3, 4, 12)
    got, want, fused = run_both(Chain, x, FORCE)
    assert_matches(got, want, rtol=1e-5, atol=1e-5)
    _, forward, _ = programs(fused)
    assert [padded(p) for p in forward.schedule.paddings] == [{"N": 40}, {"N": 12, "K": 40}]


def test_explain_lists_each_matmul_decision():
    x = torch.randn(2, 5, 16)
    _, _, fused = run_both(lambda: Head(16, 101, False), x, FORCE)
    entry, _, _ = programs(fused)
    report = build_report(entry, "Head")
    lines = padding_lines(report)
    assert lines[1].startswith("matmul padding")
    assert any(line.startswith("  forward mm") and "N=101 -> 104" in line for line in lines)
    assert any(line.startswith("  backward") and "M=101 -> 104" in line for line in lines)
    assert "matmul padding" in str(report)


# -- a tiny GPT-2 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("autocast", [None, torch.bfloat16])
def test_tiny_gpt2_with_an_odd_vocabulary_matches_eager(autocast):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=1001, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)

    def make():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(config)
    torch.manual_seed(2)
    ids = torch.randint(0, 1001, (2, 8))
    losses, grads = [], []
    # the head unchunked: its [tokens, vocab] matmuls are the ones padded (chunked, memfuse.patterns.loss_head.op pads them)
    eager, fused = make(), memfuse.memory_efficient_fusion(make(), config=Config(pad_matmuls="force",
                                                                                 chunk_loss_head=False))
    for model in (fused, eager):
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        losses.append(out.loss.detach())
        grads.append([p.grad for p in (model.original if model is fused else model).parameters()])
    tolerance = 1e-5 if autocast is None else 2e-2
    torch.testing.assert_close(losses[0], losses[1], rtol=tolerance, atol=tolerance)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=tolerance, atol=tolerance)
    _, forward, backward = programs(fused)
    vocab = 1004 if autocast is None else 1008
    assert [padded(p) for p in forward.schedule.paddings if p.padded] == [{"N": vocab}]
    assert sorted(tuple(padded(p)) for p in backward.schedule.paddings if p.padded) == [("K",), ("M",)]


# -- the kernel that computes an operand stores it padded --------------------------------------------
def pad_kernels(program) -> list:
    """Kernels whose only work is copying a computed value into its padded shape."""
    graph = program.graph
    return [k.name for k in program.schedule.kernels
            if all(graph[n].op is Op.STRIDED and "zero padding" in graph[n].attr.describe for n in k.nodes)
            and any(graph[graph[n].inputs[0]].op not in (Op.INPUT, Op.EXTERN) for n in k.nodes)]


def stored_padded(program) -> list:
    """(kernel, padded value) pairs where a kernel computes a value and stores it padded."""
    from memfuse.schedule.groups import stores_padded
    graph = program.graph
    return [(k.name, n) for k in program.schedule.kernels for n in k.nodes
            if stores_padded(graph, graph[n], set(k.nodes))]


@pytest.mark.parametrize("max_row_length", [16384, 64])
def test_the_producing_kernel_writes_the_padded_operand(max_row_length):
    """The gradient of the logits (backward) and the normalized hidden state (hidden 13: K) are
    written padded by the kernels that compute them, persistent or looped over chunks of the
    row; the unpadded values are not written at all."""
    config = Config(pad_matmuls="force", max_row_length=max_row_length, loop_block_d=32)
    x = torch.randn(2, 5, 13)
    got, want, fused = run_both(lambda: Head(13, 101, False), x, config)
    assert_matches(got, want, rtol=1e-5, atol=1e-5)
    _, forward, backward = programs(fused)
    for program in (forward, backward):
        assert pad_kernels(program) == []
        fused_pads = stored_padded(program)
        assert fused_pads
        for kernel, value in fused_pads:
            group = next(k for k in program.schedule.kernels if k.name == kernel)
            root = program.graph[value].inputs[0]
            assert value in group.outputs and root not in group.outputs
    assert any(program.graph[v].value.d == 104 for _, v in stored_padded(backward))   # grad_logits, V: 101 -> 104


def test_a_tile_narrower_than_the_padded_row_copies_instead():
    """D = 3 in bf16 pads to 8 columns, past the kernel's 4-column tiles: a second kernel copies."""
    x = torch.randn(2, 5, 3)
    got, want, fused = run_both(lambda: Head(3, 16, False), x, FORCE, autocast=torch.bfloat16)
    assert_matches(got, want, rtol=2e-2, atol=2e-2)
    _, forward, _ = programs(fused)
    assert stored_padded(forward) == [] and pad_kernels(forward)


def test_a_padded_store_in_a_group_run_through_aten(monkeypatch):
    """A group the code generator declines runs op by op; its padded store is a torch pad."""
    import memfuse.schedule.groups as schedule
    decline = schedule._codegen_limit
    monkeypatch.setattr(schedule, "_codegen_limit", lambda graph, group, config: "declined by the test"
                        if any(schedule.stores_padded(graph, graph[n], set(group.nodes)) for n in group.nodes)
                        else decline(graph, group, config))
    x = torch.randn(2, 5, 13)
    got, want, fused = run_both(lambda: Head(13, 101, False), x, FORCE)
    assert_matches(got, want, rtol=1e-5, atol=1e-5)
    _, _, backward = programs(fused)
    assert any(k.aten_reason == "declined by the test" for k in backward.schedule.kernels)
