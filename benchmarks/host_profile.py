"""Where the host time of a memfuse step goes: the floor and memfuse timed in interleaved repeats
(the minimum of each mode's), then cProfile over memfuse's steps.

On a GPU, with --tiny the leading dims shrink to [2, 4], so the GPU finishes each kernel at once and
the step time is the host's alone; the floor mode (an autograd.Function that launches nothing) is
the reference.

--stub-launches (no GPU): a CPU proxy for memfuse's host Python. The kernels compile and run once
through Triton's interpreter; then every launch goes through memfuse's direct launch
(runtime.DirectLaunch) into a launcher that does nothing, and seeds are drawn as on CUDA
(runtime.philox_seed_draw) from a stand-in generator. Implies --tiny. CPU tensors come from the
CPU allocator and no driver is called: compare the two modes, or two versions of memfuse, not
these numbers with a GPU host's.

    python -m benchmarks.host_profile [--workload layer_norm_block] [--steps 2000] [--tiny] [--stub-launches]
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import functools
import os
import pstats
import time
import types

import torch


class StandInGenerator:
    """The three methods of a CUDA torch.Generator that runtime.philox_seed_draw calls (also the
    tests' stand-in: it refuses offsets torch's CUDA generator refuses)."""

    def __init__(self, seed: int = 0):
        self.seed, self.offset = seed, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        if offset % 4:
            raise RuntimeError("torch's CUDA generator takes offsets that are multiples of 4")
        self.offset = offset


def _stub_launches(entry) -> None:
    """From now on every kernel of `entry` (compiled and launched once) launches directly, into
    nothing, and seeds come from a stand-in CUDA generator."""
    from memfuse import runtime
    cpu = torch.device("cpu")
    runtime._raw_stream = lambda index: 0
    runtime._SEED_DRAWS[cpu] = runtime.philox_seed_draw(StandInGenerator())
    nothing = types.SimpleNamespace(run=lambda *args: None, function=None, packed_metadata=None)
    for program in (entry.function.forward, entry.function.backward):
        for launch in program.steps:
            if isinstance(launch, runtime.KernelLaunch):
                config, most = launch.grids[cpu]
                launch.direct[cpu] = runtime.DirectLaunch(launch, cpu, config, most, nothing)


def _interleaved(steps: dict, inputs, count: int, repeats: int, device: torch.device) -> dict:
    """Mode name -> its fastest repeat of `count` steps, in us per step; repeats alternate modes."""
    from benchmarks.measure import run_step, synchronize
    best = {name: float("inf") for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            synchronize(device)
            start = time.perf_counter()
            for _ in range(count):
                run_step(step, inputs)
            synchronize(device)
            best[name] = min(best[name], (time.perf_counter() - start) / count * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="layer_norm_block[64x128x1024]")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tiny", action="store_true", help="leading dims [2, 4]: host time only")
    parser.add_argument("--stub-launches", action="store_true",
                        help="CPU proxy: kernels launch into nothing after one interpreted run (implies --tiny)")
    args = parser.parse_args()
    if args.stub_launches:
        os.environ.setdefault("TRITON_INTERPRET", "1")    # read when triton is imported (by memfuse)
    import memfuse
    from benchmarks.measure import run_step
    from benchmarks.modes import FACTORIES
    from benchmarks.workloads import registry

    workload = next(w for w in registry() if w.name.startswith(args.workload))
    if args.tiny or args.stub_launches:
        workload = dataclasses.replace(workload, shape=(2, 4, workload.shape[-1]))
    device = torch.device("cpu" if args.stub_launches else "cuda")
    inputs = workload.make_inputs(device)
    fused = memfuse.memory_efficient_fusion(workload.fn)
    memfuse_step = functools.partial(fused, **inputs.consts)
    run_step(memfuse_step, inputs)                       # compiles (and, stubbed, runs the kernels once)
    if args.stub_launches:
        _stub_launches(fused.compiled_for(*inputs.tensors, **inputs.consts))
    steps = {"floor": FACTORIES["floor"](workload.fn, inputs.consts), "memfuse": memfuse_step}
    _interleaved(steps, inputs, 20, 1, device)           # warm-up
    best = _interleaved(steps, inputs, max(1, args.steps // 10), 10, device)
    for name, us in best.items():
        print(f"{workload.name} {name}: {us:.1f} us per step ({1e6 / us:.0f} it/s)")
    print(f"{workload.name}: memfuse - floor = {best['memfuse'] - best['floor']:.1f} us"
          + (" (CPU proxy: launches stubbed)" if args.stub_launches else ""))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps // 4):
        run_step(memfuse_step, inputs)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
