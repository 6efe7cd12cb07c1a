"""Persistent (whole row in registers) against looped (row in chunks) kernels at one workload,
side by side (GPU): which one `Config.max_row_length` should pick for long rows.

    python -m benchmarks.long_rows [--workload rms_norm_block[256x512x4096]bf16] [--limits 16384,2048,1024]
"""
from __future__ import annotations

import argparse

from triton.testing import do_bench

import memfuse
from benchmarks.workloads import registry, sol_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="rms_norm_block[256x512x4096]bf16")
    parser.add_argument("--limits", default="16384,2048,1024", help="max_row_length values to compare")
    args = parser.parse_args()
    workload = next(w for w in registry() if w.name.startswith(args.workload))
    inputs = workload.make_inputs("cuda")
    bandwidth = 4.2e12
    for limit in (int(x) for x in args.limits.split(",")):
        fused = memfuse.memory_efficient_fusion(workload.fn, config=memfuse.Config(max_row_length=limit))

        def step():
            out = fused(*inputs.tensors, **inputs.consts)
            out.backward(inputs.grad_output)
            for t in inputs.tensors:
                t.grad = None

        ms = do_bench(step, warmup=100, rep=500, return_mode="median")
        sol = sol_bytes(inputs) / bandwidth / (ms * 1e-3)
        kind = "persistent" if workload.shape[-1] <= limit else "looped"
        print(f"{workload.name}  max_row_length={limit:6d} ({kind:10s}): {ms * 1e3:8.1f} us/step  {sol:5.0%} of SOL")


if __name__ == "__main__":
    main()
