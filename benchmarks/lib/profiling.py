"""One training step under torch.profiler: its GPU kernels in the order they started, and the class
of GPU work each kernel's name says it is (matmul, attention, memfuse's kernels, ...). Used by
benchmarks.profile_step, .kernel_sol and .distributed.
"""
from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib.hf_models import Setup, train_step

WARM_STEPS = 3
# Kernel-name fragments, first match wins: what each class of GPU work is called in a trace.
CLASSES = (
    ("communication", ("nccl",)),
    ("memfuse kernels", ("memfuse_",)),
    ("torch.compile kernels", ("triton_",)),
    ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
    ("matmul", ("gemm", "cutlass", "sm90_xmma", "sm80_xmma", "cublas", "nvjet", "wgmma")),
    ("copies and fills", ("copy", "memcpy", "memset", "fill", "elementwise_kernel<128, 2")),
)


def kernel_class(name: str) -> str:
    lowered = name.lower()
    for label, fragments in CLASSES:
        if any(f in lowered for f in fragments):
            return label
    return "other aten kernels"


def profiled_step(model, batch: dict, setup: Setup, around=contextlib.nullcontext) -> list:
    """After WARM_STEPS, one training step under torch.profiler, inside `around()`: its GPU kernels
    as (name, ms), in the order they started."""
    for _ in range(WARM_STEPS):
        train_step(model, batch, setup)
    setup.synchronize()
    with around(), profile(activities=[ProfilerActivity.CUDA]) as trace:
        train_step(model, batch, setup)
        setup.synchronize()
    events = sorted((e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return [(e.name, e.device_time_total / 1e3) for e in events]
