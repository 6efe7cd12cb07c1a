"""The loss head alone (issues 18, 52): `cross_entropy((hidden @ weight.T).float(), target)`, forward
and backward, side by side: eager, torch.compile, torch.compile with its auto-chunker, Liger-Kernel's
fused linear cross-entropy, Cut Cross-Entropy, torch's own `F.linear_cross_entropy` with its
chunking options (torch >= 2.13), and memfuse on the unchanged code.

    python -m benchmarks.loss_head [--tokens 8192] [--hidden 4096] [--vocab 128256] [--dtype bfloat16]
                                   [--ignore-fraction F] [--autocast] [--forms function,module]
                                   [--peers NAME,..] [--timed-steps N] [--tiny] [--out DIR]

The user's head is written twice, as a plain function of (hidden, weight, target) and as an
nn.Module (nn.Linear(hidden, vocab, bias=False), then cross_entropy); every peer runs each form in
this process, one after another, on the same tensors. `--autocast`: fp32 weights under
torch.autocast(bfloat16), hidden states in --dtype. Per peer: the median step time, the step's
peak memory above the inputs', the first call, the loss and gradients against an fp32 reference
(fp64 on CPU), and whether it chunked: for memfuse what `memfuse.explain` reports, for the
auto-chunker `torch._inductor.metrics.num_auto_chunking` after its compile. A peer that cannot run
here (a package not installed, no auto-chunker or no `F.linear_cross_entropy` in this torch) has a
row saying why. Writes loss-head-<variant>.json and .md into --out (variant: the dtype, or "autocast").

The peers (`--peers`):
  torch_compile_chunker          Inductor's auto-chunker, set in code before the compile, static
                                 shapes, its amplification threshold lowered so a head whose weight
                                 is as large as its logits qualifies (CHUNKER_AMPLIFY_RATIO says why)
  torch_compile_chunker_default  the same at Inductor's own thresholds (it does not fire on an LLM head)
  liger                          LigerFusedLinearCrossEntropyLoss (the user's code rewritten)
  cce, cce_exact                 cut_cross_entropy.linear_cross_entropy, as shipped (its gradient
                                 filter, filter_eps="high") and with the filter off (filter_eps=None)
  torch_lce, torch_lce_aspect1,  F.linear_cross_entropy(options=LinearCrossEntropyOptions(...)):
  torch_lce_rows1024             chunking "auto", "aspect_ratio", and 1024 rows a chunk

Liger-Kernel and Cut Cross-Entropy are pure-Python wheels over torch and triton. Where the GPU
machine lacks them, carry them as wheels (made here, in the repository root, by the device README's
`pip download ... -d .whl liger-kernel cut-cross-entropy`) and start the command with
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;

Without CUDA, or with --tiny, a tiny head runs on CPU in fp32 through the Triton interpreter
(torch.compile's peers only when --peers names them; Cut Cross-Entropy's kernels do not run in the
interpreter): a smoke run of the harness, not a measurement (loss-head-tiny-*). docs/results.md
says how the columns are measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.metadata
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lib import hf_models as models  # noqa: E402  (sets TRITON_INTERPRET for --tiny before triton loads)
from benchmarks.lib import report  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import memfuse  # noqa: E402
from memfuse.base.config import Config  # noqa: E402

MB = models.MB
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
IGNORE_INDEX = -100  # cross_entropy's default, and Liger's
TARGET_TIME_RATIO = 1.1  # issue 18: memfuse within 1.1x the fastest peer's time
GPU_SETTINGS = models.Settings(warmup_steps=5, timed_steps=20)
TINY_BANNER = (
    "=" * 88 + "\n"
    "TINY RUN: a tiny loss head on CPU, memfuse and Liger through the Triton interpreter.\n"
    "These numbers say NOTHING about performance; they only show the harness and peers work.\n"
    + "=" * 88
)


# -- the workload: the user's unchanged loss head ---------------------------------------------------
def loss_head(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((hidden @ weight.T).float(), target)


def soft_capped_loss_head(cap: float) -> Callable:
    """The head as Gemma 2 writes it (--soft-cap): the logits soft-capped in their dtype,
    `cap * tanh(logits / cap)`, then the loss. `soft_cap` tells Liger's rewrite."""
    def loss_head_soft_capped(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = hidden @ weight.T
        logits = torch.tanh(logits / cap) * cap
        return F.cross_entropy(logits.float(), target)
    loss_head_soft_capped.soft_cap = cap
    return loss_head_soft_capped


class LossHead(nn.Module):
    """The same head as a model writes it: the LM head's linear layer (soft-capped where
    `soft_cap`), then the loss."""

    def __init__(self, weight: torch.Tensor, soft_cap: float | None = None):
        super().__init__()
        self.linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.linear.weight = nn.Parameter(weight.detach())  # shares the function form's storage
        self.soft_cap = soft_cap

    def forward(self, hidden: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.linear(hidden)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        return F.cross_entropy(logits.float(), target)


@dataclasses.dataclass(frozen=True)
class Workload:
    tokens: int
    hidden: int
    vocab: int
    dtype: str  # of the hidden states, and of the weight unless autocast
    ignore_fraction: float  # share of targets set to IGNORE_INDEX
    autocast: bool  # fp32 weight under torch.autocast(bfloat16)
    chunk_mib: int | None = None  # memfuse peers: Config.loss_head_chunk_bytes in MiB (None: the default)
    chunk_rows: int | None = None  # memfuse peers: Config.loss_head_chunk_rows (None: the default)
    soft_cap: float | None = None  # the logits soft-capped before the loss (Gemma 2's 30.0), or not

    @property
    def variant(self) -> str:
        name = "autocast" if self.autocast else self.dtype
        if self.soft_cap is not None:
            name += f"-softcap{self.soft_cap:g}"
        if self.chunk_mib is not None:
            name += f"-chunk{self.chunk_mib}mib"
        return name if self.chunk_rows is None else f"{name}-rows{self.chunk_rows}"

    def memfuse_options(self) -> dict:
        """The Config fields (torch.compile options) the memfuse peers run with."""
        options = {}
        if self.chunk_mib is not None:
            options["loss_head_chunk_bytes"] = self.chunk_mib * 2**20
        if self.chunk_rows is not None:
            options["loss_head_chunk_rows"] = self.chunk_rows
        return options


@dataclasses.dataclass(frozen=True)
class Inputs:
    hidden: torch.Tensor  # [tokens, hidden], requires grad
    weight: torch.Tensor  # [vocab, hidden], requires grad
    target: torch.Tensor  # [tokens] int64, IGNORE_INDEX where ignored


def make_inputs(workload: Workload, device: torch.device) -> Inputs:
    """Seeded random inputs; the weight scaled as nn.Linear initializes it (|w| < 1/sqrt(hidden))."""
    generator = torch.Generator().manual_seed(models.DATA_SEED)
    hidden = torch.randn(workload.tokens, workload.hidden, generator=generator)
    bound = workload.hidden ** -0.5
    weight = (torch.rand(workload.vocab, workload.hidden, generator=generator) * 2 - 1) * bound
    target = torch.randint(0, workload.vocab, (workload.tokens,), generator=generator)
    ignored = torch.rand(workload.tokens, generator=generator) < workload.ignore_fraction
    weight_dtype = torch.float32 if workload.autocast else DTYPES[workload.dtype]
    return Inputs(hidden.to(device, DTYPES[workload.dtype]).requires_grad_(),
                  weight.to(device, weight_dtype).requires_grad_(),
                  target.masked_fill(ignored, IGNORE_INDEX).to(device))


@dataclasses.dataclass(frozen=True)
class Head:
    """One form of the head, ready to call: `fn(*args)` is the loss; a step's gradients land in
    `leaves` (the hidden states and the weight)."""

    form: str
    fn: Callable
    args: tuple
    leaves: tuple


def function_head(inputs: Inputs, soft_cap: float | None = None) -> Head:
    fn = loss_head if soft_cap is None else soft_capped_loss_head(soft_cap)
    return Head("function", fn, (inputs.hidden, inputs.weight, inputs.target), (inputs.hidden, inputs.weight))


def module_head(inputs: Inputs, soft_cap: float | None = None) -> Head:
    module = LossHead(inputs.weight, soft_cap)
    return Head("module", module, (inputs.hidden, inputs.target), (inputs.hidden, module.linear.weight))


FORMS: dict[str, Callable[..., Head]] = {"function": function_head, "module": module_head}


def autocast(workload: Workload, device: torch.device):
    if workload.autocast:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(fn: Callable, head: Head, workload: Workload, device: torch.device) -> torch.Tensor:
    """Forward under the workload's autocast, backward into the leaves' .grad."""
    with autocast(workload, device):
        loss = fn(*head.args)
    loss.backward()
    return loss.detach()


def clear_grads(head: Head) -> None:
    for leaf in head.leaves:
        leaf.grad = None


# -- the peers --------------------------------------------------------------------------------------
def rewritten(fn: Callable, fused: Callable) -> Callable:
    """The head rewritten as its users must for a fused op `fused(hidden, weight, target)`: the
    same weight (the module's own for the module form), ignore_index -100 and the mean."""
    if isinstance(fn, LossHead):
        return lambda hidden, target: fused(hidden, fn.linear.weight, target)
    return lambda hidden, weight, target: fused(hidden, weight, target)


def liger_rewrite(fn: Callable) -> Callable:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    fused = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, softcap=getattr(fn, "soft_cap", None))
    return rewritten(fn, lambda hidden, weight, target: fused(weight, hidden, target))


# Cut Cross-Entropy's gradient filter (`filter_eps`): "high" as it ships, which skips a block of
# the logits' gradient where every softmax value is below the dtype's eps / 32; None computes every term.
CCE_FILTERS = {"cce": "high", "cce_exact": None}


def cce_rewrite(fn: Callable, filter_eps: str | None) -> Callable:
    from cut_cross_entropy import linear_cross_entropy

    return rewritten(fn, lambda hidden, weight, target: linear_cross_entropy(
        hidden, weight, target, ignore_index=IGNORE_INDEX, softcap=getattr(fn, "soft_cap", None),
        filter_eps=filter_eps))


# F.linear_cross_entropy's chunking options (torch >= 2.13) -> the peer that runs with them:
# "auto" (its per-device pick: 'aspect_ratio:2' and the 'compact' accumulation on CUDA bf16), one
# chunk's logits as large as the hidden states, and memfuse's default 1024 rows a chunk.
TORCH_LCE_OPTIONS = {
    "torch_lce": {},
    "torch_lce_aspect1": {"chunking_method": "aspect_ratio"},
    "torch_lce_rows1024": {"chunking_method": None, "batch_chunk_size": 1024},
}


def torch_lce_rewrite(fn: Callable, options: dict) -> Callable:
    chunking = torch.nn.LinearCrossEntropyOptions(**options)
    return rewritten(fn, lambda hidden, weight, target: F.linear_cross_entropy(
        hidden, weight, target, ignore_index=IGNORE_INDEX, options=chunking))


# Inductor's auto-chunker chunks from a matmul whose output is more than `amplify_ratio_threshold`
# (8) times its inputs' bytes. An LLM head's weight is among those inputs: 8192 tokens x hidden
# 4096 -> vocabulary 128256 amplifies 1.9x, so at its own threshold the chunker never fires on the
# head it was written for. The chunker peer lowers the threshold to 1 (any matmul whose output
# outweighs its inputs); the _default peer keeps Inductor's, to show that it does not fire.
CHUNKER_AMPLIFY_RATIO = {"torch_compile_chunker": 1, "torch_compile_chunker_default": None}


def chunker_config_name() -> str | None:
    """The auto-chunker's namespace in torch._inductor.config (`auto_chunker` in torch 2.11 and
    2.13; `AutoChunker` in its early form), or None where this torch has none."""
    return next((name for name in ("auto_chunker", "AutoChunker") if hasattr(torch._inductor.config, name)), None)


def chunker_settings(peer: str) -> dict:
    """The Inductor config a chunker peer compiles under: the chunker on (and its threshold where
    the peer lowers it), and the FX graph cache off: a graph served from a cache skips the joint
    graph's passes, so the chunker's counter would read 0 for a graph it did chunk."""
    name = chunker_config_name()
    settings = {f"{name}.enable": True, "fx_graph_cache": False}
    threshold = f"{name}.amplify_ratio_threshold"  # absent from a torch whose chunker has no such knob
    if CHUNKER_AMPLIFY_RATIO[peer] is not None and threshold in torch._inductor.config.get_config_copy():
        settings[threshold] = CHUNKER_AMPLIFY_RATIO[peer]
    return settings


# peer -> (the head's function, the memfuse options of --chunk-mib) -> what the peer runs
WRAPPERS: dict[str, Callable[[Callable, dict], Callable]] = {
    "eager": lambda fn, options: fn,
    "torch_compile": lambda fn, options: torch.compile(fn, dynamic=False),
    # under peer_context(): the auto-chunker on, before the compile (which runs at the first call)
    "torch_compile_chunker": lambda fn, options: torch.compile(fn, dynamic=False),
    "torch_compile_chunker_default": lambda fn, options: torch.compile(fn, dynamic=False),
    "liger": lambda fn, options: liger_rewrite(fn),
    **{peer: (lambda fn, options, eps=eps: cce_rewrite(fn, eps)) for peer, eps in CCE_FILTERS.items()},
    **{peer: (lambda fn, options, chunking=chunking: torch_lce_rewrite(fn, chunking))
       for peer, chunking in TORCH_LCE_OPTIONS.items()},
    "memfuse": lambda fn, options: memfuse.memory_efficient_fusion(fn, config=Config(**options)),
    "memfuse_backend": lambda fn, options: torch.compile(fn, backend="memfuse", options=options),
}
PEERS = tuple(WRAPPERS)
MEMFUSE_PEERS = ("memfuse", "memfuse_backend")
CHUNKER_PEERS = tuple(CHUNKER_AMPLIFY_RATIO)
COMPILE_PEERS = ("torch_compile", *CHUNKER_PEERS)  # --tiny runs them only when --peers names them


def peer_context(peer: str):
    """The auto-chunker is a global of Inductor's: set around that peer's compile and run, with
    AOTAutograd's cache off too (a cached graph skips the chunker's pass; chunker_settings)."""
    if peer not in CHUNKER_PEERS:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch._inductor.config.patch(chunker_settings(peer)))
    stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
    return stack


