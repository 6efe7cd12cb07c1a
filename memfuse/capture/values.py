"""Traced sizes and fake tensors as the IR holds them: sympy sizes, and Values placed in the
[M, D] space."""
from __future__ import annotations

import sympy
import torch

from memfuse.ir.graph import Kind, Value, place


def to_expr(size) -> sympy.Expr:
    if isinstance(size, (torch.SymInt, torch.SymFloat)):
        return plain_sympy(size.node.expr)
    return sympy.Integer(size) if isinstance(size, int) else sympy.Float(size)


def plain_sympy(expr: sympy.Expr) -> sympy.Expr:
    """torch's sympy functions (FloatTrueDiv, FloorDiv, ToFloat, ...) as plain sympy, which
    the runtime turns into Python with lambdify."""
    from torch.utils._sympy import functions as F
    rules = [
        ((F.FloatTrueDiv, F.IntTrueDiv), lambda a, b: a / b),
        ((F.FloorDiv,), lambda a, b: sympy.floor(a / b)),
        ((F.CeilDiv,), lambda a, b: sympy.ceiling(a / b)),
        ((F.ToFloat, F.Identity), lambda a: a),
        ((F.TruncToFloat, F.TruncToInt), lambda a: sympy.sign(a) * sympy.floor(sympy.Abs(a))),
        ((F.FloorToInt,), lambda a: sympy.floor(a)),
        ((F.CeilToInt,), lambda a: sympy.ceiling(a)),
        ((F.PowByNatural, F.FloatPow), lambda a, b: a ** b),
        ((F.Mod, F.PythonMod), lambda a, b: sympy.Mod(a, b)),
        ((F.Max,), lambda *a: sympy.Max(*a)),
        ((F.Min,), lambda *a: sympy.Min(*a)),
    ]
    for classes, plain in rules:
        for cls in classes:
            expr = expr.replace(cls, plain)
    return expr


def classify(fake) -> Value:
    """Place a traced tensor in the [M, D] space (module docstring of ir.py)."""
    if not isinstance(fake, torch.Tensor):
        return Value(None, Kind.TENSOR)
    return place(fake.dtype, tuple(to_expr(s) for s in fake.shape))



def shape_text(shape) -> str:
    return f"[{', '.join(str(s) for s in shape)}]"
