"""Per-op knowledge, one row per op: the Triton expression and the torch reference.

Operands reach the Triton expression already in the node's compute dtype (fp32 for every
floating value, see `compute_dtype`). The torch column runs a node on real tensors where a
group is executed through aten instead of a generated kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .ir import Op

NAN_ALL = "propagate_nan=tl.PropagateNan.ALL"


@dataclass(frozen=True)
class OpInfo:
    triton: str                 # format string over the operand expressions {0}, {1}, {2}
    torch: Callable


OPS = {
    Op.NEG: OpInfo("-{0}", torch.neg),
    Op.ABS: OpInfo("tl.abs({0})", torch.abs),
    Op.EXP: OpInfo("tl.exp({0})", torch.exp),
    Op.LOG: OpInfo("tl.log({0})", torch.log),
    Op.SQRT: OpInfo("tl.sqrt({0})", torch.sqrt),
    Op.RSQRT: OpInfo("tl.rsqrt({0})", torch.rsqrt),
    Op.SIGMOID: OpInfo("tl.sigmoid({0})", torch.sigmoid),
    Op.TANH: OpInfo("(2.0 * tl.sigmoid(2.0 * {0}) - 1.0)", torch.tanh),
    Op.ERF: OpInfo("tl.erf({0})", torch.erf),
    Op.RECIPROCAL: OpInfo("(1.0 / {0})", torch.reciprocal),
    Op.LOGICAL_NOT: OpInfo("({0} == 0)", torch.logical_not),
    Op.ADD: OpInfo("({0} + {1})", torch.add),
    Op.SUB: OpInfo("({0} - {1})", torch.sub),
    Op.MUL: OpInfo("({0} * {1})", torch.mul),
    Op.DIV: OpInfo("({0} / {1})", torch.div),
    Op.MAXIMUM: OpInfo("tl.maximum({0}, {1}, " + NAN_ALL + ")", torch.maximum),
    Op.MINIMUM: OpInfo("tl.minimum({0}, {1}, " + NAN_ALL + ")", torch.minimum),
    Op.EQ: OpInfo("({0} == {1})", torch.eq),
    Op.NE: OpInfo("({0} != {1})", torch.ne),
    Op.LT: OpInfo("({0} < {1})", torch.lt),
    Op.LE: OpInfo("({0} <= {1})", torch.le),
    Op.GT: OpInfo("({0} > {1})", torch.gt),
    Op.GE: OpInfo("({0} >= {1})", torch.ge),
    Op.LOGICAL_AND: OpInfo("(({0} != 0) & ({1} != 0))", torch.logical_and),
    Op.LOGICAL_OR: OpInfo("(({0} != 0) | ({1} != 0))", torch.logical_or),
    Op.WHERE: OpInfo("tl.where({0}, {1}, {2})", torch.where),
}

# Reductions: Triton reducer, the neutral element masked lanes take, torch reference.
REDUCERS = {
    Op.SUM: ("tl.sum", "0.0", torch.sum),
    Op.MAX: ("tl.max", "float('-inf')", torch.amax),
    Op.MIN: ("tl.min", "float('inf')", torch.amin),
}

TRITON_DTYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.bool: "tl.int1",
}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Registers hold fp32 for every float narrower than fp64: one rounding, at the store."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    return dtype


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions (and column partial sums) accumulate in fp32, and fp64 values in fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32
