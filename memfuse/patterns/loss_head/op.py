"""The loss head, chunked: cross-entropy of a linear layer's output without its [tokens, vocab] logits.

`logits = hidden @ weight.T (+ bias)`, then `cross_entropy(logits.float(), target)`: in LLM training
the logits are the largest activation (Llama of `make bench-models`: [16384, 32000], 1 GB in bf16,
2 GB in fp32, and as much again for their gradient). `torch.ops.memfuse.linear_cross_entropy`
computes the same loss a chunk of tokens at a time:

- forward, per chunk: the chunk's rows cast to the linear's dtype (never the whole [tokens, H]: Llama's
  fp32 hidden states under autocast would hold 34 MB more), the chunk's logits (one matmul), then one kernel
  that reads each row once and writes its log-sum-exp and its loss (`_row_statistics`); before the
  chunks, one kernel counts the targets not ignored (a mean's divisor) and checks them
  (`_count_targets`). Only the [tokens] log-sum-exps are kept for the backward.
- backward, per chunk: the chunk's logits again, one kernel that writes their gradient
  `(softmax - one_hot) * scale` (`_logits_gradient`), and the two matmuls that take it into
  the hidden states' and the weight's gradients; the weight's gradient adds up over chunks.
- a mean or sum loss (`with_gradients`): the forward forms the gradients instead, for an upstream
  gradient of 1, while each chunk's logits are at hand (the hidden states' in the matmul's dtype,
  as eager's product); the backward scales them by the loss's gradient (in place in memfuse's
  programs: `linear_cross_entropy_backward_`, memfuse.schedule.reinplace).
- or, by the vocabulary-major plan (`choose_plan` picks per call): the logits transposed, kept in
  the weight gradient's own storage as far as it holds them and formed again for the rest, so that
  no chunk adds into the whole [vocab, H] weight gradient (the section of that name below).

The logits may go through the model's transform before the loss (Gemma's soft cap, a scale:
`LogitTransform`): the kernels apply it where they read them and multiply their gradient by its
derivative; returned logits are written transformed.

A chunk's rows follow a byte budget (`chunk_rows`), so the head's transient is the same at any
token count: one [rows, vocab] buffer, the gradient written over the logits. Where the logits are
also read elsewhere, the op writes them whole in the forward and adds their incoming gradient to
its gradients; they are still not kept for the backward.
Logits that only leave the graph (a model that returns them) go out detached and get their
gradient path back outside it (`ReturnedLogits`), so that autograd does not hand the backward a
[tokens, vocab] zero gradient at every step. memfuse.patterns.loss_head.detect finds the pattern in traced graphs and
puts this op there.
"""
from __future__ import annotations

import contextlib
import functools
import dataclasses
from typing import Optional, Sequence

import torch
import triton

from memfuse.base.debug import STATS
from memfuse.patterns.loss_head.kernels import (  # noqa: F401  (with plans' and transform's: the op's names, as its callers read them)
    ADD_COLUMN_SUMS, CAST_ROWS, COLUMN_SUMS_BLOCK, COUNT_TARGETS, FINISH_LOSS, FINISH_STATISTICS, GRADIENT_BLOCK_V,
    LOGITS_GRADIENT, MERGE_BLOCK, MERGE_STATISTICS, ROW_STATISTICS, ROW_STATISTICS_AND_GRADIENT, SCALE, SCALE_BLOCK,
    STATISTICS_BLOCK_T, STATISTICS_PARTS_MAX, STATISTICS_ROWS_PER_PART, VOCABULARY_GRADIENT, VOCABULARY_STATISTICS,
    _logits_gradient, _row_statistics, _row_statistics_and_gradient, direct_kernels)
from memfuse.patterns.loss_head.plans import (  # noqa: F401
    ALIGN, BLOCK_COLUMNS, LOGITS_MATMUL_ROWS, REDUCTIONS, ROW_TILE, PlanChoice, VocabularyPlan, VocabularyStep, _padded,
    _step_rows, choose_plan, chunk_rows, row_bytes, vocabulary_plan)
from memfuse.patterns.loss_head.transform import LogitTransform  # noqa: F401
from memfuse.patterns.loss_head.call import LossHeadCall, trailing_nones

# _scale's most programs, each looping over its blocks: enough to fill a GPU of 132 SMs (8 programs of
# 8 warps each) for a copy, where one program a block would launch 256K programs for the standalone
# head's weight gradient, most of which find a scale of 1 and do nothing.
SCALE_PROGRAMS = 2048


# -- the op --------------------------------------------------------------------------------------
def _no_autocast(device: torch.device):
    """The op casts its operands itself: an autocast around the call must not recast. None is on in
    memfuse's programs (AOTAutograd runs compiled code with autocast off): no context entered there."""
    if device.type in ("cuda", "cpu") and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _aligned_weight(weight: torch.Tensor, bias: Optional[torch.Tensor], dtype: torch.dtype):
    """The weight (and bias) in the matmul's dtype with the vocabulary padded to ALIGN rows of
    zeros: the chunk's logits then have an aligned row stride, and cuBLAS its aligned kernels."""
    rows = _padded(weight.shape[0])
    aligned_bias = None if bias is None else _cast(bias.unsqueeze(1), dtype, rows).view(rows)
    return _cast(weight, dtype, rows), aligned_bias