def _has_module(name: str) -> str | None:
    try:
        importlib.import_module(name)
    except ImportError as error:
        return f"not installed ({error}); the module docstring says how a GPU run carries its wheel"
    return None


def missing_reason(peer: str, tiny: bool, named: bool, soft_cap: float | None = None) -> str | None:
    """Why `peer` cannot run here, or None."""
    if tiny and peer in COMPILE_PEERS and not named:
        return "not run in --tiny: Inductor builds C++ kernels on the CPU for tens of seconds (--peers names it)"
    if peer in CHUNKER_PEERS and chunker_config_name() is None:
        return f"not available: torch {torch.__version__} has no auto-chunker in torch._inductor.config"
    if peer == "liger":
        return _has_module("liger_kernel.transformers")
    if peer in CCE_FILTERS:
        if tiny:
            return "not run in --tiny: Cut Cross-Entropy's kernels fail in Triton's interpreter (a GPU runs them)"
        return _has_module("cut_cross_entropy")
    if peer in TORCH_LCE_OPTIONS:
        if not hasattr(torch.nn, "LinearCrossEntropyOptions"):
            return (f"not available: torch {torch.__version__} has no F.linear_cross_entropy with chunking "
                    f"options (torch >= 2.13 has)")
        if soft_cap is not None:
            return "not available: F.linear_cross_entropy has no soft cap"
    return None


