"""What capture hands the later stages: the joint graph in memfuse IR with what they need to know
about it (`Captured`), and the error capture raises for a function it cannot trace as written."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from memfuse.ir.graph import Graph


@dataclass
class Captured:
    """The joint graph in memfuse IR, with what the later stages need to know about it."""
    joint: Graph                       # inputs: primals, [seed], tangents
    num_primals: int
    num_tangents: int
    num_fwd_outputs: int
    symbols: dict                      # sympy.Symbol -> (primal index, dim): read per call
    hints: dict                        # sympy.Symbol -> traced size
    has_seed: bool
    fallbacks: list = field(default_factory=list)   # (node name, target, reason)
    specialized: Optional[str] = None  # why leading shapes became part of the compile key
    layout_guards: list = field(default_factory=list)   # guards on strides, checked per call (api)
    stride_symbols: dict = field(default_factory=dict)  # sympy.Symbol -> (primal index, dim) of a stride
    differentiable_outputs: list = field(default_factory=list)   # forward outputs with a tangent
    aten_graph: Optional[torch.fx.GraphModule] = None
    merged: dict = field(default_factory=dict)   # a node dropped as a duplicate -> the one kept (explain)
    decisions: dict = field(default_factory=dict)     # pattern name -> its decisions (memfuse.ir.patterns)
    # patterns.OutputHooks: what the caller's outputs need after a run (its last outputs are for them)
    output_hooks: list = field(default_factory=list)


class MutatedInputError(RuntimeError):
    """The traced function writes into one of its inputs (an argument, a module's buffer) in place."""


class Retrace(Exception):
    """The traced function learned while tracing that it must be traced again, returning more (a
    module's buffer written in place: the next trace writes a copy and returns it, and the module
    copies it into the buffer after the call). Raised only when what it learned is new, so the
    traces end."""
