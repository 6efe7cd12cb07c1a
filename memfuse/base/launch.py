"""Launching compiled Triton kernels without Triton's generic launch path.

Triton's `kernel[grid](...)` binds every argument, works out its specialization and looks the
compiled kernel up on each call, a launch's worth of host time again. A kernel launched many times
a step with arguments of the same kind (memfuse's own kernels: runtime.launchers.KernelLaunch; the
loss head's row kernels, once a chunk: `DirectKernel`) binds once, and launches the kernel Triton
compiled for them through its C launcher.
"""
from __future__ import annotations

import torch
import triton
from triton import knobs

from memfuse.base.torch_private import raw_stream  # noqa: F401  (the current stream of a CUDA device index)

TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


def launch_hooks_installed() -> bool:
    """Whether a profiler asked Triton for launch hooks (a HookChain in newer Triton, else None)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))


def launcher_call(compiled) -> tuple:
    """(function, the arguments before the kernel's own) that launch a Triton CompiledKernel.

    Triton 3.6's launcher is a Python method (`CudaLauncher.__call__`, which allocates scratch
    memory memfuse's kernels never ask for) around a C function: calling the C function with the
    arguments that method adds saves that method's host time on every launch. Launchers of other
    Triton versions, not checked against, are called as they are."""
    run = compiled.run
    if TRITON_VERSION == (3, 6) and type(run).__name__ == "CudaLauncher" and run.global_scratch_size == 0 \
            and run.profile_scratch_size == 0:
        return run.launch, (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                            compiled.packed_metadata, None, None, None)
    return run, (compiled.function, compiled.packed_metadata, None, None, None)


def argument_kind(value) -> tuple:
    """What Triton may specialize a kernel on for one argument: a tensor's dtype and whether its
    address is 16-byte aligned; an int's width and whether it is 1 or a multiple of 16; else the
    type. Two calls whose arguments are of one kind each run the same compiled kernel."""
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return bool, value
    if isinstance(value, int):
        return INT32_MIN <= value <= INT32_MAX, value == 1, value % 16 == 0
    return type(value)


class DirectKernel:
    """A @triton.jit kernel with fixed constexprs and launch options, launched on CUDA through the
    launcher of the kernel Triton compiled for the same kinds of arguments (`argument_kind`): its
    first call with a new kind, the interpreter, other devices and calls while a profiler hooks
    Triton's launches take Triton's own path. The kernel's constexprs must close its signature."""

    def __init__(self, fn, options: dict, **constexprs):
        self.fn = fn
        self.options = options                      # num_warps and such
        self.constexprs = constexprs
        self.constexpr_values = tuple(constexprs.values())
        self.compiled: dict = {}                    # (device index, argument kinds) -> (call, leading)

    def __call__(self, programs: int, *args) -> None:
        first = args[0]
        if first.device.type != "cuda" or launch_hooks_installed():
            self.fn[(programs,)](*args, **self.constexprs, **self.options)
            return
        key = (first.device.index, *(argument_kind(a) for a in args))
        direct = self.compiled.get(key)
        if direct is None:
            compiled = self.fn[(programs,)](*args, **self.constexprs, **self.options)
            self.compiled[key] = launcher_call(compiled)
            return
        call, leading = direct
        call(programs, 1, 1, raw_stream(first.device.index), *leading, *args, *self.constexpr_values)


def outside_trace(run):
    """Run on real tensors while a trace (fake tensors, a dispatch mode) may be active."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.utils._python_dispatch import _disable_current_modes
    with unset_fake_temporarily(), _disable_current_modes():
        return run()
