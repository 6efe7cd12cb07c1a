"""The longest sequence (batch 1) and the largest batch (at a fixed sequence) that train one step,
and the tokens/s there, for each way of running a model: issue 52's memory as users state it.

    python -m benchmarks.memory [--model llama16|llama8b] [--search seq|batch] [--seq N] [--modes M,..]
                                [--start N] [--granularity N] [--budget-s S] [--timeout-s S] [--force]
                                [--chart-seq N] [--charts DIR]
                                [--out DIR] [--tiny [--tiny-cap-tokens N]]

A step is what a training loop runs: forward, loss, backward, then AdamW's step and zero_grad. AdamW
is `fused=True` on a GPU: its kernels update each parameter in registers (the default `foreach`
implementation takes the square root of every exp_avg_sq into a temporary the size of all the
parameters: 16 GB for an 8B model in bf16, a peak of its own that would cap every mode alike); on
CPU `foreach=False` (one parameter at a time: no whole-model temporary either).

Models (random weights from configs, transformers' LlamaForCausalLM, SDPA attention):
  llama16  16 layers, hidden 2048, 32 heads, 8 KV heads, FFN 8192, vocab 128256, embeddings tied:
           fp32 parameters under bf16 autocast (issue 52's table)
  llama8b  32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256: bf16 parameters,
           gradients and AdamW state, no autocast

Modes (`base` or `base@budget`):
  eager               the model as built
  checkpoint          transformers' activation (gradient) checkpointing, non-reentrant: each layer
                      recomputed in the backward
  checkpoint_offload  the same, each checkpointed layer's saved inputs offloaded to pinned host
                      memory (torch.autograd.graph.save_on_cpu around the checkpoint: Unsloth's way)
  torch_compile       torch.compile(model); `torch_compile@0.1` sets
                      torch._functorch.config.activation_memory_budget = 0.1 before compiling
  memfuse             memfuse.memory_efficient_fusion(model); `memfuse@12GB` passes
                      memory_budget="12GB", a byte target for the step's peak (memfuse.plan), and
                      `memfuse@0.3` a fraction. At a size whose least need is above the target the
                      compile raises MemoryBudgetError: recorded as "target below the least: <least>"
                      (the size fails, not an out-of-memory). A byte-budget mode's sizes record the
                      peak memfuse predicted (memfuse.plan.predicted_peak of each program), the
                      target and what the plan offloaded and recomputed; the report's byte-budget
                      table sets them against the measured peak.
                      `memfuse@auto`: a byte budget at the peak the checkpoint mode measured at
                      batch 1 x --chart-seq (its search's size, else a fresh probe), named
                      memfuse@<bytes>B and searched as any mode; the report sets its tokens/s at
                      --chart-seq against checkpointing's (issue 52: >= 1.4x). Name it after
                      checkpoint in --modes so that mode's search comes first; it needs --chart-seq.
  memfuse_per_layer   memfuse.fuse_layers(model, model.model.layers): the recipe users get, each
                      decoder layer fused in place and the rest (embeddings, final norm, the head and
                      its loss, chunked) compiled in place through memfuse's backend
  memfuse_per_layer_eager_rest  each decoder layer fused, the rest eager (its [tokens, vocab]
                      logits whole): what memfuse_per_layer measured before fuse_layers (--modes adds it)

Search: from a start size, doubling until a size fails (CUDA out of memory, or any error, recorded),
then bisection between the last size that fitted and the first that failed, to SEQ_GRANULARITY tokens
or BATCH_GRANULARITY samples (--start and --granularity: a coarser search for a short slot). Each
size runs in a fresh process (this script with --one) so an out-of-memory leaves nothing behind,
under a timeout (--timeout-s; the process group is killed past it). A size fits when its process
trains GPU_STEPS (first, warm-up, timed); its tokens/s come from the timed steps, its
peak is torch.cuda.max_memory_allocated over all of them (parameters, gradients and AdamW state
included: what has to fit on the GPU). A memfuse mode's size that memfuse ran partly through torch
(its program's first run failed, counted in memfuse.stats()) does not fit in that mode.

Each model x search x mode is a JSON in OUT/memory-<model>/<search>/ with every size tried; a mode
with a complete JSON (at the same granularity) is skipped unless --force; --budget-s stops starting
sizes after that many seconds (the next command resumes, reusing the sizes already tried). The report
(OUT/memory-<model>.json and .md) merges them; --chart-seq N draws peak against step time for every
mode at batch 1 and N tokens into --charts.

Without CUDA, or with --tiny: a 2-layer model of hidden 64 on CPU through the Triton interpreter (no
torch_compile modes unless --modes names them). Memory is not measured on CPU: a size "fails" when its
tokens per step exceed --tiny-cap-tokens. The point is to exercise the search, the fresh processes
and the report, not memory.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

RESULTS = Path(__file__).parent / "results"
CHARTS = Path(__file__).parent.parent / "docs" / "img"


@dataclasses.dataclass(frozen=True)
class Steps:
    """The steps a size's process trains: the first (compiles), warm-up, then the timed ones (each
    timed on its own; tokens/s from their median)."""

    first: int
    warmup: int
    timed: int


GPU_STEPS = Steps(first=1, warmup=1, timed=3)
TINY_STEPS = Steps(first=1, warmup=0, timed=1)  # the interpreter is slow; a tiny run measures nothing
SEQ_START, SEQ_GRANULARITY, SEQ_LIMIT = 1024, 256, 1 << 20  # tokens
BATCH_START, BATCH_GRANULARITY, BATCH_LIMIT = 1, 1, 4096  # samples
TINY_SEQ_START, TINY_SEQ_GRANULARITY = 16, 8
TINY_CAP_TOKENS = 40
PROBE_TIMEOUT_S = 480
LEARNING_RATE = 1e-5
# memfuse.stats() counters of calls and graphs that ran through torch instead of memfuse's programs
THROUGH_TORCH = ("first_run_fallbacks", "graph_fallbacks", "eager_calls")
ERROR_CHARS = 140  # of an error in the Markdown table (the JSON has it whole)
RESULT_PREFIX = "RESULT "
BASES = ("eager", "checkpoint", "checkpoint_offload", "torch_compile", "memfuse", "memfuse_per_layer",
         "memfuse_per_layer_eager_rest")
BUDGETED = ("torch_compile", "memfuse")  # the bases that take `@budget`
MODES = ("eager", "checkpoint", "checkpoint_offload", "torch_compile", "torch_compile@0.1", "memfuse",
         "memfuse@12GB", "memfuse@auto", "memfuse_per_layer")  # memfuse_per_layer_eager_rest: --modes adds it
TINY_MODES = tuple(m for m in MODES if not m.startswith("torch_compile"))


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    bf16_parameters: bool  # bf16 parameters, gradients and optimizer state; else fp32 under bf16 autocast
    tied: bool  # the head shares the embedding's weight


MODELS = {m.name: m for m in (
    Model("llama16", 16, 2048, 32, 8, 8192, 128256, bf16_parameters=False, tied=True),
    Model("llama8b", 32, 4096, 32, 8, 14336, 128256, bf16_parameters=True, tied=False),
)}
TINY = Model("tiny", 2, 64, 4, 2, 128, 256, bf16_parameters=False, tied=True)


@dataclasses.dataclass(frozen=True)
class Mode:
    """A mode's name split into its base and its budget ('' where none)."""

    base: str
    budget: str = ""

    @property
    def name(self) -> str:
        return f"{self.base}@{self.budget}" if self.budget else self.base

    @staticmethod
    def parse(name: str) -> "Mode":
        base, _, budget = name.partition("@")
        if base not in BASES:
            raise ValueError(f"unknown mode {name!r}: the base must be one of {', '.join(BASES)}")
        if budget and base not in BUDGETED:
            raise ValueError(f"mode {name!r}: only {', '.join(BUDGETED)} take @budget")
        return Mode(base, budget)

    @property
    def is_memfuse(self) -> bool:
        return self.base.startswith("memfuse")


