"""Named policies and thresholds: every knob of the pipeline, documented in one place."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional, Union


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


# The units a byte budget may be written in: decimal (GB = 10**9 bytes, as disk and GPU makers
# count) and binary (GiB = 2**30, as torch.cuda.memory_allocated and nvidia-smi's MiB count).
BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_BYTES_TEXT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]+)\s*$")
BUDGET_EXPECTED = ("memory_budget must be a number in (0, 1] (a fraction of the default plan's saved bytes; "
                   "1.0 keeps the default plan) or a byte target for the step's peak: a whole number of bytes "
                   "above 1, or a string with a unit (\"12GB\" = 12*10**9 bytes, \"12GiB\" = 12*2**30, \"800MB\")")


def is_byte_budget(budget) -> bool:
    """A parsed Config.memory_budget that is a byte target (an int above 1), not a fraction."""
    return isinstance(budget, int) and not isinstance(budget, bool) and budget > 1


def parse_memory_budget(value):
    """Config.memory_budget as the planner reads it: a fraction (a float or int in (0, 1]) as it is,
    a byte count (an int above 1) as it is, a string with a unit ("12GB", "1.5GiB") as whole bytes.
    Anything else is a ValueError naming memory_budget and what it takes."""
    if isinstance(value, str):
        match = _BYTES_TEXT.match(value)
        unit = match and BYTE_UNITS.get(match.group(2).upper())
        if unit and int(float(match.group(1)) * unit) > 1:
            return int(float(match.group(1)) * unit)
    elif is_byte_budget(value) or not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value <= 1:
        return value
    raise ValueError(f"memfuse: {BUDGET_EXPECTED}, got {value!r}")


def _env_budget():
    """MEMFUSE_MEMORY_BUDGET, read as Config.memory_budget (1.0 when unset): a number is a fraction,
    a number with a unit ("12GB") a byte target."""
    text = os.environ.get("MEMFUSE_MEMORY_BUDGET", "").strip()
    if not text:
        return 1.0
    if _BYTES_TEXT.match(text):
        return text
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"memfuse: MEMFUSE_MEMORY_BUDGET={text!r} is not a number; expected a fraction in "
                         f"(0, 1] of the default plan's saved bytes, e.g. 0.5, or a byte target with a unit, "
                         f"e.g. 12GB (10**9 bytes) or 12GiB (2**30)") from None


# A loss-head chunk's most token rows (where Config.loss_head_chunk_rows is unset, on one process:
# memfuse.patterns.loss_head.detect.rows_cap) and most bytes of logits; the smaller wins (memfuse.patterns.loss_head.detect.chunk_bytes).
# Llama's and GPT-2's heads of `make bench-models` run in 16 chunks of 1024 rows, well under
# torch.compile's peak and no slower (docs/benchmarks.md); a 128256-word head in 1024-row chunks
# too (263 MB), a wider one in fewer rows.
DEFAULT_LOSS_HEAD_CHUNK_ROWS = 1024
DEFAULT_LOSS_HEAD_CHUNK_BYTES = 256 * 2**20
LOSS_HEAD_PLANS = ("auto", "rows", "vocabulary")


def _env_whole_number(name: str, default: Optional[int], example: str) -> Optional[int]:
    """The environment variable `name` as a whole number, `default` when unset."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"memfuse: {name}={text!r} is not a whole number; expected e.g. {example}") from None


def default_cache_dir() -> Path:
    return Path(os.environ.get("MEMFUSE_CACHE_DIR", Path.home() / ".cache" / "memfuse"))