# -- one form x peer --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Reference:
    loss: float
    grads: tuple  # of the leaves, in the reference dtype


def reference(inputs: Inputs, device: torch.device, soft_cap: float | None = None) -> Reference:
    """The head in fp32 (fp64 on CPU) from the same values, no autocast."""
    dtype = torch.float32 if device.type == "cuda" else torch.float64
    hidden, weight = (t.detach().to(dtype).requires_grad_() for t in (inputs.hidden, inputs.weight))
    logits = hidden @ weight.T
    if soft_cap is not None:
        logits = torch.tanh(logits / soft_cap) * soft_cap
    loss = F.cross_entropy(logits, inputs.target)
    return Reference(loss.item(), torch.autograd.grad(loss, (hidden, weight)))


def errors(loss: torch.Tensor, head: Head, ref: Reference) -> tuple[float, float]:
    """(|loss - ref| / |ref|, max over the leaves of ||grad - ref|| / ||ref||)."""
    loss_error = abs(loss.item() - ref.loss) / abs(ref.loss)
    grad_error = max(((leaf.grad.to(want.dtype) - want).norm() / want.norm()).item()
                     for leaf, want in zip(head.leaves, ref.grads))
    return loss_error, grad_error


@dataclasses.dataclass(frozen=True)
class Row:
    """One form x peer. None where not measured (memory on CPU), where it failed or was missing."""

    form: str
    peer: str
    missing: str | None = None  # why the peer did not run here
    error: str | None = None  # it ran and raised: type, where and message
    first_call_s: float | None = None  # wrap + first step, compile included
    step_s: float | None = None  # median of the timed steps
    step_samples_s: tuple = ()
    host_s: float | None = None  # on a GPU: a step's call alone, the GPU idle at its start (the host's share)
    peak_bytes: int | None = None  # a step's peak above the memory allocated at its start (the inputs)
    loss: float | None = None
    loss_error: float | None = None
    grad_error: float | None = None
    chunked_loss_head: bool | None = None  # memfuse: explain reports a chunked loss head; chunker: it fired
    explain: tuple = ()  # explain's lines about the loss head, or the auto-chunker's count, or why not
    auto_chunkings: int | None = None  # chunker peers: torch._inductor.metrics.num_auto_chunking after the compile
    time_ratio: float | None = None  # step_s / the fastest row's of the form
    memory_ratio: float | None = None  # peak_bytes / the least row's of the form


