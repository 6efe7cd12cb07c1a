"""A language-model loss head: cross-entropy picks each row's target log-probability with a
gather, which capture fuses into a row sum of where(column == index, x, 0) in the kernel that
computes the log-softmax, so the forward writes no [tokens, vocab] value. An index outside the
row still raises, as eager's gather and cross_entropy do."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import memfuse
from memfuse import Config
from memfuse.buffers import Origin
from memfuse.ir.targets import IndexCheck

from compare import assert_matches_eager

CONFIGS = {"looped": Config(max_row_length=16, loop_block_d=8), "persistent": Config()}
TOKENS, HIDDEN, VOCAB = 6, 8, 40


def lm_head_loss(reduction: str):
    """h [tokens, hidden] @ w [hidden, vocab] (w's last dim is static: the vocabulary), upcast."""
    def loss(h, w, t):
        return F.cross_entropy((h @ w).float(), t, ignore_index=-100, reduction=reduction)
    return loss


def head_args(dtype: torch.dtype, targets: torch.Tensor) -> list:
    torch.manual_seed(0)
    h = torch.randn(TOKENS, HIDDEN, dtype=dtype, requires_grad=True)
    w = (torch.randn(HIDDEN, VOCAB) * 0.5).to(dtype).requires_grad_()
    return [h, w, targets]


TARGETS = {
    "some_ignored": torch.tensor([3, -100, 39, 0, 17, -100]),
    "all_ignored": torch.full((TOKENS,), -100),
}


def kernel_written(fused) -> list:
    """(name, shape) of every buffer a generated kernel of a forward program writes."""
    written = []
    for entry in fused.cache.values():
        for buffer in entry.function.forward.buffers.buffers.values():
            if buffer.origin is Origin.OUTPUT:
                written.append((buffer.name, tuple(int(s) if s.is_number else s for s in buffer.shape)))
    return written


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("targets", list(TARGETS))
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16_upcast"])
def test_lm_head_loss_matches_eager_and_writes_no_vocab_row(dtype, reduction, targets, config):
    fn = lm_head_loss(reduction)
    args = head_args(dtype, TARGETS[targets])
    both = assert_matches_eager(fn, args, config=CONFIGS[config])
    assert not [f for f in both.fallbacks if f[1] == "aten.gather.default"], both.fallbacks
    fused = memfuse.memory_efficient_fusion(fn, config=CONFIGS[config])
    fused(*args)
    wide = [(name, shape) for name, shape in kernel_written(fused) if shape and shape[-1] == VOCAB]
    assert wide == [], f"the forward's kernels write [tokens, vocab] values: {wide}"


def test_explain_shows_the_pick_in_the_loss_kernel_and_no_vocab_row_saved():
    fn = lm_head_loss("mean")
    args = head_args(torch.bfloat16, TARGETS["some_ignored"])
    fused = memfuse.memory_efficient_fusion(fn, config=CONFIGS["looped"])
    report = memfuse.explain(fused, *args)
    (loss_kernel,) = [k for k in report.kernels_of("forward") if k.d == VOCAB]
    ops = dict(loss_kernel.ops)
    assert ops["amax"] == "max" and ops["gather_sum"] == "sum" and ops["gather_hit"] == "eq"
    # it writes the per-token loss, ignored targets zeroed: the targets [tokens] are a row of
    # tokens (integer: their one dim is a size symbol), whose mask joins the loss kernel
    assert loss_kernel.outputs == ("where_1",) and loss_kernel.passes == 2
    assert "extern gather_check: IndexCheck(0 <= index < 40)" in str(report)
    # of [tokens, vocab], the backward gets the bf16 logits the matmul wrote, nothing in fp32
    wide = [(s.dtype, s.shape) for s in report.saved if not s.is_input and s.bytes >= TOKENS * VOCAB]
    assert wide == [(torch.bfloat16, (TOKENS, VOCAB))], report.saved


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("bad", [VOCAB, -5])
def test_a_target_outside_the_vocabulary_raises(bad, config):
    targets = TARGETS["some_ignored"].clone()
    targets[2] = bad
    args = head_args(torch.float32, targets)
    with pytest.raises(IndexError):
        lm_head_loss("mean")(*args)          # eager: "Target 40 is out of bounds."
    fused = memfuse.memory_efficient_fusion(lm_head_loss("mean"), config=CONFIGS[config])
    with pytest.raises(RuntimeError, match=r"gather index out of bounds.*\[0, 40\)"):
        fused(*args)
    # the inputs' fault, not the program's: it stays, and runs the next call
    fused(*head_args(torch.float32, TARGETS["some_ignored"]))
    stats = memfuse.stats()
    assert stats["first_run_fallbacks"] == 0 and stats["eager_calls"] == 0, stats


def gather_of_computed(x, w, index):
    """(Adding the index ties its leading sizes to x's: gather allows an index of fewer rows.)"""
    return torch.gather(torch.sin(x) * w + index, -1, index) * 3


@pytest.mark.parametrize("config", list(CONFIGS))
def test_gather_of_a_computed_value_matches_eager(config):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, VOCAB, requires_grad=True), torch.randn(VOCAB, requires_grad=True)
    index = torch.randint(0, VOCAB, (2, 3, 1))
    both = assert_matches_eager(gather_of_computed, [x, w, index], config=CONFIGS[config])
    assert not [f for f in both.fallbacks if f[1] == "aten.gather.default"], both.fallbacks
    index[1, 2, 0] = VOCAB
    with pytest.raises(RuntimeError, match="gather index out of bounds"):
        memfuse.memory_efficient_fusion(gather_of_computed, config=CONFIGS[config])(x, w, index)


