"""Side-by-side benchmark of memfuse and its peers on the seed tutorial's blocks.

    python -m benchmarks.run [--workloads SUBSTR,..] [--modes NAME,..] [--quick] [--first-call] [--out DIR]
                             [--charts DIR]

Every workload x mode runs in this one process: it/s of a forward+backward step (CUDA
events), kernel time (torch.profiler), share of the speed of light against a copy bandwidth
measured in the same run, memory saved for the backward, step peak and first-call time; then
the tutorial's dynamic-shape test. --first-call adds cold/warm first calls in fresh processes.
Writes bench.json and bench.png into --out (smoke.* without CUDA); --charts DIR draws the chart there too.
Without CUDA this is a smoke run on tiny shapes through the Triton interpreter.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import statistics
import sys
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

SMOKE = not torch.cuda.is_available()
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before memfuse loads

from benchmarks.lib import measure, report  # noqa: E402
from benchmarks.lib.first_calls import measure_first_calls  # noqa: E402
from benchmarks.lib.modes import (  # noqa: E402
    BASELINE_MODE, COMPILING_MODES, DYNAMIC_MODES, MODE_ORDER, SMOKE_MODES, Factory, ModeSet, memfuse_stats,
    resolve_modes,
)
from benchmarks.lib.workloads import SEED_SHAPE, SMOKE_SHAPE, StepInputs, Workload, workloads_for  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
INPUT_SEED = 0
SMOKE_BANNER = (
    "=" * 88 + "\n"
    "CPU SMOKE RUN: no CUDA device. memfuse runs through the Triton interpreter on tiny shapes.\n"
    "These numbers say NOTHING about performance; they only show the harness and modes work.\n"
    + "=" * 88
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", help="comma-separated substrings of workload names")
    parser.add_argument("--modes", help=f"comma-separated, from {', '.join(MODE_ORDER)}")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter repeats")
    parser.add_argument("--first-call", action="store_true", help="cold/warm first call in fresh processes")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--charts", type=Path, metavar="DIR",
                        help="also draw the charts into DIR, same undated names (docs/img: the results page's)")
    return parser.parse_args(argv)


def select_workloads(available: list[Workload], filters: str | None) -> list[Workload]:
    if not filters:
        return available
    terms = [t.strip() for t in filters.split(",") if t.strip()]
    chosen = [w for w in available if any(term in w.name for term in terms)]
    if not chosen:
        sys.exit(f"--workloads {filters!r} matches none of: {', '.join(w.name for w in available)}")
    return chosen


def select_modes(filters: str | None) -> tuple[str, ...]:
    offered = SMOKE_MODES if SMOKE else MODE_ORDER
    if not filters:
        return offered
    requested = [m.strip() for m in filters.split(",") if m.strip()]
    unknown = [m for m in requested if m not in MODE_ORDER]
    if unknown:
        sys.exit(f"unknown modes {unknown}; choose from {', '.join(MODE_ORDER)}")
    chosen = tuple(m for m in offered if m in requested)
    if not chosen:
        sys.exit(f"--modes {filters!r}: none of them runs here; this run offers {', '.join(offered)}")
    return chosen


def _error_text(error: Exception) -> str:
    traceback.print_exc()
    return f"{type(error).__name__}: {error}"


def _release_memory() -> None:
    gc.collect()
    if not SMOKE:
        torch.cuda.empty_cache()


def measure_cell(
    workload: Workload,
    inputs: StepInputs,
    mode: str,
    factory: Factory,
    settings: measure.Settings,
    bandwidth: float | None,
) -> report.CellResult:
    """All step metrics of one workload x mode, after its first call."""
    device = inputs.grad_output.device
    cell = report.CellResult(workload.name, mode, workload.bytes_sol_fwd_bwd())
    step_fn, first_call_s = measure.first_call(factory, workload.fn, inputs, device)
    step = measure.median_step_time(step_fn, inputs, settings, device)
    cell = dataclasses.replace(cell, first_call_s=first_call_s, step_s=step.median_s,
                               steps_per_repeat=step.steps_per_repeat)
    if device.type == "cuda":
        memory = measure.step_memory(step_fn, inputs)
        kernel_s = measure.kernel_seconds_per_step(step_fn, inputs, settings.profile_steps)
        sol_s = cell.sol_bytes / bandwidth
        moves_bytes = mode != "floor"   # the floor launches nothing: a share of SOL means nothing there
        cell = dataclasses.replace(
            cell, kernel_s=kernel_s, saved_bytes=memory.saved_bytes, peak_bytes=memory.peak_bytes,
            peak_abs_bytes=memory.peak_abs_bytes, step_sol=sol_s / step.median_s if moves_bytes else None,
            gpu_sol=sol_s / kernel_s if kernel_s and moves_bytes else None,
        )
    return dataclasses.replace(cell, stats=memfuse_stats() if mode.startswith("memfuse") else None)


def run_workload(
    workload: Workload, modes: ModeSet, settings: measure.Settings, device: torch.device, bandwidth: float | None
) -> list[report.CellResult]:
    """Every mode on the same inputs, then each mode's it/s relative to torch.compile's."""
    torch.manual_seed(INPUT_SEED)
    inputs = workload.make_inputs(device)
    cells = []
    for mode, factory in modes.factories.items():
        print(f"{workload.name} {mode} ...", flush=True)
        try:
            cells.append(measure_cell(workload, inputs, mode, factory, settings, bandwidth))
        except Exception as error:  # one failing mode must not end the comparison
            cells.append(report.CellResult(workload.name, mode, workload.bytes_sol_fwd_bwd(), error=_error_text(error)))
        _release_memory()
    baseline = next((c.it_s for c in cells if c.mode == BASELINE_MODE and c.it_s), None)
    return [dataclasses.replace(c, vs_baseline=c.it_s / baseline if baseline and c.it_s else None) for c in cells]


def _pass_it_s(step_fn, steps: list, count: int, device: torch.device) -> float:
    """it/s of `count` steps cycling through the shapes, timed like the tutorial (host clock)."""
    def cycle() -> None:
        for index in range(count):
            measure.run_step(step_fn, steps[index % len(steps)])

    return count / measure.wall_seconds(cycle, device)


def run_dynamic(
    workload: Workload, mode: str, factory: Factory, settings: measure.Settings, device: torch.device
) -> report.DynamicResult:
    """The tutorial's test: warm up on the first shape only, then two passes over all shapes.
    One pass is about 100 steps of a few ms in all, so the whole test runs `dynamic_runs` times,
    each from a fresh wrapper (compile cache empty, caching allocator emptied), medians reported."""
    result = report.DynamicResult(workload.name, mode, settings.dynamic_shape_count)
    try:
        torch.manual_seed(INPUT_SEED)
        steps = workload.make_dynamic_inputs(device, settings.dynamic_shape_count)
        firsts, seconds = [], []
        for _ in range(settings.dynamic_runs):
            _release_memory()
            step_fn = factory(workload.fn, steps[0].consts)
            measure.run_steps(step_fn, steps[0], settings.dynamic_warmup_steps)
            firsts.append(_pass_it_s(step_fn, steps, settings.dynamic_pass_steps, device))
            seconds.append(_pass_it_s(step_fn, steps, settings.dynamic_pass_steps, device))
            del step_fn
        return dataclasses.replace(result, first_pass_it_s=statistics.median(firsts),
                                   second_pass_it_s=statistics.median(seconds),
                                   ratios=tuple(f / s for f, s in zip(firsts, seconds)))
    except Exception as error:  # reported in the results
        return dataclasses.replace(result, error=_error_text(error))
    finally:
        _release_memory()


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def metadata(device: torch.device, bandwidth: float | None, settings: measure.Settings) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "smoke": SMOKE,
        "device": (platform.processor() or "cpu") if SMOKE else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "argv": sys.argv[1:],
        "copy_bandwidth_bytes_per_s": bandwidth,
        "settings": dataclasses.asdict(settings),
        "definitions": {
            "sol_bytes": "fwd reads every tensor input, writes the output; bwd reads the output grad, "
                         "re-reads the inputs needing grads, writes their grads",
            "step_sol": "(sol_bytes / copy bandwidth) / median step wall time (CUDA events)",
            "gpu_sol": "(sol_bytes / copy bandwidth) / summed device time of the step's kernels (profiler)",
            "saved_bytes": "memory_allocated after forward - before forward - output storage",
            "peak_bytes": "max_memory_allocated over the step - memory_allocated before it",
            "first_call_s": "wrap + first fwd+bwd in this process (modes already imported)",
        },
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if SMOKE else "cuda")
    settings = measure.SMOKE if SMOKE else measure.QUICK if args.quick else measure.FULL
    workloads = select_workloads(workloads_for(SMOKE), args.workloads)
    modes = resolve_modes(select_modes(args.modes), cuda=not SMOKE)
    if SMOKE:
        print(SMOKE_BANNER, flush=True)
    bandwidth = None if SMOKE else measure.copy_bandwidth(device, settings.copy_repeats)
    cells = [cell for w in workloads for cell in run_workload(w, modes, settings, device, bandwidth)]
    dynamic_shape = SMOKE_SHAPE if SMOKE else SEED_SHAPE
    dynamic = [
        run_dynamic(w, mode, factory, settings, device)
        for w in workloads if w.shape == dynamic_shape
        for mode, factory in modes.factories.items() if mode in DYNAMIC_MODES
    ]
    first_calls = []
    if args.first_call:
        compiling = [m for m in COMPILING_MODES if m in modes.factories]
        first_calls = measure_first_calls([w.name for w in workloads], compiling, SMOKE)
    results = report.BenchResults(metadata(device, bandwidth, settings), modes.unavailable, cells, dynamic, first_calls)
    write_outputs(results, args.out, args.charts)


def write_outputs(results: report.BenchResults, out_dir: Path, charts: Path | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "smoke" if SMOKE else "bench"
    print()
    print(report.render(results))
    report.write_json(results, out_dir / f"{stem}.json")
    report.write_chart(results, out_dir / f"{stem}.png")
    if charts is not None:
        charts.mkdir(parents=True, exist_ok=True)
        report.write_chart(results, charts / f"{stem}.png")
        print(f"wrote {charts / stem}.png")
    bandwidth = results.metadata["copy_bandwidth_bytes_per_s"]
    if bandwidth:
        print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s on {results.metadata['device']}")
    print(f"wrote {out_dir / stem}.json and {out_dir / stem}.png")
    if SMOKE:
        print(SMOKE_BANNER)


if __name__ == "__main__":
    main()
