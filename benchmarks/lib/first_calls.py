"""First calls in fresh processes, the parent's side: run `python -m benchmarks.first_call WORKLOAD
MODE` twice per (workload, mode) with every compile cache pointed into one new temporary directory
(cold: empty caches; warm: what the first run wrote), and read back what each child measured
(benchmarks/first_call.py is the child). Used by benchmarks.run --first-call and benchmarks.first_call
--models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CACHE_ENV_VARS = ("MEMFUSE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
CHILD_TIMEOUT_S = 600
RESULT_PREFIX = "FIRST_CALL_RESULT "
STDERR_TAIL_CHARS = 2000
REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_PREFIX = "model:"  # a workload naming a whole HuggingFace model (benchmarks/lib/hf_models.py)


@dataclasses.dataclass(frozen=True)
class ChildRun:
    """One fresh process: its whole wall time and what it measured inside."""

    process_s: float  # python start to exit: interpreter, torch import, compile, step
    import_s: float | None = None  # resolving the mode (imports memfuse, functorch, ...)
    first_call_s: float | None = None  # wrap + first forward+backward, synchronized
    stats: object | None = None  # memfuse.stats() after the step, when offered
    compile_times: dict | None = None  # memfuse.compile_times() after the step: seconds per stage
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class FirstCallResult:
    workload: str
    mode: str
    cold: ChildRun
    warm: ChildRun


def _child_env(cache_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    for var in CACHE_ENV_VARS:
        env[var] = os.path.join(cache_dir, var.lower())
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def _run_child(workload: str, mode: str, cache_dir: str, smoke: bool) -> ChildRun:
    command = [sys.executable, "-m", "benchmarks.first_call", workload, mode] + (["--smoke"] if smoke else [])
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=REPO_ROOT, env=_child_env(cache_dir), capture_output=True, text=True, timeout=CHILD_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return ChildRun(time.perf_counter() - start, error=f"timed out after {CHILD_TIMEOUT_S} s")
    process_s = time.perf_counter() - start
    for line in done.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return ChildRun(process_s, **json.loads(line[len(RESULT_PREFIX):]))
    return ChildRun(process_s, error=f"exit {done.returncode}: {done.stderr[-STDERR_TAIL_CHARS:]}")


def _seconds(run: ChildRun) -> str:
    return "error" if run.first_call_s is None else f"{run.first_call_s:.2f} s"


def stage_line(run: ChildRun) -> str:
    """Where the child's memfuse compile time went, and its kernels generated and loaded."""
    if not run.compile_times or not run.compile_times.get("compile"):
        return run.error or "no memfuse compile"
    stages = ", ".join(f"{stage} {seconds:.2f}" for stage, seconds in run.compile_times.items() if stage != "compile")
    counts = run.stats or {}
    return (f"memfuse compile {run.compile_times['compile']:.2f} s ({stages}); kernels generated "
            f"{counts.get('kernels_generated', '?')}, loaded from the index {counts.get('kernels_loaded', '?')}")


def measure_first_calls(workloads: list[str], modes: list[str], smoke: bool) -> list[FirstCallResult]:
    """Cold then warm first call of every (workload, mode), each in a fresh process."""
    results = []
    for workload in workloads:
        for mode in modes:
            with tempfile.TemporaryDirectory(prefix="memfuse-bench-cache-") as cache_dir:
                cold = _run_child(workload, mode, cache_dir, smoke)
                warm = _run_child(workload, mode, cache_dir, smoke)
            results.append(FirstCallResult(workload, mode, cold, warm))
            print(f"first call {workload} {mode}: cold {_seconds(cold)}, warm {_seconds(warm)}", flush=True)
            if mode.startswith("memfuse"):
                print(f"  cold: {stage_line(cold)}\n  warm: {stage_line(warm)}", flush=True)
    return results
