"""The seed tutorial's three training blocks, their inputs and their speed-of-light bytes.

The block functions are copied from the nvFuser tutorial (seeds/000_*.txt) without changes,
so every mode compiles exactly the code the tutorial measured.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

DROPOUT_PROB = 0.1
SEED_SHAPE = (64, 128, 1024)  # the tutorial's input_size
LARGE_SHAPE = (256, 512, 1024)
WIDE_SHAPE = (256, 512, 4096)
SMOKE_SHAPE = (4, 4, 32)  # CPU smoke runs: small enough for the Triton interpreter

DYNAMIC_SHAPE_SEED = 42  # the tutorial calls random.seed(42) before drawing its shapes
DYNAMIC_SHAPE_COUNT = 20


def layer_norm_block(
    input1: torch.Tensor,
    input2: torch.Tensor,
    weight: torch.Tensor,
    bias1: torch.Tensor,
    bias2: torch.Tensor,
    normalization_axis: int,
    dropout_prob: float,
) -> torch.Tensor:
    """Bias-Dropout-Add-LayerNorm (the tutorial's `composite_definition`)."""
    bias1_out = input1 + bias1
    dropout_out = F.dropout(bias1_out, dropout_prob, training=True)
    norm_input = dropout_out + input2
    norm_output = F.layer_norm(norm_input, (input1.size(normalization_axis),), weight, bias2)
    return norm_output


def primitive_layer_norm_block(
    input1: torch.Tensor,
    input2: torch.Tensor,
    weight: torch.Tensor,
    bias1: torch.Tensor,
    bias2: torch.Tensor,
    normalization_axis: int,
    dropout_prob: float,
    keepdim: bool,
) -> torch.Tensor:
    """The same block with mean and variance by hand (the tutorial's `primitive_definition`)."""
    bias1_out = input1 + bias1
    dropout_out = F.dropout(bias1_out, dropout_prob, training=True)
    norm_input = dropout_out + input2
    mean = norm_input.mean(normalization_axis, keepdim=keepdim)
    diff = norm_input - mean
    diff_sq = diff * diff
    var = diff_sq.mean(normalization_axis, keepdim=keepdim)
    pre_shift_scale_norm_output = (norm_input - mean) / torch.sqrt(var + 1e-12)
    norm_output = weight * pre_shift_scale_norm_output + bias2
    return norm_output


def rms_norm_block(
    input1: torch.Tensor,
    input2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    normalization_axis: int,
    dropout_prob: float,
    keepdim: bool,
) -> torch.Tensor:
    """Bias-Dropout-Add-RMSNorm (the tutorial's `with_rms_norm`)."""
    bias_out = input1 + bias
    dropout_out = F.dropout(bias_out, dropout_prob, training=True)
    norm_input = dropout_out + input2
    var = norm_input.mul(norm_input).mean(normalization_axis, keepdim)
    pre_shift_scale_norm_output = norm_input / torch.sqrt(var + 1e-12)
    norm_output = weight * pre_shift_scale_norm_output
    return norm_output


class StepInputs(NamedTuple):
    """Everything one forward+backward step needs."""

    tensors: tuple[torch.Tensor, ...]  # input1, input2, then the [D] parameters
    consts: dict[str, object]  # the python constants, passed by keyword as the tutorial does
    grad_output: torch.Tensor


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One block at one shape and dtype."""

    fn: Callable[..., torch.Tensor]
    shape: tuple[int, ...]
    dtype: torch.dtype
    num_params: int  # [D] parameters after input1 and input2 (weight, biases)
    extra_consts: tuple[tuple[str, object], ...] = ()  # constants beyond axis and dropout

    @property
    def name(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"{self.fn.__name__}[{dims}]{DTYPE_NAMES[self.dtype]}"

    @property
    def consts(self) -> dict[str, object]:
        axis = len(self.shape) - 1
        return {"normalization_axis": axis, "dropout_prob": DROPOUT_PROB, **dict(self.extra_consts)}

    def make_params(self, device: torch.device | str) -> tuple[torch.nn.Parameter, ...]:
        hidden = self.shape[-1]
        return tuple(
            torch.nn.Parameter(torch.randn(hidden, dtype=self.dtype, device=device))
            for _ in range(self.num_params)
        )

    def make_inputs(self, device: torch.device | str) -> StepInputs:
        """Inputs as the tutorial makes them: every tensor requires grad."""
        input1 = torch.randn(*self.shape, device=device, dtype=self.dtype, requires_grad=True)
        input2 = torch.rand_like(input1).requires_grad_()
        grad_output = torch.rand_like(input1)
        return StepInputs((input1, input2, *self.make_params(device)), self.consts, grad_output)

    def make_dynamic_inputs(self, device: torch.device | str, count: int) -> list[StepInputs]:
        """The tutorial's dynamic-shape inputs: input2 needs no grad, parameters are shared."""
        params = self.make_params(device)
        steps = []
        for shape in dynamic_shapes(self.shape, count):
            input1 = torch.randn(*shape, device=device, dtype=self.dtype, requires_grad=True)
            input2 = torch.rand_like(input1)
            grad_output = torch.rand_like(input1)
            steps.append(StepInputs((input1, input2, *params), self.consts, grad_output))
        return steps

    def bytes_sol_fwd_bwd(self) -> int:
        """Speed-of-light bytes of one step, computed on meta tensors (nothing is allocated)."""
        return sol_bytes(self.make_inputs("meta"))


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.element_size() * tensor.numel()


def sol_bytes(inputs: StepInputs) -> int:
    """Bytes a perfect fused forward+backward must move (DESIGN.md, "What the anchors do").

    Forward: read every tensor input once, write the output. Backward: read the output grad,
    re-read the inputs that need grads, write their grads. The output has grad_output's
    shape and dtype.
    """
    output = tensor_bytes(inputs.grad_output)
    forward = sum(tensor_bytes(t) for t in inputs.tensors) + output
    needs_grad = sum(tensor_bytes(t) for t in inputs.tensors if t.requires_grad)
    backward = output + 2 * needs_grad
    return forward + backward


def dynamic_shapes(base_shape: tuple[int, ...], count: int) -> list[tuple[int, ...]]:
    """The tutorial's random shapes: dims 0 and 1 perturbed, the rest kept."""
    rng = random.Random(DYNAMIC_SHAPE_SEED)
    shapes = []
    for _ in range(count):
        dim0 = base_shape[0] + rng.randrange(-2, 3)
        dim1 = base_shape[1] + rng.randrange(-2, 3)
        shapes.append((dim0, dim1, *base_shape[2:]))
    return shapes


def _layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> Workload:
    return Workload(layer_norm_block, shape, dtype, num_params=3)


def _primitive_layer_norm(shape: tuple[int, ...], dtype: torch.dtype) -> Workload:
    return Workload(primitive_layer_norm_block, shape, dtype, 3, (("keepdim", True),))


def _rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> Workload:
    return Workload(rms_norm_block, shape, dtype, 2, (("keepdim", True),))


def registry() -> list[Workload]:
    """The benchmarked workloads: the seed's shape, then the sizes where bandwidth rules."""
    return [
        _layer_norm(SEED_SHAPE, torch.float32),
        _primitive_layer_norm(SEED_SHAPE, torch.float32),
        _rms_norm(SEED_SHAPE, torch.float32),
        _layer_norm(LARGE_SHAPE, torch.float32),
        _rms_norm(LARGE_SHAPE, torch.float32),
        _rms_norm(WIDE_SHAPE, torch.bfloat16),
    ]


def smoke_registry() -> list[Workload]:
    """One tiny workload per (block, dtype) of the registry, for CPU smoke runs."""
    tiny: dict[tuple[Callable, torch.dtype], Workload] = {}
    for workload in registry():
        tiny.setdefault((workload.fn, workload.dtype), dataclasses.replace(workload, shape=SMOKE_SHAPE))
    return list(tiny.values())


def workloads_for(smoke: bool) -> list[Workload]:
    return smoke_registry() if smoke else registry()
