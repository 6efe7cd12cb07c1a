"""split: a call whose trace reads a tensor's value runs through torch.compile with memfuse's backend.

memfuse traces a function as one graph (AOTAutograd, no graph breaks). A function whose Python
reads a tensor's value cannot be one graph: `if torch.rand([]) < self.layerdrop:` (transformers'
layer drop, drawn at every training step whatever its probability, in BART, OPT, Whisper and their
kin up to transformers 5.17), `if mask.all():`, `.item()`, `nonzero`. The trace stops at the read
(GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException): no value
can be assumed there, since the read may answer otherwise on every call (a random draw).
torch.compile's Dynamo splits such a function at the read (a graph break): the read runs in Python
on every call, as in eager, and the graphs around it go to a backend. So such a call runs through
`torch.compile(fn, backend=memfuse_backend)`: memfuse compiles every graph Dynamo makes (Dynamo
owns their guards and recompiles), each graph that memfuse cannot compile runs through torch with
its reason (`graph_fallbacks`). Decided once per compile key (`SplitCall`, logged once with the
read that stopped the trace, counted in `stats()["split_calls"]` per call); strict mode, which asks
for one program, raises the trace's error instead.
"""
from __future__ import annotations

import dataclasses
import functools
import traceback
from pathlib import Path
from typing import Callable

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from memfuse.base.config import Config
from memfuse.base.debug import STATS, register_counter
from memfuse.driver.fallback import EagerCall, say_once
from memfuse.fronts.backend import memfuse_backend

# What a trace raises where the function reads a tensor's value (Dynamo breaks the graph there)
VALUE_READS = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)

register_counter("split_calls", "calls whose trace reads a tensor's value, run through torch.compile with the "
                                "memfuse backend, split at the read (fronts.split.SplitCall)")


@dataclasses.dataclass(frozen=True)
class SplitCall(EagerCall):
    """The decision to run a call through torch.compile with memfuse's backend (module docstring):
    an EagerCall (not one memfuse program: `memfuse.explain` prints why) whose `run` (the bound
    values -> the function's output) is the compiled function."""
    run: Callable = None

    def __str__(self) -> str:
        return (f"memfuse: {self.name} runs through torch.compile with the memfuse backend, split where it reads "
                f"a tensor's value: {self.reason}. Way out: {self.way_out}")

    def __call__(self, values: list):
        say_once(self)
        STATS["split_calls"] += 1
        return self.run(values)


def through_backend(target: Callable, config: Config) -> Callable:
    """`torch.compile(target)` with memfuse's backend and this config: one backend object per
    config, since Dynamo runs its compiled code only under the backend it was compiled for (a
    second torch.compile of the same forward, for another compile key, reuses its graphs)."""
    return torch.compile(target, backend=_backend(config))


@functools.lru_cache(maxsize=None)
def _backend(config: Config) -> Callable:
    return functools.partial(memfuse_backend, config=config)


def split_call(name: str, read: Exception, run: Callable) -> SplitCall:
    """The decision for a call whose trace `read` stopped (one of VALUE_READS, raised in the user's
    code): `run` (the bound values -> the output, through_backend) runs it."""
    message = (str(read).strip().splitlines() or [""])[0]
    return SplitCall(name, f"its trace stopped at {_user_frame(read)}: {type(read).__name__}: {message}",
                     "move the read out of the function or make it a Python number, for one memfuse program "
                     "(transformers' layer drop draws even at probability 0 up to 5.17; 5.24 draws only above 0)",
                     run=run)


def _user_frame(error: Exception) -> str:
    """file:line (function) of the innermost frame of the traceback outside torch and memfuse: the
    user's line that read the value."""
    outside = [f for f in traceback.extract_tb(error.__traceback__)
               if not any(part in Path(f.filename).parts for part in ("torch", "memfuse"))]
    if not outside:
        return "a read of a tensor's value"
    frame = outside[-1]
    return f"{Path(frame.filename).name}:{frame.lineno} ({frame.name})"
