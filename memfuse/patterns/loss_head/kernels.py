"""The loss head's Triton kernels: row statistics and gradients of a chunk's logits, the vocabulary-major
plan's kernels over transposed logits, and the small kernels around them (target counts, the loss's
finish, scales, column sums). memfuse.patterns.loss_head.op launches them."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

from memfuse.base.launch import DirectKernel
from memfuse.patterns.loss_head.plans import ALIGN, BLOCK_COLUMNS, NUM_WARPS
from memfuse.patterns.loss_head.transform import ROUNDINGS, STEP_KINDS

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
    GPT-2's 50257, is not provably aligned: masked throughout, every load would be a masked one).
    The target's logit is one load,
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
    standalone head's: 1 GB each way), its launch a few programs that loop zero times."""
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


# Launched straight through their compiled launchers (memfuse.base.launch): Triton's own launch path
# binds and looks up every argument on each call, and so costs the host several times what the
# compiled launcher does; the aten calls these replace (a cast, a pad, a sum, a division) cost as much
# each.
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
# the vocabulary-major plan's kernels; tiles: the fastest measured on the standalone head's
# [62184, 8192] kept logits and [5888, 8192] chunks (the gradient about a copy's time on them;
# docs/benchmarks.md holds the timings)
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
SCALE = {in_place: DirectKernel(_scale, {"num_warps": 8}, IN_PLACE=in_place, BLOCK=SCALE_BLOCK)
         for in_place in (False, True)}
KERNEL_FAMILIES = (ROW_STATISTICS, ROW_STATISTICS_AND_GRADIENT, LOGITS_GRADIENT, VOCABULARY_STATISTICS,
                   VOCABULARY_GRADIENT)
FIXED_KERNELS = (COUNT_TARGETS, *FINISH_LOSS.values(), CAST_ROWS, *ADD_COLUMN_SUMS.values(), *SCALE.values(),
                 *MERGE_STATISTICS.values(), *FINISH_STATISTICS.values())


def direct_kernels() -> tuple:
    """Every DirectKernel of the op made so far."""
    return (*FIXED_KERNELS, *(kernel for family in KERNEL_FAMILIES for kernel in family.made.values()))
