"""The chunked loss head (issue 18): memfuse.patterns.loss_head.op's op against the unchunked math, and
memfuse.patterns.loss_head.detect finding the pattern (linear -> [cast] -> [flatten] -> cross_entropy) in functions,
in torch.compile graphs and in HuggingFace's GPT-2, BERT-MLM and Llama heads, or saying why not."""
import dataclasses
import functools
import logging
import sys

import pytest
import torch
import torch.nn.functional as F

import memfuse
from memfuse.patterns.loss_head import op as loss_head
from memfuse.base.config import Config
from memfuse.patterns.loss_head.detect import BUDGET_MIN_CHUNK_ROWS, chunk_bytes

IGNORE = -100


def head_inputs(tokens, hidden, vocab, bias=False, dtype=torch.float64, ignored_every=5, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=generator, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hidden, generator=generator, dtype=dtype, requires_grad=True)
    b = torch.randn(vocab, generator=generator, dtype=dtype, requires_grad=True) if bias else None
    target = torch.randint(0, vocab, (tokens,), generator=generator)
    if ignored_every:
        target[::ignored_every] = IGNORE
    return x, weight, b, target


def as_fp32(*tensors):
    return [None if t is None else t.detach().float().requires_grad_() for t in tensors]


def op_loss(x, weight, b, target, reduction, smoothing, return_logits=False, chunk=4096, dtype=torch.float32,
            with_gradients=False, plan="rows"):
    if plan == "vocabulary" and with_gradients and not return_logits and x.shape[0]:   # it runs, not the rows plan
        assert loss_head.choose_plan(x.shape[0], x.shape[1], weight.shape[0], dtype, weight.dtype, x.dtype, chunk,
                                     plan).vocabulary is not None
    loss, log_sum_exp, logits, *_ = torch.ops.memfuse.linear_cross_entropy(
        x, weight, b, target, IGNORE, reduction, smoothing, dtype, return_logits, with_gradients, chunk, True, plan)
    return loss, log_sum_exp, logits


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# -- the op ----------------------------------------------------------------------------------------
# the gradients formed by the backward (recomputing each chunk), or by the forward: in chunks of token
# rows, or by the vocabulary-major plan
GRADIENTS = pytest.mark.parametrize("with_gradients, plan", [(False, "rows"), (True, "rows"), (True, "vocabulary")],
                                    ids=["backward_recomputes", "forward_forms", "vocabulary_major"])
ROWS_GRADIENTS = pytest.mark.parametrize("with_gradients", [False, True], ids=["backward_recomputes", "forward_forms"])


@pytest.mark.parametrize("reduction, with_gradients, plan", [
    ("mean", False, "rows"), ("mean", True, "rows"), ("mean", True, "vocabulary"), ("sum", False, "rows"),
    ("sum", True, "rows"), ("sum", True, "vocabulary"),
    ("none", False, "rows"),     # a per-row loss has per-row upstream gradients: only the recomputing backward
])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_op_matches_cross_entropy_of_the_linear(reduction, with_gradients, plan, smoothing, bias):
    """Odd vocabulary (37: the aligned weight has 3 rows of padding), 45 tokens in chunks of 8
    rows (the last chunk short), every fifth target ignored; fp32 against fp64. The gradients
    formed in the forward (mean, sum) or by recomputing each chunk in the backward."""
    x, weight, b, target = head_inputs(45, 16, 37, bias)
    assert loss_head.chunk_rows(45, 37, torch.float32, 2048) == 8
    x32, w32, b32 = as_fp32(x, weight, b)
    loss, log_sum_exp, logits = op_loss(x32, w32, b32, target, reduction, smoothing, chunk=2048,
                                        with_gradients=with_gradients, plan=plan)
    reference = F.cross_entropy(F.linear(x, weight, b), target, ignore_index=IGNORE, reduction=reduction,
                                label_smoothing=smoothing)
    assert logits.numel() == 0
    assert relative(loss, reference) < 1e-6
    assert relative(log_sum_exp, torch.logsumexp(F.linear(x, weight, b), -1)) < 1e-6
    upstream = torch.randn_like(reference)
    (loss * upstream.float()).sum().backward()
    (reference * upstream).sum().backward()
    for ours, theirs in zip((x32, w32, b32), (x, weight, b)):
        if theirs is not None:
            assert relative(ours.grad, theirs.grad) < 1e-5


@GRADIENTS
def test_masked_columns_and_rows_wider_than_a_block_match_eager(with_gradients, plan):
    """Rows longer than the kernels' block of columns (each lane of the running statistics sees
    two columns), with a bias of -inf over the whole first block and the last columns (masked
    words: every lane's first column is -inf): the loss, the log-sum-exps and every gradient as
    eager's, none NaN."""
    block = loss_head.BLOCK_COLUMNS
    vocab = block + 13
    x, weight, b, target = head_inputs(20, 8, vocab, bias=True)
    with torch.no_grad():
        b[:block] = float("-inf")
        b[-5:] = float("-inf")
        target.copy_(block + torch.arange(20) % 8)
        target[::5] = IGNORE
    x32, w32, b32 = as_fp32(x, weight, b)
    loss, log_sum_exp, _ = op_loss(x32, w32, b32, target, "mean", 0.0, chunk=4 * loss_head.row_bytes(vocab,
                                   torch.float32), with_gradients=with_gradients, plan=plan)
    reference = F.cross_entropy(F.linear(x, weight, b), target, ignore_index=IGNORE)
    assert relative(loss, reference) < 1e-6
    assert relative(log_sum_exp, torch.logsumexp(F.linear(x, weight, b), -1)) < 1e-6
    loss.backward()
    reference.backward()
    for ours, theirs in zip((x32, w32, b32), (x, weight, b)):
        assert not ours.grad.isnan().any()
        assert relative(ours.grad, theirs.grad) < 1e-5


@pytest.mark.parametrize("reduction, with_gradients, plan", [("mean", True, "rows"), ("mean", True, "vocabulary"),
                                                             ("sum", False, "rows"), ("none", False, "rows")])