@dataclasses.dataclass(frozen=True)
class Case:
    workload: Workload
    setup: models.Setup
    head: Head
    reference: Reference


def measure(case: Case, peer: str) -> Row:
    """First call (wrap and compile included) and its errors, warm-up, timed steps, one step's peak;
    then whether it chunked: for memfuse what explain says about the loss head, for the
    auto-chunker Inductor's counter over its compile."""
    head, setup = case.head, case.setup

    def step(fn):
        train_step(fn, head, case.workload, setup.device)
        clear_grads(head)

    with peer_context(peer):
        torch._inductor.metrics.reset()  # the auto-chunker's counter: this peer's compile alone
        setup.synchronize()
        start = time.perf_counter()
        fn = WRAPPERS[peer](head.fn, case.workload.memfuse_options())
        loss = train_step(fn, head, case.workload, setup.device)
        setup.synchronize()
        first_call_s = time.perf_counter() - start
        auto_chunkings = getattr(torch._inductor.metrics, "num_auto_chunking", None)  # None: no such counter
        loss_error, grad_error = errors(loss, head, case.reference)
        clear_grads(head)
        for _ in range(setup.settings.warmup_steps):
            step(fn)
        samples = models.step_seconds(lambda: step(fn), setup.settings.timed_steps, setup)
        on_gpu = setup.device.type == "cuda"
        host = host_seconds(lambda: step(fn), setup, setup.settings.timed_steps) if on_gpu else None
        peak = step_peak(lambda: step(fn), setup) if on_gpu else None
    row = Row(head.form, peer, first_call_s=first_call_s, step_s=statistics.median(samples),
              step_samples_s=tuple(samples), host_s=host, peak_bytes=peak, loss=loss.item(), loss_error=loss_error,
              grad_error=grad_error)
    if peer in MEMFUSE_PEERS:
        chunked, lines = explain_loss_head(fn, case)
        row = dataclasses.replace(row, chunked_loss_head=chunked, explain=lines)
    if peer in CHUNKER_PEERS:
        fired = None if auto_chunkings is None else auto_chunkings > 0
        row = dataclasses.replace(row, chunked_loss_head=fired, auto_chunkings=auto_chunkings,
                                  explain=(chunker_line(peer, auto_chunkings),))
    return row