def index_checks(both) -> list:
    return [n for c in both.captured for n in c.joint.nodes.values()
            if n.op.value == "extern" and isinstance(n.attr.target, IndexCheck)]


def test_a_gather_at_an_argmax_needs_no_check():
    fn = (lambda x: torch.gather(x * 2, -1, x.argmax(-1, keepdim=True)) + 1)
    both = assert_matches_eager(fn, [torch.randn(5, VOCAB, requires_grad=True)], config=CONFIGS["looped"])
    assert [f[1] for f in both.fallbacks] == ["aten.scatter_add.default"]   # (the backward's)
    assert index_checks(both) == []


def test_a_gather_of_other_rows_stays_atens():
    """An index with fewer rows than x (gather reads the first ones) is not one index per row."""
    fn = (lambda x, index: torch.gather(x * 2, -1, index))
    x, index = torch.randn(6, VOCAB, requires_grad=True), torch.randint(0, VOCAB, (4, 1))
    both = assert_matches_eager(fn, [x, index])
    assert "aten.gather.default" in [f[1] for f in both.fallbacks], both.fallbacks


def test_hf_causal_lm_loss_behind_torch_compile_writes_no_vocab_row():
    """HF's ForCausalLMLoss (labels shifted by a pad and a slice, then an aten view: the targets
    are ready a stage after the logits) behind torch.compile: the log-softmax still runs in the
    kernel that picks from it."""
    loss_utils = pytest.importorskip("transformers.loss.loss_utils")

    def loss(logits, labels):
        return loss_utils.ForCausalLMLoss(logits, labels, vocab_size=VOCAB)

    torch.manual_seed(0)
    logits = torch.randn(2, 8, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (2, 8))
    labels[0, 3] = -100
    report = memfuse.explain(torch.compile(loss, backend="memfuse"), logits, labels)
    (graph,) = report.graphs
    forward = graph.entry.function.forward.buffers.buffers.values()
    wide = [b.name for b in forward if b.origin is Origin.OUTPUT and b.shape and b.shape[-1] == VOCAB]
    assert wide == [], wide
    assert "or later: computed there" in str(graph)   # explain says why the log-softmax is not written
    got = torch.compile(loss, backend="memfuse")(logits, labels)
    got_grad, = torch.autograd.grad(got, logits)
    want = loss(logits, labels)
    want_grad, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_grad, want_grad)


def causal_lm_loss(h, w, labels):
    """A causal LM's loss as HuggingFace writes it: [B, S, V] logits flattened to rows, the labels
    [B, S] padded, shifted and flattened: the rows only a product of sizes relates to the labels."""
    logits = (h @ w).float()
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.view(-1), ignore_index=-100)


@pytest.mark.parametrize("symbolic", [True, False], ids=["symbolic_tokens", "static_tokens"])
def test_labels_of_the_logits_batch_share_its_rows_in_the_loss_kernels(symbolic):
    """The labels' [B, S] and the hidden states' [B, S] are traced with one symbol per size (duck
    shaping, as the compile key holds equal sizes equal): the labels' tokens are the logits' rows,
    and the pick, the target scatter and its scale fuse. With distinct symbols only the product
    B*S == B'*S' related them, and all three ran through aten."""
    torch.manual_seed(0)
    h = torch.randn(2, 5, HIDDEN, requires_grad=True)
    w = (torch.randn(HIDDEN, VOCAB) * 0.5).requires_grad_()
    labels = torch.tensor([[3, -100, 39, 0, 17], [1, 2, -100, 4, 5]])
    config = Config(symbolic_token_dims=symbolic)
    both = assert_matches_eager(causal_lm_loss, [h, w, labels], config=config)
    aten = {f[1] for f in both.fallbacks}
    assert not aten & {"aten.gather.default", "aten.scatter.value", "aten.mul.Tensor"}, both.fallbacks