def test_label_smoothing_over_rows_wider_than_a_block_matches_eager(reduction, with_gradients, plan):
    """Smoothing's sum of logits over whole blocks (loaded unmasked) and the masked last one."""
    vocab = loss_head.BLOCK_COLUMNS + 3
    x, weight, b, target = head_inputs(12, 8, vocab, bias=True)
    x32, w32, b32 = as_fp32(x, weight, b)
    loss, _, _ = op_loss(x32, w32, b32, target, reduction, 0.1, chunk=3 * loss_head.row_bytes(vocab, torch.float32),
                         with_gradients=with_gradients, plan=plan)
    reference = F.cross_entropy(F.linear(x, weight, b), target, ignore_index=IGNORE, reduction=reduction,
                                label_smoothing=0.1)
    assert relative(loss, reference) < 1e-6
    upstream = torch.randn_like(reference)
    (loss * upstream.float()).sum().backward()
    (reference * upstream).sum().backward()
    for ours, theirs in zip((x32, w32, b32), (x, weight, b)):
        assert relative(ours.grad, theirs.grad) < 1e-5


@GRADIENTS
@pytest.mark.parametrize("bias", [False, True])
def test_no_tokens_give_eager_losses_and_zero_gradients(with_gradients, plan, bias):
    """A batch of no tokens: no chunk runs; the sum is 0 and the gradients are zeros, as eager's."""
    x, weight, b, target = head_inputs(0, 16, 37, bias, ignored_every=0)
    x32, w32, b32 = as_fp32(x, weight, b)
    loss, _, _ = op_loss(x32, w32, b32, target, "sum", 0.0, chunk=2048, with_gradients=with_gradients, plan=plan)
    reference = F.cross_entropy(F.linear(x, weight, b), target, ignore_index=IGNORE, reduction="sum")
    assert loss.item() == reference.item() == 0.0
    loss.backward()
    reference.backward()
    for ours, theirs in zip((x32, w32, b32), (x, weight, b)):
        if theirs is not None:
            assert ours.grad.shape == theirs.grad.shape and not ours.grad.any() and not theirs.grad.any()


@ROWS_GRADIENTS      # returned logits: the rows plan
def test_returned_logits_and_their_gradient(with_gradients):
    """With return_logits the op also returns the [tokens, vocab] logits (rows aligned to 8, a
    view of the padded buffer) and adds the gradient they receive to each chunk's (recomputing)
    or through its own two matmuls (formed in the forward)."""
    x, weight, b, target = head_inputs(30, 8, 21, bias=True)
    x32, w32, b32 = as_fp32(x, weight, b)
    loss, _, logits = op_loss(x32, w32, b32, target, "mean", 0.0, return_logits=True, chunk=1024,
                              with_gradients=with_gradients)
    reference_logits = F.linear(x, weight, b)
    reference = F.cross_entropy(reference_logits, target, ignore_index=IGNORE)
    assert logits.shape == (30, 21) and logits.stride() == (24, 1)
    assert relative(logits, reference_logits) < 1e-6
    logits_upstream = torch.randn(30, 21, dtype=torch.float64)
    (loss + (logits * logits_upstream.float()).sum()).backward()
    (reference + (reference_logits * logits_upstream).sum()).backward()
    for ours, theirs in zip((x32, w32, b32), (x, weight, b)):
        assert relative(ours.grad, theirs.grad) < 1e-5


@GRADIENTS
def test_bf16_no_further_from_fp64_than_eager(with_gradients, plan):
    """bf16 operands: loss and gradients no further from fp64 than eager's bf16 linear + fp32 loss
    (the op accumulates the bf16 weight's gradient over chunks in bf16, as eager's one matmul
    rounds it once: a margin of 3x)."""
    x, weight, _, target = head_inputs(64, 32, 50)
    exact = F.cross_entropy(F.linear(x, weight), target, ignore_index=IGNORE)
    exact_grads = torch.autograd.grad(exact, (x, weight))
    xb, wb = (t.detach().bfloat16().requires_grad_() for t in (x, weight))
    eager = F.cross_entropy(F.linear(xb, wb).float(), target, ignore_index=IGNORE)
    eager_grads = torch.autograd.grad(eager, (xb, wb))
    ours, _, _ = op_loss(xb, wb, None, target, "mean", 0.0, chunk=1024, dtype=torch.bfloat16,
                         with_gradients=with_gradients, plan=plan)
    our_grads = torch.autograd.grad(ours, (xb, wb))
    assert abs(ours.double() - exact) <= 3 * abs(eager.double() - exact) + 1e-6
    for mine, theirs, truth in zip(our_grads, eager_grads, exact_grads):
        assert mine.dtype == torch.bfloat16
        assert relative(mine, truth) <= 3 * relative(theirs, truth) + 1e-6


def test_all_targets_ignored_gives_nan_as_eager():
    x, weight, _, target = head_inputs(8, 4, 10, ignored_every=1)
    loss, _, _ = op_loss(*as_fp32(x, weight), None, target, "mean", 0.0)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(F.linear(x, weight), target, ignore_index=IGNORE))


@pytest.mark.parametrize("bad", [40, -1, 12345])
@GRADIENTS
def test_a_target_outside_the_vocabulary_is_an_error(bad, with_gradients, plan):
    """As aten's nll_loss: a target not ignored outside [0, vocab) (vocab 40 here) is an error; the
    ignored -100 is not."""
    x, weight, _, target = head_inputs(16, 4, 40, ignored_every=0)
    target[5] = IGNORE
    op_loss(*as_fp32(x, weight), None, target, "mean", 0.0, with_gradients=with_gradients, plan=plan)
    target[3] = bad
    with pytest.raises(RuntimeError, match="outside"):
        op_loss(*as_fp32(x, weight), None, target, "mean", 0.0, with_gradients=with_gradients, plan=plan)


@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
def test_targets_are_counted_and_checked_over_many_blocks(target_dtype):
    """The count kernel (the mean's divisor, the check of the targets) over 2500 tokens: three
    blocks of its loop, the last one partial; a bad target in the last block is found."""
    target = torch.randint(0, 11, (2500,), generator=torch.Generator().manual_seed(0))
    target[::3] = IGNORE
    target = target.to(target_dtype)
    count = loss_head._counted_targets(target, IGNORE, 11)
    assert count.item() == float((target != IGNORE).sum())
    target[2499] = 11
    with pytest.raises(RuntimeError, match="outside"):
        loss_head._counted_targets(target, IGNORE, 11)


