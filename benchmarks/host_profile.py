"""Where the host time of a memfuse step goes (GPU): cProfile over many steps.

With --tiny the leading dims shrink to [2, 4], so the GPU finishes each kernel at once and the
step time is the host's alone; the floor mode (an autograd.Function that launches nothing) is
timed beside it.

    python -m benchmarks.host_profile [--workload layer_norm_block] [--steps 2000] [--tiny]
"""
from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import time

import torch

import memfuse
from benchmarks.measure import run_step
from benchmarks.modes import FACTORIES
from benchmarks.workloads import registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="layer_norm_block[64x128x1024]")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tiny", action="store_true", help="leading dims [2, 4]: host time only")
    args = parser.parse_args()
    workload = next(w for w in registry() if w.name.startswith(args.workload))
    if args.tiny:
        workload = dataclasses.replace(workload, shape=(2, 4, workload.shape[-1]))
    inputs = workload.make_inputs("cuda")
    floor = FACTORIES["floor"](workload.fn, inputs.consts)
    for name, step in (("floor", floor), ("memfuse", None)):
        if step is None:
            break
        for _ in range(20):
            run_step(step, inputs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            run_step(step, inputs)
        torch.cuda.synchronize()
        print(f"{workload.name} {name}: {(time.perf_counter() - start) / args.steps * 1e6:.1f} us per step")
    fused = memfuse.memory_efficient_fusion(workload.fn)

    def steps(n):
        for _ in range(n):
            out = fused(*inputs.tensors, **inputs.consts)
            out.backward(inputs.grad_output)
            for t in inputs.tensors:
                t.grad = None
        torch.cuda.synchronize()

    steps(20)
    start = time.perf_counter()
    steps(args.steps)
    per_step = (time.perf_counter() - start) / args.steps
    print(f"{workload.name}: {per_step * 1e6:.1f} us per step ({1 / per_step:.0f} it/s)")
    profiler = cProfile.Profile()
    profiler.enable()
    steps(args.steps // 4)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
