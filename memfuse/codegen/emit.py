"""Expression text for generated kernels: literals, products and sums with 0 and 1 folded, broadcasts
of row and column registers, the names kernels may not take."""
from __future__ import annotations

import os

import torch

from memfuse.ir.graph import Kind


RESERVED = {"pid", "num_programs", "cols", "col_mask", "rows", "row_mask", "mask", "offsets",
            "tile", "step", "tl", "triton", "M", "D", "BLOCK_M", "BLOCK_D", "seed", "tiles_per_program",
            "float", "range", "int", "partials", "partials_max", "partials_min",
            "ticket", "first", "programs", "partials_mask", "done", "stream_base"}


def interpreted() -> bool:
    """Kernels for Triton's CPU interpreter, whose fp32 -> bf16 conversion truncates."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def literal(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if value != value:
            return "float('nan')"
        if value in (float("inf"), float("-inf")):
            return "float('inf')" if value > 0 else "float('-inf')"
        return repr(value)
    return str(value)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": names of kernel arguments per dtype."""
    return str(dtype).replace("torch.", "")


def is_simple(text: str) -> bool:
    return text.lstrip("-").replace("_", "").isalnum()


def paren(text: str) -> str:
    return text if is_simple(text) else f"({text})"


def times(a: str, b: str) -> str:
    """a * b as text, with the products by 0 and 1 done."""
    if a == "0" or b == "0":
        return "0"
    if a == "1":
        return b
    if b == "1":
        return a
    return f"{paren(a)} * {paren(b)}"


def plus(terms) -> str:
    terms = [t for t in terms if t != "0"]
    return " + ".join(terms) if terms else "0"


def broadcast(text: str, have: Kind, want: Kind) -> str:
    """A register of kind `have` read where a `want` register is: rows and columns of a tile."""
    if want is Kind.FULL and have is Kind.ROW:
        return f"{text}[:, None]"
    if want is Kind.FULL and have is Kind.COL:
        return f"{text}[None, :]"
    return text


def register_kind(kinds) -> Kind:
    """The shape of an elementwise result: FULL if any operand is, or ROW meets COL."""
    present = {k for k in kinds if k is not Kind.SCALAR}
    if not present:
        return Kind.SCALAR
    if len(present) == 1:
        return present.pop()
    return Kind.FULL