@pytest.mark.parametrize("shapes, message", [
    (((8, 4), (10, 5), (8,)), "hidden"),
    (((8, 4), (10, 4), (7,)), "target"),
])
def test_bad_shapes_name_the_argument(shapes, message):
    x, weight, target = torch.randn(*shapes[0]), torch.randn(*shapes[1]), torch.zeros(shapes[2], dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        op_loss(x, weight, None, target, "mean", 0.0)


def test_chunks_follow_the_byte_budget_and_the_memory_budget():
    assert loss_head.chunk_rows(16384, 32000, torch.bfloat16, 256 * 2**20) == 4096
    assert loss_head.chunk_rows(5, 32000, torch.bfloat16, 256 * 2**20) == 5
    assert loss_head.chunk_rows(16384, 32000, torch.bfloat16, 1) == 8
    llama = (32000, torch.bfloat16)
    row = loss_head.row_bytes(*llama)
    assert chunk_bytes(Config(), *llama) == 1024 * row           # the default: 1024 rows
    assert chunk_bytes(Config(memory_budget=0.8), *llama) == 1024 * row     # the budget's floor
    more_rows = Config(loss_head_chunk_rows=8192)                 # 8192 rows: over 256 MiB
    assert chunk_bytes(more_rows, *llama) == 256 * 2**20
    assert chunk_bytes(dataclasses.replace(more_rows, memory_budget=0.8), *llama) == int(0.8 * 256 * 2**20)
    assert chunk_bytes(dataclasses.replace(more_rows, memory_budget="12GB"), *llama) == 256 * 2**20   # bytes: no scaling
    wider = (300_000, torch.bfloat16)                            # 1024 rows: 614 MB, over 256 MiB
    assert loss_head.chunk_rows(8192, *wider, chunk_bytes(Config(), *wider)) == 256


def test_under_torch_distributed_the_default_chunk_is_the_bytes_alone(monkeypatch):
    """More than one rank: no rows cap unless set (steps there are host-paced, and each chunk costs
    the host), said in explain(); a set one still holds."""
    llama = (32000, torch.bfloat16)
    monkeypatch.setattr(memfuse.patterns.loss_head.detect, "_ranks", lambda: 2)
    assert chunk_bytes(Config(), *llama) == 256 * 2**20
    assert chunk_bytes(Config(loss_head_chunk_rows=1024), *llama) == 1024 * loss_head.row_bytes(*llama)
    x, weight, _, target = head_inputs(72, 16, 101, dtype=torch.float32)
    [head] = memfuse.explain(linear_head, x, weight, target).loss_heads
    assert head.chunked and "no rows cap by default under torch.distributed's 2 ranks" in str(head)
    monkeypatch.setattr(memfuse.patterns.loss_head.detect, "_ranks", lambda: 1)
    assert chunk_bytes(Config(), *llama) == 1024 * loss_head.row_bytes(*llama)


def test_a_chunk_of_so_many_token_rows_when_they_are_set():
    """loss_head_chunk_rows sets a chunk's rows at any vocabulary (Llama's 32000 and GPT-2's 50257
    words alike), fewer where they would take more than loss_head_chunk_bytes: the smaller wins;
    the memory budget does not shrink 1024 rows (its floor)."""
    for vocab in (32000, 50257):
        row = loss_head.row_bytes(vocab, torch.bfloat16)
        config = Config(loss_head_chunk_rows=1024)
        assert chunk_bytes(config, vocab, torch.bfloat16) == 1024 * row
        assert loss_head.chunk_rows(16384, vocab, torch.bfloat16, chunk_bytes(config, vocab, torch.bfloat16)) == 1024
        assert chunk_bytes(Config(loss_head_chunk_rows=1024, memory_budget=0.3), vocab, torch.bfloat16) == 1024 * row
        assert chunk_bytes(Config(loss_head_chunk_rows=512), vocab, torch.bfloat16) == 512 * row
    huge_vocab = 256 * 1024
    assert chunk_bytes(Config(loss_head_chunk_rows=1024), huge_vocab, torch.bfloat16) == 256 * 2**20   # 512 rows fit
    assert chunk_bytes(Config(loss_head_chunk_rows=1024, loss_head_chunk_bytes=2**20), 32000, torch.bfloat16) == 2**20


def test_chunks_of_many_rows_hold_whole_row_tiles():
    """A chunk that fits ROW_TILE rows or more holds a multiple of it; fewer, a multiple of ALIGN."""
    head_alone = (128256, torch.bfloat16, 256 * 2**20)
    assert loss_head.chunk_rows(8192, *head_alone) == 1024      # 1046 rows fit
    row = loss_head.row_bytes(128256, torch.bfloat16)
    assert loss_head.chunk_rows(8192, 128256, torch.bfloat16, 300 * row) == 256
    assert loss_head.chunk_rows(8192, 128256, torch.bfloat16, 203 * row) == 200
    assert loss_head.chunk_rows(100, *head_alone) == 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bias_gradient_is_one_launch_a_chunk_that_writes_then_adds_column_sums(dtype):
    """A chunk's logits gradient [37 rows, 597 words, row stride 600] summed over its rows in fp32:
    written over the bias's gradient by the first chunk (its old values, even NaN, unread), added
    by the next; columns past the vocabulary untouched."""
    gradient = torch.randn(37, 600).to(dtype)
    total = torch.full((600,), float("nan"))
    programs = -(-597 // loss_head.COLUMN_SUMS_BLOCK)
    loss_head.ADD_COLUMN_SUMS[True](programs, gradient, gradient.stride(0), 37, 597, total)
    expected = gradient[:, :597].float().sum(0)
    torch.testing.assert_close(total[:597], expected)
    assert total[597:].isnan().all()
    loss_head.ADD_COLUMN_SUMS[False](programs, gradient, gradient.stride(0), 37, 597, total)
    torch.testing.assert_close(total[:597], 2 * expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_first_chunk_overwrites_the_weight_gradient_without_reading_it(dtype):
    """The weight's gradient starts as empty memory: the first chunk's product must not add to it
    (a NaN there would spread), the next ones must."""
    left, right = torch.randn(6, 5, dtype=dtype), torch.randn(5, 3, dtype=dtype)
    total = torch.full((6, 3), float("nan"), dtype=dtype)
    loss_head._accumulate(total, left, right, overwrite=True)
    torch.testing.assert_close(total, left @ right)
    loss_head._accumulate(total, left, right)
    torch.testing.assert_close(total, 2 * (left @ right))


def train_head_in_chunks_of_8_rows(dtype: torch.dtype, with_gradients: bool) -> None:
    """The op and its backward on fp32 [40, 16] hidden states, vocabulary 101, the head in `dtype`."""
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(101, 16, requires_grad=True)
    target = torch.randint(0, 101, (40,))
    chunk = loss_head.row_bytes(101, dtype) * 8
    loss, *_ = torch.ops.memfuse.linear_cross_entropy(hidden, weight, None, target, -100, "mean", 0.0,
                                                      dtype, False, with_gradients, chunk, True, "rows")
    loss.backward()


@pytest.mark.parametrize("with_gradients", [True, False])
def test_every_chunk_writes_its_logits_into_one_buffer(monkeypatch, with_gradients):
    """In the forward, and in the backward that forms the logits again, every chunk's matmul writes
    into one buffer of one chunk's rows, made before the loop: a chunk's bytes are the head's
    transient, once, and no chunk allocates."""
    storages = []
    make = loss_head._chunk_logits

    def recording(hidden, weight_t, bias, out=None):
        assert out is not None, "a chunk's logits went into a tensor of their own"
        storages.append((out.untyped_storage().data_ptr(), out.untyped_storage().nbytes()))
        return make(hidden, weight_t, bias, out=out)

    monkeypatch.setattr(loss_head, "_chunk_logits", recording)
    train_head_in_chunks_of_8_rows(torch.float32, with_gradients)
    assert len(storages) == (5 if with_gradients else 10)     # 40 rows in chunks of 8, again in the backward
    for loop in (storages[:5], storages[5:]) if not with_gradients else (storages,):
        assert set(loop) == {(loop[0][0], 8 * loss_head.row_bytes(101, torch.float32))}


@pytest.mark.parametrize("with_gradients", [True, False])
def test_the_hidden_states_are_cast_a_chunk_at_a_time(monkeypatch, with_gradients):
    """fp32 hidden states under a bf16 head (autocast's): each chunk's matmuls read that chunk's rows
    cast, in memory of their own, never a view of a [tokens, H] cast copy held through the loop."""
    storage_bytes = []
    make = loss_head._chunk_logits

    def recording(chunk_hidden, *args, **kwargs):
        assert chunk_hidden.dtype == torch.bfloat16
        storage_bytes.append(chunk_hidden.untyped_storage().nbytes())
        return make(chunk_hidden, *args, **kwargs)

    monkeypatch.setattr(loss_head, "_chunk_logits", recording)
    train_head_in_chunks_of_8_rows(torch.bfloat16, with_gradients)
    assert len(storage_bytes) == (5 if with_gradients else 10)
    assert max(storage_bytes) == 8 * 16 * 2            # one chunk's rows in bf16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp32_hidden_states_gradient_is_formed_in_the_heads_dtype_and_returned_in_theirs(dtype):
    """fp32 hidden states under a bf16/fp16 head (autocast's), gradients formed in the forward: the
    saved hidden gradient is the matmul's product in the head's dtype (half the bytes held from the
    forward to the backward), as eager's product is; the backward returns it in fp32, scaled by the
    loss's gradient, no further from fp64's than eager's (autocast's bf16 product cast to fp32)."""
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, requires_grad=True)
    weight = torch.randn(101, 16, requires_grad=True)
    target = torch.randint(0, 101, (40,))
    chunk = loss_head.row_bytes(101, dtype) * 8
    loss, _, _, hidden_unit, weight_unit, _ = torch.ops.memfuse.linear_cross_entropy(
        hidden, weight, None, target, -100, "mean", 0.0, dtype, False, True, chunk)
    assert hidden_unit.dtype == dtype and weight_unit.dtype == torch.float32
    (loss * 3.0).backward()
    logits = F.linear(hidden.detach().to(dtype), weight.detach().to(dtype)).float().requires_grad_()
    (F.cross_entropy(logits, target) * 3.0).backward()
    eager = (logits.grad.to(dtype) @ weight.detach().to(dtype)).float()
    hidden64 = hidden.detach().double().requires_grad_()
    (F.cross_entropy(F.linear(hidden64, weight.detach().double()), target) * 3.0).backward()
    assert hidden.grad.dtype == torch.float32
    # a margin of 3x, as test_bf16_no_further_from_fp64_than_eager's (Triton's interpreter rounds the
    # logits' gradient toward zero, the GPU to nearest)
    assert relative(hidden.grad, hidden64.grad) <= 3 * relative(eager, hidden64.grad) + 1e-6
    assert relative(hidden.grad, 3.0 * hidden_unit.float()) < 1e-6


def check_cast_with_padding_rows(dtype, device, exact: bool):
    """`exact`: bit for bit; else within one ulp of dtype (Triton's interpreter rounds fp32 -> bf16
    toward zero, the GPU to nearest as torch)."""
    def same(cast, expected):
        if exact:
            return torch.equal(cast, expected)
        ulp = expected.float().abs() * torch.finfo(dtype).eps
        return cast.shape == expected.shape and bool(((cast.float() - expected.float()).abs() <= ulp).all())

    torch.manual_seed(0)
    source = torch.randn(7, 45, device=device) * 3
    cast = loss_head._cast(source, dtype, rows=10)
    assert same(cast, F.pad(source.to(dtype), (0, 0, 0, 3)))
    assert torch.equal(cast[7:], torch.zeros(3, 45, dtype=dtype, device=device))
    strided = torch.randn(45, 7, device=device).t()
    assert same(loss_head._cast(strided, dtype), strided.to(dtype))
    same_dtype = source.to(dtype)
    assert loss_head._cast(same_dtype, dtype) is same_dtype
    bias = torch.randn(7, device=device)
    _, aligned_bias = loss_head._aligned_weight(source, bias, dtype)
    assert same(aligned_bias, F.pad(bias.to(dtype), (0, 1)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_cast_with_padding_rows_matches_to_and_pad(dtype):
    """The weight's cast and its padding to aligned rows (one launch) give what Tensor.to and F.pad
    give, from a strided source too, bit for bit in fp16 (bf16: one ulp here, see the GPU test); a
    source already in the dtype and size is itself."""
    check_cast_with_padding_rows(dtype, "cpu", exact=dtype == torch.float16)


def test_a_budget_shrinks_the_chunks_down_to_a_floor_of_rows():
    """Chunks of fewer rows make each weight-gradient addmm memory-bound: the budget stops there,
    and never raises a chunk past the configured bytes."""
    gpt2 = (50257, torch.bfloat16)
    floor = BUDGET_MIN_CHUNK_ROWS * loss_head.row_bytes(*gpt2)
    assert chunk_bytes(Config(loss_head_chunk_rows=2560, memory_budget=0.5), *gpt2) == 1280 * loss_head.row_bytes(*gpt2)
    assert chunk_bytes(Config(memory_budget=0.2), *gpt2) == floor
    assert loss_head.chunk_rows(16384, 50257, torch.bfloat16, floor) == BUDGET_MIN_CHUNK_ROWS
    assert chunk_bytes(Config(memory_budget=0.2, loss_head_chunk_bytes=2**20), *gpt2) == 2**20


# -- found in functions (memory_efficient_fusion) ------------------------------------------------
def linear_head(x, weight, target):
    return F.cross_entropy(F.linear(x, weight).float().view(-1, weight.shape[0]), target, label_smoothing=0.1)


def matmul_head(x, weight, target):
    """The issue's head as users write it: a matmul with the transposed weight."""
    return F.cross_entropy((x @ weight.T).float(), target)


def untransposed_head(x, weight, target):
    """Not the pattern: the weight is [hidden, vocab], no transpose says which dim is the vocabulary."""
    return F.cross_entropy(x @ weight, target)


def returning_head(x, weight, target):
    logits = F.linear(x, weight)
    return F.cross_entropy(logits, target), logits


def weighted_head(x, weight, target):
    return F.cross_entropy(F.linear(x, weight), target, weight=torch.ones(weight.shape[0]))


def test_returned_logits_that_receive_no_gradient_add_nothing():
    """A model's returned logits nobody reads get a zero gradient (autograd's): the formed
    gradients stand as they are, the same as without returned logits."""
    x, weight, _, target = head_inputs(30, 8, 21)
    plain, returning = (as_fp32(x, weight) for _ in range(2))
    loss, _, _ = op_loss(*plain, None, target, "mean", 0.0, with_gradients=True)
    loss_too, _, logits = op_loss(*returning, None, target, "mean", 0.0, return_logits=True, with_gradients=True)
    torch.autograd.backward((loss_too, logits), (torch.ones(()), torch.zeros_like(logits)))
    loss.backward()
    for a, b in zip(plain, returning):
        assert torch.equal(a.grad, b.grad)


def test_a_function_head_is_chunked_and_keeps_no_logits():
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    fused = memfuse.memory_efficient_fusion(linear_head)
    loss = fused(x, weight, target)
    grads = torch.autograd.grad(loss, (x, weight))
    reference = linear_head(x, weight, target)
    assert relative(loss, reference) < 1e-6
    for ours, theirs in zip(grads, torch.autograd.grad(reference, (x, weight))):
        assert relative(ours, theirs) < 1e-5
    assert memfuse.stats()["loss_heads_chunked"] == 1
    report = memfuse.explain(linear_head, x, weight, target)
    assert [(d.chunked, d.gradients_in_forward) for d in report.loss_heads] == [(True, True)]
    assert "chunked linear + cross-entropy over vocab 37" in str(report)
    formed_in_forward = (40 * 16 + 37 * 16) * 4   # the gradients of x and weight, for the backward to scale
    assert report.saved_bytes <= 40 * 4 + formed_in_forward, "log-sum-exps and gradients, no [tokens, vocab]"
    graph_targets = {str(n.target) for n in report.entry.captured.aten_graph.graph.nodes}
    assert "aten.mm.default" not in graph_targets, "the replaced linear is not computed"


class Head(torch.nn.Module):
    """A module's head on [batch, sequence, hidden]: the weight a parameter (static)."""

    def __init__(self, hidden, vocab):
        super().__init__()
        self.vocab = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, target):
        logits = self.vocab(x).float().view(-1, self.vocab.out_features)
        return F.cross_entropy(logits, target.view(-1))


def test_one_compile_for_every_batch_size():
    """memfuse's key holds each input's last dim (the sequence length of [batch, sequence]
    targets); the leading ones, here the batch, take every size in one compile."""
    head = Head(16, 37)
    fused = memfuse.memory_efficient_fusion(head)
    for batch in (5, 7, 3):
        x, _, _, target = head_inputs(batch * 8, 16, 37, dtype=torch.float32, seed=batch)
        x, target = x.view(batch, 8, 16), target.view(batch, 8)
        loss = fused(x, target)
        assert relative(loss, head(x, target)) < 1e-6
    assert memfuse.stats()["compiles"] == 1 and memfuse.stats()["loss_heads_chunked"] == 1


def returning_flattened_head(x, weight, target):
    logits = F.linear(x, weight).reshape(-1, weight.shape[0])
    return F.cross_entropy(logits, target), logits


@pytest.mark.parametrize("fn, reason", [
    (returning_flattened_head, "its logits leave cast, reshaped or read past the loss"),
    (weighted_head, "a class weight is given"),
])
def test_a_head_not_taken_says_why_and_matches_eager(fn, reason, caplog):
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="memfuse.fallbacks"):
        out = memfuse.memory_efficient_fusion(fn)(x, weight, target)
    expected = fn(x, weight, target)
    loss, reference = (out[0], expected[0]) if isinstance(out, tuple) else (out, expected)
    assert relative(loss, reference) < 1e-6
    assert memfuse.stats()["loss_heads_chunked"] == 0
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("compile_with", ["memory_efficient_fusion", "backend"])
def test_x_at_w_transposed_is_the_pattern_and_x_at_w_is_not(compile_with):
    torch._dynamo.reset()
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32, ignored_every=0)
    wrap = memfuse.memory_efficient_fusion if compile_with == "memory_efficient_fusion" else \
        (lambda fn: torch.compile(fn, backend="memfuse"))
    loss = wrap(matmul_head)(x, weight, target)
    grads = torch.autograd.grad(loss, (x, weight))
    expected = matmul_head(x, weight, target)
    assert relative(loss, expected) < 1e-6
    for ours, theirs in zip(grads, torch.autograd.grad(expected, (x, weight))):
        assert relative(ours, theirs) < 1e-5
    assert memfuse.stats()["loss_heads_chunked"] == 1
    upright = weight.detach().t().contiguous().requires_grad_()
    loss = wrap(untransposed_head)(x, upright, target)
    assert relative(loss, untransposed_head(x, upright, target)) < 1e-6
    assert memfuse.stats()["loss_heads_chunked"] == 1


def test_chunking_can_be_turned_off():
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    fused = memfuse.memory_efficient_fusion(linear_head, config=Config(chunk_loss_head=False))
    assert relative(fused(x, weight, target), linear_head(x, weight, target)) < 1e-6
    assert memfuse.stats()["loss_heads_chunked"] == 0


# -- found in torch.compile graphs, HuggingFace models included ------------------------------------
def test_backend_chunks_a_head_whose_logits_are_returned():
    """The backend rewrites Dynamo's graph: returned logits come out of the op, and their gradient
    goes into its backward."""
    torch._dynamo.reset()
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    compiled = torch.compile(returning_head, backend="memfuse")
    loss, logits = compiled(x, weight, target)
    reference_loss, reference_logits = returning_head(x, weight, target)
    upstream = torch.randn_like(logits)
    grads = torch.autograd.grad(loss + (logits * upstream).sum(), (x, weight))
    expected = torch.autograd.grad(reference_loss + (reference_logits * upstream).sum(), (x, weight))
    assert relative(loss, reference_loss) < 1e-6 and relative(logits, reference_logits) < 1e-6
    for ours, theirs in zip(grads, expected):
        assert relative(ours, theirs) < 1e-5
    assert memfuse.stats()["loss_heads_chunked"] == 1
    [graph] = memfuse.explain(compiled, x, weight, target).graphs
    [head] = graph.loss_heads
    assert head.chunked and head.returns_logits and head.gradients_in_forward


def whole_slice_head(x, weight, target):
    """HuggingFace's head: `lm_head(hidden_states[:, slice(-logits_to_keep, None), :])`, keeping all."""
    logits = F.linear(x[:, 0:, :], weight)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target), logits