def chunker_line(peer: str, auto_chunkings: int | None) -> str:
    """What the auto-chunker did in a peer's compile, from Inductor's counter, with its threshold."""
    set_ratio = [value for key, value in chunker_settings(peer).items() if key.endswith(".amplify_ratio_threshold")]
    threshold = f"amplify_ratio_threshold {set_ratio[0]}" if set_ratio else "Inductor's default thresholds"
    if auto_chunkings is None:
        return f"auto-chunker on ({threshold}), not checked: this torch has no metrics.num_auto_chunking"
    if auto_chunkings > 0:
        return f"auto-chunker fired: num_auto_chunking = {auto_chunkings} ({threshold})"
    return (f"auto-chunker DID NOT FIRE: num_auto_chunking = 0 ({threshold}; TORCH_LOGS=auto_chunker "
            f"says why): this row is plain torch.compile")


def host_seconds(step: Callable[[], None], setup: models.Setup, count: int) -> float:
    """Median time for a step's call to return, the GPU idle at its start: the host's share of the
    step (its kernels are queued, not waited for). A chunked head makes more calls than one that
    is not, and where the host paces a step (FSDP2's, 2026-11-28) those calls are what it costs."""
    samples = []
    for _ in range(count):
        setup.synchronize()
        start = time.perf_counter()
        step()
        samples.append(time.perf_counter() - start)
    setup.synchronize()
    return statistics.median(samples)


def step_peak(step: Callable[[], None], setup: models.Setup) -> int:
    setup.synchronize()
    torch.cuda.reset_peak_memory_stats(setup.device)
    before = torch.cuda.memory_allocated(setup.device)
    step()
    setup.synchronize()
    return torch.cuda.max_memory_allocated(setup.device) - before


