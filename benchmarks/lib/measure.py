"""How a step is measured: wall time with CUDA events, kernel time with torch.profiler,
memory with the caching allocator's counters, and the copy bandwidth SOL is taken against."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib.modes import Factory, StepFn
from benchmarks.lib.workloads import StepInputs, tensor_bytes

COPY_BYTES = 1 << 30  # far above any L2, so the copy streams from and to HBM
COPY_WARMUP = 3


@dataclasses.dataclass(frozen=True)
class Settings:
    """How long to measure. A timed repeat runs enough steps to last about repeat_target_s."""

    warmup_steps: int
    repeats: int
    repeat_target_s: float
    min_steps: int  # per repeat
    profile_steps: int  # steps under torch.profiler for the kernel time
    copy_repeats: int  # bandwidth samples
    dynamic_shape_count: int
    dynamic_warmup_steps: int  # on the first shape only, as the tutorial does
    dynamic_pass_steps: int
    dynamic_runs: int  # the whole test again from a fresh wrapper: one 100-step pass is noisy


FULL = Settings(10, 7, 0.2, 10, 20, 20, 20, 3, 100, 5)
QUICK = Settings(3, 3, 0.05, 5, 5, 5, 20, 3, 100, 1)
SMOKE = Settings(0, 1, 0.0, 1, 0, 0, 4, 1, 4, 1)  # first call + one timed step per mode


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(step_fn: StepFn, inputs: StepInputs) -> None:
    """One training step as the tutorial writes it: forward, backward, grads set to None."""
    output = step_fn(*inputs.tensors)
    output.backward(inputs.grad_output)
    for tensor in inputs.tensors:
        tensor.grad = None


def first_call(factory: Factory, fn: Callable, inputs: StepInputs, device: torch.device) -> tuple[StepFn, float]:
    """Wrap `fn` and run its first step: what a user pays once (compile included)."""
    synchronize(device)
    start = time.perf_counter()
    step_fn = factory(fn, inputs.consts)
    run_step(step_fn, inputs)
    synchronize(device)
    return step_fn, time.perf_counter() - start


def run_steps(step_fn: StepFn, inputs: StepInputs, steps: int) -> None:
    for _ in range(steps):
        run_step(step_fn, inputs)


def wall_seconds(work: Callable[[], None], device: torch.device) -> float:
    """Host wall time of `work`, GPU drained before and after (compile time included)."""
    synchronize(device)
    start = time.perf_counter()
    work()
    synchronize(device)
    return time.perf_counter() - start


def event_seconds(work: Callable[[], None]) -> float:
    """GPU-side time from before to after `work` on the current stream, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e-3


def seconds_per_step(step_fn: StepFn, inputs: StepInputs, steps: int, device: torch.device) -> float:
    work = functools.partial(run_steps, step_fn, inputs, steps)
    seconds = event_seconds(work) if device.type == "cuda" else wall_seconds(work, device)
    return seconds / steps


@dataclasses.dataclass(frozen=True)
class StepTime:
    median_s: float
    steps_per_repeat: int
    samples_s: list[float]


def median_step_time(step_fn: StepFn, inputs: StepInputs, settings: Settings, device: torch.device) -> StepTime:
    """Warm up, size the repeats from the warm-up's pace, then the median of the repeats."""
    warmup = wall_seconds(functools.partial(run_steps, step_fn, inputs, settings.warmup_steps), device)
    pace = warmup / settings.warmup_steps if settings.warmup_steps else 0.0
    steps = settings.min_steps
    if pace > 0:
        steps = max(steps, math.ceil(settings.repeat_target_s / pace))
    samples = [seconds_per_step(step_fn, inputs, steps, device) for _ in range(settings.repeats)]
    return StepTime(statistics.median(samples), steps, samples)


def kernel_seconds_per_step(step_fn: StepFn, inputs: StepInputs, steps: int) -> float | None:
    """Device time of every kernel, memcpy and memset of a step, summed (torch.profiler/CUPTI).
    None when the profiler recorded no device activity."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(step_fn, inputs, steps)
        torch.cuda.synchronize()
    device_us = sum(
        event.self_device_time_total for event in prof.key_averages() if event.device_type == DeviceType.CUDA
    )
    return device_us * 1e-6 / steps if device_us > 0 else None


@dataclasses.dataclass(frozen=True)
class StepMemory:
    saved_bytes: int  # alive after the forward, beyond what was alive before it and the output
    peak_bytes: int  # the step's peak above what was alive before it (inputs, grad_output)
    peak_abs_bytes: int  # torch.cuda.max_memory_allocated() over the step


def _new_output_bytes(output: torch.Tensor, inputs: StepInputs) -> int:
    """The output's storage, unless it aliases an input (the floor mode's output does)."""
    storage = output.untyped_storage()
    if any(storage.data_ptr() == t.untyped_storage().data_ptr() for t in inputs.tensors):
        return 0
    return storage.nbytes()


def step_memory(step_fn: StepFn, inputs: StepInputs) -> StepMemory:
    """Saved-for-backward bytes: memory_allocated() after the forward minus before it minus the
    output's own storage; what remains is what autograd (or the mode) keeps for the backward."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    output = step_fn(*inputs.tensors)
    torch.cuda.synchronize()
    saved = torch.cuda.memory_allocated() - before - _new_output_bytes(output, inputs)
    output.backward(inputs.grad_output)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    for tensor in inputs.tensors:
        tensor.grad = None
    return StepMemory(saved, peak - before, peak)


def copy_bandwidth(device: torch.device, repeats: int) -> float:
    """Bytes per second (read + written) of a large device-to-device copy, median of repeats."""
    source = torch.empty(COPY_BYTES // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    for _ in range(COPY_WARMUP):
        target.copy_(source)
    samples = [event_seconds(lambda: target.copy_(source)) for _ in range(repeats)]
    return 2 * tensor_bytes(source) / statistics.median(samples)