def part_slice_head(x, weight, target):
    logits = F.linear(x[:, 1:, :], weight)
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target), logits


@pytest.mark.parametrize("fn, hidden_place", [(whole_slice_head, ("input", 0)), (part_slice_head, ("output", 2))],
                         ids=["whole_view", "part"])
def test_returned_logits_take_their_operands_from_the_inputs_where_they_are_inputs(fn, hidden_place, monkeypatch):
    """The returned logits' gradient path needs the linear's operands. Where the hidden states are
    an input, or a whole view of one (HuggingFace slices them by `slice(0, None)`), the input
    itself goes to ReturnedLogits: returned as an output, memfuse's program would write a copy
    and keep it to the backward. A part of an input is the graph's output, as before."""
    torch._dynamo.reset()
    flat, weight, _, _ = head_inputs(40, 16, 37, dtype=torch.float32)
    x = flat.detach().view(2, 20, 16).requires_grad_()
    rows = 40 if fn is whole_slice_head else 38
    target = torch.randint(0, 37, (rows,))
    attached = []
    attach = loss_head.attach_returned_logits
    monkeypatch.setattr(loss_head, "attach_returned_logits",
                        lambda outputs, inputs, returns, count: attached.append((returns, len(outputs), count))
                        or attach(outputs, inputs, returns, count))
    loss, logits = torch.compile(fn, backend="memfuse")(x, weight, target)
    [([returned], outputs, count)] = attached
    assert (returned.hidden, returned.weight, returned.bias) == (hidden_place, ("input", 1), None)
    assert outputs == count + (hidden_place[0] == "output")         # no operand returned but a part
    reference_loss, reference_logits = fn(x, weight, target)
    assert relative(loss, reference_loss) < 1e-6 and relative(logits, reference_logits) < 1e-6
    upstream = torch.randn_like(logits)
    ours = torch.autograd.grad(loss + (logits * upstream).sum(), (x, weight))
    theirs = torch.autograd.grad(reference_loss + (reference_logits * upstream).sum(), (x, weight))
    for a, b in zip(ours, theirs):
        assert relative(a, b) < 1e-5