# -- the search ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Search:
    """What search() found: the largest size that fitted (None: not even the start), the smallest
    that failed (None: none failed up to the limit), the sizes tried in order, and whether it ended
    (False: `fits` answered None, out of time)."""

    largest: int | None
    smallest_failed: int | None
    tried: tuple[int, ...]
    complete: bool


def search(fits: Callable[[int], bool | None], start: int, granularity: int, limit: int) -> Search:
    """Doubling from `start` until a size fails or passes `limit`, then bisection between the last
    size that fitted and the first that failed, on multiples of `granularity`. `fits(size)` answers
    True, False, or None to stop (the time budget is spent)."""
    tried: list[int] = []

    def probe(size: int) -> bool | None:
        tried.append(size)
        return fits(size)

    low, high, size = None, None, start
    while size <= limit:
        answer = probe(size)
        if answer is None:
            return Search(low, high, tuple(tried), complete=False)
        if not answer:
            high = size
            break
        low, size = size, size * 2
    if low is None or high is None:
        return Search(low, high, tuple(tried), complete=True)
    while True:
        middle = (low + high) // 2 // granularity * granularity
        if middle <= low:
            return Search(low, high, tuple(tried), complete=True)
        answer = probe(middle)
        if answer is None:
            return Search(low, high, tuple(tried), complete=False)
        low, high = (middle, high) if answer else (low, middle)


# -- one size in this process (--one) --------------------------------------------------------------
def llama_config(model: Model, seq: int):
    import transformers
    return transformers.LlamaConfig(
        vocab_size=model.vocab, hidden_size=model.hidden, intermediate_size=model.ffn,
        num_hidden_layers=model.layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
        max_position_embeddings=max(seq, 256), rope_theta=500000.0, tie_word_embeddings=model.tied,
        use_cache=False, bos_token_id=1, eos_token_id=2)


