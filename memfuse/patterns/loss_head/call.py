"""The loss head's calls as typed values: `LossHeadCall` is one call of
`torch.ops.memfuse.linear_cross_entropy` by its schema's argument names, whatever holds its tensors
(fx nodes in a Dynamo graph, tensors in a trace, memfuse.ir.ValueRefs in the lowered graph); its
`transform` a LogitTransform, parsed once. Positions are the schema's business alone: `args()`
writes them, `of(args, kwargs)` reads them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from memfuse.patterns.loss_head.transform import LogitTransform


def schema_arguments(op, args: tuple, kwargs) -> dict:
    """`op`'s arguments by its schema's names: positional, then keywords, then the defaults."""
    kwargs = dict(kwargs)
    named = {}
    for position, argument in enumerate(op._schema.arguments):
        if position < len(args):
            named[argument.name] = args[position]
        elif argument.name in kwargs:
            named[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            named[argument.name] = argument.default_value
        else:
            raise TypeError(f"memfuse: {op} called without its argument {argument.name!r}")
    return named


def argument_index(op, name: str) -> int:
    """The position of `op`'s argument `name` in its schema."""
    return next(i for i, a in enumerate(op._schema.arguments) if a.name == name)


def trailing_nones(op, gradients: int) -> tuple:
    """None for each of `op`'s arguments past its first `gradients` (a backward's non-tensor ones)."""
    return (None,) * (len(op._schema.arguments) - gradients)


@dataclasses.dataclass(frozen=True)
class LossHeadCall:
    """One call of linear_cross_entropy (memfuse.patterns.loss_head.op: what each argument means)."""
    hidden: Any
    weight: Any
    bias: Any
    target: Any
    ignore_index: Any = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    dtype: torch.dtype = torch.float32
    return_logits: bool = False
    with_gradients: bool = False
    chunk_bytes: Any = 256 * 2**20
    differentiable_logits: bool = True
    plan: str = "auto"
    transform: LogitTransform = LogitTransform()

    @staticmethod
    def op():
        return torch.ops.memfuse.linear_cross_entropy.default

    @classmethod
    def of(cls, args: tuple, kwargs=()) -> "LossHeadCall":
        named = schema_arguments(cls.op(), tuple(args), kwargs)
        return cls(**{**named, "transform": LogitTransform.parse(named["transform"])})

    def args(self) -> tuple:
        """The op's positional arguments, every one, in its schema's order."""
        named = {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, "transform": self.transform.spec}
        return tuple(named[a.name] for a in self.op()._schema.arguments)

    def without_logits(self) -> "LossHeadCall":
        """The same call writing no logits (`return_logits` off, `differentiable_logits` its default)."""
        return dataclasses.replace(self, return_logits=False, differentiable_logits=True)


# linear_cross_entropy's outputs, by name (its schema leaves them unnamed)
OUTPUTS = ("loss", "log_sum_exp", "logits", "hidden_unit", "weight_unit", "bias_unit")
OUTPUT = {name: position for position, name in enumerate(OUTPUTS)}