def explain_loss_head(fn: Callable, case: Case) -> tuple[bool, tuple]:
    """(whether memfuse.explain reports a chunked loss head, its lines naming the loss head).
    Best-effort: an explain that raises, or names no loss head, reads as not chunked, with why."""
    try:
        with contextlib.redirect_stdout(io.StringIO()), autocast(case.workload, case.setup.device):
            text = str(memfuse.explain(fn, *case.head.args))
    except Exception as error:  # a report about the run, never a reason to stop it
        return False, (f"not chunked: explain raised {type(error).__name__}: {error}",)
    finally:
        clear_grads(case.head)
    return read_loss_head(text)


def read_loss_head(text: str) -> tuple[bool, tuple]:
    """(whether a report's text names a chunked loss head, its lines naming a loss head)."""
    lines = tuple(line.strip() for line in text.splitlines() if "loss head" in line.lower())
    if not lines:
        return False, ("not chunked: explain names no loss head",)
    return any("chunked" in line and "not chunked" not in line for line in lines), lines


def run_peer(case: Case, peer: str, missing: str | None) -> Row:
    print(f"{case.head.form} {peer} ...", flush=True)
    if missing:
        return Row(case.head.form, peer, missing=missing)
    models.isolate(case.setup)
    try:
        row = measure(case, peer)
    except Exception as error:  # one failing peer must not end the comparison
        clear_grads(case.head)
        row = Row(case.head.form, peer, error=models._error_text(error))
    models.isolate(case.setup)
    return row


def with_ratios(rows: list[Row]) -> list[Row]:
    """Each row's time over the fastest row's and peak over the least row's (rows that ran)."""
    fastest = min((r.step_s for r in rows if r.step_s), default=None)
    least = min((r.peak_bytes for r in rows if r.peak_bytes is not None), default=None)
    return [dataclasses.replace(r, time_ratio=r.step_s / fastest if r.step_s and fastest else None,
                                memory_ratio=r.peak_bytes / least if r.peak_bytes is not None and least else None)
            for r in rows]


def target_lines(rows: list[Row]) -> list[str]:
    """Issue 18's target for each memfuse row: a peak at most the best other peer's, a time at
    most TARGET_TIME_RATIO x the fastest other peer's."""
    others = [r for r in rows if r.peer not in MEMFUSE_PEERS and r.step_s]
    lines = []
    for row in (r for r in rows if r.peer in MEMFUSE_PEERS):
        name = f"{row.form} {row.peer}"
        if not row.step_s or not others:
            lines.append(f"{name}: not judged (no time for it or for any other peer)")
            continue
        fastest = min(others, key=lambda r: r.step_s)
        timed = row.step_s <= TARGET_TIME_RATIO * fastest.step_s
        text = (f"time {row.step_s * 1e3:.2f} ms = {row.step_s / fastest.step_s:.2f}x the fastest peer's "
                f"({fastest.peer}), target <= {TARGET_TIME_RATIO}x")
        measured = [r for r in others if r.peak_bytes is not None]
        if row.peak_bytes is None or not measured:
            lines.append(f"{name}: {text}; memory not measured (CPU): not judged")
            continue
        least = min(measured, key=lambda r: r.peak_bytes)
        met = timed and row.peak_bytes <= least.peak_bytes
        lines.append(f"{name}: {'MET' if met else 'NOT MET'}: peak {row.peak_bytes / MB:.0f} MB = "
                     f"{row.peak_bytes / least.peak_bytes:.2f}x the least peer's ({least.peer}), target <= 1x; {text}")
    return lines


def run_form(form: str, inputs: Inputs, ref: Reference, workload: Workload, setup: models.Setup,
             missing: dict) -> list[Row]:
    """Every peer on one form of the head, or a row saying why it is missing."""
    case = Case(workload, setup, FORMS[form](inputs, workload.soft_cap), ref)
    return with_ratios([run_peer(case, peer, reason) for peer, reason in missing.items()])