def _cast(source: torch.Tensor, dtype: torch.dtype, rows: Optional[int] = None,
          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """source [n, columns] in `dtype`, padded with rows of zeros to `rows`: one launch, where a
    Tensor.to and a pad were two aten calls, each a trip through the dispatcher; into `out` (contiguous
    [rows, columns]) where given. The source itself where nothing changes."""
    rows = source.shape[0] if rows is None else rows
    if source.dtype == dtype and rows == source.shape[0]:
        return source
    source = _unit_stride(source)
    if out is None:
        out = source.new_empty((rows, source.shape[1]), dtype=dtype)
    if out.numel():
        CAST_ROWS(rows, source, source.stride(0), source.shape[0], source.shape[1], out)
    return out


def _chunk_logits(hidden: torch.Tensor, weight_t: torch.Tensor, bias: Optional[torch.Tensor],
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A chunk's logits from the weight transposed (`weight.t()`, made once for all chunks)."""
    if bias is None:
        return torch.mm(hidden, weight_t, out=out)
    return torch.addmm(bias, hidden, weight_t, out=out)


@dataclasses.dataclass
class _ChunkBuffers:
    """The buffers every chunk reuses, made once for the rows of the largest chunk (a smaller last
    chunk takes their first rows): its hidden states' rows in the matmul's dtype (None where hidden
    is in it already) and its logits, which their gradient overwrites (None where the logits are
    returned: the chunk's are rows of the output). One buffer each for all chunks, not a tensor a
    chunk: one chunk's memory by construction, and no allocation a chunk on the host."""
    hidden: Optional[torch.Tensor]
    logits: Optional[torch.Tensor]

    @staticmethod
    def empty(hidden: torch.Tensor, padded_vocab: int, dtype: torch.dtype, rows: int,
              with_logits: bool) -> "_ChunkBuffers":
        rows = min(rows, hidden.shape[0])
        cast = None if hidden.dtype == dtype else hidden.new_empty((rows, hidden.shape[1]), dtype=dtype)
        logits = hidden.new_empty((rows, padded_vocab), dtype=dtype) if with_logits else None
        return _ChunkBuffers(cast, logits)

    def hidden_rows(self, hidden: torch.Tensor, dtype: torch.dtype, first: int, last: int) -> torch.Tensor:
        """Tokens first..last of hidden in `dtype`: cast into the buffer, or hidden's own rows."""
        rows = hidden[first:last]
        return rows if self.hidden is None else _cast(rows, dtype, out=_first_rows(self.hidden, last - first))

    def logits_rows(self, count: int) -> Optional[torch.Tensor]:
        """The buffer's first `count` rows; None without a logits buffer."""
        return None if self.logits is None else _first_rows(self.logits, count)


def _first_rows(buffer: torch.Tensor, count: int) -> torch.Tensor:
    return buffer if buffer.shape[0] == count else buffer[:count]


def _counted_targets(target: torch.Tensor, ignore_index: int, vocab: int) -> torch.Tensor:
    """The count of targets not ignored (a 0-dim fp32 tensor, read by the kernels that divide by
    it): one kernel, where torch took eight calls on the host; as aten's nll_loss, a target outside
    the vocabulary that is not ignored is an error (raised by the device, or at once on the CPU)."""
    count, inside = (target.new_empty((), dtype=torch.float32) for _ in range(2))
    COUNT_TARGETS(1, target, target.shape[0], ignore_index, vocab, count, inside)
    torch._assert_async(inside, "memfuse.linear_cross_entropy: a target is outside [0, vocab)")
    return count


def _reduced(row_losses: torch.Tensor, count: torch.Tensor, reduction: str) -> torch.Tensor:
    """The loss of the rows' losses (0 where ignored): their sum, over the count of counted rows
    for a mean (0 / 0, NaN, where none is counted, as eager); one launch (a sum, a select and a
    division were three aten calls)."""
    if reduction == "none":
        return row_losses
    loss = row_losses.new_empty(())
    FINISH_LOSS[reduction == "mean"](1, row_losses, row_losses.shape[0], count, loss)
    return loss


def _check(hidden, weight, bias, target, reduction: str) -> None:
    """Bad input is an error naming the argument. Sizes that may be symbolic (traced) are
    compared only on real tensors: a comparison in the trace would make them part of the key."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"memfuse.linear_cross_entropy: hidden [tokens, H] and weight [vocab, H] expected, "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"memfuse.linear_cross_entropy: reduction {reduction!r}, expected one of {REDUCTIONS}")
    if target.dim() != 1 or target.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"memfuse.linear_cross_entropy: target of int64 [tokens] expected, "
                         f"got {target.dtype} {tuple(target.shape)}")


def _check_sizes(hidden, weight, bias, target) -> None:
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"memfuse.linear_cross_entropy: hidden [tokens, H] and weight [vocab, H] expected, "
                         f"got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if target.shape != hidden.shape[:1]:
        raise ValueError(f"memfuse.linear_cross_entropy: target of [tokens] = [{hidden.shape[0]}] expected, "
                         f"got {tuple(target.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"memfuse.linear_cross_entropy: bias of [vocab] = [{weight.shape[0]}] expected, "
                         f"got {tuple(bias.shape)}")


@dataclasses.dataclass
class _Gradients:
    """The head's gradients as the chunks add to them: hidden [tokens, H] in `hidden_dtype`, the
    weight's [vocab, H] in the weight's dtype, the bias's [vocab] in fp32. The weight's is written
    at its own rows even where the chunks' logits are padded to aligned columns: its matmul reads
    the gradient's first `vocab` columns (an aligned row stride still), so no [padded vocab, H]
    gradient is copied to [vocab, H] at the end (GPT-2: 154 MB more at the peak and a copy)."""
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor

    @staticmethod
    def empty(hidden, weight, bias, hidden_dtype: torch.dtype) -> "_Gradients":
        """The weight's and the bias's gradients are written by the first chunk (no memset, nor its
        read); zeros where no chunk will write them (no tokens)."""
        make = torch.empty if hidden.shape[0] else torch.zeros
        weight_gradient = make(weight.shape, dtype=weight.dtype, device=weight.device)
        bias_gradient = make(weight.shape[:1] if bias is not None else (0,), dtype=torch.float32, device=weight.device)
        return _Gradients(hidden.new_empty(hidden.shape, dtype=hidden_dtype), weight_gradient, bias_gradient)

    def add_chunk(self, hidden_rows, first: bool, gradient, chunk_hidden, aligned, has_bias: bool) -> None:
        """The two matmuls that take a chunk's logits gradient (padded columns 0) into its rows of
        hidden's gradient (`hidden_rows`, written in place by the matmul) and the weight's (the
        first chunk's product overwrites it, the others add)."""
        _accumulate(hidden_rows, gradient, aligned, overwrite=True)
        vocab = self.weight.shape[0]
        vocab_columns = gradient if gradient.shape[1] == vocab else gradient[:, :vocab]     # no slice when aligned
        _accumulate(self.weight, vocab_columns.t(), chunk_hidden, overwrite=first)
        if has_bias:
            ADD_COLUMN_SUMS[first](-(-vocab // COLUMN_SUMS_BLOCK), gradient, gradient.stride(0),
                                   gradient.shape[0], vocab, self.bias)

    def finished(self, bias) -> tuple:
        """(hidden, weight, bias) gradients; the bias's empty without a bias."""
        return self.hidden, self.weight, self.bias.to(bias.dtype) if bias is not None else self.bias


def _launch_gradient(chunk, first: int, gradient, log_sum_exp, target, scales, incoming, vocab: int,
                     smoothing: float, transform: tuple) -> None:
    """The gradient of the chunk's logits (tokens `first` on); without incoming gradient the kernel
    is handed the chunk in its place, never read."""
    LOGITS_GRADIENT[incoming is not None, smoothing != 0.0, transform](
        chunk.shape[0], chunk, chunk.stride(0), first, log_sum_exp, target, scales,
        chunk if incoming is None else incoming, 0 if incoming is None else incoming.stride(0),
        gradient, gradient.stride(0), vocab, gradient.shape[1], smoothing)


def linear_cross_entropy_impl(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                              target: torch.Tensor, ignore_index: int, reduction: str, label_smoothing: float,
                              dtype: torch.dtype, return_logits: bool, with_gradients: bool, chunk_bytes: int,
                              differentiable_logits: bool = True, plan: str = "auto", transform: str = ""
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                         torch.Tensor]:
    """(loss, log_sum_exp [tokens] fp32, logits, d loss / d hidden, d weight, d bias) of
    `cross_entropy((hidden @ weight.T + bias) in dtype, as fp32, target)`.

    `logits` is [tokens, vocab] in `dtype` when `return_logits` (rows aligned: a view of a padded
    buffer where vocab is odd), else empty; without `differentiable_logits` they carry no gradient
    (logits a graph only returns: memfuse.patterns.loss_head.detect gives them ReturnedLogits). With `with_gradients` (a
    mean or sum loss) the forward also forms the gradients for an upstream gradient of 1 while each
    chunk's logits are at hand: the backward then only scales them, three matmuls in all instead of
    four. Else they are empty and the backward recomputes each chunk's logits.

    `plan` (formed gradients only): "rows" chunks token rows, "vocabulary" runs the vocabulary-major
    plan where it keeps any logits, "auto" picks (choose_plan). `transform` (LogitTransform.spec):
    what the model does to the logits before the loss (a soft cap, a scale); returned logits are
    written transformed, and their incoming gradient is the transformed ones'."""
    _check(hidden, weight, bias, target, reduction)
    _check_sizes(hidden, weight, bias, target)
    kernel_transform = LogitTransform.parse(transform).constexpr
    tokens, vocab = hidden.shape[0], weight.shape[0]
    target = target.contiguous()       # the kernels read one target per row
    with _no_autocast(hidden.device):
        if with_gradients and not return_logits:
            choice = choose_plan(tokens, hidden.shape[1], vocab, dtype, weight.dtype, hidden.dtype, chunk_bytes, plan)
            if choice.vocabulary is not None:
                STATS["loss_head_vocabulary_calls"] += 1
                loss, log_sum_exp, *gradients = _vocabulary_major(hidden, weight, bias, target, ignore_index, reduction,
                                                                  label_smoothing, dtype, choice.vocabulary,
                                                                  kernel_transform)
                return loss, log_sum_exp, _logits_buffer(hidden, vocab, dtype, False), *gradients
        aligned, aligned_bias = _aligned_weight(weight, bias, dtype)
        logits = _logits_buffer(hidden, vocab, dtype, return_logits)
        log_sum_exp, row_losses = (hidden.new_empty(tokens, dtype=torch.float32) for _ in range(2))
        count = _counted_targets(target, ignore_index, vocab)
        # formed for an upstream gradient of 1, hidden's in the matmul's dtype as eager's product is
        # (fp32 hidden states under bf16 autocast: half the bytes at the head's peak, 34 MB for Llama
        # of `make bench-models`); the backward's scaling writes it in hidden's dtype
        gradients = _Gradients.empty(hidden, weight, bias, dtype) if with_gradients else None
        aligned_t = aligned.t()
        write_transformed = return_logits and len(kernel_transform) > 1    # the user's are the transformed ones
        rows = chunk_rows(tokens, vocab, dtype, chunk_bytes)
        # returned logits are written into the output, their gradient (if formed) into the buffer
        buffers = _ChunkBuffers.empty(hidden, aligned.shape[0], dtype, rows,
                                      with_logits=not return_logits or with_gradients)
        for index, (first, last) in enumerate(_chunks(tokens, rows)):
            chunk_hidden = buffers.hidden_rows(hidden, dtype, first, last)   # a chunk's rows cast, not all [tokens, H]
            own = buffers.logits_rows(last - first)
            chunk = _chunk_logits(chunk_hidden, aligned_t, aligned_bias,
                                  out=logits[first:last] if return_logits else own)
            if gradients is None:
                ROW_STATISTICS[label_smoothing != 0.0, kernel_transform, write_transformed](
                    chunk.shape[0], chunk, chunk.stride(0), first, target, log_sum_exp, row_losses, vocab,
                    chunk.shape[1], ignore_index, label_smoothing)
            else:
                gradient = own          # over the chunk's logits, unless those are returned
                ROW_STATISTICS_AND_GRADIENT[reduction == "mean", label_smoothing != 0.0, kernel_transform,
                                            write_transformed](
                    chunk.shape[0], chunk, chunk.stride(0), first, target, log_sum_exp, row_losses, count, gradient,
                    gradient.stride(0), vocab, gradient.shape[1], ignore_index, label_smoothing)
                gradients.add_chunk(gradients.hidden[first:last], index == 0, gradient, chunk_hidden, aligned,
                                    bias is not None)
        loss = _reduced(row_losses, count, reduction)
        precomputed = gradients.finished(bias) if gradients is not None else _no_gradients(hidden)
    return loss, log_sum_exp, logits[:, :vocab] if return_logits else logits, *precomputed


# The op around the implementation: what traces, fake tensors and autograd see. memfuse's programs
# call the implementation itself (its rule's implementation, memfuse.patterns.loss_head.rules): the
# dispatcher and the custom op's wrappers only cost the host time, and a program runs without autograd.
linear_cross_entropy = torch.library.custom_op("memfuse::linear_cross_entropy", mutates_args=())(
    linear_cross_entropy_impl)


def _chunks(tokens: int, rows: int) -> list:
    """(first, last) token of each chunk of `rows` rows; none for no tokens. The kernels take the
    first token and index the [tokens] tensors themselves, so a chunk makes views only for its
    matmuls. Small chunks leave the step to the host: each chunk enqueues several matmuls and
    kernels, so many small chunks can take the host longer to enqueue than the GPU to run."""
    return [(first, min(first + rows, tokens)) for first in range(0, tokens, rows)]


def _vocabulary_major(hidden, weight, bias, target, ignore_index: int, reduction: str, label_smoothing: float,
                      dtype: torch.dtype, plan: VocabularyPlan, kernel_transform: tuple) -> tuple:
    """linear_cross_entropy_impl's results with the gradients formed, by the vocabulary-major plan."""
    tokens, hidden_size = hidden.shape
    vocab = weight.shape[0]
    smoothing = label_smoothing != 0.0
    hidden_rows = _cast(hidden, dtype, plan.tokens)     # hidden itself where nothing changes
    hidden_t = hidden_rows.t()
    weight_rows = _cast(weight, dtype)
    bias_rows = None if bias is None else _cast(bias.unsqueeze(1), dtype)
    count = _counted_targets(target, ignore_index, vocab)
    weight_gradient = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
    storage = weight_gradient.view(-1).view(dtype)      # the kept logits' home until the gradient's rows come
    log_sum_exp, row_losses = (hidden.new_empty(tokens, dtype=torch.float32) for _ in range(2))
    running = hidden.new_empty((4, tokens), dtype=torch.float32)
    kept = plan.steps[0]
    for first in range(kept.rows, vocab, plan.forward_rows):      # the rows not kept, in the empty storage
        rows = min(plan.forward_rows, vocab - first)
        logits = storage[:rows * plan.tokens].view(rows, plan.tokens)
        _vocabulary_logits(weight_rows, bias_rows, hidden_t, first, rows, logits)
        _add_statistics(logits, first, target, running, smoothing, kernel_transform, first_call=first == kept.rows)
    kept_logits = _stored_logits(storage, kept, plan.tokens)
    _vocabulary_logits(weight_rows, bias_rows, hidden_t, kept.first, kept.rows, kept_logits)
    _add_statistics(kept_logits, kept.first, target, running, smoothing, kernel_transform,
                    first_call=kept.rows == vocab)
    FINISH_STATISTICS[smoothing](triton.cdiv(tokens, MERGE_BLOCK), running, tokens, target, ignore_index, vocab,
                                 label_smoothing, log_sum_exp, row_losses)
    loss = _reduced(row_losses, count, reduction)
    hidden_gradient = hidden.new_empty((plan.tokens, hidden_size), dtype=dtype)
    bias_gradient = torch.empty(vocab if bias is not None else 0, dtype=torch.float32, device=weight.device)
    gradient_kernel = VOCABULARY_GRADIENT[reduction == "mean", smoothing, bias is not None, kernel_transform]
    tail = None
    for index, step in enumerate(plan.steps):
        if index == 0:
            logits = kept_logits
        else:
            if step.logits_at is not None:
                logits = _stored_logits(storage, step, plan.tokens)
            else:
                tail = hidden.new_empty(plan.tail_rows * plan.tokens, dtype=dtype) if tail is None else tail
                logits = tail[:step.rows * plan.tokens].view(step.rows, plan.tokens)
            _vocabulary_logits(weight_rows, bias_rows, hidden_t, step.first, step.rows, logits)
        gradient_kernel(triton.cdiv(step.rows, GRADIENT_BLOCK_V), logits, step.rows, tokens, plan.tokens, step.first,
                        log_sum_exp, target, count, ignore_index, vocab, label_smoothing, bias_gradient)
        _accumulate(hidden_gradient, logits.t(), weight_rows[step.first:step.first + step.rows], overwrite=index == 0)
        done = 0
        for rows in step.writes:    # each over logits read already
            first = step.first + done
            _accumulate(weight_gradient[first:first + rows], logits[done:done + rows], hidden_rows, overwrite=True)
            done += rows
    bias_gradient = bias_gradient.to(bias.dtype) if bias is not None else bias_gradient
    hidden_gradient = hidden_gradient if plan.tokens == tokens else hidden_gradient[:tokens]
    return loss, log_sum_exp, hidden_gradient, weight_gradient, bias_gradient


def _stored_logits(storage: torch.Tensor, step: VocabularyStep, tokens: int) -> torch.Tensor:
    start = step.logits_at // storage.element_size()
    return storage[start:start + step.rows * tokens].view(step.rows, tokens)


def _vocabulary_logits(weight, bias, hidden_t, first: int, rows: int, out: torch.Tensor) -> None:
    """Vocabulary rows first..first+rows' logits, transposed: weight rows @ hidden.T (+ bias), in
    matmuls of at most LOGITS_MATMUL_ROWS rows, as even as multiples of ALIGN make them."""
    matmuls = -(-rows // LOGITS_MATMUL_ROWS)
    size = -(-rows // (matmuls * ALIGN)) * ALIGN
    for start in range(0, rows, size):
        end = min(start + size, rows)
        weight_rows = weight[first + start:first + end]
        if bias is None:
            torch.mm(weight_rows, hidden_t, out=out[start:end])
        else:
            torch.addmm(bias[first + start:first + end], weight_rows, hidden_t, out=out[start:end])


def _add_statistics(logits: torch.Tensor, first: int, target: torch.Tensor, running: torch.Tensor, smoothing: bool,
                    kernel_transform: tuple, first_call: bool) -> None:
    """The tokens' statistics over vocabulary rows first.. ([rows, padded tokens] logits) merged into
    `running` (written by the first call)."""
    rows = logits.shape[0]
    tokens = running.shape[1]
    parts = min(STATISTICS_PARTS_MAX, triton.cdiv(rows, STATISTICS_ROWS_PER_PART))
    part_statistics = running.new_empty((4, parts, tokens))
    VOCABULARY_STATISTICS[smoothing, kernel_transform](
        triton.cdiv(tokens, STATISTICS_BLOCK_T) * parts, logits, rows, tokens, logits.stride(0), first, target,
        triton.cdiv(rows, parts), part_statistics)
    MERGE_STATISTICS[first_call](triton.cdiv(tokens, MERGE_BLOCK), part_statistics, parts, tokens, running)


def _no_gradients(hidden: torch.Tensor) -> tuple:
    return tuple(hidden.new_empty((0,)) for _ in range(3))


def _logits_buffer(hidden: torch.Tensor, vocab: int, dtype: torch.dtype, return_logits: bool) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0], _padded(vocab) if return_logits else 0), dtype=dtype)


@linear_cross_entropy.register_fake
def _(hidden, weight, bias, target, ignore_index, reduction, label_smoothing, dtype, return_logits, with_gradients,
      chunk_bytes, differentiable_logits=True, plan="auto", transform=""):
    _check(hidden, weight, bias, target, reduction)
    LogitTransform.parse(transform)
    tokens, vocab = hidden.shape[0], weight.shape[0]
    loss = hidden.new_empty((tokens,) if reduction == "none" else (), dtype=torch.float32)
    log_sum_exp = hidden.new_empty((tokens,), dtype=torch.float32)
    logits = _logits_buffer(hidden, vocab, dtype, return_logits)
    if with_gradients:
        precomputed = (hidden.new_empty(hidden.shape, dtype=dtype), weight.new_empty(weight.shape),
                       bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,)))
    else:
        precomputed = _no_gradients(hidden)
    return loss, log_sum_exp, logits[:, :vocab] if return_logits else logits, *precomputed


def linear_cross_entropy_backward_impl(loss_gradient: torch.Tensor, logits_gradient: Optional[torch.Tensor],
                                       hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                       target: torch.Tensor, log_sum_exp: torch.Tensor, hidden_unit: torch.Tensor,
                                       weight_unit: torch.Tensor, bias_unit: torch.Tensor, ignore_index: int,
                                       reduction: str, label_smoothing: float, dtype: torch.dtype, chunk_bytes: int,
                                       transform: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias) of linear_cross_entropy. Where the forward formed the gradients
    (`hidden_unit` not empty) they are scaled by the loss's gradient; else each chunk's logits are
    formed again, then their gradient and the two matmuls. The weight's gradient adds up over the
    chunks in fp32 when the weight is fp32 (autocast's master weights), else in the weight's dtype
    (one rounding per chunk). `logits_gradient`: what the logits received from their readers in
    the graph, or None."""
    with _no_autocast(hidden.device):
        if weight_unit.numel():    # the forward formed them
            return _scaled(loss_gradient, logits_gradient, (hidden, weight, bias),
                           (hidden_unit, weight_unit, bias_unit), dtype, transform, chunk_bytes, in_place=False)
        return _recomputed_backward(loss_gradient, logits_gradient, hidden, weight, bias, target, log_sum_exp,
                                    ignore_index, reduction, label_smoothing, dtype, chunk_bytes,
                                    LogitTransform.parse(transform).constexpr)


linear_cross_entropy_backward = torch.library.custom_op("memfuse::linear_cross_entropy_backward", mutates_args=())(
    linear_cross_entropy_backward_impl)


def _scaled(loss_gradient, logits_gradient, operands: tuple, units: tuple, dtype, transform: str, chunk_bytes: int,
            in_place: bool, hidden_in_place: bool = False) -> tuple:
    """The gradients the forward formed for an upstream gradient of 1, times the loss's gradient
    (the weight's and the bias's in their units themselves `in_place`, the hidden states' too where
    `hidden_in_place` as well), plus what the returned logits received (`operands`: hidden, weight,
    bias)."""
    hidden_unit, *parameter_units = units
    gradients = (_times(hidden_unit, loss_gradient, in_place=in_place and hidden_in_place, dtype=operands[0].dtype),
                 *(_times(u, loss_gradient, in_place) for u in parameter_units))
    if logits_gradient is not None:
        _add_incoming(gradients, logits_gradient, operands, dtype, transform, chunk_bytes)
    return gradients


def _times(unit: torch.Tensor, loss_gradient: torch.Tensor, in_place: bool,
           dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """unit * the loss's gradient (a 0-dim tensor, read by the kernel: no sync), in fp32 and rounded
    once to `dtype` (the unit's by default) as aten's mul; into the unit itself `in_place`. One
    launch where aten took a cast and a mul. An empty unit (no bias): itself in place, else a new
    empty tensor (the custom op's results must not alias its inputs)."""
    dtype = unit.dtype if dtype is None else dtype
    if not unit.numel():
        return unit if in_place else torch.empty_like(unit, dtype=dtype)
    if not unit.is_contiguous() or loss_gradient.dim() != 0:
        scale = loss_gradient.to(torch.float32)
        return unit.mul_(scale) if in_place else (unit.to(torch.float32) * scale).to(dtype)
    out = unit if in_place else torch.empty_like(unit, dtype=dtype)
    programs = min(triton.cdiv(unit.numel(), SCALE_BLOCK), SCALE_PROGRAMS)
    SCALE[in_place](programs, unit, out, unit.numel(), loss_gradient)
    return out


# The same backward where the forward formed the gradients, scaling them in place: memfuse's backward
# program calls it (memfuse.schedule.reinplace) where the formed gradients are saved values only that call reads,
# so the backward allocates no second [vocab, H] weight gradient. `linear_cross_entropy_backward_` scales
# the weight's and the bias's (the hidden states' gradient is a new tensor: the form for a unit in the
# matmul's dtype, not hidden's, as autocast's fp32 hidden states); `linear_cross_entropy_backward_all_`
# the hidden states' too, where the forward formed it in their dtype: no second [tokens, H] gradient
# either (the standalone head's peak: 64 MiB, the scaled copy beside the formed one). The results
# written in place alias their units, as the schemas say, so memfuse's buffer plan holds a unit as long
# as its result (or a returned view of it) lives. A backward run that keeps its graph for another
# (retain_graph, create_graph) needs the units again and gets scaled copies instead.
def _in_place_backward(name: str, hidden_written: bool):
    """Defines memfuse::`name` and returns its implementation."""
    hidden_unit, hidden_result = ("Tensor(c!) hidden_unit", "Tensor(c!)") if hidden_written else ("Tensor hidden_unit",
                                                                                                  "Tensor")
    torch.library.define(
        f"memfuse::{name}",
        "(Tensor loss_gradient, Tensor? logits_gradient, Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
        f"Tensor log_sum_exp, {hidden_unit}, Tensor(a!) weight_unit, Tensor(b!) bias_unit, int ignore_index, "
        f"str reduction, float label_smoothing, ScalarType dtype, int chunk_bytes, str transform=\"\") -> "
        f"({hidden_result}, Tensor(a!), Tensor(b!))")

    def implementation(loss_gradient, logits_gradient, hidden, weight, bias, target, log_sum_exp, hidden_unit,
                       weight_unit, bias_unit, ignore_index, reduction, label_smoothing, dtype, chunk_bytes,
                       transform=""):
        with _no_autocast(hidden.device):
            return _scaled(loss_gradient, logits_gradient, (hidden, weight, bias),
                           (hidden_unit, weight_unit, bias_unit), dtype, transform, chunk_bytes,
                           in_place=not _graph_kept(),
                           hidden_in_place=hidden_written and hidden_unit.dtype == hidden.dtype)

    torch.library.impl(f"memfuse::{name}", "CompositeExplicitAutograd")(implementation)

    def fake(loss_gradient, logits_gradient, hidden, weight, bias, target, log_sum_exp, hidden_unit, weight_unit,
             bias_unit, ignore_index, reduction, label_smoothing, dtype, chunk_bytes, transform=""):
        """The results on fake tensors (a compile-only program runs the op on them): the units
        written in place, as the schema says, and a new hidden-states gradient where it is not."""
        return hidden_unit if hidden_written else hidden.new_empty(hidden.shape), weight_unit, bias_unit

    torch.library.register_fake(f"memfuse::{name}")(fake)
    return implementation


linear_cross_entropy_backward_in_place_impl = _in_place_backward("linear_cross_entropy_backward_", False)
linear_cross_entropy_backward_all_in_place_impl = _in_place_backward("linear_cross_entropy_backward_all_", True)


def _graph_kept() -> bool:
    """Whether the running backward keeps its graph (and its saved tensors) for another; True outside
    a backward run."""
    return torch._C._autograd._get_current_graph_task_keep_graph()


def _add_incoming(gradients: tuple, logits_gradient: torch.Tensor, operands: tuple, dtype: torch.dtype,
                  transform: str, chunk_bytes: int) -> None:
    """The returned logits' own gradient g through the matmul, into `gradients` (hidden, weight, bias:
    an empty bias gradient for none): hidden += g @ W, weight += g.T @ hidden, bias += g's column
    sums. Where the logits went through the model's transform, g is taken back through it first, a
    chunk of token rows at a time (`chunk_bytes` of logits formed again, then
    LogitTransform.gradient_through): no [tokens, vocab] logits, nor fp32 ones, whole."""
    hidden_gradient, weight_gradient, bias_gradient = gradients
    hidden, weight, bias = operands
    logit_transform = LogitTransform.parse(transform)
    incoming = _unit_stride(logits_gradient.reshape(-1, logits_gradient.shape[-1]))
    weight_rows = weight.to(dtype)
    tokens = hidden.shape[0]
    rows = chunk_rows(tokens, weight.shape[0], dtype, chunk_bytes) if logit_transform.steps else max(1, tokens)
    for first, last in _chunks(tokens, rows):
        hidden_rows = hidden[first:last].to(dtype)
        chunk = incoming[first:last]
        if logit_transform.steps:
            logits = _chunk_logits(hidden_rows, weight_rows.t(), None if bias is None else bias.to(dtype))
            chunk = logit_transform.gradient_through(logits, chunk)
        chunk = chunk.to(dtype)
        hidden_gradient[first:last] += torch.mm(chunk, weight_rows)
        _accumulate(weight_gradient, chunk.t(), hidden_rows)
        if bias_gradient.numel():
            bias_gradient += chunk.sum(0, dtype=torch.float32).to(bias_gradient.dtype)


def _recomputed_backward(loss_gradient, logits_gradient, hidden, weight, bias, target, log_sum_exp, ignore_index,
                         reduction, label_smoothing, dtype, chunk_bytes, kernel_transform: tuple) -> tuple:
    tokens, vocab = hidden.shape[0], weight.shape[0]
    target = target.contiguous()
    aligned, aligned_bias = _aligned_weight(weight, bias, dtype)
    aligned_t = aligned.t()
    scales = _row_scales(loss_gradient, target, ignore_index, reduction)
    gradients = _Gradients.empty(hidden, weight, bias, hidden.dtype)
    incoming = None if logits_gradient is None else _unit_stride(logits_gradient)
    rows = chunk_rows(tokens, vocab, dtype, chunk_bytes)
    buffers = _ChunkBuffers.empty(hidden, aligned.shape[0], dtype, rows, with_logits=True)
    for index, (first, last) in enumerate(_chunks(tokens, rows)):
        chunk_hidden = buffers.hidden_rows(hidden, dtype, first, last)
        chunk = _chunk_logits(chunk_hidden, aligned_t, aligned_bias, out=buffers.logits_rows(last - first))
        _launch_gradient(chunk, first, chunk, log_sum_exp, target, scales, incoming, vocab, label_smoothing,
                         kernel_transform)
        gradients.add_chunk(gradients.hidden[first:last], index == 0, chunk, chunk_hidden, aligned, bias is not None)
    return gradients.finished(bias)


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _accumulate(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor, overwrite: bool = False) -> None:
    """total += left @ right (total = left @ right where `overwrite`: its old values, even NaN, are
    not read), in place in the matmul's epilogue: in total's dtype where the operands share it
    (cuBLAS adds in fp32 and rounds once); an fp32 total of bf16/fp16 operands through aten's addmm
    with out_dtype on CUDA (no [vocab, H] product written and read again per chunk), else the
    chunk's product added to total."""
    beta = 0 if overwrite else 1
    if total.dtype == left.dtype:
        total.addmm_(left, right, beta=beta)
    elif total.dtype == torch.float32 and _fp32_epilogue(total.device, left.dtype):
        torch.addmm(total, left, right, out_dtype=torch.float32, beta=beta, out=total)    # addmm.dtype_out
    elif overwrite:
        total.copy_(torch.mm(left, right))
    else:
        total += torch.mm(left, right)


@functools.cache
def _fp32_epilogue(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch runs addmm of `dtype` operands into an fp32 total on `device` (CUDA builds
    since torch 2.9; not the CPU): tried once on a 8x8 product."""
    if device.type != "cuda" or not hasattr(torch.ops.aten.addmm, "dtype_out"):
        return False
    total = torch.zeros(8, 8, device=device)
    operand = torch.ones(8, 8, device=device, dtype=dtype)
    try:
        torch.addmm(total, operand, operand, out_dtype=torch.float32, out=total)
    except (RuntimeError, NotImplementedError):
        return False
    return bool((total == 8).all())


def _row_scales(loss_gradient: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    """d loss / d row loss, per row (fp32): the incoming gradient, over the count of counted rows
    for a mean, and 0 where the target is ignored."""
    valid = target != ignore_index
    scale = loss_gradient.to(torch.float32)
    if reduction == "mean":
        scale = scale / valid.sum()
    return torch.where(valid, scale.expand(target.shape), 0.0)


@linear_cross_entropy_backward.register_fake
def _(loss_gradient, logits_gradient, hidden, weight, bias, target, log_sum_exp, hidden_unit, weight_unit, bias_unit,
      ignore_index, reduction, label_smoothing, dtype, chunk_bytes, transform=""):
    bias_gradient = bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,))
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), bias_gradient


def _setup_context(ctx, inputs, output) -> None:
    call = LossHeadCall.of(inputs)
    _, log_sum_exp, logits, *units = output
    ctx.save_for_backward(call.hidden, call.weight, call.bias, call.target, log_sum_exp, *units)
    ctx.settings = {"ignore_index": call.ignore_index, "reduction": call.reduction,
                    "label_smoothing": call.label_smoothing, "dtype": call.dtype, "chunk_bytes": call.chunk_bytes,
                    "transform": call.transform.spec}
    ctx.return_logits = call.return_logits and call.differentiable_logits
    ctx.mark_non_differentiable(log_sum_exp, *units, *([] if call.differentiable_logits else [logits]))
    ctx.set_materialize_grads(False)    # logits nobody differentiates: None, not [tokens, vocab] zeros


def _backward(ctx, loss_gradient, _log_sum_exp_gradient, logits_gradient, *_unit_gradients):
    hidden, weight, bias, target, log_sum_exp, *units = ctx.saved_tensors
    incoming = logits_gradient if ctx.return_logits else None
    if loss_gradient is None:      # only the logits are differentiated
        loss_gradient = log_sum_exp.new_zeros(() if ctx.settings["reduction"] != "none" else log_sum_exp.shape)
    hidden_gradient, weight_gradient, bias_gradient = linear_cross_entropy_backward(
        loss_gradient, incoming, hidden, weight, bias, target, log_sum_exp, *units, **ctx.settings)
    # a gradient for hidden, weight and bias; none for the arguments after them
    return (hidden_gradient, weight_gradient, bias_gradient if bias is not None else None,
            *trailing_nones(torch.ops.memfuse.linear_cross_entropy.default, 3))


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


class ReturnedLogits(torch.autograd.Function):
    """Logits the op wrote whole and a Dynamo graph returned detached, given their gradient path
    back: d hidden = g @ W, d weight = g.T @ hidden, d bias = the column sums of g, in the
    logits' dtype as the linear's own backward (g taken back through the model's transform first,
    where the logits went through one). Autograd runs it only when something differentiates the
    returned logits: unread, they cost the backward nothing."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], transform: str = "", chunk_bytes: int = 0) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight, bias)
        ctx.transform, ctx.chunk_bytes = transform, chunk_bytes
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, gradient: torch.Tensor):
        hidden, weight, bias = ctx.saved_tensors
        with _no_autocast(gradient.device):
            rows = _unit_stride(gradient.reshape(-1, gradient.shape[-1]))
            if ctx.transform:       # back through it a chunk of rows at a time, into zeros
                flat_hidden = hidden.reshape(-1, hidden.shape[-1])
                gradients = (torch.zeros_like(flat_hidden), torch.zeros_like(weight),
                             weight.new_zeros(bias.shape if bias is not None else (0,), dtype=torch.float32))
                _add_incoming(gradients, rows, (flat_hidden, weight, bias), rows.dtype, ctx.transform, ctx.chunk_bytes)
                hidden_gradient, weight_gradient, bias_gradient = gradients
                return (None, hidden_gradient.view(hidden.shape), weight_gradient,
                        bias_gradient.to(bias.dtype) if bias is not None else None, None, None)
            hidden_gradient = weight_gradient = bias_gradient = None
            if ctx.needs_input_grad[1]:
                hidden_gradient = torch.mm(rows, weight.to(rows.dtype)).view(hidden.shape).to(hidden.dtype)
            if ctx.needs_input_grad[2]:
                flat_hidden = hidden.reshape(-1, hidden.shape[-1]).to(rows.dtype)
                weight_gradient = torch.mm(rows.t(), flat_hidden).to(weight.dtype)
            if bias is not None and ctx.needs_input_grad[3]:
                bias_gradient = rows.sum(0).to(bias.dtype)
        return None, hidden_gradient, weight_gradient, bias_gradient, None, None


@dataclasses.dataclass(frozen=True)
class LogitsReturn:
    """Where a compiled graph returns a chunked head's logits without gradient (its outputs at
    `positions`), and where the linear's operands are for ReturnedLogits: each an ("output", i)
    or ("input", i) of the compiled call; `bias` None without a bias; the head's `transform`
    (LogitTransform.spec), which the returned logits went through, and its chunks' bytes (the
    backward through the transform forms the logits again a chunk at a time)."""
    positions: tuple
    hidden: tuple
    weight: tuple
    bias: Optional[tuple]
    transform: str = ""
    chunk_bytes: int = 256 * 2**20


def attach_returned_logits(outputs: Sequence, inputs: Sequence, returns: list, count: int) -> list:
    """The compiled call's first `count` outputs (the caller's; the rest are the operands it
    returned for this), the logits of each LogitsReturn through ReturnedLogits."""
    def found(place):
        if place is None:
            return None
        source, index = place
        return (outputs if source == "output" else inputs)[index]
    results = list(outputs[:count])
    for returned in returns:
        logits = ReturnedLogits.apply(outputs[returned.positions[0]], found(returned.hidden),
                                      found(returned.weight), found(returned.bias), returned.transform,
                                      returned.chunk_bytes)
        for position in returned.positions:
            results[position] = logits
    return results