@pytest.mark.parametrize("fn", [returning_head, whole_slice_head], ids=["returned_logits", "sliced"])
def test_programs_call_the_head_implementation_past_the_dispatcher(fn):
    """memfuse's programs run without autograd: they bind the loss head's implementations
    (externs.SUBSTITUTES), not the custom ops, whose dispatch only costs the host time; the
    forward and the backward still give eager's results."""
    from memfuse.fronts.backend import watch
    torch._dynamo.reset()
    flat, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    x = flat.detach().view(2, 20, 16).requires_grad_() if fn is whole_slice_head else flat
    with watch() as graphs:
        loss, logits = torch.compile(fn, backend="memfuse")(x, weight, target)
        grads = torch.autograd.grad(loss, (x, weight))
    [graph] = graphs
    forward = set(map(id, graph.function.forward.run.__globals__.values()))
    backward = set(map(id, graph.function.backward.run.__globals__.values()))
    assert id(loss_head.linear_cross_entropy_impl) in forward
    assert id(torch.ops.memfuse.linear_cross_entropy.default) not in forward
    assert id(loss_head.linear_cross_entropy_backward_all_in_place_impl) in backward
    assert id(torch.ops.memfuse.linear_cross_entropy_backward_all_.default) not in backward
    reference_loss, _ = fn(x, weight, target)
    assert relative(loss, reference_loss) < 1e-6
    for ours, theirs in zip(grads, torch.autograd.grad(reference_loss, (x, weight))):
        assert relative(ours, theirs) < 1e-5