# -- metadata, files, the report --------------------------------------------------------------------
def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(workload: Workload, setup: models.Setup, inputs: Inputs) -> dict:
    meta = models.metadata(setup)
    del meta["transformers"], meta["definitions"]
    grad_bytes = sum(t.numel() * t.element_size() for t in (inputs.hidden, inputs.weight))
    return {
        **meta,
        "precision": f"{workload.dtype} hidden, fp32 weight under autocast(bfloat16)" if workload.autocast
        else f"{workload.dtype} hidden and weight",
        "liger_kernel": _version("liger-kernel"),
        "cut_cross_entropy": _version("cut-cross-entropy"),
        "torch_linear_cross_entropy": hasattr(torch.nn, "LinearCrossEntropyOptions"),
        "workload": dataclasses.asdict(workload),
        "input_bytes": sum(t.numel() * t.element_size() for t in (inputs.hidden, inputs.weight, inputs.target)),
        "grad_bytes": grad_bytes,
        "definitions": {
            "step_s": "median of the timed steps (CUDA events around each; host clock on CPU); a step is "
                      "forward, backward into .grad, then the grads set to None",
            "peak_bytes": "max_memory_allocated over one step - memory_allocated at its start (the inputs); "
                          "includes the step's own gradients (grad_bytes, the same for every peer)",
            "first_call_s": "wrap + first step, compile included, in this process",
            "loss_error": "first step: |loss - reference| / |reference|, reference in fp32 (fp64 on CPU)",
            "grad_error": "first step: max over hidden and weight of ||grad - reference|| / ||reference||",
            "time_ratio": "step_s / the fastest peer's of the same form",
            "memory_ratio": "peak_bytes / the least peer's of the same form",
            "chunked_loss_head": "memfuse peers: memfuse.explain's report names a chunked loss head; auto-chunker "
                                 "peers: auto_chunkings > 0",
            "auto_chunkings": "auto-chunker peers: torch._inductor.metrics.num_auto_chunking after the first "
                              "call (graphs the chunker rewrote; Inductor's and AOTAutograd's caches off)",
        },
    }


def stem(out: Path, workload: Workload, tiny: bool) -> Path:
    return out / f"loss-head-{'tiny-' if tiny else ''}{workload.variant}"


def _note(row: dict) -> str:
    text = row["missing"] and f"missing: {row['missing']}" or row["error"] and f"error: {row['error']}" or ""
    return " ".join(text.split()).replace("|", "/")[:models.ERROR_CHARS]


def _chunked(row: dict) -> str:
    if row["chunked_loss_head"] is None:
        return report.MISSING
    return "chunked" if row["chunked_loss_head"] else "not chunked"


def render(result: dict, markdown: bool) -> str:
    meta, w = result["metadata"], result["metadata"]["workload"]
    headers = ["form", "peer", "ms/step", "vs fastest", "host ms", "peak MB", "vs least", "1st call s", "loss",
               "loss err", "grad err", "loss head", "note"]
    fmt = report._fmt
    body = [[r["form"], r["peer"], fmt(r["step_s"], ".2f", 1e3), fmt(r["time_ratio"], ".2f", suffix="x"),
             fmt(r.get("host_s"), ".2f", 1e3),
             fmt(r["peak_bytes"], ".0f", 1 / MB), fmt(r["memory_ratio"], ".2f", suffix="x"),
             fmt(r["first_call_s"], ".1f"), fmt(r["loss"], ".4f"), fmt(r["loss_error"], ".1e"),
             fmt(r["grad_error"], ".1e"), _chunked(r), _note(r)] for r in result["rows"]]
    head = (f"- {w['tokens']} tokens x hidden {w['hidden']} -> vocab {w['vocab']}, {meta['precision']}, "
            f"{w['ignore_fraction']:.0%} of targets ignored; {meta['device']}, torch {meta['torch']}, "
            f"triton {meta['triton']}, liger-kernel {meta['liger_kernel'] or 'not installed'}, cut-cross-entropy "
            f"{meta.get('cut_cross_entropy') or 'not installed'}, {meta['date']}")
    table = report._markdown(headers, body) if markdown else report._table(headers, body)
    targets = [f"- {line}" for line in result["targets"]]
    explained = [f"- {r['form']} {r['peer']}: {line}" for r in result["rows"] for line in r["explain"]]
    chunking_heading = "How each peer chunked (memfuse.explain; the auto-chunker's counter):"
    return "\n".join([head, "", table, "", "Target (issue 18):", *targets, "", chunking_heading, *explained])


def write_report(result: dict, path_stem: Path) -> None:
    text = render(result, markdown=True)
    heading = "The loss head alone: one forward+backward"
    if result["metadata"]["tiny"]:
        heading += " -- TINY RUN on CPU through the Triton interpreter: not a performance result"
    path_stem.with_suffix(".md").write_text(f"## {heading}\n\n{text}\n")
    print("\n" + render(result, markdown=False))
    print(f"\nwrote {path_stem.with_suffix('.json')} and {path_stem.with_suffix('.md')}")


