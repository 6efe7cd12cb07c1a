"""The compared modes: each turns a block function into a step callable over its tensors.

A factory takes (fn, consts) and returns `step_fn(*tensors) -> output`. Modes that accept
python constants at call time get them by keyword, as the tutorial passes them; functorch's
memory_efficient_fusion cannot take non-tensor arguments, so the constants are baked into
the function first, as the tutorial does for it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Callable

import torch

MODE_ORDER = ("eager", "torch_compile", "functorch_mef", "memfuse", "memfuse_cudagraph", "floor")
SMOKE_MODES = ("eager", "memfuse")  # CPU: eager as reference, memfuse through the interpreter
COMPILING_MODES = ("torch_compile", "memfuse")  # measured cold/warm in fresh processes
DYNAMIC_MODES = ("eager", "torch_compile", "memfuse", "memfuse_cudagraph")
BASELINE_MODE = "torch_compile"  # the "ratio" column divides by this mode's it/s
CUDA_GRAPHS_OPTION = "cuda_graphs"

StepFn = Callable[..., torch.Tensor]
Factory = Callable[[Callable[..., torch.Tensor], dict], StepFn]


def _eager(fn: Callable, consts: dict) -> StepFn:
    return functools.partial(fn, **consts)


def _torch_compile(fn: Callable, consts: dict) -> StepFn:
    # Dynamo caches compiled frames on fn's code object: without a reset, a later workload
    # of the same block would start from an earlier one's graphs (and go dynamic).
    torch.compiler.reset()
    return functools.partial(torch.compile(fn), **consts)


def _functorch_mef(fn: Callable, consts: dict) -> StepFn:
    from functorch.compile import memory_efficient_fusion

    return memory_efficient_fusion(functools.partial(fn, **consts))


def _memfuse(fn: Callable, consts: dict) -> StepFn:
    import memfuse

    return functools.partial(memfuse.memory_efficient_fusion(fn), **consts)


def _memfuse_cudagraph(fn: Callable, consts: dict) -> StepFn:
    import memfuse

    fused = memfuse.memory_efficient_fusion(fn, **{CUDA_GRAPHS_OPTION: True})
    return functools.partial(fused, **consts)


class _NoKernelStep(torch.autograd.Function):
    """The host floor: the autograd bookkeeping of one fused fwd+bwd step, launching nothing."""

    @staticmethod
    def forward(ctx, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return tensors[0].detach()  # a new tensor object on input1's storage: no kernel

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Aliases of the right shapes, so every leaf gets a .grad as in a real step;
        # AccumulateGrad takes them over without a copy.
        return tuple(
            grad_output.detach() if t.shape == grad_output.shape else t.detach()
            for t in ctx.saved_tensors
        )


def _floor(fn: Callable, consts: dict) -> StepFn:
    return _NoKernelStep.apply


FACTORIES: dict[str, Factory] = {
    "eager": _eager,
    "torch_compile": _torch_compile,
    "functorch_mef": _functorch_mef,
    "memfuse": _memfuse,
    "memfuse_cudagraph": _memfuse_cudagraph,
    "floor": _floor,
}


@dataclasses.dataclass(frozen=True)
class ModeSet:
    """The modes a run compares, and why the others could not run."""

    factories: dict[str, Factory]  # in MODE_ORDER
    unavailable: dict[str, str]  # mode -> reason


def _import_error(module: str) -> str | None:
    """Why `module` cannot be imported, or None. The package may be mid-rewrite: any error."""
    try:
        __import__(module)
    except Exception as error:  # reported in the results, never hidden
        return f"import {module} failed: {type(error).__name__}: {error}"
    return None


def _memfuse_problem() -> str | None:
    problem = _import_error("memfuse")
    if problem is None and not hasattr(__import__("memfuse"), "memory_efficient_fusion"):
        problem = "memfuse has no memory_efficient_fusion yet"
    return problem


def _has_cuda_graphs_option() -> bool:
    import memfuse

    return CUDA_GRAPHS_OPTION in inspect.signature(memfuse.memory_efficient_fusion).parameters


def resolve_modes(names: tuple[str, ...], cuda: bool) -> ModeSet:
    """Check which requested modes can run here. memfuse_cudagraph is offered only when
    memfuse has a `cuda_graphs` option and there is a GPU; otherwise it is left out silently."""
    factories, unavailable = {}, {}
    memfuse_problem = _memfuse_problem() if {"memfuse", "memfuse_cudagraph"} & set(names) else None
    for name in (n for n in MODE_ORDER if n in names):
        problem = None
        if name == "functorch_mef":
            problem = _import_error("functorch.compile")
        elif name == "memfuse":
            problem = memfuse_problem
        elif name == "memfuse_cudagraph" and (memfuse_problem or not cuda or not _has_cuda_graphs_option()):
            continue
        if problem is None:
            factories[name] = FACTORIES[name]
        else:
            unavailable[name] = problem
    return ModeSet(factories, unavailable)


def memfuse_stats() -> object | None:
    """memfuse.stats() when the package offers it (kernel counts, cache hits, ...)."""
    memfuse = sys.modules.get("memfuse")
    return memfuse.stats() if memfuse is not None and hasattr(memfuse, "stats") else None
