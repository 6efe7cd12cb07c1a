"""First-call cost in fresh processes, cold (empty compile caches) and warm (same caches).

The parent runs `python -m benchmarks.first_call WORKLOAD MODE` twice per (workload, mode)
with every compile cache pointed into one new temporary directory: the first run finds
them empty ("cold"), the second finds what the first wrote ("warm disk cache").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CACHE_ENV_VARS = ("MEMFUSE_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
CHILD_TIMEOUT_S = 600
RESULT_PREFIX = "FIRST_CALL_RESULT "
STDERR_TAIL_CHARS = 2000
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class ChildRun:
    """One fresh process: its whole wall time and what it measured inside."""

    process_s: float  # python start to exit: interpreter, torch import, compile, step
    import_s: float | None = None  # resolving the mode (imports memfuse, functorch, ...)
    first_call_s: float | None = None  # wrap + first forward+backward, synchronized
    stats: object | None = None  # memfuse.stats() after the step, when offered
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
    return results


def _child(workload_name: str, mode: str, smoke: bool) -> dict:
    """Measure in this fresh process; returns ChildRun's fields (less process_s)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before memfuse
    import torch

    from benchmarks.measure import first_call
    from benchmarks.modes import memfuse_stats, resolve_modes
    from benchmarks.workloads import workloads_for

    device = torch.device("cpu" if smoke else "cuda")
    workload = {w.name: w for w in workloads_for(smoke)}[workload_name]
    torch.manual_seed(0)
    inputs = workload.make_inputs(device)
    start = time.perf_counter()
    mode_set = resolve_modes((mode,), cuda=device.type == "cuda")
    import_s = time.perf_counter() - start
    if mode not in mode_set.factories:
        return {"import_s": import_s, "error": mode_set.unavailable.get(mode, f"{mode} not offered here")}
    _, seconds = first_call(mode_set.factories[mode], workload.fn, inputs, device)
    return {"import_s": import_s, "first_call_s": seconds, "stats": memfuse_stats()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload")
    parser.add_argument("mode")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU workloads, Triton interpreter")
    args = parser.parse_args(argv)
    result = _child(args.workload, args.mode, args.smoke)
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
