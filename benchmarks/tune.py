"""Sweep launch configurations for each memfuse kernel of the benchmark workloads (GPU only).

For every kernel: rows per tile x warps, then (persistent kernels) programs per SM and then
pipeline stages at the best of those, each kernel timed alone with `triton.testing.do_bench`
on the arguments of a recorded step. Prints the best per kernel next to the default table's
choice, writes the winners to memfuse's tuning cache (so later runs on this
device use them) and to `tune.json` in --out.

    python -m benchmarks.tune [--workloads rms,layer_norm] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import memfuse
from benchmarks.lib.kernel_timing import best_of, sweep
from benchmarks.lib.workloads import registry
from memfuse.runtime.program import KernelLaunch
from memfuse.codegen.tuning import TuningCache, source_config


def tune_workload(workload, results: list, cache: TuningCache, device_name: str, exhaustive: bool) -> None:
    """`exhaustive`: every rows x warps x programs-per-SM combination for persistent kernels
    (else rows x warps at 2 per SM, then programs per SM at the best of those)."""
    inputs = workload.make_inputs("cuda")
    fused = memfuse.memory_efficient_fusion(workload.fn)

    def step(inputs):
        out = fused(*inputs.tensors, **inputs.consts)
        out.backward(inputs.grad_output)
        for t in inputs.tensors:
            t.grad = None

    step(inputs)
    entry = next(iter(fused.cache.values()))
    launches = [s for program in (entry.function.forward, entry.function.backward) for s in program.steps
                if isinstance(s, KernelLaunch)]
    for launch in launches:
        launch.record = True
    step(inputs)
    device = inputs.tensors[0].device
    rows = inputs.tensors[0].numel() // inputs.tensors[0].shape[-1]
    for launch in launches:
        source = launch.kernel.source
        block_d = source.constexprs["BLOCK_D"]
        default = source_config(source)
        default_us = best_of(launch, [default], device)[0][0]
        best_us, best = sweep(launch, device, exhaustive)
        if default_us <= best_us:
            best_us, best = default_us, default
        launch.configs[device] = best
        cache.put(device_name, Path(launch.kernel.path).stem, best)
        gbps = source.bytes_per_row * rows / (best_us * 1e-6) / 1e9
        results.append(dict(workload=workload.name, kernel=source.name, block_d=block_d,
                            persistent=source.persistent, default=vars(default), default_us=default_us,
                            best=vars(best), best_us=best_us, best_gbps=gbps))
        print(f"{workload.name:44s} {source.name:20s} default {default_us:8.1f} us  best {best_us:8.1f} us "
              f"{vars(best)}  {gbps:7.0f} GB/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", help="comma-separated substrings of workload names")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--exhaustive", action="store_true", help="joint search for persistent kernels")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.tune needs a CUDA device")
    wanted = args.workloads.split(",") if args.workloads else None
    device_name = torch.cuda.get_device_name()
    cache = TuningCache(memfuse.Config().cache_dir)
    results: list = []
    for workload in registry():
        if wanted is None or any(w in workload.name for w in wanted):
            tune_workload(workload, results, cache, device_name, args.exhaustive)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(dict(device=device_name, results=results), indent=1))
    print(f"tuning cache: {cache.path}")


if __name__ == "__main__":
    main()
