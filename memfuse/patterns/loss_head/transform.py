"""The model's transform of the logits before its loss (a soft cap, a scale), as one typed value."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

# -- the model's transform of the logits ----------------------------------------------------------
# What a model does to the linear's output before its loss, elementwise with constants: Gemma's soft
# cap (`logits / cap`, `tanh`, `* cap`), Cohere's `logits * scale`, Granite's `logits / scale`. The
# kernels apply it wherever they read logits and multiply the logits' gradient by its derivative;
# returned logits are written transformed.
STEP_KINDS = {"mul": 1, "div": 2, "tanh": 3}
ROUNDINGS = {None: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclasses.dataclass(frozen=True)
class LogitTransform:
    """Steps in order, each ("mul", factor), ("div", factor) or ("tanh", None), each rounded to
    `rounded_to` (the logits' half dtype, where the model transforms them before its float cast:
    eager's ops on them round so) or kept in fp32 (None). The op takes it as a string, `spec`."""
    steps: tuple = ()
    rounded_to: Optional[torch.dtype] = None

    @property
    def spec(self) -> str:
        """'div 30.0, tanh, mul 30.0 in bfloat16'; '' for none. Factors as repr(float): exact."""
        if not self.steps:
            return ""
        text = ", ".join(kind if factor is None else f"{kind} {factor!r}" for kind, factor in self.steps)
        return text + (f" in {_dtype_name(self.rounded_to)}" if self.rounded_to is not None else "")

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def parse(spec: str) -> "LogitTransform":
        """The transform of `spec` (LogitTransform.spec's form); ValueError naming it otherwise."""
        if not spec:
            return LogitTransform()
        text, _, dtype_name = spec.partition(" in ")
        rounded_to = getattr(torch, dtype_name, None) if dtype_name else None
        steps = []
        for step in text.split(", "):
            kind, _, factor = step.partition(" ")
            number = _number(factor)
            if kind not in STEP_KINDS or (kind == "tanh") != (factor == "") or (factor and number is None) or \
                    (dtype_name and rounded_to not in ROUNDINGS):
                raise ValueError(f"memfuse.linear_cross_entropy: transform {spec!r}: expected steps 'mul F', "
                                 "'div F' or 'tanh' joined by ', ', then ' in bfloat16' or ' in float16' or nothing")
            steps.append((kind, number))
        return LogitTransform(tuple(steps), rounded_to)

    @functools.cached_property      # the op reads it every call
    def constexpr(self) -> tuple:
        """The kernels' TRANSFORM: (rounding, kind, factor, reciprocal, kind, ...); (0,) for none. A
        divide's reciprocal is fp32's 1 / factor: CUDA's eager divides by a number so, multiplying
        by it (aten's div_true_kernel_cuda), and the compiled kernels do as it does."""
        flat = [ROUNDINGS[self.rounded_to]]
        for kind, factor in self.steps:
            reciprocal = (torch.tensor(1.0) / torch.tensor(factor)).item() if kind == "div" else 0.0
            flat += [STEP_KINDS[kind], 0.0 if factor is None else factor, reciprocal]
        return tuple(flat)

    def returns_in(self, dtype: torch.dtype) -> bool:
        """Whether logits of `dtype` hold the transformed ones as eager has them (the op writes
        returned logits in their dtype): there are no steps (the logits are the linear's own output,
        whatever the loss then casts them to), the steps round to it, or they run in fp32 on fp32
        logits."""
        return not self.steps or self.rounded_to == dtype or (self.rounded_to is None and dtype == torch.float32)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The steps as eager's ops, on the logits in their dtype (differentiable)."""
        for kind, factor in self.steps:
            logits = logits * factor if kind == "mul" else logits / factor if kind == "div" else torch.tanh(logits)
        return logits

    def gradient_through(self, logits: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
        """gradient (of the transformed logits) times the transform's derivative at `logits`, in fp32,
        as the kernels form it (`_transformed`): each step rounded as eager's, tanh's derivative from
        its rounded output. Torch ops: a custom op's backward runs below autograd."""
        value, slope = logits.float(), gradient.float()
        for kind, factor in self.steps:
            value = value * factor if kind == "mul" else value / factor if kind == "div" else torch.tanh(value)
            if self.rounded_to is not None:
                value = value.to(self.rounded_to).float()
            if kind == "tanh":
                slope = slope * (1 - value * value)
            else:
                slope = slope * factor if kind == "mul" else slope / factor
        return slope

    def __str__(self) -> str:
        return " then ".join(f"{'*' if kind == 'mul' else '/'} {factor!r}" if factor is not None else kind
                             for kind, factor in self.steps) + (
            f" (in {_dtype_name(self.rounded_to)})" if self.rounded_to is not None else " (in float32)")


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