class ShapesMade(torch.utils._python_dispatch.TorchDispatchMode):
    """The shapes of every tensor the ops inside the block return (the backward's included)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.shapes += [tuple(t.shape) for t in torch.utils._pytree.tree_leaves(result)
                        if isinstance(t, torch.Tensor)]
        return result


def biased_returning_head(x, weight, bias, target):
    logits = F.linear(x, weight, bias)
    return F.cross_entropy(logits, target), logits


@pytest.mark.parametrize("compile_with", ["memory_efficient_fusion", "backend"])
def test_returned_logits_nobody_reads_cost_the_backward_nothing(compile_with):
    """Logits the function returns come out of the compiled graph without gradient (the backend
    rewrites Dynamo's graph; memory_efficient_fusion traces again with the head writing them):
    the loss's backward makes no [tokens, vocab] tensor (autograd would hand the compiled graph a
    zero gradient of that size), and the logits keep their own gradient path (bias included)
    for a caller that reads them."""
    torch._dynamo.reset()
    x, weight, bias, target = head_inputs(40, 16, 37, bias=True, dtype=torch.float32)
    wrap = memfuse.memory_efficient_fusion if compile_with == "memory_efficient_fusion" else \
        functools.partial(torch.compile, backend="memfuse")
    compiled = wrap(biased_returning_head)
    loss, logits = compiled(x, weight, bias, target)
    reference_loss, reference_logits = biased_returning_head(x, weight, bias, target)
    assert relative(loss, reference_loss) < 1e-6 and relative(logits, reference_logits) < 1e-6
    assert type(logits.grad_fn).__name__ == "ReturnedLogitsBackward"
    with ShapesMade() as made:
        loss.backward()
    assert made.shapes and (40, 37) not in made.shapes
    for tensor, theirs in zip((x, weight, bias), torch.autograd.grad(reference_loss, (x, weight, bias))):
        assert relative(tensor.grad, theirs) < 1e-5
    upstream = torch.randn_like(logits)
    loss, logits = compiled(x, weight, bias, target)
    ours = torch.autograd.grad(loss + (logits * upstream).sum(), (x, weight, bias))
    reference_loss, reference_logits = biased_returning_head(x, weight, bias, target)
    theirs = torch.autograd.grad(reference_loss + (reference_logits * upstream).sum(), (x, weight, bias))
    for a, b in zip(ours, theirs):
        assert relative(a, b) < 1e-5
    report = memfuse.explain(compiled, x, weight, bias, target)
    [head] = report.loss_heads if compile_with == "memory_efficient_fusion" else report.graphs[0].loss_heads
    assert head.chunked and head.returns_logits


def z_loss_head(x, weight, target):
    """Logits read in the graph (a z-loss) and returned: their gradient goes into the op's backward."""
    logits = F.linear(x, weight)
    return F.cross_entropy(logits, target) + 1e-2 * logits.logsumexp(-1).pow(2).mean(), logits