def enable_checkpointing(model) -> None:
    """Non-reentrant checkpointing of each layer, through transformers' own switch: its newer name
    (activation_checkpointing_enable) where it exists, else the older gradient_checkpointing_enable."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def offload_checkpointed_inputs(model, pin_memory: bool) -> None:
    """Each checkpointed layer's saved inputs to host memory: the checkpoint function transformers
    calls per layer (`_gradient_checkpointing_func`) runs under save_on_cpu, which packs what is
    saved outside the checkpoint's own hooks: the layer's inputs (non-reentrant checkpoint saves
    them before entering its hooks; what the layer saves inside is recomputed, never packed). Newer
    transformers do the same with activation_checkpointing_enable(offload=True); this works on the
    older ones too, so every run measures one mechanism."""
    import torch

    def offloaded(checkpoint):
        @functools.wraps(checkpoint)
        def run(*args, **kwargs):
            with torch.autograd.graph.save_on_cpu(pin_memory=pin_memory):
                return checkpoint(*args, **kwargs)
        return run

    wrapped = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = offloaded(module._gradient_checkpointing_func)
            wrapped += 1
    if not wrapped:
        raise RuntimeError("checkpoint_offload: no module has gradient checkpointing on after "
                           "gradient_checkpointing_enable(); transformers' layer API changed?")


def wrap(model, mode: Mode, cuda: bool):
    """The model as `mode` runs it."""
    import torch
    import memfuse
    from benchmarks.lib import hf_models
    if mode.base in ("checkpoint", "checkpoint_offload"):
        enable_checkpointing(model)
        if mode.base == "checkpoint_offload":
            offload_checkpointed_inputs(model, pin_memory=cuda)
        return model
    if mode.base == "torch_compile":
        if mode.budget:
            torch._functorch.config.activation_memory_budget = float(mode.budget)
        return torch.compile(model)
    if mode.base == "memfuse":
        return memfuse.memory_efficient_fusion(model, memory_budget=_memfuse_budget(mode.budget))
    if mode.base == "memfuse_per_layer":
        return memfuse.fuse_layers(model, hf_models.layer_list(model, hf_models.FAMILIES["llama"]))
    if mode.base == "memfuse_per_layer_eager_rest":
        return hf_models.WRAPPERS["memfuse_per_layer"](model, hf_models.FAMILIES["llama"])
    return model


def _memfuse_budget(text: str) -> float | str | None:
    """'' -> None (the default plan); '0.3' -> 0.3; '12GB' -> '12GB' (a byte budget, as given)."""
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        return text


def optimizer_state_bytes(optimizer) -> int:
    """AdamW's state tensors (exp_avg, exp_avg_sq): on the device in every step after the first, and
    outside what memfuse's predicted peak counts."""
    import torch
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def state_bytes(model, optimizer) -> int:
    """Parameters, their gradients (as if all present) and AdamW's state tensors."""
    import torch
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    return sum(2 * p.numel() * p.element_size() for p in params) + optimizer_state_bytes(optimizer)


