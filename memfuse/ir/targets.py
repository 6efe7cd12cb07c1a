"""Extern targets that are not aten ops: callables an EXTERN node runs (capture makes them; buffers,
the runtime and the reports read them)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


class InputError(RuntimeError):
    """An error the call's inputs cause, raised where eager's own op raises for them too (a target
    outside the vocabulary): the caller's to fix, never a reason for memfuse to stop running its
    program (the first run's guards let it through: memfuse.driver.fallback)."""


@dataclass(frozen=True)
class IndexCheck:
    """An extern target that checks an index tensor lies in [0, width) and returns a 0: a fused
    gather adds it to the values it picked, so its result waits for the check. An index outside raises as
    aten's gather does: on the CPU at once, on CUDA as a device assert (`torch._assert_async`)."""
    width: int
    dtype: torch.dtype                 # of the 0 it returns: the gathered values'

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        inside = ((index >= 0) & (index < self.width)).all()
        try:
            torch._assert_async(inside, f"memfuse: gather index out of bounds: an index lies outside [0, "
                                        f"{self.width}) (eager's gather, or cross_entropy's target check, raises here too)")
        except RuntimeError as error:      # the CPU's at once (CUDA's is a device assert)
            raise InputError(str(error)) from None
        return torch.zeros((), dtype=self.dtype, device=index.device)

    def __repr__(self) -> str:
        return f"IndexCheck(0 <= index < {self.width})"


class TensorConstant:
    """An extern target that returns a tensor the traced function closed over."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __call__(self) -> torch.Tensor:
        return self.tensor

    def __repr__(self) -> str:
        return f"constant{tuple(self.tensor.shape)}"