def test_backend_logits_read_in_the_graph_take_their_gradient_into_the_op():
    torch._dynamo.reset()
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    loss, logits = torch.compile(z_loss_head, backend="memfuse")(x, weight, target)
    reference_loss, reference_logits = z_loss_head(x, weight, target)
    assert relative(loss, reference_loss) < 1e-6 and relative(logits, reference_logits) < 1e-6
    ours, theirs = (torch.autograd.grad(value, (x, weight)) for value in (loss, reference_loss))
    for a, b in zip(ours, theirs):
        assert relative(a, b) < 1e-5
    assert memfuse.stats()["loss_heads_chunked"] == 1


@pytest.mark.parametrize("family", ["gpt2", "bert", "llama"])
def test_huggingface_heads_are_found_and_match_eager(family):
    """The three heads of `make bench-models`, tiny, under torch.compile(backend="memfuse"): the
    loss and every gradient as eager's (the head's pattern found once per model)."""
    pytest.importorskip("transformers")
    sys.argv.append("--tiny")           # benchmarks.models: tiny configs, the interpreter
    try:
        from benchmarks.lib.hf_models import FAMILIES, build
    finally:
        sys.argv.remove("--tiny")
    torch._dynamo.reset()
    spec = FAMILIES[family]
    model = build(spec, spec.tiny, 0.0)
    reference = build(spec, spec.tiny, 0.0, model.state_dict())
    ids = torch.randint(0, spec.tiny.vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    loss = torch.compile(model, backend="memfuse")(input_ids=ids, labels=ids).loss
    expected = reference(input_ids=ids, labels=ids).loss
    loss.backward()
    expected.backward()
    assert memfuse.stats()["loss_heads_chunked"] == 1
    assert relative(loss, expected) < 1e-6
    largest = max(p.grad.norm() for p in reference.parameters() if p.grad is not None)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        if theirs.grad is not None:
            error = (ours.grad - theirs.grad).norm() / max(theirs.grad.norm(), 1e-3 * largest)
            assert error < 1e-4, name


def test_backend_head_takes_every_batch_size_after_dynamo_goes_dynamic():
    """Dynamo compiles the first size as it is and the second with symbolic sizes; the chunked op
    (its fake implementation) takes those, so later sizes compile nothing more."""
    torch._dynamo.reset()
    head = Head(16, 37)
    compiled = torch.compile(head, backend="memfuse")
    for batch in (5, 7, 3, 9):
        x, _, _, target = head_inputs(batch * 8, 16, 37, dtype=torch.float32, seed=batch)
        x, target = x.view(batch, 8, 16), target.view(batch, 8)
        loss = compiled(x, target)
        expected = head(x, target)
        assert relative(loss, expected) < 1e-6
        assert relative(torch.autograd.grad(loss, x)[0], torch.autograd.grad(expected, x)[0]) < 1e-5
    assert memfuse.stats()["compiles"] == 2 and memfuse.stats()["loss_heads_chunked"] == 2


def _wrapped(compile_with: str, fn):
    if compile_with == "memory_efficient_fusion":
        return memfuse.memory_efficient_fusion(fn)
    torch._dynamo.reset()      # AOTAutograd's backward compiled here, not one an earlier test ran
    return torch.compile(fn, backend="memfuse", dynamic=False)


@pytest.mark.parametrize("loss_gradient", [3.0, 1.0])
@pytest.mark.parametrize("compile_with", ["memory_efficient_fusion", "backend"])
def test_the_backward_scales_the_gradients_its_forward_formed_in_place(compile_with, loss_gradient):
    """The formed gradients are saved values only the head's backward reads (memfuse.schedule.reinplace): the
    weight's gradient it returns is that tensor, scaled where it lies, no second [vocab, H] one."""
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = _wrapped(compile_with, linear_head)(x, weight, target)
    grads = torch.autograd.grad(loss, (x, weight), torch.tensor(loss_gradient))
    formed = {t.data_ptr() for t in saved if t.shape == weight.shape}
    assert grads[1].data_ptr() in formed, "the weight's gradient is the one the forward formed"
    expected = torch.autograd.grad(linear_head(x, weight, target), (x, weight), torch.tensor(loss_gradient))
    for ours, theirs in zip(grads, expected):
        assert relative(ours, theirs) < 1e-5


@pytest.mark.parametrize("in_place", [True, False])
def test_a_scale_of_one_in_place_reads_and_writes_nothing(in_place):
    """The in-place scale skips a loss gradient of 1 (x * 1 is x): given another output the in-place
    kernel leaves it as it was, where the out-of-place one writes the source into it; any other
    scale is written either way."""
    source = torch.randn(5000)
    for scale, written in ((1.0, not in_place), (0.5, True)):
        out = torch.zeros(5000)
        loss_head.SCALE[in_place](2, source, out, source.numel(), torch.tensor(scale))    # 3 blocks, 2 programs
        assert torch.equal(out, source * scale if written else torch.zeros(5000)), (scale, in_place)


def test_the_scale_takes_a_tensor_of_more_blocks_than_programs(monkeypatch):
    """_times launches at most SCALE_PROGRAMS programs, each looping over its blocks."""
    monkeypatch.setattr(loss_head, "SCALE_PROGRAMS", 3)
    unit = torch.randn(7 * loss_head.SCALE_BLOCK + 5)
    scaled = loss_head._times(unit, torch.tensor(1.5), in_place=False)
    assert torch.equal(scaled, unit * 1.5)


@pytest.mark.parametrize("compile_with", ["memory_efficient_fusion", "backend"])
def test_a_retained_graph_keeps_the_formed_gradients_for_its_next_backward(compile_with):
    """With retain_graph the saved gradients serve the next backward: the first gets scaled copies,
    so a loss gradient of 3 scales them once in each backward, never 9 times in the second."""
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    loss = _wrapped(compile_with, linear_head)(x, weight, target)
    first = torch.autograd.grad(loss, (x, weight), torch.tensor(3.0), retain_graph=True)
    second = torch.autograd.grad(loss, (x, weight), torch.tensor(3.0))
    expected = torch.autograd.grad(linear_head(x, weight, target), (x, weight), torch.tensor(3.0))
    for a, b, theirs in zip(first, second, expected):
        assert torch.equal(a, b) and relative(a, theirs) < 1e-5


@pytest.mark.parametrize("in_place", [True, False])
def test_the_backward_plan_counts_the_gradients_it_allocates_at_the_call(in_place, monkeypatch):
    """memfuse.buffers counts an aten call's new tuple elements at the call's step, while its inputs
    are held: out of place the head's backward holds two weight gradients there (the formed one and
    its scaled copy) and two of the hidden states, in place one of each (fp32 hidden states: the
    forward formed their gradient in their dtype)."""
    from memfuse.buffers import memory_timeline
    from memfuse.ir.patterns import RULES
    if not in_place:      # the backward's rule without its in-place twin (memfuse.patterns.loss_head.rules)
        backward_op = torch.ops.memfuse.linear_cross_entropy_backward.default
        monkeypatch.setitem(RULES, backward_op, dataclasses.replace(RULES[backward_op], in_place=None))
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    fused = memfuse.memory_efficient_fusion(linear_head)
    torch.autograd.grad(fused(x, weight, target), (x, weight))
    entry = fused.compiled_for(x, weight, target)
    backward = entry.function.backward
    [call] = [s.name for s in backward.buffers.steps if s.name.startswith("linear_cross_entropy_backward")]
    points = {p.step: p for p in memory_timeline(backward.buffers, entry.captured.hints)}
    entry_bytes = points["entry"].during
    x_bytes, weight_bytes = 40 * 16 * 4, 37 * 16 * 4
    assert points[call].during == entry_bytes + (0 if in_place else x_bytes + weight_bytes)


def test_the_hidden_states_gradient_is_scaled_in_place_and_returned_without_a_copy():
    """fp32 hidden states, the head in fp32: the forward formed their gradient in their dtype, the
    backward scales it where it lies (memfuse.schedule.reinplace's all-in-place form) and returns a reshape
    of it: the backward program runs the op and no kernel (no copy of [tokens, H]); its result
    still matches eager's at a loss gradient of 3."""
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    fused = memfuse.memory_efficient_fusion(linear_head)
    grads = torch.autograd.grad(fused(x, weight, target) * 3.0, (x, weight))
    backward = fused.compiled_for(x, weight, target).function.backward
    [record] = [r for r in backward.schedule.in_place if "linear_cross_entropy_backward" in r.name]
    assert "the hidden states' in their dtype" in record.reason
    assert not [s for s in backward.steps if getattr(s, "kernel", None) is not None]
    for ours, theirs in zip(grads, torch.autograd.grad(linear_head(x, weight, target) * 3.0, (x, weight))):
        assert relative(ours, theirs) < 1e-5


def test_cuda_graph_programs_keep_the_formed_gradients():
    """Under CUDA graphs (Config.seed_from_memory) the backward is replayed over the same saved
    buffers, and a retained graph's next replay reads them again: no in-place scaling there."""
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    for replayed, expected in ((False, 1), (True, 0)):
        fused = memfuse.memory_efficient_fusion(linear_head, config=Config(seed_from_memory=replayed))
        torch.autograd.grad(fused(x, weight, target), (x, weight))
        backward = fused.compiled_for(x, weight, target).function.backward
        assert sum("linear_cross_entropy_backward" in s.name for s in backward.schedule.in_place) == expected


@pytest.mark.parametrize("fn, returns_logits", [(linear_head, False), (returning_head, True)])
def test_one_trace_whether_or_not_the_logits_are_returned(fn, returns_logits, monkeypatch):
    """memory_efficient_fusion traces each head writing its logits; a head whose logits nothing reads
    (the function returned only the loss) then writes none: one trace of the function either way."""
    from memfuse.capture import trace as capture
    from memfuse.patterns.loss_head.call import LossHeadCall
    exports = []
    real_export = capture._export
    monkeypatch.setattr(capture, "_export", lambda *args: exports.append(1) or real_export(*args))
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    fused = memfuse.memory_efficient_fusion(fn)
    out = fused(x, weight, target)
    assert len(exports) == 1
    joint = fused.compiled_for(x, weight, target).captured.joint
    [call] = [n for n in joint.nodes.values() if n.op.value == "extern"
              and n.attr.target is torch.ops.memfuse.linear_cross_entropy.default]
    assert LossHeadCall.of(call.attr.args, call.attr.kwargs).return_logits is returns_logits
    expected = fn(x, weight, target)
    for ours, theirs in zip(out if returns_logits else (out,), expected if returns_logits else (expected,)):
        assert relative(ours, theirs) < 1e-6
