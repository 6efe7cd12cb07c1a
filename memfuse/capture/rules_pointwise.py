"""Lowering rules for pointwise ops: arithmetic and math (POINTWISE_ATEN), division with a
rounding mode, comparisons in the operands' common dtype, clamp, pow, casts, fills and random
draws."""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch

from memfuse.capture.tables import NotFusible, POLYGAMMA_ORDERS, POW_AS_OP
from memfuse.ir.graph import COMPARISON, Cast, Kind, Matmul, Node, Op, Seeded, Value
from memfuse.ir.ops import OPS
from memfuse.base.launch import outside_trace

aten = torch.ops.aten
prims = torch.ops.prims


class PointwiseRules:
    """The pointwise rules of memfuse.capture.lower.Lowering (a mixin: the state is the Lowering's)."""

    def lower_relu(self, node, value: Value) -> str:
        return self.pointwise(Op.MAXIMUM, [self.operand(node.args[0]), self.const(0.0)], value, node.name)

    def lower_pointwise(self, node, op: Op, value: Value, args: Optional[list] = None) -> str:
        """`op` over the node's arguments (or over `args`, when some of them are attributes)."""
        args = [self.operand(a) for a in node.args] if args is None else args
        alpha = node.kwargs.get("alpha", 1)
        if alpha != 1:
            scaled = self.graph[args[1]].value
            args[1] = self.pointwise(Op.MUL, [args[1], self.operand(alpha)], scaled, f"{node.name}_alpha")
        if value.dtype == torch.bool:   # bitwise ops on booleans are the logical ones
            op = {Op.BITWISE_NOT: Op.LOGICAL_NOT, Op.BITWISE_AND: Op.LOGICAL_AND, Op.BITWISE_OR: Op.LOGICAL_OR,
                  Op.BITWISE_XOR: Op.LOGICAL_XOR}.get(op, op)
        if op in (Op.FMOD, Op.REMAINDER, Op.FLOOR_DIVIDE) and not value.is_floating:
            raise NotFusible(f"integer {op.value}: eager raises on a zero divisor, a kernel cannot")
        if op is Op.POW and not value.is_floating:
            raise NotFusible("integer pow: integer results (and errors for negative exponents) as eager")
        if not OPS[op].fp64 and torch.float64 in [value.dtype] + [self.graph[a].value.dtype for a in args]:
            raise NotFusible(f"fp64 {op.value}: its helper ({OPS[op].helper}) is accurate to fp32 only")
        if op in COMPARISON:
            args = self.promote(node, args)
        if op is Op.ADD and alpha == 1:     # gradients of a split value's parts (rewrite_joins)
            joined = self.joined_sum(args, value, node.name)
            if joined is not None:
                return joined
        return self.pointwise(op, args, value, node.name)

    def promote(self, node, args: list) -> list:
        """Comparisons run in the operands' common dtype (torch.result_type): a float scalar or
        0-d tensor compared with a bf16 tensor is first rounded to bf16, as eager does."""
        common = torch.result_type(*[a.meta["val"] if isinstance(a, torch.fx.Node) else a
                                     for a in node.args[:2]])
        promoted = []
        for fx_arg, name in zip(node.args[:2], args):
            have = self.graph[name].value
            if not common.is_floating_point:   # integers: widen to the common type (uint8 vs int8)
                if have.dtype is not None and have.dtype != common and self.graph[name].op is not Op.CONSTANT:
                    widened = Value(common, have.kind, have.shape, have.m, have.d)
                    name = self.add(Op.CAST, [name], widened, Cast(common), name=f"{node.name}_operand")
            elif isinstance(fx_arg, (int, float)) and not isinstance(fx_arg, bool):
                name = self.const(float(fx_arg), common)
            elif self.graph[name].op is Op.CONSTANT and have.dtype != common:   # a 0-d tensor constant
                name = self.const(float(self.graph[name].attr.value), common)
            elif have.is_floating and have.dtype.itemsize > common.itemsize:
                rounded = Value(common, have.kind, have.shape, have.m, have.d)
                name = self.add(Op.CAST, [name], rounded, Cast(common), name=f"{node.name}_operand")
            promoted.append(name)
        return promoted + args[2:]

    def lower_divide(self, node, value: Value) -> str:
        """div with a rounding mode, and prims' div/fmod (truncating for integers)."""
        mode = node.kwargs.get("rounding_mode", node.args[2] if len(node.args) > 2 else None)
        if node.target is prims.fmod.default:
            op = Op.FMOD
        elif node.target is prims.div.default:
            op = Op.DIV if value.is_floating else Op.TRUNC_DIVIDE
        else:
            op = {None: Op.DIV, "trunc": Op.TRUNC_DIVIDE, "floor": Op.FLOOR_DIVIDE}[mode]
        if op is not Op.DIV and not value.is_floating:
            raise NotFusible(f"integer {op.value}: eager raises on a zero divisor, a kernel cannot")
        args = [self.operand(a) for a in node.args[:2]]
        return self.pointwise(op, args, value, node.name)

    def lower_polygamma(self, node, value: Value) -> str:
        """polygamma(n, x): orders 0 and 1 have helpers (digamma and trigamma, digamma's derivative)."""
        order, x = node.args
        op = POLYGAMMA_ORDERS.get(order)
        if op is None:
            raise NotFusible(f"polygamma of order {order}: only orders 0 and 1 (digamma, trigamma) have helpers")
        return self.lower_pointwise(node, op, value, [self.operand(x)])

    def lower_clamp(self, node, value: Value) -> str:
        """clamp(x, min, max) = minimum(maximum(x, min), max), NaN kept (scalar or tensor bounds)."""
        x = self.operand(node.args[0])
        low, high = (list(node.args[1:]) + [None, None])[:2]
        low, high = node.kwargs.get("min", low), node.kwargs.get("max", high)
        if low is not None:
            x = self.pointwise(Op.MAXIMUM, [x, self.operand(low)], value, f"{node.name}_min")
        if high is not None:
            x = self.pointwise(Op.MINIMUM, [x, self.operand(high)], value, f"{node.name}_max")
        return x

    def lower_pow(self, node, value: Value) -> str:
        """x ** c: the exponents torch special-cases become the same ops; others call mf_pow."""
        x, exponent = self.operand(node.args[0]), node.args[1]
        if not isinstance(exponent, (int, float)):
            raise NotFusible(f"pow with a symbolic exponent {exponent}")
        if exponent == 0:
            return self.lower_fill(node, value, fill=1)
        if exponent == 2:
            return self.pointwise(Op.MUL, [x, x], value, node.name)
        if exponent == 3:
            square = self.pointwise(Op.MUL, [x, x], value, f"{node.name}_square")
            return self.pointwise(Op.MUL, [square, x], value, node.name)
        op = POW_AS_OP.get(exponent)
        if op is not None and (value.is_floating or op is Op.VIEW):
            return self.pointwise(op, [x], value, node.name)
        if not value.is_floating:
            raise NotFusible(f"integer pow with exponent {exponent}")
        return self.pointwise(Op.POW, [x, self.const(float(exponent))], value, node.name)

    def lower_cast(self, node, value: Value) -> str:
        source = node.args[1] if node.target is aten.copy.default else node.args[0]
        device = node.kwargs.get("device")
        if device is not None and device != source.meta["val"].device:
            raise NotFusible(f"copies to device {device}")
        x = self.operand(source)
        if self.product_in_fp32(source, x, value):
            return x
        op = Op.VIEW if self.graph[x].value.dtype == value.dtype else Op.CAST
        self.check_fits(op, [x], value)
        return self.add(op, [x], value, Cast(value.dtype) if op is Op.CAST else None, name=node.name)

    def product_in_fp32(self, source, x: str, value: Value) -> bool:
        """An fp32 cast of a bf16 or fp16 `mm` product nothing else reads becomes the matmul's own
        output dtype (`aten.mm.dtype`): cuBLAS writes the fp32 product, one call where a matmul, a
        [M, N] product in memory and a cast kernel were three (autocast's weight gradients: one
        per linear layer, each its own launch). The product is rounded
        once, to fp32, instead of to bf16 first: nearer fp64 than eager, not bit for bit eager's.
        Where the build has that op on the device (CUDA since torch 2.9; not the CPU): `x` is
        rewritten in place, and True."""
        node = self.graph[x]
        if not (isinstance(source, torch.fx.Node) and source.target is aten.mm.default and len(source.users) == 1
                and node.op is Op.EXTERN and isinstance(node.attr, Matmul) and value.dtype == torch.float32
                and node.value.dtype in (torch.bfloat16, torch.float16)
                and matmul_writes_fp32(node.attr.device, node.value.dtype)):
            return False
        attr = dataclasses.replace(node.attr, target=aten.mm.dtype, args=(*node.attr.args, torch.float32))
        self.graph.nodes[x] = Node(x, Op.EXTERN, node.inputs, dataclasses.replace(node.value, dtype=torch.float32),
                                   attr)
        return True

    def lower_fill(self, node, value: Value, fill=None) -> str:
        """full/full_like/empty/scalar_tensor: one value broadcast over the result."""
        if fill is None:
            if node.target in (aten.full.default, aten.full_like.default):
                fill = node.args[1]
            elif node.target is aten.scalar_tensor.default:
                fill = node.args[0]
            else:
                fill = 0    # empty: any value is right
        if isinstance(fill, torch.fx.Node):   # a size-derived fill value
            scalar = self.operand(fill)
            if self.graph[scalar].value.dtype == value.dtype:
                return self.add(Op.VIEW, [scalar], value, name=node.name)
            return self.add(Op.CAST, [scalar], value, Cast(value.dtype), name=node.name)
        if not isinstance(fill, (bool, int, float)):
            raise NotFusible(f"fill value {fill!r}")
        return self.add(Op.VIEW, [self.const(fill, value.dtype)], value, name=node.name)

    def lower_rand(self, node, value: Value) -> str:
        if value.kind is not Kind.FULL or not value.is_floating:
            raise NotFusible("random values outside a FULL float [M, D] tensor")
        stream = self.rng_streams
        self.rng_streams += 1
        return self.add(Op.RAND, [self.seed()], value, Seeded(stream), name=node.name)


@functools.cache
def matmul_writes_fp32(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch's `aten.mm.dtype` writes the fp32 product of `dtype` operands on the device
    type (CUDA builds since torch 2.9; not the CPU): tried once on an 8x8 product, outside any fake
    mode the trace runs in."""
    if device_type != "cuda" or not hasattr(aten.mm, "dtype") or not torch.cuda.is_available():
        return False

    def product_of_ones():
        operand = torch.ones(8, 8, device="cuda", dtype=dtype)
        return aten.mm.dtype(operand, operand, torch.float32)
    try:
        product = outside_trace(product_of_ones)
    except (RuntimeError, NotImplementedError):
        return False
    return product.dtype == torch.float32 and bool((product == 8).all())
