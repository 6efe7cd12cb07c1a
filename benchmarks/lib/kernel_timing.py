"""GPU kernels timed alone with Triton's `do_bench`: the copy bandwidth a kernel's speed is held
against, one launch's time on the arguments of its recorded call, and sweeps of its launch
configurations (rows per tile x warps, programs per SM, pipeline stages). Used by benchmarks.tune,
.kernel_sol, .long_rows and .instructions.
"""
from __future__ import annotations

import dataclasses

import torch
from triton.testing import do_bench

from memfuse.codegen.tuning import LaunchConfig
from memfuse.runtime.program import KernelLaunch


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), measured now."""
    source = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    target = torch.empty_like(source)
    ms = do_bench(lambda: target.copy_(source), warmup=25, rep=200, return_mode="median")
    return 2 * source.nbytes / (ms * 1e-3)


def kernel_time(launch: KernelLaunch) -> float:
    """Median microseconds of `launch` on the arguments of its recorded call (column sums
    included: the kernel's last program finishes them)."""
    return 1000 * do_bench(lambda: launch(*launch.recorded), warmup=10, rep=40, return_mode="median")


def tile_candidates(block_d: int, per_sm: int) -> list:
    return [LaunchConfig(block_m, warps, per_sm)
            for block_m in (1, 2, 4, 8, 16, 32) if 1024 <= block_m * block_d <= 16384
            for warps in (2, 4, 8, 16) if warps * 32 <= block_m * block_d // 4]


def best_of(launch: KernelLaunch, configs: list, device) -> list:
    timed = []
    for config in configs:
        launch.configs[device] = config
        timed.append((kernel_time(launch), config))
    return sorted(timed, key=lambda tc: tc[0])


def sweep(launch: KernelLaunch, device, exhaustive: bool = False, tiles: list | None = None) -> tuple:
    """(microseconds, LaunchConfig) of the fastest configuration found for `launch` on its recorded
    call: rows x warps (at 2 programs per SM if persistent), then programs per SM and pipeline stages
    at the best of those; `exhaustive`: rows x warps x programs per SM jointly; `tiles`: only these
    (rows, warps), each a compile fewer where a kernel takes long to compile. Leaves the launch's
    configuration at the last one timed."""
    source = launch.kernel.source
    block_d = source.constexprs["BLOCK_D"]
    per_sm = 2 if source.persistent else 0
    candidates = tile_candidates(block_d, per_sm) if tiles is None else \
        [LaunchConfig(rows, warps, per_sm) for rows, warps in tiles]
    if source.persistent and exhaustive:
        ranked = best_of(launch, [LaunchConfig(c.block_m, c.num_warps, per_sm)
                                  for c in candidates for per_sm in (1, 2, 4, 8)], device)
    else:
        ranked = best_of(launch, candidates, device)
    if source.persistent and not exhaustive:
        tile = ranked[0][1]
        ranked = best_of(launch, [LaunchConfig(tile.block_m, tile.num_warps, per_sm) for per_sm in (1, 2, 4, 8)],
                         device)
    if source.persistent:
        tile = ranked[0][1]
        ranked = best_of(launch, [dataclasses.replace(tile, num_stages=stages) for stages in (1, 2, 3, 4)], device)
    return ranked[0]


def config_text(c: dict) -> str:
    text = f"{c['block_m']}x, {c['num_warps']}w"
    return text + (f", {c['programs_per_sm']}/SM, {c['num_stages']}st" if c["programs_per_sm"] else "")
