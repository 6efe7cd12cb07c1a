"""Sweep launch configurations for each memfuse kernel of the benchmark workloads (GPU only).

For every kernel: rows per tile x warps (and, for persistent kernels, programs per SM), each
timed alone with torch.profiler over a few steps. Prints the best per kernel next to the
default table's choice, writes the winners to memfuse's tuning cache (so later runs on this
device use them) and to `tune.json` in --out.

    python -m benchmarks.tune [--workloads rms,layer_norm] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import memfuse
from benchmarks.workloads import registry
from memfuse.runtime import KernelLaunch
from memfuse.tuning import LaunchConfig, TuningCache, default_config

STEPS = 10


def kernel_times(step, inputs) -> dict:
    """Mean device time (us) per kernel name over STEPS steps."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step(inputs)
        torch.cuda.synchronize()
    times: dict = {}
    for event in prof.events():
        if event.name.startswith("memfuse_"):
            times.setdefault(event.name, []).append(event.device_time)
    return {name: statistics.mean(values) for name, values in times.items()}


def candidates(launch: KernelLaunch) -> list:
    block_d = launch.kernel.source.constexprs["BLOCK_D"]
    persistent = launch.kernel.source.persistent
    out = []
    for block_m in (1, 2, 4, 8, 16, 32):
        if not 512 <= block_m * block_d <= 32768:
            continue
        for warps in (2, 4, 8, 16):
            if warps * 32 * 4 > block_m * block_d * 2:
                continue
            for per_sm in ((1, 2, 4, 8) if persistent else (0,)):
                out.append(LaunchConfig(block_m, warps, per_sm))
    return out


def tune_workload(workload, results: list, cache: TuningCache, device_name: str) -> None:
    inputs = workload.make_inputs("cuda")
    fused = memfuse.memory_efficient_fusion(workload.fn)

    def step(inputs):
        out = fused(*inputs.tensors, **inputs.consts)
        out.backward(inputs.grad_output)
        for t in inputs.tensors:
            t.grad = None

    step(inputs)
    entry = next(iter(fused.cache.values()))
    launches = [s for p in (entry.function.forward, entry.function.backward) for s in p.steps
                if isinstance(s, KernelLaunch)]
    device = inputs.tensors[0].device
    rows = inputs.tensors[0].numel() // inputs.tensors[0].shape[-1]
    for launch in launches:
        name = launch.kernel.source.name
        block_d = launch.kernel.source.constexprs["BLOCK_D"]
        default = default_config(block_d, launch.kernel.source.persistent)
        timed = []
        for config in [default] + candidates(launch):
            launch.configs[device] = config
            step(inputs)                      # compile this variant outside the timing
            step(inputs)
            timed.append((kernel_times(step, inputs).get(name, float("inf")), config))
        best_time, best = min(timed, key=lambda tc: tc[0])
        launch.configs[device] = best
        cache.put(device_name, Path(launch.kernel.path).stem, best)
        gbps = launch.kernel.source.bytes_per_row * rows / (best_time * 1e-6) / 1e9
        results.append(dict(workload=workload.name, kernel=name, block_d=block_d,
                            persistent=launch.kernel.source.persistent, default=vars(default),
                            default_us=timed[0][0], best=vars(best), best_us=best_time, best_gbps=gbps))
        print(f"{workload.name:44s} {name:20s} default {timed[0][0]:8.1f} us  best {best_time:8.1f} us "
              f"{vars(best)}  {gbps:7.0f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", help="comma-separated substrings of workload names")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.tune needs a CUDA device")
    wanted = args.workloads.split(",") if args.workloads else None
    device_name = torch.cuda.get_device_name()
    cache = TuningCache(memfuse.Config().cache_dir)
    results: list = []
    for workload in registry():
        if wanted is None or any(w in workload.name for w in wanted):
            tune_workload(workload, results, cache, device_name)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(dict(device=device_name, results=results), indent=1))
    print(f"tuning cache: {cache.path}")


if __name__ == "__main__":
    main()
