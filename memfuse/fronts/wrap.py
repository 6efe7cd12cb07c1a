"""wrap: `memory_efficient_fusion`, the public entry. A function becomes a FusedFunction
(function.py), an nn.Module a FusedModule (module.py, which builds on it)."""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Union

import torch

from memfuse.fronts.function import FusedFunction
from memfuse.base.config import Config
from memfuse.fronts.module import FusedModule, fuse_in_place


def memory_efficient_fusion(fn: Callable, *, config: Optional[Config] = None, cuda_graphs: bool = False,
                            memory_budget: Optional[Union[float, int, str]] = None, in_place: bool = False):
    """Wrap `fn` (tensors, constants and pytrees of them -> the same): same signature, same
    results as eager within float tolerance, forward and backward fused into Triton kernels.
    An nn.Module becomes a `FusedModule` (module.py) sharing its parameters and state_dict keys.

    `cuda_graphs=True` (opt-in, for static shapes): each call signature's forward and backward
    programs are captured into CUDA graphs and replayed (cuda_graphs.py; docs/usage.md says what is
    static). Outputs live in graph memory, rewritten by a later replay once nothing holds them.

    `memory_budget` (Config.memory_budget): a fraction in (0, 1] keeps at most that fraction of the
    default plan's saved bytes for the backward, recomputing more there; bytes (an int, or "12GB" =
    12*10**9, "12GiB" = 12*2**30) are a target for the step's predicted peak, reached by recomputing
    or offloading to host memory per value (memfuse.plan).

    `in_place=True` (an nn.Module only): the module itself is returned, its calls fused, as
    `nn.Module.compile` does it (module.fuse_in_place): its class stays, for clients that check it
    (HuggingFace Trainer's save_model writes a PreTrainedModel's configuration)."""
    config = config or Config()
    if memory_budget is not None:
        config = dataclasses.replace(config, memory_budget=memory_budget)
    if cuda_graphs:
        config = dataclasses.replace(config, seed_from_memory=True)
    if isinstance(fn, torch.nn.Module):
        if in_place:
            return fuse_in_place(fn, config, cuda_graphs=cuda_graphs)
        return FusedModule(fn, config, cuda_graphs=cuda_graphs)
    if in_place:
        raise TypeError(f"memfuse.memory_efficient_fusion: in_place=True fuses an nn.Module in place; "
                        f"got {type(fn).__name__}")
    if not callable(fn):
        raise TypeError(f"memfuse.memory_efficient_fusion: fn must be callable, got {type(fn).__name__}")
    return FusedFunction(fn, config, cuda_graphs=cuda_graphs)