@dataclass(frozen=True)
class Config:
    # Longest row (D) kept whole in registers by a persistent kernel; longer rows are looped.
    max_row_length: int = 16384
    # Columns per chunk of a looped kernel (rows longer than max_row_length); rounded down to
    # a power of two no larger than max_row_length.
    loop_block_d: int = 2048
    # Without a GPU (Triton's interpreter): elements of one [BLOCK_M, BLOCK_D] tile, and the
    # grid of kernels with reductions over M. GPU launches use memfuse.codegen.tuning's configurations.
    tile_elements: int = 4096
    cpu_programs: int = 2
    # Turn every extern (aten) fallback into an error naming the op (MEMFUSE_STRICT=1).
    strict: bool = field(default_factory=lambda: _env_flag("MEMFUSE_STRICT"))
    # memory_efficient_fusion: integer inputs' last dims (token ids, labels) traced as size symbols,
    # so a new sequence length is no new compile. MEMFUSE_SYMBOLIC_TOKEN_DIMS=0 turns it off (each
    # sequence length its own program, the length a compile-time D).
    symbolic_token_dims: bool = field(default_factory=lambda: os.environ.get("MEMFUSE_SYMBOLIC_TOKEN_DIMS", "1")
                                      .strip().lower() not in ("0", "false", "no", "off"))
    # Where generated kernels are written, one content-addressed file each.
    cache_dir: Path = field(default_factory=default_cache_dir)
    # Run the IR verifier after every stage (tests turn it on; MEMFUSE_CHECK=1).
    check: bool = field(default_factory=lambda: _env_flag("MEMFUSE_CHECK"))
    # On a GPU, compile a program's Triton kernels in parallel threads when it is built, instead
    # of one by one at their first launch (memfuse.runtime.precompile). MEMFUSE_PRECOMPILE=0 turns it off.
    precompile: bool = field(default_factory=lambda: os.environ.get("MEMFUSE_PRECOMPILE", "1").strip().lower()
                             not in ("0", "false", "no", "off"))
    # Kernels read the dropout seed from a 1-element int64 tensor (`seed_ptr`) instead of taking
    # it as a scalar argument: a CUDA-graph replay cannot take a new Python int, but the graph
    # can advance a seed in memory. `memory_efficient_fusion(fn, cuda_graphs=True)` sets it.
    seed_from_memory: bool = False
    # CUDA-graph mode: most graph pairs (forward + backward) one fused function captures, over
    # all its call signatures; calls past it run without graphs (logged once).
    cuda_graphs_limit: int = 32
    # Align the operands of extern matmuls (mm, bmm, addmm) as torch.compile's pad_mm does: a static
    # M, N or K that is not a multiple of 8 elements (fp16/bf16) or 4 (fp32) is padded with zeros and
    # the result sliced back, so cuBLAS runs its aligned kernels (an odd vocabulary of 50257 otherwise
    # runs the LM head in `align1` kernels, several times slower). memfuse.schedule.padding; `explain` lists each
    # matmul's decision. "auto": matmuls traced on CUDA whose static dims say it pays
    # (pad_matmul_min_intensity); "force": every unaligned static dim, any device (tests, measurements);
    # "off": never. MEMFUSE_PAD_MATMULS sets it.
    pad_matmuls: str = field(default_factory=lambda: os.environ.get("MEMFUSE_PAD_MATMULS", "auto").strip().lower())
    # "auto" pads a matmul when it is compute-bound enough for the aligned kernels' speed to pay for the
    # pad: its arithmetic intensity MNK / (MK + KN + MN) in elements, with symbolic dims (the tokens)
    # taken as large, is at least this. pad_mm's test: above half the machine balance, about 100-150 on
    # current data-centre GPUs in bf16 (the LM head of GPT-2: 756; a [101 x 64] test matmul: 39).
    pad_matmul_min_intensity: float = 100.0
    # The memory the planner aims for, one of two kinds (memfuse.plan's budget):
    # - a fraction in (0, 1] of the bytes the default plan keeps for the backward: below 1.0 the
    #   planner recomputes more in the backward, cheapest first (reductions over M, then matmuls);
    # - a byte target for the step's peak as this program sees it (memfuse.plan.predicted_peak): an
    #   int above 1, or a string with a unit, "12GB" (decimal, 10**9 bytes) or "12GiB" (binary,
    #   2**30), parsed to whole bytes here. The planner keeps, recomputes or offloads to host memory
    #   (Plan.offloaded) per value, cheapest time first, until the predicted peak is at most the target.
    # MEMFUSE_MEMORY_BUDGET sets it; so do `memory_efficient_fusion(fn, memory_budget=0.5)` and
    # torch.compile's options={"memory_budget": "12GB"}.
    memory_budget: Union[float, int, str] = field(default_factory=_env_budget)
    # The loss head (a linear layer's output read only by cross_entropy) runs chunked, its
    # [tokens, vocab] logits never whole (memfuse.patterns.loss_head.detect, memfuse.patterns.loss_head.op). MEMFUSE_CHUNK_LOSS_HEAD=0
    # turns it off; options={"chunk_loss_head": False} under torch.compile.
    chunk_loss_head: bool = field(default_factory=lambda: os.environ.get("MEMFUSE_CHUNK_LOSS_HEAD", "1").strip()
                                  .lower() not in ("0", "false", "no", "off"))
    # The most token rows a loss-head chunk holds and the most bytes its logits (their gradient
    # written over them) may take: the smaller of the two, at memory_budget 1.0
    # (memfuse.patterns.loss_head.detect.chunk_bytes). Rows unset: 1024 on one process, none under torch.distributed
    # with more than one rank (memfuse.patterns.loss_head.detect.rows_cap). MEMFUSE_LOSS_HEAD_CHUNK_ROWS and
    # MEMFUSE_LOSS_HEAD_CHUNK_BYTES set them; under torch.compile options={"loss_head_chunk_rows": n}
    # and {"loss_head_chunk_bytes": n}.
    loss_head_chunk_rows: Optional[int] = field(default_factory=lambda: _env_whole_number(
        "MEMFUSE_LOSS_HEAD_CHUNK_ROWS", None, "1024 (token rows)"))
    loss_head_chunk_bytes: int = field(default_factory=lambda: _env_whole_number(
        "MEMFUSE_LOSS_HEAD_CHUNK_BYTES", DEFAULT_LOSS_HEAD_CHUNK_BYTES, "33554432 (32 MiB)"))
    # The loss head's plan where its forward forms the gradients (a mean or sum loss, logits not
    # returned): "rows" chunks token rows; "vocabulary" forms the logits transposed, keeping what fits
    # in the weight gradient's storage and forming the rest again (memfuse.patterns.loss_head.op, "the
    # vocabulary-major plan"); "auto" takes the vocabulary-major plan per call where it lowers the
    # head's peak at no more than 1.1x the rows plan's predicted time. MEMFUSE_LOSS_HEAD_PLAN sets
    # it; options={"loss_head_plan": "rows"} under torch.compile.
    loss_head_plan: str = field(default_factory=lambda: os.environ.get("MEMFUSE_LOSS_HEAD_PLAN", "auto").strip())
    # A [batch, 1, q, q] boolean mask a backend graph returns is marked causal for the FusedModules
    # that receive it (memfuse.patterns.attention), looked at once per set of sizes where the graph built it
    # from sizes alone. HuggingFace's mask also reads position ids made in eager code; with this on it
    # is looked at every call, one wait for the GPU a step (slower where steps are paced by the
    # host, as under FSDP2). options={"check_returned_masks": True} under torch.compile.
    check_returned_masks: bool = False
    # Compile without running (memfuse.check_compiles; MEMFUSE_COMPILE_ONLY=1): every stage runs,
    # codegen included, but no kernel is launched and none is handed to Triton's compiler (it needs
    # a GPU); the programs run on fake tensors (FakeTensorMode), allocating, viewing and calling
    # their externs' fake implementations, so a training step "runs" at any size in seconds. A
    # compile that fails raises (as in strict mode): there is nothing to fall back for.
    compile_only: bool = field(default_factory=lambda: _env_flag("MEMFUSE_COMPILE_ONLY"))
    # A debugging and benchmark knob: saved values the forward copies to host memory (pinned, on a
    # side stream) and the backward fetches back ahead of their first reader (Plan.offloaded,
    # memfuse.runtime.offload), whatever the planner chose. A tuple of saved-value names (as explain
    # lists them), or "all": every saved value the forward computes (not an input, not one it
    # returns) of at least offload_min_bytes. Off under CUDA graphs (a graph replays device memory).
    offload_saved: Union[tuple, str] = ()
    # "all" leaves smaller values on the device: a copy each way costs a launch for few bytes.
    offload_min_bytes: int = 2**20
    # The backward issues an offloaded value's fetch this many launching steps (kernels, aten calls;
    # not views) before its first reader, so the copy overlaps them and no earlier: fetching sooner
    # holds the bytes longer, and fetching everything at the start would restore the forward's peak.
    offload_fetch_ahead: int = 2

    def __post_init__(self):
        for name, what in (("loss_head_chunk_bytes", "bytes (a loss head chunk's logits)"),
                           ("loss_head_chunk_rows", "token rows (of a loss head chunk)")):
            value = getattr(self, name)
            if name == "loss_head_chunk_rows" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"memfuse: {name} must be a positive whole number of {what}, got {value!r}")
        if self.loss_head_plan not in LOSS_HEAD_PLANS:
            raise ValueError(f"memfuse: loss_head_plan must be one of {LOSS_HEAD_PLANS}, got {self.loss_head_plan!r}")
        offload = self.offload_saved
        if isinstance(offload, list):
            object.__setattr__(self, "offload_saved", tuple(offload))
        elif offload != "all" and not (isinstance(offload, tuple) and all(isinstance(n, str) for n in offload)):
            raise ValueError(f"memfuse: offload_saved must be \"all\" or a tuple of saved-value names, got {offload!r}")
        for name in ("offload_min_bytes", "offload_fetch_ahead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"memfuse: {name} must be a whole number >= 0, got {value!r}")
        object.__setattr__(self, "memory_budget", parse_memory_budget(self.memory_budget))

    @property
    def memory_fraction(self) -> float:
        """The budget as a fraction of the default plan's saved bytes: 1.0 under a byte target, which
        the planner reaches by its own moves (what scales by the fraction, a loss-head chunk, stays)."""
        return 1.0 if is_byte_budget(self.memory_budget) else float(self.memory_budget)


# torch.compile(model, backend="memfuse", options={...}): the Config fields an option may set.
OPTIONS = ("memory_budget", "chunk_loss_head", "loss_head_chunk_rows", "loss_head_chunk_bytes",
           "loss_head_plan", "check_returned_masks", "offload_saved", "offload_min_bytes", "offload_fetch_ahead")


def config_with_options(config: Config, options: dict | None) -> Config:
    """`config` with torch.compile's `options` applied; an unknown option is an error naming it."""
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"memfuse: unknown torch.compile option(s) {unknown} for backend=\"memfuse\"; "
                         f"known: {list(OPTIONS)}")
    return replace(config, **options)