def train_size(model_spec: Model, mode: Mode, seq: int, batch: int, cuda: bool) -> dict:
    """Build the model on the device, wrap it, train GPU_STEPS (CPU: TINY_STEPS) at batch x seq."""
    import torch
    import transformers
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    dtype = torch.bfloat16 if model_spec.bf16_parameters and cuda else torch.float32
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = transformers.LlamaForCausalLM(llama_config(model_spec, seq)).train()
    finally:
        torch.set_default_dtype(default)
    # not model.to(dtype): that would also round RoPE's fp32 inverse frequencies to bf16
    stray = sorted({str(p.dtype) for p in model.parameters()} - {str(dtype)})
    if stray:
        raise RuntimeError(f"built with default dtype {dtype}, some parameters are {stray}")
    wrapped = wrap(model, mode, cuda)
    optimizer = (torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True) if cuda
                 else torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=False))
    ids = torch.randint(0, model_spec.vocab, (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if cuda and not model_spec.bf16_parameters
                else contextlib.nullcontext())

    def step() -> float:
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with autocast:
            loss = wrapped(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start

    steps = GPU_STEPS if cuda else TINY_STEPS
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first = [step() for _ in range(steps.first)]
    for _ in range(steps.warmup):
        step()
    timed = [step() for _ in range(steps.timed)]
    step_s = statistics.median(timed)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    state = state_bytes(model, optimizer)
    import memfuse
    result = {"fits": True, "seq": seq, "batch": batch, "step_s": step_s, "tokens_per_s": batch * seq / step_s,
              "first_step_s": first[0], "step_samples_s": timed, "peak_bytes": peak, "state_bytes": state,
              "optimizer_state_bytes": optimizer_state_bytes(optimizer),
              "peak_above_state_bytes": None if peak is None else peak - state,
              "memfuse": memfuse.stats() if mode.is_memfuse else None,
              "plans": plan_summary(wrapped, model) if mode.is_memfuse else None}
    return judge_through_torch(result)


def plan_summary(wrapped, model) -> dict | None:
    """What memfuse's plans of this step predicted, for the report beside the measured peak: each
    program memory_efficient_fusion compiled (the whole model's, or each fused layer's), with its
    predicted peak (memfuse.plan.predicted_peak), its byte target where one was set, and the saved
    values it offloaded and recomputed. `predicted_peak_bytes` is the largest: the programs of a step
    run one after another, and each counts the inputs it reads (parameters included). Graphs the
    backend compiled (fuse_layers' rest) are not listed: the budget modes wrap the whole model."""
    from memfuse.fronts.check import _entries
    from memfuse.fronts.module import FusedModule
    from memfuse.plan import Decision, PeakBudget, predicted_peak
    fused = {id(m): m for m in (wrapped, *model.modules()) if isinstance(m, FusedModule)}.values()
    graphs = []
    for module in fused:
        for name, entry in _entries(module):
            the_plan, budget = entry.plan, entry.plan.budget
            moves = budget.moves if isinstance(budget, PeakBudget) else ()
            sizes = {s.name: s.bytes for s in the_plan.saved}
            graphs.append({
                "name": name, "predicted_peak_bytes": predicted_peak(the_plan, entry.captured.hints),
                "target_bytes": budget.target_bytes if isinstance(budget, PeakBudget) else None,
                "default_plan_peak_bytes": budget.peak_before if isinstance(budget, PeakBudget) else None,
                "offloaded": len(the_plan.offloaded),
                "offloaded_bytes": sum(sizes.get(n, 0) for n in the_plan.offloaded),
                "recomputed": sum(d is Decision.RECOMPUTE for d, _ in the_plan.decisions.values()),
                "recomputed_for_budget": sum(m.choice == "recompute" for m in moves)})
    if not graphs:
        return None
    return {"predicted_peak_bytes": max(g["predicted_peak_bytes"] for g in graphs),
            "offloaded": sum(g["offloaded"] for g in graphs),
            "recomputed_for_budget": sum(g["recomputed_for_budget"] for g in graphs), "graphs": graphs}


def judge_through_torch(result: dict) -> dict:
    """A memfuse mode's size that memfuse ran (in part) through torch does not fit in that mode: its
    program's first run failed (out of memory, say) and torch's ops ran instead, so the size says
    what torch fits. The measured numbers stay in the result beside the reason."""
    counted = {name: (result["memfuse"] or {}).get(name, 0) for name in THROUGH_TORCH}
    if not any(counted.values()):
        return result
    ran = ", ".join(f"{name} {count}" for name, count in counted.items() if count)
    return {**result, "fits": False, "oom": False,
            "error": f"memfuse ran part of the step through torch ({ran}; the child's stderr says why): "
                     f"not counted as fitting in this mode"}


def is_out_of_memory(error: BaseException) -> bool:
    """torch's OutOfMemoryError, or an error whose message or cause says so (a library that wraps it)."""
    import torch
    while error is not None:
        if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
            return True
        error = error.__cause__
    return False


def over_tiny_cap(seq: int, batch: int, cap_tokens: int) -> dict:
    return {"fits": False, "seq": seq, "batch": batch, "oom": False,
            "error": f"tiny cap: {batch} x {seq} tokens > --tiny-cap-tokens {cap_tokens} (a CPU stand-in for "
                     f"out of memory)"}


def run_one(model_spec: Model, mode: Mode, seq: int, batch: int, cuda: bool, cap_tokens: int | None) -> dict:
    """One size's result: fits, or the error that stopped it (an out-of-memory says so)."""
    if cap_tokens is not None and batch * seq > cap_tokens:
        return over_tiny_cap(seq, batch, cap_tokens)
    try:
        return train_size(model_spec, mode, seq, batch, cuda)
    except Exception as error:  # any failure bounds the search; the parent records it
        traceback.print_exc()
        failed = {"fits": False, "seq": seq, "batch": batch, "oom": is_out_of_memory(error),
                  "error": f"{type(error).__name__}: {error}"}
        below = below_least(error)
        if below is not None:  # the byte budget's own bound at this size, not an out-of-memory
            least = below.least_bytes
            failed.update(oom=False, target_bytes=below.target_bytes, least_bytes=least,
                          detail=f"{type(below).__name__}: {below}",
                          error=f"target below the least: {least / 1e9:.2f} GB ({least} bytes)")
        return failed


def below_least(error: BaseException | None):
    """The MemoryBudgetError (memfuse.plan: a byte target below the least this size can need) that
    `error` is or was raised from, or None."""
    from memfuse.plan import MemoryBudgetError
    seen = set()
    while error is not None and not isinstance(error, MemoryBudgetError) and id(error) not in seen:
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return error if isinstance(error, MemoryBudgetError) else None


# -- the parent: each size in a fresh process ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Run:
    """How this command probes sizes."""

    model: Model
    tiny: bool
    timeout_s: float
    cap_tokens: int | None  # tiny runs only
    deadline: float  # time.monotonic() after which no size starts
    start: int | None = None  # the search's first size (None: SEQ_START or BATCH_START)
    granularity: int | None = None  # its bisection's step (None: SEQ_GRANULARITY or BATCH_GRANULARITY)


def run_in_own_group(command: list[str], env: dict, timeout_s: float) -> subprocess.CompletedProcess | None:
    """`command`'s output, or None past `timeout_s`: then it and every process it started (its
    process group: inductor's compile workers, say) are killed, so nothing of a size outlives it."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          start_new_session=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def probe_in_fresh_process(run: Run, mode: Mode, seq: int, batch: int) -> dict:
    """This script with --one in a new process: its RESULT line, or why there was none."""
    command = [sys.executable, "-m", "benchmarks.memory", "--one", mode.name, "--seq", str(seq), "--batch", str(batch)]
    command += ["--tiny", "--tiny-cap-tokens", str(run.cap_tokens)] if run.tiny else ["--model", run.model.name]
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent.parent),
                                                                      os.environ.get("PYTHONPATH")]))}
    done = run_in_own_group(command, env, run.timeout_s)
    if done is None:
        result = {"fits": False, "seq": seq, "batch": batch, "oom": False,
                  "error": f"timeout: no result in {run.timeout_s:g} s"}
    else:
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if lines:
            result = json.loads(lines[-1][len(RESULT_PREFIX):])
        else:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            result = {"fits": False, "seq": seq, "batch": batch, "oom": "out of memory" in done.stderr.lower(),
                      "error": f"exit {done.returncode} without a result: {tail}"}
        if not result["fits"]:
            sys.stderr.write(done.stderr[-3000:])
    result["process_s"] = time.perf_counter() - started
    print(f"  {mode.name} batch {batch} x seq {seq}: "
          f"{'fits' if result['fits'] else 'fails: ' + result['error'][:100]}", flush=True)
    return result


def mode_path(out: Path, model: str, kind: str, mode: Mode) -> Path:
    return out / f"memory-{model}" / kind / f"{mode.name}.json"


def search_bounds(kind: str, run: Run) -> tuple[int, int, int]:
    """(start, granularity, limit) of a search: the named defaults, or the command's --start and
    --granularity (a coarser search tries fewer sizes: one that fits a short GPU slot)."""
    if kind == "seq":
        start, granularity = (TINY_SEQ_START, TINY_SEQ_GRANULARITY) if run.tiny else (SEQ_START, SEQ_GRANULARITY)
        limit = SEQ_LIMIT
    else:
        start, granularity, limit = BATCH_START, BATCH_GRANULARITY, BATCH_LIMIT
    return run.start or start, run.granularity or granularity, limit


def search_mode(run: Run, mode: Mode, kind: str, seq: int, probe=probe_in_fresh_process, known=()) -> dict:
    """One mode's search (kind 'seq': the sequence at batch 1; 'batch': the batch at `seq`), reusing
    `known` probes (an earlier command's) at the same sizes."""
    probes = {(p["batch"], p["seq"]): p for p in known}

    def fits(size: int) -> bool | None:
        batch, length = (1, size) if kind == "seq" else (size, seq)
        if (batch, length) not in probes:
            if time.monotonic() > run.deadline:
                return None
            probes[batch, length] = probe(run, mode, length, batch)
        return probes[batch, length]["fits"]

    start, granularity, limit = search_bounds(kind, run)
    found = search(fits, start, granularity, limit)
    at = lambda size: None if size is None else probes[(1, size) if kind == "seq" else (size, seq)]  # noqa: E731
    return {"mode": mode.name, "search": kind, "seq": seq if kind == "batch" else None,
            "largest": found.largest, "smallest_failed": found.smallest_failed, "tried": list(found.tried),
            "complete": found.complete, "granularity": granularity, "at_largest": at(found.largest),
            "first_failure": at(found.smallest_failed), "probes": list(probes.values())}


# -- the report ------------------------------------------------------------------------------------
def best_peer(rows: list[dict]) -> dict | None:
    """The peer (not memfuse) that reached the largest size; the faster one where two tie."""
    peers = [r for r in rows if not Mode.parse(r["mode"]).is_memfuse and r["largest"]]
    return max(peers, key=lambda r: (r["largest"], r["at_largest"]["tokens_per_s"]), default=None)


def _gb(value: int | None) -> str:
    return "-" if value is None else f"{value / 1e9:.1f}"


def table(rows: list[dict], kind: str) -> str:
    what = "longest seq (batch 1)" if kind == "seq" else f"largest batch (seq {rows[0]['seq']})"
    best = best_peer(rows)
    lines = [f"| mode | {what} | tokens/s there | peak GB | size vs best peer | tokens/s vs best peer "
             f"| bounded by |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        at = r["at_largest"] or {}
        size = "none fits" if r["largest"] is None else str(r["largest"])
        if not r["complete"]:
            size += " (search unfinished)"
        speed = f"{at['tokens_per_s']:.0f}" if at else "-"
        size_ratio = f"{r['largest'] / best['largest']:.2f}x" if best and r["largest"] else "-"
        speed_ratio = (f"{at['tokens_per_s'] / best['at_largest']['tokens_per_s']:.2f}x" if best and at else "-")
        failure = r["first_failure"]
        bound = ("-" if failure is None else
                 ("out of memory" if failure.get("oom") else failure["error"][:ERROR_CHARS].replace("|", "/")))
        lines.append(f"| {r['mode']} | {size} | {speed} | {_gb(at.get('peak_bytes'))} | {size_ratio} "
                     f"| {speed_ratio} | {bound} |")
    if best:
        lines.append(f"\nBest peer: {best['mode']} ({best['largest']}).")
    return "\n".join(lines)


def target_bytes(mode: Mode) -> int | None:
    """A memfuse mode's byte target (`memfuse@12GB`: 12 * 10**9), or None (no budget, a fraction)."""
    from memfuse.base.config import is_byte_budget, parse_memory_budget
    if not (mode.base == "memfuse" and mode.budget):
        return None
    budget = parse_memory_budget(_memfuse_budget(mode.budget))
    return budget if is_byte_budget(budget) else None


def _ratio(numerator: int | None, denominator: int | None) -> str:
    return f"{numerator / denominator:.2f}" if numerator is not None and denominator else "-"


def budget_table(rows: list[dict]) -> str:
    """Every size a byte-budget mode tried that fitted or met its target's bound: the target beside
    the peak memfuse predicted and the one measured (issue 52: the measured peak within 10% of the
    target at every target tried). measured / target takes the whole measured peak (AdamW's state
    included: what has to fit); predicted / measured leaves AdamW's state out of the measured peak,
    as memfuse.plan.predicted_peak does (it counts parameters, gradients and the step's live values)."""
    lines = ["| mode | batch x seq | target GB | predicted GB | measured GB | AdamW state GB | measured / target "
             "| predicted / (measured - AdamW state) | offloaded | recomputed for the budget |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        target = target_bytes(Mode.parse(r["mode"]))
        if target is None:
            continue
        for p in sorted(r["probes"], key=lambda p: (p["batch"], p["seq"])):
            size = f"{p['batch']} x {p['seq']}"
            if "least_bytes" in p:
                lines.append(f"| {r['mode']} | {size} | {_gb(target)} | {p['error']} | | | | | | |")
            elif p["fits"] and p.get("plans"):
                plans, measured = p["plans"], p.get("peak_bytes")
                step = None if measured is None else measured - p.get("optimizer_state_bytes", 0)
                lines.append(f"| {r['mode']} | {size} | {_gb(target)} | {_gb(plans['predicted_peak_bytes'])} "
                             f"| {_gb(measured)} | {_gb(p.get('optimizer_state_bytes'))} | {_ratio(measured, target)} "
                             f"| {_ratio(plans['predicted_peak_bytes'], step)} | {plans['offloaded']} "
                             f"| {plans['recomputed_for_budget']} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def report(model: str, results: dict[str, list[dict]], chart: list[dict], tiny: bool) -> str:
    parts = [f"# Memory: {model}"]
    if tiny:
        parts.append("TINY RUN on CPU: sizes bounded by --tiny-cap-tokens, not memory; the numbers say "
                     "nothing about performance.")
    for kind, rows in results.items():
        if rows:
            parts.append(f"## {'Longest sequence' if kind == 'seq' else 'Largest batch'}\n\n{table(rows, kind)}")
    budgets = budget_table([r for rows in results.values() for r in rows])
    if budgets:
        parts.append(f"## Byte budgets: target, predicted and measured peaks\n\n{budgets}")
    if chart and versus_checkpoint(chart):
        parts.append(versus_checkpoint(chart))
    if chart:
        parts.append("## Peak and step time at one size\n\n| mode | step s | peak GB |\n| --- | --- | --- |\n"
                     + "\n".join(f"| {c['mode']} | " + (f"{c['step_s']:.3f} | {_gb(c.get('peak_bytes'))} |"
                                                         if c["fits"] else f"failed: {c['error'][:ERROR_CHARS]} | |")
                                 for c in chart))
    return "\n\n".join(parts) + "\n"


def draw_chart(chart: list[dict], title: str, path: Path) -> Path | None:
    """Peak against step time, a point per mode that fitted (a CPU run has no peak: drawn at 0)."""
    points = [c for c in chart if c["fits"]]
    if not points:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 5))
    for c in points:
        peak_gb = (c["peak_bytes"] or 0) / 1e9
        axes.scatter(c["step_s"], peak_gb)
        axes.annotate(c["mode"], (c["step_s"], peak_gb), textcoords="offset points", xytext=(5, 3))
    axes.set_xlabel("step time (s; forward, backward, AdamW)")
    axes.set_ylabel("peak allocated (GB; parameters, gradients, AdamW state included)")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def chart_points(run: Run, modes: list[Mode], seq: int, out: Path, probe=probe_in_fresh_process) -> list[dict]:
    """Every mode at batch 1 x `seq`: a size its searches already tried, or a fresh probe (kept in
    OUT/memory-<model>/chart/)."""
    points = []
    for mode in modes:
        searched = [mode_path(out, run.model.name, kind, mode) for kind in ("seq", "batch")]
        known = [p for path in searched if path.exists() for p in json.loads(path.read_text())["probes"]]
        point = next((p for p in known if (p["batch"], p["seq"]) == (1, seq)), None)
        path = out / f"memory-{run.model.name}" / "chart" / f"{mode.name}-seq{seq}.json"
        if point is None and path.exists():
            point = json.loads(path.read_text())
        if point is None and time.monotonic() <= run.deadline:
            point = probe(run, mode, seq, 1)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(point, indent=1))
        if point is not None:
            points.append({"mode": mode.name, **point})
    return points


AUTO = "auto"  # memfuse@auto: a byte budget at checkpointing's measured peak (at_checkpoints_peak)


def at_checkpoints_peak(peak_bytes: int) -> Mode:
    """The memfuse mode whose byte budget is `peak_bytes` exactly (memfuse@<peak_bytes>B): what
    memfuse@auto becomes, named by its number so a later command finds its JSON again."""
    return Mode("memfuse", f"{peak_bytes}B")


def resolve_auto(run: Run, seq: int | None, out: Path, probe=probe_in_fresh_process) -> Mode | str:
    """memfuse@auto as a byte-budget mode at the peak the checkpoint mode measured at batch 1 x `seq`
    (--chart-seq): its search's size or a fresh probe (chart_points). Or why there is none (a str)."""
    if seq is None:
        return "memfuse@auto needs --chart-seq: the size at which checkpointing's peak becomes the budget"
    point = next(iter(chart_points(run, [Mode("checkpoint")], seq, out, probe)), None)
    if point is None or not point["fits"] or not point.get("peak_bytes"):
        why = ("no size started (--budget-s)" if point is None else
               point.get("error", "") if not point["fits"] else "no peak measured (CPU)")
        return f"memfuse@auto: checkpoint has no measured peak at batch 1 x {seq}: {why}"
    return at_checkpoints_peak(point["peak_bytes"])


def versus_checkpoint(chart: list[dict]) -> str:
    """Issue 52's target at a byte budget equal to checkpointing's peak (memfuse@auto): memfuse's
    tokens/s there against checkpointing's, at the chart's size."""
    checkpoint = next((c for c in chart if c["mode"] == "checkpoint" and c["fits"] and c.get("peak_bytes")), None)
    if checkpoint is None:
        return ""
    name = at_checkpoints_peak(checkpoint["peak_bytes"]).name
    point = next((c for c in chart if c["mode"] == name), None)
    if point is None:
        return ""
    head = (f"memfuse at checkpointing's peak ({name}: {_gb(checkpoint['peak_bytes'])} GB at batch 1 x "
            f"{checkpoint['seq']}): ")
    if not point["fits"]:
        return head + f"failed: {point['error'][:ERROR_CHARS]}"
    return head + (f"{point['tokens_per_s']:.0f} tokens/s, {point['tokens_per_s'] / checkpoint['tokens_per_s']:.2f}x "
                   f"checkpointing's {checkpoint['tokens_per_s']:.0f} (issue 52's target: >= 1.4x)")


def metadata(tiny: bool) -> dict:
    """The run's device and versions. Called after every size's process has ended: the device name
    is this process's first touch of the GPU (a CUDA context of its own would take memory from the
    sizes' processes)."""
    import torch
    import transformers
    return {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "tiny": tiny,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not tiny else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__, "argv": sys.argv[1:],
            "steps": dataclasses.asdict(TINY_STEPS if tiny else GPU_STEPS),
            "definitions": {
                "step": "forward, loss, backward, AdamW step (fused on CUDA, foreach=False on CPU), zero_grad",
                "largest": "the largest size whose fresh process trained every step (search: doubling, then "
                           "bisection to `granularity`)",
                "tokens_per_s": "batch x seq / median of the timed steps' times (synchronized host clock)",
                "peak_bytes": "torch.cuda.max_memory_allocated over all steps of that process (parameters, "
                              "gradients and AdamW state included)",
                "best peer": "the mode other than memfuse's with the largest size (faster on a tie)"}}


def parse_modes(text: str | None, tiny: bool) -> list[Mode]:
    names = [n.strip() for n in text.split(",") if n.strip()] if text else list(TINY_MODES if tiny else MODES)
    return [Mode.parse(n) for n in names]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama16")
    parser.add_argument("--search", choices=("seq", "batch"), default="seq", help="seq: the longest sequence at "
                        "batch 1; batch: the largest batch at --seq")
    parser.add_argument("--seq", type=int, default=4096, help="the sequence of --search batch (and of --one)")
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)  # of --one
    parser.add_argument("--modes", help=f"comma-separated (default: {','.join(MODES)}); a base from "
                        f"{', '.join(BASES)}, {' and '.join(BUDGETED)} with @budget")
    parser.add_argument("--start", type=int, help=f"the first size (default: {SEQ_START} tokens, "
                        f"{BATCH_START} sample)")
    parser.add_argument("--granularity", type=int, help=f"the bisection's step (default: {SEQ_GRANULARITY} "
                        f"tokens, {BATCH_GRANULARITY} sample)")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no size after this many s")
    parser.add_argument("--timeout-s", type=float, default=PROBE_TIMEOUT_S, help="per size")
    parser.add_argument("--force", action="store_true", help="search again modes that have a complete JSON")
    parser.add_argument("--chart-seq", type=int, help="draw peak against step time at batch 1 x this many tokens")
    parser.add_argument("--charts", type=Path, default=CHARTS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU through the Triton interpreter")
    parser.add_argument("--tiny-cap-tokens", type=int, default=TINY_CAP_TOKENS,
                        help="tiny runs: a size with more tokens per step fails (a stand-in for memory)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a worker: train this mode at --batch x --seq
    args = parser.parse_args(argv)
    if args.one and args.tiny and args.batch * args.seq > args.tiny_cap_tokens:
        # answered before importing torch: a capped size costs the search no model
        print(RESULT_PREFIX + json.dumps(over_tiny_cap(args.seq, args.batch, args.tiny_cap_tokens)), flush=True)
        return
    import torch
    tiny = args.tiny or not torch.cuda.is_available()
    model = TINY if tiny else MODELS[args.model]
    if args.one:
        from benchmarks.lib import hf_models  # noqa: F401  (sets TRITON_INTERPRET before triton loads)
        # hf_models (imported by wrap) sets TRITON_INTERPRET when --tiny is in sys.argv or there is no CUDA
        result = run_one(model, Mode.parse(args.one), args.seq, args.batch, cuda=not tiny,
                         cap_tokens=args.tiny_cap_tokens if tiny else None)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    try:
        modes = parse_modes(args.modes, tiny)
    except ValueError as error:
        parser.error(str(error))
    run = Run(model, tiny, args.timeout_s, args.tiny_cap_tokens if tiny else None,
              deadline=time.monotonic() + args.budget_s, start=args.start, granularity=args.granularity)
    for index, mode in enumerate(modes):
        if mode.base == "memfuse" and mode.budget == AUTO:
            resolved = resolve_auto(run, args.chart_seq, args.out)
            print(f"memfuse@auto is {resolved.name}" if isinstance(resolved, Mode) else resolved, flush=True)
            if not isinstance(resolved, Mode):
                continue
            mode = modes[index] = resolved
        path = mode_path(args.out, model.name, args.search, mode)
        earlier = json.loads(path.read_text()) if path.exists() and not args.force else None
        if earlier and earlier.get("seq") != (args.seq if args.search == "batch" else None):
            earlier = None  # a batch search at another sequence: nothing to reuse
        if earlier and earlier["complete"] and earlier["granularity"] == search_bounds(args.search, run)[1]:
            print(f"{mode.name}: done earlier ({path}); --force searches again", flush=True)
            continue
        print(f"{mode.name}: searching {args.search} ...", flush=True)
        result = search_mode(run, mode, args.search, args.seq, known=earlier["probes"] if earlier else ())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
    modes = [m for m in modes if m.budget != AUTO or m.base != "memfuse"]  # an auto left unresolved
    write_report(args.out, model.name, modes, tiny, run, args.chart_seq, args.charts)


def write_report(out: Path, model: str, modes: list[Mode], tiny: bool, run: Run, chart_seq: int | None,
                 charts: Path) -> None:
    results = {kind: [json.loads(mode_path(out, model, kind, m).read_text()) for m in modes
                      if mode_path(out, model, kind, m).exists()] for kind in ("seq", "batch")}
    chart = chart_points(run, modes, chart_seq, out) if chart_seq else []
    text = report(model, results, chart, tiny)
    title = f"{model}, batch 1 x {chart_seq} tokens" + (" (TINY RUN on CPU: no memory measured)" if tiny else "")
    picture = draw_chart(chart, title, charts / f"memory-{model}-seq{chart_seq}.png")
    if picture:
        text += f"\n![peak against step time]({os.path.relpath(picture, out)})\n"
    (out / f"memory-{model}.json").write_text(json.dumps({"metadata": metadata(tiny), "model": dataclasses.asdict(
        run.model), **results, "chart": chart}, indent=1))
    (out / f"memory-{model}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