# -- the command ------------------------------------------------------------------------------------
TINY_SIZE = {"tokens": 40, "hidden": 16, "vocab": 101, "dtype": "float32"}
GPU_SIZE = {"tokens": 8192, "hidden": 4096, "vocab": 128256, "dtype": "bfloat16"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, help=f"default {GPU_SIZE['tokens']} (--tiny {TINY_SIZE['tokens']})")
    parser.add_argument("--hidden", type=int, help=f"default {GPU_SIZE['hidden']} (--tiny {TINY_SIZE['hidden']})")
    parser.add_argument("--vocab", type=int, help=f"default {GPU_SIZE['vocab']} (--tiny {TINY_SIZE['vocab']})")
    parser.add_argument("--dtype", choices=DTYPES, help="of the hidden states and the weight (default bfloat16; "
                                                        "--tiny float32); with --autocast, of the hidden states")
    parser.add_argument("--ignore-fraction", type=float, default=0.0,
                        help=f"share of targets set to {IGNORE_INDEX}, in [0, 1) (default 0)")
    parser.add_argument("--autocast", action="store_true", help="fp32 weight under torch.autocast(bfloat16)")
    parser.add_argument("--forms", help=f"comma-separated, from {', '.join(FORMS)} (default: both)")
    parser.add_argument("--peers", help=f"comma-separated, from {', '.join(PEERS)} (default: all; --tiny: all but "
                                        f"{', '.join(COMPILE_PEERS)}, which are reported missing)")
    parser.add_argument("--chunk-mib", type=int,
                        help="the most bytes of memfuse's loss-head chunk (Config.loss_head_chunk_bytes) in MiB "
                             "(default: its default, 256); the other peers are unchanged")
    parser.add_argument("--chunk-rows", type=int,
                        help="the most token rows of memfuse's loss-head chunk (Config.loss_head_chunk_rows; "
                             "default: its default, 1024); the smaller of the two wins")
    parser.add_argument("--soft-cap", type=float,
                        help="soft-cap the logits before the loss, cap * tanh(logits / cap), in their dtype, as "
                             "Gemma 2 does (its cap: 30)")
    parser.add_argument("--timed-steps", type=int,
                        help=f"timed steps per peer (GPU default {GPU_SETTINGS.timed_steps})")
    parser.add_argument("--tiny", action="store_true", help="a tiny head on CPU through the Triton interpreter")
    parser.add_argument("--out", type=Path, default=models.DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    for name in ("tokens", "hidden", "vocab", "timed_steps", "chunk_mib", "chunk_rows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if args.soft_cap is not None and not args.soft_cap > 0:
        parser.error(f"--soft-cap must be positive, got {args.soft_cap}")
    if not 0 <= args.ignore_fraction < 1:
        parser.error(f"--ignore-fraction must be in [0, 1) (some target must count), got {args.ignore_fraction}")
    return args


def workload_of(args: argparse.Namespace, tiny: bool) -> Workload:
    size = TINY_SIZE if tiny else GPU_SIZE
    return Workload(args.tokens or size["tokens"], args.hidden or size["hidden"], args.vocab or size["vocab"],
                    args.dtype or size["dtype"], args.ignore_fraction, args.autocast, args.chunk_mib,
                    args.chunk_rows, args.soft_cap)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    if tiny and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--tiny runs memfuse through the Triton interpreter: set TRITON_INTERPRET=1 before "
                 "triton loads (python -m benchmarks.loss_head --tiny does)")
    forms = models._names(args.forms, tuple(FORMS), "forms")
    named = models._names(args.peers, PEERS, "peers") if args.peers else ()
    settings = models.TINY_SETTINGS if tiny else GPU_SETTINGS
    if args.timed_steps:
        settings = dataclasses.replace(settings, timed_steps=args.timed_steps)
    setup = models.Setup(torch.device("cpu" if tiny else "cuda"), tiny, settings)
    workload = workload_of(args, tiny)
    missing = {peer: missing_reason(peer, tiny, peer in named, workload.soft_cap) for peer in named or PEERS}
    if tiny:
        print(TINY_BANNER, flush=True)
    inputs = make_inputs(workload, setup.device)
    ref = reference(inputs, setup.device, workload.soft_cap)
    rows = [row for form in forms for row in run_form(form, inputs, ref, workload, setup, missing)]
    result = {"metadata": metadata(workload, setup, inputs), "rows": [dataclasses.asdict(r) for r in rows],
              "targets": [line for form in forms for line in target_lines([r for r in rows if r.form == form])]}
    args.out.mkdir(parents=True, exist_ok=True)
    path_stem = stem(args.out, workload, tiny)
    path_stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    write_report(result, path_stem)
    if tiny:
        print(TINY_BANNER)


if __name__ == "__main__":
    main()
