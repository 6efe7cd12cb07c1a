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
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

from memfuse.base.config import LOSS_HEAD_PLANS
from memfuse.base.debug import STATS
from memfuse.base.launch import DirectKernel

# A matmul dimension that is a multiple of this many elements runs cuBLAS's aligned kernels.
ALIGN = 8
# Chunks of at least this many token rows hold a multiple of it: the widest tile cuBLAS's kernels
# take along a chunk's rows (its logits' M, its weight gradient's K), so no tile runs part empty
# (520 rows, the head alone's chunk before: 5 tiles of 128 rows for 4 rows' worth of work).
ROW_TILE = 256
# Columns one program reads per step of its loop over the vocabulary, and its warps: the fastest
# of BLOCK 1024-8192 x 4-16 warps on an H100 for [2096, 32000], [1328, 50257] and [512, 128256]
# chunks (docs/benchmarks.md, 2026-11-24).
BLOCK_COLUMNS = 4096
NUM_WARPS = 8
REDUCTIONS = ("mean", "sum", "none")


def chunk_rows(tokens: int, vocab: int, dtype: torch.dtype, chunk_bytes: int) -> int:
    """Token rows per chunk: the chunk's logits fit in `chunk_bytes`; a multiple of ROW_TILE where
    that many fit (no matmul tile of a chunk half empty), else of ALIGN (the chunk's matmuls stay
    aligned); at least ALIGN, at most `tokens`."""
    fitting = chunk_bytes // row_bytes(vocab, dtype)
    multiple = ROW_TILE if fitting >= ROW_TILE else ALIGN
    rows = max(ALIGN, fitting // multiple * multiple)
    return max(1, min(rows, tokens))


def row_bytes(vocab: int, dtype: torch.dtype) -> int:
    """What one token row of a chunk holds: its logits, which their gradient overwrites (the one
    buffer a chunk allocates; returned logits are written into the output and their gradient into
    the chunk's buffer)."""
    return _padded(vocab) * dtype.itemsize


def _padded(vocab: int) -> int:
    return -(-vocab // ALIGN) * ALIGN


# -- the model's transform of the logits ----------------------------------------------------------
# What a model does to the linear's output before its loss, elementwise with constants: Gemma's soft
# cap (`logits / cap`, `tanh`, `* cap`), Cohere's `logits * scale`, Granite's `logits / scale`. The
# kernels apply it wherever they read logits and multiply the logits' gradient by its derivative;
# returned logits are written transformed.
STEP_KINDS = {"mul": 1, "div": 2, "tanh": 3}
ROUNDINGS = {None: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """Steps in order, each ("mul", factor), ("div", factor) or ("tanh", None), each rounded to
    `rounded_to` (the logits' half dtype, where the model transforms them before its float cast:
    eager's ops on them round so) or kept in fp32 (None). The op takes it as a string, `spec`."""
    steps: tuple = ()
    rounded_to: Optional[torch.dtype] = None

    @property
    def spec(self) -> str:
        """'div 30.0, tanh, mul 30.0 in bfloat16'; '' for none. Factors as repr(float): exact."""
        if not self.steps:
            return ""
        text = ", ".join(kind if factor is None else f"{kind} {factor!r}" for kind, factor in self.steps)
        return text + (f" in {_dtype_name(self.rounded_to)}" if self.rounded_to is not None else "")

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def parse(spec: str) -> "LogitTransform":
        """The transform of `spec` (LogitTransform.spec's form); ValueError naming it otherwise."""
        if not spec:
            return LogitTransform()
        text, _, dtype_name = spec.partition(" in ")
        rounded_to = getattr(torch, dtype_name, None) if dtype_name else None
        steps = []
        for step in text.split(", "):
            kind, _, factor = step.partition(" ")
            number = _number(factor)
            if kind not in STEP_KINDS or (kind == "tanh") != (factor == "") or (factor and number is None) or \
                    (dtype_name and rounded_to not in ROUNDINGS):
                raise ValueError(f"memfuse.linear_cross_entropy: transform {spec!r}: expected steps 'mul F', "
                                 "'div F' or 'tanh' joined by ', ', then ' in bfloat16' or ' in float16' or nothing")
            steps.append((kind, number))
        return LogitTransform(tuple(steps), rounded_to)

    @functools.cached_property      # the op reads it every call
    def constexpr(self) -> tuple:
        """The kernels' TRANSFORM: (rounding, kind, factor, reciprocal, kind, ...); (0,) for none. A
        divide's reciprocal is fp32's 1 / factor: CUDA's eager divides by a number so, multiplying
        by it (aten's div_true_kernel_cuda), and the compiled kernels do as it does."""
        flat = [ROUNDINGS[self.rounded_to]]
        for kind, factor in self.steps:
            reciprocal = (torch.tensor(1.0) / torch.tensor(factor)).item() if kind == "div" else 0.0
            flat += [STEP_KINDS[kind], 0.0 if factor is None else factor, reciprocal]
        return tuple(flat)

    def returns_in(self, dtype: torch.dtype) -> bool:
        """Whether logits of `dtype` hold the transformed ones as eager has them (the op writes
        returned logits in their dtype): the steps round to it, or run in fp32 on fp32 logits."""
        return self.rounded_to == dtype or (self.rounded_to is None and dtype == torch.float32)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The steps as eager's ops, on the logits in their dtype (differentiable)."""
        for kind, factor in self.steps:
            logits = logits * factor if kind == "mul" else logits / factor if kind == "div" else torch.tanh(logits)
        return logits

    def gradient_through(self, logits: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        """gradient (of the transformed logits) times the transform's derivative at `logits`, in fp32,
        as the kernels form it (`_transformed`): each step rounded as eager's, tanh's derivative from
        its rounded output. Torch ops: a custom op's backward runs below autograd."""
        value, slope = logits.float(), gradient.float()
        for kind, factor in self.steps:
            value = value * factor if kind == "mul" else value / factor if kind == "div" else torch.tanh(value)
            if self.rounded_to is not None:
                value = value.to(self.rounded_to).float()
            if kind == "tanh":
                slope = slope * (1 - value * value)
            else:
                slope = slope * factor if kind == "mul" else slope / factor
        return slope

    def __str__(self) -> str:
        return " then ".join(f"{'*' if kind == 'mul' else '/'} {factor!r}" if factor is not None else kind
                             for kind, factor in self.steps) + (
            f" (in {_dtype_name(self.rounded_to)})" if self.rounded_to is not None else " (in float32)")


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the kernels ---------------------------------------------------------------------------------
# A transform's steps as the kernels read them (LogitTransform.constexpr)
STEP_MUL = tl.constexpr(STEP_KINDS["mul"])
STEP_DIV = tl.constexpr(STEP_KINDS["div"])
ROUNDED_BF16 = tl.constexpr(ROUNDINGS[torch.bfloat16])
ROUNDED_FP16 = tl.constexpr(ROUNDINGS[torch.float16])
INTERPRETED = tl.constexpr(bool(knobs.runtime.interpret))     # Triton's interpreter runs the kernels


@triton.jit
def _tanh(x):
    """fp32 tanh: CUDA's tanhf compiled (libdevice's, which eager's tanh on the GPU runs); in the
    interpreter, which has no libdevice, (e - 1) / (e + 1) with e = exp(2x) in fp64 (x - x^3 / 3
    near 0, where e - 1 cancels), rounded once to fp32."""
    if INTERPRETED:
        wide = tl.minimum(tl.maximum(x.to(tl.float64), -20.0), 20.0)      # tanh(20) is 1 in fp64
        e = tl.exp(2.0 * wide)
        near_zero = wide - wide * wide * wide / 3.0
        result = tl.where(tl.abs(wide) < 1e-4, near_zero, (e - 1.0) / (e + 1.0)).to(tl.float32)
    else:
        result = libdevice.tanh(x)
    return result


@triton.jit
def _rounded(value, ROUNDING: tl.constexpr):
    """value (fp32) rounded to the logits' half dtype where the model's transform runs in it, to the
    nearest (ties to even). Triton's interpreter truncates fp32 -> bf16 where the GPU's cast rounds:
    there the bits are rounded here (memfuse.ir.ops' mf_rne_bf16)."""
    if ROUNDING == ROUNDED_BF16:
        if INTERPRETED:
            bits = value.to(tl.uint32, bitcast=True)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
            value = tl.where(value != value, value, rounded)
        else:
            value = value.to(tl.bfloat16).to(tl.float32)
    elif ROUNDING == ROUNDED_FP16:
        value = value.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    return value


@triton.jit
def _transformed(logits, TRANSFORM: tl.constexpr):
    """(the logits through the model's transform, its derivative d transformed / d logits), fp32.
    TRANSFORM: LogitTransform.constexpr, (rounding, kind, factor, reciprocal, kind, ...);
    (rounding,) alone is no transform (the derivative a constant 1, which no caller multiplies by).
    Each step rounds as eager's op on the logits' dtype does (a divide multiplies by the reciprocal
    compiled, as CUDA's eager does, and divides in the interpreter, as the CPU's does); tanh's
    derivative takes its rounded output, as eager's tanh_backward."""
    value = logits
    slope = 1.0
    for i in tl.static_range(1, len(TRANSFORM), 3):
        if TRANSFORM[i] == STEP_MUL:
            value = _rounded(value * TRANSFORM[i + 1], TRANSFORM[0])
            slope = slope * TRANSFORM[i + 1]
        elif TRANSFORM[i] == STEP_DIV:
            if INTERPRETED:
                value = _rounded(value / TRANSFORM[i + 1], TRANSFORM[0])
            else:
                value = _rounded(value * TRANSFORM[i + 2], TRANSFORM[0])
            slope = slope / TRANSFORM[i + 1]
        else:
            value = _rounded(_tanh(value), TRANSFORM[0])
            slope = slope * (1.0 - value * value)
    return value, slope


@triton.jit
def _add_to_lanes(lane_max, lane_sum_of_exp, lane_logit_sum, logits, summed, SMOOTHING: tl.constexpr):
    """One block of a row into each lane's running max and sum of exps (rescaled as its max grows:
    online softmax), and its sum of logits where smoothing asks for it (`summed`: the logits, 0
    past the vocabulary)."""
    new_max = tl.maximum(lane_max, logits)
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)     # a lane with no finite logit yet: no inf - inf
    lane_sum_of_exp = lane_sum_of_exp * tl.exp(lane_max - shift) + tl.exp(logits - shift)
    if SMOOTHING:
        lane_logit_sum += summed
    return new_max, lane_sum_of_exp, lane_logit_sum


@triton.jit
def _statistics_of_row(row_logits, target, vocab, padded_vocab, SMOOTHING: tl.constexpr, TRANSFORM: tl.constexpr,
                       WRITE_TRANSFORMED: tl.constexpr, BLOCK: tl.constexpr):
    """(log-sum-exp, target's logit, sum of logits: 0 without smoothing) of one row in fp32, reading
    it once. Each of the BLOCK lanes keeps its own statistics, combined once after the loop: no
    reduction across the program's warps at each step. The blocks inside the vocabulary load
    unmasked; only the last, to the padded end, is masked (a mask that ends at an odd vocabulary,
    GPT-2's 50257, is not provably aligned: masked throughout, the kernel took 2.9x a copy's time on
    GPT-2's rows against 1.9x on Llama's, one H200, 2026-11-28). The target's logit is one load,
    first. The statistics are of the logits through the model's TRANSFORM, which WRITE_TRANSFORMED
    writes over the row as it goes (returned logits)."""
    known = (target >= 0) & (target < vocab)        # an ignored target (-100) reads column 0, unused
    target_logit, target_slope = _transformed(tl.load(row_logits + tl.where(known, target, 0)).to(tl.float32),
                                              TRANSFORM)     # (a scalar's slope: not the loop's `_`)
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum_of_exp = tl.zeros((BLOCK,), tl.float32)
    lane_logit_sum = tl.zeros((BLOCK,), tl.float32)
    whole_blocks_end = vocab // BLOCK * BLOCK
    for start in range(0, whole_blocks_end, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        logits, _ = _transformed(tl.load(row_logits + columns).to(tl.float32), TRANSFORM)
        if WRITE_TRANSFORMED:
            tl.store(row_logits + columns, logits.to(row_logits.dtype.element_ty))
        lane_max, lane_sum_of_exp, lane_logit_sum = _add_to_lanes(lane_max, lane_sum_of_exp, lane_logit_sum,
                                                                  logits, logits, SMOOTHING)
    for start in range(whole_blocks_end, padded_vocab, BLOCK):
        columns = start + tl.arange(0, BLOCK)
        inside = columns < vocab
        logits, _ = _transformed(tl.load(row_logits + columns, mask=columns < padded_vocab, other=0.0).to(tl.float32),
                                 TRANSFORM)
        if WRITE_TRANSFORMED:
            tl.store(row_logits + columns, logits.to(row_logits.dtype.element_ty), mask=columns < padded_vocab)
        lane_max, lane_sum_of_exp, lane_logit_sum = _add_to_lanes(
            lane_max, lane_sum_of_exp, lane_logit_sum, tl.where(inside, logits, float("-inf")),
            tl.where(inside, logits, 0.0), SMOOTHING)
    row_max = tl.max(lane_max, axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)
    sum_of_exp = tl.sum(lane_sum_of_exp * tl.exp(lane_max - shift), axis=0)
    return shift + tl.log(sum_of_exp), tl.where(known, target_logit, 0.0), tl.sum(lane_logit_sum, axis=0)


@triton.jit
def _unit_gradient(logits, log_sum_exp, is_target, vocab, smoothing, SMOOTHING: tl.constexpr):
    """d row loss / d logits: softmax - (1 - smoothing) * one_hot - smoothing / vocab (both plans'
    kernels; past the vocabulary their callers write 0)."""
    gradient = tl.exp(logits - log_sum_exp) - tl.where(is_target, 1.0 - smoothing, 0.0)
    if SMOOTHING:
        gradient -= smoothing / vocab
    return gradient


@triton.jit
def _gradient_of_block(row_logits, row_gradient, row_incoming, columns, log_sum_exp, target, row_scale, vocab,
                       padded_vocab, smoothing, MASKED: tl.constexpr, SMOOTHING: tl.constexpr,
                       HAS_INCOMING: tl.constexpr, TRANSFORM: tl.constexpr, WRITE_TRANSFORMED: tl.constexpr):
    """(softmax - (1 - smoothing) * one_hot - smoothing / vocab) * row_scale, plus what the logits
    received from other readers, at `columns`, times the model's TRANSFORM's derivative; 0 past the
    vocabulary, so the matmuls can read the padding. MASKED: the block reaches past the vocabulary.
    WRITE_TRANSFORMED: the transformed logits written over the logits read (returned logits)."""
    if MASKED:
        inside = columns < vocab
        logits = tl.load(row_logits + columns, mask=columns < padded_vocab, other=0.0).to(tl.float32)
        logits, slope = _transformed(logits, TRANSFORM)
        if WRITE_TRANSFORMED:
            tl.store(row_logits + columns, logits.to(row_logits.dtype.element_ty), mask=columns < padded_vocab)
        logits = tl.where(inside, logits, float("-inf"))
    else:
        logits, slope = _transformed(tl.load(row_logits + columns).to(tl.float32), TRANSFORM)
        if WRITE_TRANSFORMED:
            tl.store(row_logits + columns, logits.to(row_logits.dtype.element_ty))
    gradient = _unit_gradient(logits, log_sum_exp, columns == target, vocab, smoothing, SMOOTHING) * row_scale
    if HAS_INCOMING:
        if MASKED:
            gradient += tl.load(row_incoming + columns, mask=inside, other=0.0).to(tl.float32)
        else:
            gradient += tl.load(row_incoming + columns).to(tl.float32)
    if len(TRANSFORM) > 1:
        gradient = gradient * slope
    if MASKED:
        gradient = tl.where(inside, gradient, 0.0)
        tl.store(row_gradient + columns, gradient.to(row_gradient.dtype.element_ty), mask=columns < padded_vocab)
    else:
        tl.store(row_gradient + columns, gradient.to(row_gradient.dtype.element_ty))


@triton.jit
def _gradient_of_row(row_logits, row_gradient, row_incoming, log_sum_exp, target, row_scale, vocab, padded_vocab,
                     smoothing, SMOOTHING: tl.constexpr, HAS_INCOMING: tl.constexpr, TRANSFORM: tl.constexpr,
                     WRITE_TRANSFORMED: tl.constexpr, BLOCK: tl.constexpr):
    """Writes one row's d loss / d logits over its padded columns: whole blocks inside the
    vocabulary unmasked, the rest masked (`_gradient_of_block`)."""
    whole_blocks_end = vocab // BLOCK * BLOCK
    for start in range(0, whole_blocks_end, BLOCK):
        _gradient_of_block(row_logits, row_gradient, row_incoming, start + tl.arange(0, BLOCK), log_sum_exp, target,
                           row_scale, vocab, padded_vocab, smoothing, False, SMOOTHING, HAS_INCOMING, TRANSFORM,
                           WRITE_TRANSFORMED)
    for start in range(whole_blocks_end, padded_vocab, BLOCK):
        _gradient_of_block(row_logits, row_gradient, row_incoming, start + tl.arange(0, BLOCK), log_sum_exp, target,
                           row_scale, vocab, padded_vocab, smoothing, True, SMOOTHING, HAS_INCOMING, TRANSFORM,
                           WRITE_TRANSFORMED)


@triton.jit
def _row_start(pointer, row, row_stride):
    """The row's first element. Row strides are multiples of ALIGN (the chunks' padded
    vocabulary), said so to the compiler: 16-byte loads need rows that start 16-byte aligned, which
    it cannot prove of a stride such as GPT-2's 50264 alone."""
    return pointer + tl.multiple_of(row * row_stride, 8)


@triton.jit
def _loss_of_row(log_sum_exp, target_logit, logit_sum, valid, vocab, smoothing, SMOOTHING: tl.constexpr):
    """-log softmax[target], mixed with the mean of -log softmax over the vocabulary by `smoothing`
    (cross_entropy's label_smoothing); 0 where the target is ignored. Without smoothing the mean is
    not added at all: a masked word's -inf logit makes it inf, and 0 * inf is NaN."""
    loss = (1.0 - smoothing) * (log_sum_exp - target_logit)
    if SMOOTHING:
        loss += smoothing * (log_sum_exp - logit_sum / vocab)
    return tl.where(valid, loss, 0.0)


@triton.jit
def _count_targets(target_ptr, tokens, ignore_index, vocab, count_ptr, inside_ptr, BLOCK: tl.constexpr):
    """One program: count = the targets not ignored (fp32: the mean's divisor), inside = 1.0 if
    every one of them is inside [0, vocab), else 0.0 (the op asserts it, as aten's nll_loss)."""
    count = tl.full((), 0, tl.int32)
    outside = tl.full((), 0, tl.int32)
    for start in range(0, tokens, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        target = tl.load(target_ptr + offsets, mask=offsets < tokens, other=ignore_index)
        valid = target != ignore_index
        count += tl.sum(valid.to(tl.int32), axis=0)
        outside += tl.sum((valid & ((target < 0) | (target >= vocab))).to(tl.int32), axis=0)
    tl.store(count_ptr, count.to(tl.float32))
    tl.store(inside_ptr, (outside == 0).to(tl.float32))


@triton.jit
def _row_statistics(logits_ptr, logits_row_stride, first_token, target_ptr, log_sum_exp_ptr, row_loss_ptr, vocab,
                    padded_vocab, ignore_index, smoothing, SMOOTHING: tl.constexpr, TRANSFORM: tl.constexpr,
                    WRITE_TRANSFORMED: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of a chunk's logits (the token `first_token` + row): its log-sum-exp
    (kept for the backward) and its loss; the transformed logits written over the row where
    WRITE_TRANSFORMED (returned logits)."""
    row = tl.program_id(0).to(tl.int64)
    token = first_token + row
    target = tl.load(target_ptr + token)
    log_sum_exp, target_logit, logit_sum = _statistics_of_row(
        _row_start(logits_ptr, row, logits_row_stride), target, vocab, padded_vocab, SMOOTHING, TRANSFORM,
        WRITE_TRANSFORMED, BLOCK)
    tl.store(log_sum_exp_ptr + token, log_sum_exp)
    tl.store(row_loss_ptr + token,
             _loss_of_row(log_sum_exp, target_logit, logit_sum, target != ignore_index, vocab, smoothing, SMOOTHING))


@triton.jit
def _logits_gradient(logits_ptr, logits_row_stride, first_token, log_sum_exp_ptr, target_ptr, row_scale_ptr,
                     incoming_ptr, incoming_row_stride, gradient_ptr, gradient_row_stride, vocab, padded_vocab,
                     smoothing, SMOOTHING: tl.constexpr, HAS_INCOMING: tl.constexpr, TRANSFORM: tl.constexpr,
                     BLOCK: tl.constexpr):
    """One program per row of a chunk: the gradient of its logits (the backward that recomputes
    them); the incoming gradient is the whole [tokens, vocab] one, read at the row's token."""
    row = tl.program_id(0).to(tl.int64)
    token = first_token + row
    _gradient_of_row(_row_start(logits_ptr, row, logits_row_stride),
                     _row_start(gradient_ptr, row, gradient_row_stride),
                     incoming_ptr + token * incoming_row_stride, tl.load(log_sum_exp_ptr + token),
                     tl.load(target_ptr + token), tl.load(row_scale_ptr + token), vocab, padded_vocab, smoothing,
                     SMOOTHING, HAS_INCOMING, TRANSFORM, False, BLOCK)


@triton.jit
def _row_statistics_and_gradient(logits_ptr, logits_row_stride, first_token, target_ptr, log_sum_exp_ptr,
                                 row_loss_ptr, count_ptr, gradient_ptr, gradient_row_stride, vocab, padded_vocab,
                                 ignore_index, smoothing, MEAN: tl.constexpr, SMOOTHING: tl.constexpr,
                                 TRANSFORM: tl.constexpr, WRITE_TRANSFORMED: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of a chunk, the forward that forms the gradients for an upstream gradient
    of 1: the row's statistics and loss, then its gradient scaled by d loss / d row loss (1 over the
    count of counted targets for a mean, 1 for a sum, 0 where ignored), in place where gradient is
    logits: one launch, the row's second read from L2 while it is still there. WRITE_TRANSFORMED
    (returned logits, the gradient in its own buffer): the second read writes the transformed logits
    over the row."""
    row = tl.program_id(0).to(tl.int64)
    token = first_token + row
    row_logits = _row_start(logits_ptr, row, logits_row_stride)
    target = tl.load(target_ptr + token)
    valid = target != ignore_index
    log_sum_exp, target_logit, logit_sum = _statistics_of_row(row_logits, target, vocab, padded_vocab, SMOOTHING,
                                                              TRANSFORM, False, BLOCK)
    tl.store(log_sum_exp_ptr + token, log_sum_exp)
    tl.store(row_loss_ptr + token,
             _loss_of_row(log_sum_exp, target_logit, logit_sum, valid, vocab, smoothing, SMOOTHING))
    if MEAN:
        row_scale = 1.0 / tl.load(count_ptr)
    else:
        row_scale = 1.0
    row_scale = tl.where(valid, row_scale, 0.0)
    _gradient_of_row(row_logits, _row_start(gradient_ptr, row, gradient_row_stride), row_logits, log_sum_exp, target,
                     row_scale, vocab, padded_vocab, smoothing, SMOOTHING, False, TRANSFORM, WRITE_TRANSFORMED, BLOCK)


@triton.jit
def _add_column_sums(gradient_ptr, gradient_row_stride, rows, vocab, total_ptr, OVERWRITE: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """One program per BLOCK columns of a chunk's logits gradient: their sums over the chunk's rows,
    in fp32, added into the bias's gradient (written, not added, where OVERWRITE: the first chunk,
    so the gradient needs no zero fill)."""
    columns = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = columns < vocab
    sums = tl.zeros((BLOCK_ROWS, BLOCK), tl.float32)
    for start in range(0, rows, BLOCK_ROWS):
        row = (start + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        values = tl.load(gradient_ptr + row[:, None] * gradient_row_stride + columns[None, :],
                         mask=(row[:, None] < rows) & inside[None, :], other=0.0)
        sums += values.to(tl.float32)
    column_sums = tl.sum(sums, axis=0)
    if not OVERWRITE:
        column_sums += tl.load(total_ptr + columns, mask=inside, other=0.0)
    tl.store(total_ptr + columns, column_sums, mask=inside)


@triton.jit
def _finish_loss(row_loss_ptr, tokens, count_ptr, loss_ptr, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """One program: the loss of the rows' losses, their sum (over the count of counted targets,
    for a mean: 0 / 0 is NaN where none is counted, as eager's)."""
    partial = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, tokens, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        partial += tl.load(row_loss_ptr + offsets, mask=offsets < tokens, other=0.0)
    loss = tl.sum(partial, axis=0)
    if MEAN:
        loss = loss / tl.load(count_ptr)
    tl.store(loss_ptr, loss)


@triton.jit
def _scale(source_ptr, out_ptr, numel, scale_ptr, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    """out = source * scale[0], in fp32, rounded once to out's dtype; each program takes every
    num_programs-th block. In place, a scale of 1 reads and writes nothing (x * 1 rounds back to x):
    the usual `loss.backward()` then costs the formed weight gradient no pass over its bytes (the
    standalone head's: 1 GB each way, 0.5 ms), its launch a few programs that loop zero times."""
    scale = tl.load(scale_ptr).to(tl.float32)
    written = numel
    if IN_PLACE:
        written = tl.where(scale != 1.0, numel, 0)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    for start in range(first, written, tl.num_programs(0) * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < written
        values = tl.load(source_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, (values * scale).to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=inside)


@triton.jit
def _cast_rows(source_ptr, source_row_stride, source_rows, columns, out_ptr, BLOCK: tl.constexpr):
    """One program per row of out [rows, columns]: the source's row in out's dtype, zeros for the
    padding rows past the source's."""
    row = tl.program_id(0).to(tl.int64)
    read_columns = tl.where(row < source_rows, columns, 0)      # a padding row reads nothing
    for start in range(0, columns, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        values = tl.load(source_ptr + row * source_row_stride + offsets, mask=offsets < read_columns, other=0.0)
        tl.store(out_ptr + row * columns + offsets, values.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"),
                 mask=offsets < columns)


# -- the vocabulary-major plan's kernels: logits transposed, [vocabulary rows, tokens] ------------
@triton.jit
def _vocabulary_statistics(logits_ptr, rows, tokens, row_stride, first_vocab, target_ptr, rows_per_part, part_ptr,
                           SMOOTHING: tl.constexpr, TRANSFORM: tl.constexpr, BLOCK_V: tl.constexpr,
                           BLOCK_T: tl.constexpr):
    """Program (token block, part), token blocks varying fastest, over a [rows, tokens] tile of
    logits whose first row is vocabulary row `first_vocab`: over the part's rows, each token's max,
    sum of exps from it, target's logit (0 where the target is another part's row) and sum of
    logits, into part_ptr [4, parts, tokens]. Each of the BLOCK_V x BLOCK_T lanes keeps its own
    statistics, combined once after the loop; a block's loads run along the tokens (contiguous)."""
    token_blocks = tl.cdiv(tokens, BLOCK_T)
    program = tl.program_id(0)
    part = program // token_blocks
    plane = tl.num_programs(0) // token_blocks * tokens
    token = (program % token_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_inside = token < tokens
    target_row = tl.load(target_ptr + token, mask=token_inside, other=-1) - first_vocab
    lane_max = tl.full((BLOCK_V, BLOCK_T), float("-inf"), tl.float32)
    lane_sum_of_exp = tl.zeros((BLOCK_V, BLOCK_T), tl.float32)
    lane_logit_sum = tl.zeros((BLOCK_V, BLOCK_T), tl.float32)
    lane_target_logit = tl.zeros((BLOCK_V, BLOCK_T), tl.float32)
    first_row = part * rows_per_part
    last_row = tl.minimum(first_row + rows_per_part, rows)
    for start in range(first_row, last_row, BLOCK_V):
        row = start + tl.arange(0, BLOCK_V)
        inside = (row < last_row)[:, None] & token_inside[None, :]
        logits = tl.load(logits_ptr + row[:, None].to(tl.int64) * row_stride + token[None, :], mask=inside,
                         other=0.0).to(tl.float32)
        logits, _ = _transformed(logits, TRANSFORM)
        summed = tl.where(inside, logits, 0.0)
        logits = tl.where(inside, logits, float("-inf"))
        lane_max, lane_sum_of_exp, lane_logit_sum = _add_to_lanes(lane_max, lane_sum_of_exp, lane_logit_sum,
                                                                  logits, summed, SMOOTHING)
        lane_target_logit += tl.where(row[:, None] == target_row[None, :], summed, 0.0)
    token_max = tl.max(lane_max, axis=0)
    shift = tl.where(token_max == float("-inf"), 0.0, token_max)
    out = part_ptr + part * tokens + token
    tl.store(out, token_max, mask=token_inside)
    tl.store(out + plane, tl.sum(lane_sum_of_exp * tl.exp(lane_max - shift[None, :]), axis=0), mask=token_inside)
    tl.store(out + 2 * plane, tl.sum(lane_target_logit, axis=0), mask=token_inside)
    tl.store(out + 3 * plane, tl.sum(lane_logit_sum, axis=0), mask=token_inside)


@triton.jit
def _merge_statistics(part_ptr, parts, tokens, running_ptr, FIRST: tl.constexpr, BLOCK: tl.constexpr):
    """One program per BLOCK tokens: the parts' statistics ([4, parts, tokens]) merged into the
    running ones ([4, tokens]: max, sum of exps from it, target's logit, sum of logits), which the
    first call writes."""
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = token < tokens
    if FIRST:
        top = tl.full((BLOCK,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK,), tl.float32)
        target_logit = tl.zeros((BLOCK,), tl.float32)
        logit_sum = tl.zeros((BLOCK,), tl.float32)
    else:
        top = tl.load(running_ptr + token, mask=inside, other=float("-inf"))
        total = tl.load(running_ptr + tokens + token, mask=inside, other=0.0)
        target_logit = tl.load(running_ptr + 2 * tokens + token, mask=inside, other=0.0)
        logit_sum = tl.load(running_ptr + 3 * tokens + token, mask=inside, other=0.0)
    plane = parts * tokens
    for part in range(0, parts):
        at = part_ptr + part * tokens + token
        part_max = tl.load(at, mask=inside, other=float("-inf"))
        new_top = tl.maximum(top, part_max)
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        total = total * tl.exp(top - shift) + tl.load(at + plane, mask=inside, other=0.0) * tl.exp(part_max - shift)
        top = new_top
        target_logit += tl.load(at + 2 * plane, mask=inside, other=0.0)
        logit_sum += tl.load(at + 3 * plane, mask=inside, other=0.0)
    tl.store(running_ptr + token, top, mask=inside)
    tl.store(running_ptr + tokens + token, total, mask=inside)
    tl.store(running_ptr + 2 * tokens + token, target_logit, mask=inside)
    tl.store(running_ptr + 3 * tokens + token, logit_sum, mask=inside)


@triton.jit
def _finish_statistics(running_ptr, tokens, target_ptr, ignore_index, vocab, smoothing, log_sum_exp_ptr,
                       row_loss_ptr, SMOOTHING: tl.constexpr, BLOCK: tl.constexpr):
    """One program per BLOCK tokens: each token's log-sum-exp and loss from its merged statistics."""
    token = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = token < tokens
    top = tl.load(running_ptr + token, mask=inside, other=0.0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    log_sum_exp = shift + tl.log(tl.load(running_ptr + tokens + token, mask=inside, other=1.0))
    target_logit = tl.load(running_ptr + 2 * tokens + token, mask=inside, other=0.0)
    logit_sum = tl.load(running_ptr + 3 * tokens + token, mask=inside, other=0.0)
    target = tl.load(target_ptr + token, mask=inside, other=ignore_index)
    tl.store(log_sum_exp_ptr + token, log_sum_exp, mask=inside)
    tl.store(row_loss_ptr + token, _loss_of_row(log_sum_exp, target_logit, logit_sum, target != ignore_index, vocab,
                                                smoothing, SMOOTHING), mask=inside)


@triton.jit
def _vocabulary_gradient(logits_ptr, rows, tokens, row_stride, first_vocab, log_sum_exp_ptr, target_ptr, count_ptr,
                         ignore_index, vocab, smoothing, bias_gradient_ptr, MEAN: tl.constexpr,
                         SMOOTHING: tl.constexpr, HAS_BIAS: tl.constexpr, TRANSFORM: tl.constexpr,
                         BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program per BLOCK_V rows of a [rows, padded tokens] tile of logits (vocabulary rows
    `first_vocab` on), looping over the tokens: the logits' gradient for an upstream gradient of 1,
    (softmax - (1 - smoothing) * one_hot - smoothing / vocab) * d loss / d row loss, written over
    them; 0 at the padding tokens past `tokens` (the weight gradient's matmul reads them). With a
    bias, the rows' sums over the tokens are its gradient's rows (each row is formed once)."""
    row = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_inside = row < rows
    if MEAN:
        unit = 1.0 / tl.load(count_ptr)
    else:
        unit = 1.0
    row_sums = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, row_stride, BLOCK_T):
        token = start + tl.arange(0, BLOCK_T)
        token_inside = token < tokens
        mask = row_inside[:, None] & (token < row_stride)[None, :]
        pointers = logits_ptr + row[:, None].to(tl.int64) * row_stride + token[None, :]
        logits, slope = _transformed(tl.load(pointers, mask=mask, other=0.0).to(tl.float32), TRANSFORM)
        log_sum_exp = tl.load(log_sum_exp_ptr + token, mask=token_inside, other=0.0)
        target = tl.load(target_ptr + token, mask=token_inside, other=ignore_index)
        scale = tl.where(target != ignore_index, unit, 0.0)
        gradient = _unit_gradient(logits, log_sum_exp[None, :], row[:, None] == (target - first_vocab)[None, :],
                                  vocab, smoothing, SMOOTHING)
        if len(TRANSFORM) > 1:
            gradient = gradient * slope
        gradient = tl.where(token_inside[None, :], gradient * scale[None, :], 0.0)
        tl.store(pointers, gradient.to(logits_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            row_sums += tl.sum(gradient, axis=1)
    if HAS_BIAS:
        tl.store(bias_gradient_ptr + first_vocab + row, row_sums, mask=row_inside)


# Launched straight through their compiled launchers (memfuse.base.launch): on an H200 host Triton's own
# launch path cost 47 us a launch, and aten's calls this replaces 36-60 us each (a cast, a pad, a sum,
# a division; 2026-11-28), a launch here about 8.
class KernelFamily:
    """The DirectKernels of one @triton.jit kernel, one per value of its varying constexprs (`varying`,
    in order: family[values]), each made on first use: a model's logit transform is one more
    constexpr, with any constant in it."""

    def __init__(self, fn, options: dict, varying: tuple, **fixed):
        self.fn, self.options, self.varying, self.fixed = fn, options, varying, fixed
        self.made: dict = {}

    def __getitem__(self, values) -> DirectKernel:
        values = values if isinstance(values, tuple) and len(self.varying) > 1 else (values,)
        kernel = self.made.get(values)
        if kernel is None:
            kernel = DirectKernel(self.fn, self.options, **dict(zip(self.varying, values)), **self.fixed)
            self.made[values] = kernel
        return kernel


_ROW_OPTIONS = {"num_warps": NUM_WARPS}
ROW_STATISTICS = KernelFamily(_row_statistics, _ROW_OPTIONS, ("SMOOTHING", "TRANSFORM", "WRITE_TRANSFORMED"),
                              BLOCK=BLOCK_COLUMNS)
ROW_STATISTICS_AND_GRADIENT = KernelFamily(_row_statistics_and_gradient, _ROW_OPTIONS,
                                           ("MEAN", "SMOOTHING", "TRANSFORM", "WRITE_TRANSFORMED"), BLOCK=BLOCK_COLUMNS)
COUNT_TARGETS = DirectKernel(_count_targets, {"num_warps": 4}, BLOCK=1024)
LOGITS_GRADIENT = KernelFamily(_logits_gradient, _ROW_OPTIONS, ("HAS_INCOMING", "SMOOTHING", "TRANSFORM"),
                               BLOCK=BLOCK_COLUMNS)
FINISH_LOSS = {mean: DirectKernel(_finish_loss, {"num_warps": 4}, MEAN=mean, BLOCK=4096) for mean in (False, True)}
CAST_ROWS = DirectKernel(_cast_rows, {"num_warps": 4}, BLOCK=1024)
# the bias's gradient a chunk: one launch where aten took a sum and an add
COLUMN_SUMS_BLOCK = 256
ADD_COLUMN_SUMS = {overwrite: DirectKernel(_add_column_sums, {"num_warps": 4}, OVERWRITE=overwrite, BLOCK_ROWS=16,
                                           BLOCK=COLUMN_SUMS_BLOCK) for overwrite in (False, True)}
# the vocabulary-major plan's kernels; tiles: the fastest on the standalone head's [62184, 8192] kept
# logits and [5888, 8192] chunks, one H200, its inputs (2026-11-28): statistics 0.545 and 0.069 ms,
# the gradient 0.51 ms on the kept logits, a copy of them 0.48
STATISTICS_BLOCK_V, STATISTICS_BLOCK_T, STATISTICS_ROWS_PER_PART = 16, 64, 1024
STATISTICS_PARTS_MAX = 64       # a call's parts at most (more rows a part where there are more rows)
VOCABULARY_STATISTICS = KernelFamily(_vocabulary_statistics, {"num_warps": 4}, ("SMOOTHING", "TRANSFORM"),
                                     BLOCK_V=STATISTICS_BLOCK_V, BLOCK_T=STATISTICS_BLOCK_T)
MERGE_BLOCK = 1024
MERGE_STATISTICS = {first: DirectKernel(_merge_statistics, {"num_warps": 4}, FIRST=first, BLOCK=MERGE_BLOCK)
                    for first in (False, True)}
FINISH_STATISTICS = {smoothing: DirectKernel(_finish_statistics, {"num_warps": 4}, SMOOTHING=smoothing,
                                             BLOCK=MERGE_BLOCK) for smoothing in (False, True)}
GRADIENT_BLOCK_V, GRADIENT_BLOCK_T = 8, 512
VOCABULARY_GRADIENT = KernelFamily(_vocabulary_gradient, {"num_warps": 4},
                                   ("MEAN", "SMOOTHING", "HAS_BIAS", "TRANSFORM"), BLOCK_V=GRADIENT_BLOCK_V,
                                   BLOCK_T=GRADIENT_BLOCK_T)
SCALE_BLOCK = 2048
# _scale's most programs, each looping over its blocks: enough to fill an H200 (132 SMs x 8 programs of
# 8 warps) for a copy; a launch of them costs microseconds where one program a block cost 0.2 ms on
# the standalone head's weight gradient (256K programs that found a scale of 1).
SCALE_PROGRAMS = 2048
SCALE = {in_place: DirectKernel(_scale, {"num_warps": 8}, IN_PLACE=in_place, BLOCK=SCALE_BLOCK)
         for in_place in (False, True)}
KERNEL_FAMILIES = (ROW_STATISTICS, ROW_STATISTICS_AND_GRADIENT, LOGITS_GRADIENT, VOCABULARY_STATISTICS,
                   VOCABULARY_GRADIENT)
FIXED_KERNELS = (COUNT_TARGETS, *FINISH_LOSS.values(), CAST_ROWS, *ADD_COLUMN_SUMS.values(), *SCALE.values(),
                 *MERGE_STATISTICS.values(), *FINISH_STATISTICS.values())


def direct_kernels() -> tuple:
    """Every DirectKernel of the op made so far."""
    return (*FIXED_KERNELS, *(kernel for family in KERNEL_FAMILIES for kernel in family.made.values()))


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
    Tensor.to and a pad were two aten calls (~40 and ~60 us of an H200 host); into `out` (contiguous
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
# call the implementation itself (memfuse.runtime.externs.SUBSTITUTES): the dispatcher and the custom op's
# wrappers cost the host about 40 us a call on a CPU, and a program runs without autograd.
linear_cross_entropy = torch.library.custom_op("memfuse::linear_cross_entropy", mutates_args=())(
    linear_cross_entropy_impl)


def _chunks(tokens: int, rows: int) -> list:
    """(first, last) token of each chunk of `rows` rows; none for no tokens. The kernels take the
    first token and index the [tokens] tensors themselves, so a chunk makes views only for its
    matmuls. Small chunks leave the step to the host: Llama's head in 512-row chunks took 9.5-10.2
    ms to enqueue 8.1 ms of GPU work (one H200, 2026-11-27), about 0.25 ms a chunk, against 2.1-2.8
    ms for 4 chunks of 4096 rows."""
    return [(first, min(first + rows, tokens)) for first in range(0, tokens, rows)]


# -- the vocabulary-major plan --------------------------------------------------------------------
# The rows plan's chunks hold whole rows of logits (a row's gradient needs its log-sum-exp over the
# whole vocabulary), so each chunk's product adds into the whole [vocab, H] weight gradient, reading
# and writing it: at small chunks that traffic is most of the head's time (the standalone head in
# Liger's memory, 256-row chunks: 32 x 0.81 ms of cuBLAS addmm). The vocabulary-major plan never
# adds into the weight gradient. The forward forms the logits transposed, [vocabulary rows, tokens],
# in the weight gradient's own storage (allocated then, as the rows plan does): first the rows it
# will not keep, a storage-full at a time, for their statistics only, then as many rows as it keeps.
# Once every token's log-sum-exp is known, the kept rows' gradient is formed over them, goes into
# the hidden states' gradient (one matmul), then into the weight gradient's rows, each write over
# logits already read. The rows not kept are formed again in rounds, each in the part of the
# storage not yet written (about half of what is left a round), the last in the transient. Cost:
# the rows not kept take a fourth matmul (the standalone head keeps 48%); nothing is added into
# the weight gradient, and the head's transient is a small buffer, not a chunk of logits.
VOCABULARY_LEAD = 16          # a step's first write is 1/16 of its rows: its logits start that far in
# A logits matmul's most vocabulary rows: cuBLAS ran [rows, 4096] x [4096, 8192] at 10.98 ms per 128256
# rows in matmuls of 16384 rows, 11.07 of 8192, 12.09 of 62184 at once, 12.49 of 5908, one H200,
# the standalone head's inputs (2026-11-28)
LOGITS_MATMUL_ROWS = 16384
# The backward's transient buffer: 1/32 of the weight gradient's bytes, or more (up to the chunk's
# bytes) where the plan would take more steps than VOCABULARY_STEPS_MAX: the hidden states' gradient
# adds up in the matmul's dtype, one rounding a step (the rows plan's weight gradient, one a chunk:
# 8 at the standalone head's default), and each step costs the host its launches.
VOCABULARY_TRANSIENT_SHARE = 32
VOCABULARY_STEPS_MAX = 12
# Matmul FLOPs worth one byte of memory traffic in the plans' predicted times: an H200 ran the
# standalone head's [8192, 4096] x [4096, 128256] bf16 product at about 820 TFLOP/s and copied 1 GB
# at 4.2 TB/s (2026-11-28).
FLOPS_PER_BYTE = 195
# The vocabulary-major plan's matmuls took this many times their FLOPs' worth at the rows plan's rate:
# more, smaller matmuls (the standalone head: 42.5 ms of matmuls for 3.5 products, one H200,
# 2026-11-28). With it the predicted ratio of the plans' times was 1.18 at 1024-row chunks (measured
# 1.155) and 0.885 at 256-row chunks (measured 0.856).
VOCABULARY_MATMUL_OVERHEAD = 1.11
# "auto" takes the vocabulary-major plan where it lowers the head's peak at no more than this many
# times the rows plan's predicted time: memory first, within issue 18's bar for time.
VOCABULARY_TIME_RATIO = 1.1


@dataclasses.dataclass(frozen=True)
class VocabularyStep:
    """Vocabulary rows first..first+rows: their logits [rows, padded tokens] at byte `logits_at` of
    the weight gradient's storage (None: in the transient buffer), their gradient written over them,
    then the weight gradient's rows, `writes` rows a matmul in order, each over logits read already."""
    first: int
    rows: int
    logits_at: Optional[int]
    writes: tuple


@dataclasses.dataclass(frozen=True)
class VocabularyPlan:
    """The steps over the vocabulary: steps[0]'s logits the forward keeps, the others' the backward
    forms again. `tokens`: padded to ALIGN, the logits' row stride."""
    tokens: int
    steps: tuple
    forward_rows: int       # the forward's rows a piece for those not kept, formed first in the empty storage
    tail_rows: int          # the backward's

    @property
    def kept_rows(self) -> int:
        return self.steps[0].rows


def vocabulary_plan(tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, weight_dtype: torch.dtype,
                    transient_bytes: int) -> Optional[VocabularyPlan]:
    """The vocabulary-major plan's steps; None where it keeps nothing: a vocabulary row's logits
    ([tokens] in `dtype`) take no more bytes than its row of the weight gradient ([H] in the
    weight's dtype), or the weight gradient's storage holds fewer rows of logits than the
    transient. Steps in the storage until one would hold fewer rows than the transient."""
    padded = _padded(tokens)
    logits_row = padded * dtype.itemsize
    gradient_row = hidden_size * weight_dtype.itemsize
    if not tokens or logits_row <= gradient_row or gradient_row % dtype.itemsize:
        return None
    tail_rows = transient_bytes // logits_row
    tail_rows = tail_rows // ALIGN * ALIGN if tail_rows >= ALIGN else max(1, tail_rows)
    steps, first = [], 0
    while first < vocab:
        left = vocab - first
        rows, lead = _step_rows(left, logits_row, gradient_row)
        if rows < max(ALIGN, tail_rows):      # the transient holds more: fewer, larger steps
            rows = min(left, tail_rows)
            steps.append(VocabularyStep(first, rows, None, (rows,)))
        else:
            steps.append(VocabularyStep(first, rows, (first + lead) * gradient_row,
                                        _writes(rows, lead, logits_row, gradient_row)))
        first += rows
    if steps[0].logits_at is None:
        return None
    # the forward forms the rows not kept first, in the storage while it is empty (no transient, and
    # matmuls as large as it holds), in even pieces, then the kept rows over them
    capacity = vocab * gradient_row // logits_row // ALIGN * ALIGN
    not_kept = vocab - steps[0].rows
    pieces = max(1, -(-not_kept // capacity))
    forward_rows = min(capacity, -(-not_kept // (pieces * ALIGN)) * ALIGN)
    return VocabularyPlan(padded, tuple(steps), forward_rows, tail_rows)


def _step_rows(left: int, logits_row: int, gradient_row: int) -> tuple[int, int]:
    """(rows, lead) of a step in the storage of the weight gradient's `left` last rows: its logits
    start `lead` gradient rows in and end inside; rows a multiple of ALIGN, (0, 0) where none fit."""
    rows = left * gradient_row // (logits_row + gradient_row // VOCABULARY_LEAD) // ALIGN * ALIGN
    while rows > 0:
        lead = min(rows, -(-rows // (VOCABULARY_LEAD * ALIGN)) * ALIGN)
        if rows * logits_row + lead * gradient_row <= left * gradient_row:
            return rows, lead
        rows -= ALIGN
    return 0, 0


def _writes(rows: int, lead: int, logits_row: int, gradient_row: int) -> tuple:
    """The weight gradient's rows a matmul: after `done` rows the next write may reach the logits'
    start (`lead` rows in) plus the logits rows read by then, less the rows written."""
    writes, done = [], 0
    while done < rows:
        write = min(rows - done, lead + done * (logits_row - gradient_row) // gradient_row)
        writes.append(write)
        done += write
    return tuple(writes)


@dataclasses.dataclass(frozen=True)
class PlanChoice:
    """Which plan a call runs ("rows" or "vocabulary") and why; the vocabulary-major plan's steps."""
    name: str
    reason: str
    vocabulary: Optional[VocabularyPlan] = None

    def __str__(self) -> str:
        return f"{self.name} plan: {self.reason}"


@functools.lru_cache(maxsize=256)      # a call's sizes: the same every step of a training loop
def choose_plan(tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, weight_dtype: torch.dtype,
                hidden_dtype: torch.dtype, chunk_bytes: int, requested: str = "auto") -> PlanChoice:
    """The plan of a head whose forward forms the gradients (a mean or sum loss, logits not
    returned). "auto": the vocabulary-major plan where it lowers the head's transient bytes at no
    more than VOCABULARY_TIME_RATIO times the rows plan's predicted time (3 matmuls, passes over the
    logits, the rows plan's adds into the weight gradient, the other's fourth matmul over the rows
    it does not keep), else the rows plan."""
    if requested not in LOSS_HEAD_PLANS:
        raise ValueError(f"memfuse.linear_cross_entropy: plan {requested!r}, expected one of {LOSS_HEAD_PLANS}")
    if requested == "rows":
        return PlanChoice("rows", "asked for")
    gradient_bytes = vocab * hidden_size * weight_dtype.itemsize
    transient = min(chunk_bytes, gradient_bytes // VOCABULARY_TRANSIENT_SHARE)
    plan = vocabulary_plan(tokens, hidden_size, vocab, dtype, weight_dtype, transient)
    while plan is not None and len(plan.steps) > VOCABULARY_STEPS_MAX and transient < chunk_bytes:
        larger = vocabulary_plan(tokens, hidden_size, vocab, dtype, weight_dtype, min(chunk_bytes, 2 * transient))
        if larger is None:      # the transient would hold more rows than the storage: keep the steps
            break
        transient, plan = min(chunk_bytes, 2 * transient), larger
    if plan is None:
        return PlanChoice("rows", "the vocabulary-major plan would keep no logits (a vocabulary row's logits "
                                  "take no more bytes than its row of the weight gradient)")
    if requested == "vocabulary":
        return PlanChoice("vocabulary", "asked for", plan)
    product = 2 * plan.tokens * vocab * hidden_size
    logits_bytes = plan.tokens * vocab * dtype.itemsize
    rows = chunk_rows(tokens, vocab, dtype, chunk_bytes)
    cast_row = hidden_size * dtype.itemsize if hidden_dtype != dtype else 0
    rows_time = 3 * product + FLOPS_PER_BYTE * (2 * logits_bytes + 2 * (-(-tokens // rows) - 1) * gradient_bytes)
    rows_transient = rows * (row_bytes(vocab, dtype) + cast_row)
    recomputed = vocab - plan.kept_rows
    vocabulary_time = (VOCABULARY_MATMUL_OVERHEAD * (3 + recomputed / vocab) * product
                       + FLOPS_PER_BYTE * 3 * logits_bytes)
    needs_cast = hidden_dtype != dtype or plan.tokens != tokens
    vocabulary_transient = (plan.tail_rows * plan.tokens * dtype.itemsize
                            + (plan.tokens * hidden_size * dtype.itemsize if needs_cast else 0))
    ratio = vocabulary_time / rows_time
    saved = (rows_transient - vocabulary_transient) / 2**20
    if saved > 0 and ratio <= VOCABULARY_TIME_RATIO:
        return PlanChoice("vocabulary", f"{saved:.0f} MiB less at the head's peak at {ratio:.2f}x the rows plan's "
                                        f"predicted time (keeps {plan.kept_rows} of {vocab} vocabulary rows' "
                                        f"logits; forms {recomputed} again)", plan)
    if saved <= 0:
        return PlanChoice("rows", "the vocabulary-major plan would not lower the head's peak")
    return PlanChoice("rows", f"the vocabulary-major plan would take {ratio:.2f}x the rows plan's predicted time "
                              f"(above {VOCABULARY_TIME_RATIO}x) to save {saved:.0f} MiB")


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
    (hidden, weight, bias, target, ignore_index, reduction, label_smoothing, dtype, return_logits, _,
     chunk_bytes, differentiable_logits, _plan, transform) = inputs
    _, log_sum_exp, logits, *units = output
    ctx.save_for_backward(hidden, weight, bias, target, log_sum_exp, *units)
    ctx.settings = (ignore_index, reduction, label_smoothing, dtype, chunk_bytes, transform)
    ctx.return_logits = return_logits and differentiable_logits
    ctx.mark_non_differentiable(log_sum_exp, *units, *([] if differentiable_logits else [logits]))
    ctx.set_materialize_grads(False)    # logits nobody differentiates: None, not [tokens, vocab] zeros


def _backward(ctx, loss_gradient, _log_sum_exp_gradient, logits_gradient, *_unit_gradients):
    hidden, weight, bias, target, log_sum_exp, *units = ctx.saved_tensors
    incoming = logits_gradient if ctx.return_logits else None
    if loss_gradient is None:      # only the logits are differentiated
        loss_gradient = log_sum_exp.new_zeros(() if ctx.settings[1] != "none" else log_sum_exp.shape)
    hidden_gradient, weight_gradient, bias_gradient = linear_cross_entropy_backward(
        loss_gradient, incoming, hidden, weight, bias, target, log_sum_exp, *units, *ctx.settings)
    return (hidden_gradient, weight_gradient, bias_gradient if bias is not None else None,
            None, None, None, None, None, None, None, None, None, None, None)


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
