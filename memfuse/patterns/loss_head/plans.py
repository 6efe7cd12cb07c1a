"""The loss head's plans: how many token rows a chunk holds (the rows plan), and the vocabulary-major
plan with the choice between them (`choose_plan`, per call)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from memfuse.base.config import LOSS_HEAD_PLANS

# A matmul dimension that is a multiple of this many elements runs cuBLAS's aligned kernels.
ALIGN = 8
# Chunks of at least this many token rows hold a multiple of it: the widest tile cuBLAS's kernels
# take along a chunk's rows (its logits' M, its weight gradient's K), so no tile runs part empty
# (520 rows, the head alone's chunk before: 5 tiles of 128 rows for 4 rows' worth of work).
ROW_TILE = 256
# Columns one program reads per step of its loop over the vocabulary, and its warps: the fastest
# of BLOCK 1024-8192 x 4-16 warps for [2096, 32000], [1328, 50257] and [512, 128256] chunks
# (docs/benchmarks.md).
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


# -- the vocabulary-major plan --------------------------------------------------------------------
# The rows plan's chunks hold whole rows of logits (a row's gradient needs its log-sum-exp over the
# whole vocabulary), so each chunk's product adds into the whole [vocab, H] weight gradient, reading
# and writing it: at small chunks that traffic is most of the head's time (the standalone head in
# Liger's memory, 256-row chunks: 32 cuBLAS addmms over the whole gradient). The vocabulary-major plan never
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
# A logits matmul's most vocabulary rows: cuBLAS ran [rows, 4096] x [4096, 8192] fastest in matmuls
# of 16384 rows, against 8192, 5908 or 62184 at once (the standalone head's inputs)
LOGITS_MATMUL_ROWS = 16384
# The backward's transient buffer: 1/32 of the weight gradient's bytes, or more (up to the chunk's
# bytes) where the plan would take more steps than VOCABULARY_STEPS_MAX: the hidden states' gradient
# adds up in the matmul's dtype, one rounding a step (the rows plan's weight gradient, one a chunk:
# 8 at the standalone head's default), and each step costs the host its launches.
VOCABULARY_TRANSIENT_SHARE = 32
VOCABULARY_STEPS_MAX = 12
# Matmul FLOPs worth one byte of memory traffic in the plans' predicted times: the ratio of the
# GPU's bf16 matmul rate (the standalone head's [8192, 4096] x [4096, 128256] product) to its copy
# bandwidth, as measured (docs/benchmarks.md).
FLOPS_PER_BYTE = 195
# The vocabulary-major plan's matmuls take this many times their FLOPs' worth at the rows plan's rate:
# more, smaller matmuls (the standalone head's, as measured). With it the predicted ratio of the
# plans' times stays within a few percent of the measured one at 256- and 1024-row chunks.
VOCABULARY_MATMUL_OVERHEAD = 1.11
# "auto" takes the vocabulary-major plan where it lowers the head's peak at no more than this many
# times the rows plan's predicted time: memory first, within a bar for time.
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
