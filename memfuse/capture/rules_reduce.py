"""Lowering rules for reductions: over D (a row's, in registers), over the leading dims (columns:
fp32 partials), over some leading dims (a summed strided read), over everything (rows in the
kernel, then one small aten call); max/min with their indices, any, mean, var_mean."""
from __future__ import annotations

import sympy
import torch

from memfuse.capture.tables import EXTREME_ATEN, TOTALS, NotFusible
from memfuse.capture.values import classify, shape_text
from memfuse.ir import views
from memfuse.ir.graph import Cast, Extern, Kind, Op, Reduce, Symbol, Value, ValueRef, fits, place
from memfuse.ir.ops import accumulate_dtype

aten = torch.ops.aten


class ReductionRules:
    """The reduction rules of memfuse.capture.lower.Lowering (a mixin: the state is the Lowering's)."""

    @staticmethod
    def leading_subset(dims, source: Value) -> tuple | None:
        """(dims, whether D is summed too) of a sum over some, not all, of the leading dims of
        `source` (for a row value: of its dims other than a last 1), dims sorted; None for a
        reduction over all of them, over D alone, or over everything."""
        rank = len(source.shape)
        if source.kind not in (Kind.FULL, Kind.ROW) or dims is None or isinstance(dims, int) or not dims:
            return None
        dims = sorted(d % rank for d in dims)
        with_d = source.kind is Kind.FULL and dims[-1] == rank - 1
        leading = [j for j in range(rank) if (j < rank - 1 or source.kind is Kind.ROW)
                   and not views.same(source.shape[j], 1)]
        subset = dims[:-1] if with_d else dims
        return (subset, with_d) if subset and set(subset) < set(leading) else None

    def leading_sum(self, node, x: str, dims: list, value: Value, keepdim: bool, name: str | None = None) -> str:
        """A sum over some of the leading dims ([T, B, D] -> [B, D]: a broadcast's gradient): each
        element of the result adds up its T elements of `x`, read in place (x is written first
        when a kernel computes it)."""
        if node.kwargs.get("dtype") not in (None, value.dtype):
            raise NotFusible("reduction with a dtype argument")
        source = self.access(x)
        coeffs, consts, shape = views.sum_over(source.shape, dims, keepdim)
        summed = shape[len(shape) - len(dims):]
        return self.strided(name or node.name, source.then(coeffs, consts, shape), value, f"sum over dims {dims}",
                            summed=tuple(summed))

    def lower_leading_sum(self, node, x: str, dims: list, with_d: bool, value: Value, name: str) -> str:
        """A sum over some leading dims, and over D when `with_d` ([T, B, D] -> [B, 1]: the gradient
        of a [B, 1] operand): the rows are summed in a kernel first, as fp32, into a row value, then
        the rows by a strided read, or by one aten call where that read would add more terms one
        after another than it has outputs (`sums_serially`: BatchNorm's per-channel sums of
        [N, C, H, W], N x H rows for each of C outputs)."""
        source = self.graph[x].value
        keepdim = len(value.shape) == len(source.shape)
        if not with_d:
            return self.leading_sum(node, x, dims, value, keepdim, name)
        if node.kwargs.get("dtype") not in (None, value.dtype):
            raise NotFusible("reduction with a dtype argument")
        acc = accumulate_dtype(value.dtype) if value.is_floating else value.dtype
        rows = self.add(Op.SUM, [x], place(acc, tuple(source.shape[:-1]) + (sympy.Integer(1),)), Reduce(Kind.ROW),
                        name=f"{name}_rows")
        shaped = Value(acc, value.kind, value.shape, value.m, value.d)
        last = len(source.shape) - 1
        if self.sums_serially([source.shape[j] for j in dims], value.shape):
            total = self.add(Op.EXTERN, [rows], shaped, Extern(aten.sum.dim_IntList, (ValueRef(rows), [*dims, last],
                                                                                       keepdim), ()),
                             name=name if acc == value.dtype else f"{name}_total")
            return total if acc == value.dtype else self.add(Op.CAST, [total], value, Cast(value.dtype), name=name)
        kept = tuple(sympy.Integer(1) if j in dims else s for j, s in enumerate(self.graph[rows].value.shape))
        total = self.leading_sum(node, rows, dims, place(acc, kept), True, f"{name}_total")
        if not fits(self.graph[total].value, shaped, Op.VIEW):
            # another place in [M, D] (a [N, C, 1, 1] sum of rows is a row value, its [N, C] result
            # a full one): the written totals read again in the result's shape
            step = views.reshape(kept, value.shape)
            if step is None:
                raise NotFusible(f"a sum whose result {shape_text(value.shape)} is no reshape of {shape_text(kept)}")
            read = self.access(total).then(*step, value.shape)
            if acc == value.dtype:
                return self.strided(name, read, value, f"view{shape_text(value.shape)}")
            total = self.strided(f"{name}_reshaped", read, shaped, f"view{shape_text(value.shape)}")
        if acc == value.dtype:
            return self.add(Op.VIEW, [total], value, name=name)
        return self.add(Op.CAST, [total], value, Cast(value.dtype), name=name)

    def sums_serially(self, terms: list, result: tuple) -> bool:
        """Whether a strided read would add more `terms` (the summed dims' sizes) for each output
        than `result` has outputs, at the traced sizes: it adds one output's terms one after
        another, and runs its outputs in parallel, so that sum is aten's (a tree over all of them)."""
        count, outputs = (sympy.sympify(sympy.sympify(sympy.Mul(*sizes)).xreplace(self.hints))
                          for sizes in (terms, result))
        return bool(count.is_number and outputs.is_number and count > outputs)

    def reduction_axis(self, dims, source: Value) -> Kind:
        rank = len(source.shape)
        dims = [dims] if isinstance(dims, int) else dims
        if source.kind is not Kind.FULL or dims is None:
            raise NotFusible("reduction over a non-[M, D] tensor or over every dim")
        dims = sorted(d % rank for d in dims)
        if dims == [rank - 1]:
            return Kind.ROW
        if dims == list(range(rank - 1)):
            return Kind.COL
        raise NotFusible(f"reduction over dims {dims} of a rank-{rank} tensor")

    def lower_reduction(self, node, op: Op, value: Value) -> str:
        x = self.operand(node.args[0])
        source = self.graph[x].value
        if op in (Op.ARGMAX, Op.ARGMIN):
            if len(node.args) < 2 or node.args[1] is None:
                raise NotFusible(f"{op.value} over every dim (a flat index)")
            dims = [node.args[1]]
        else:
            dims = node.args[1] if len(node.args) > 1 else None
            if self.everything(dims, source):
                return self.lower_total(node, op, x, value)
            subset = self.leading_subset(dims, source)
            if subset is not None and op is Op.SUM:
                return self.lower_leading_sum(node, x, *subset, value, node.name)
        axis = self.reduction_axis(dims, source)
        if node.kwargs.get("dtype") not in (None, value.dtype):
            raise NotFusible("reduction with a dtype argument")
        self.check_reducible(op, axis, source, value)
        if axis is Kind.ROW and not fits(source, value, op):
            return self.lower_rows_reshaped(op, x, value, node.name)
        self.check_fits(op, [x], value)
        return self.add(op, [x], value, Reduce(axis), name=node.name)

    def lower_rows_reshaped(self, op: Op, x: str, value: Value, name: str) -> str:
        """A reduction over D whose result leaves the rows' place ([N, C, L] summed over L without
        keepdim: a full [N, C] value, not a row of the [N x C, L] rows): each row reduced in the
        kernel into a row value, then read in the result's shape. Run by aten instead, the sum
        reads its whole input from memory, which a kernel must write first (GroupNorm's backward
        over wav2vec2's conv features: fp32 copies of the activation, alive together)."""
        source = self.graph[x].value
        kept = tuple(source.shape[:-1]) + (sympy.Integer(1),)
        rows = self.add(op, [x], place(value.dtype, kept), Reduce(Kind.ROW), name=f"{name}_rows")
        step = views.reshape(kept, value.shape)
        if step is None:
            raise NotFusible(f"a reduction whose result {shape_text(value.shape)} is no reshape of {shape_text(kept)}")
        return self.strided(name, self.access(rows).then(*step, value.shape), value, f"view{shape_text(value.shape)}")

    def lower_any(self, node, value: Value) -> str:
        """any over D or over the leading dims (all arrives decomposed, as not any of not): the
        count of true elements, a fp32 sum of the booleans, above 0. _safe_softmax asks
        any(x != -inf) of every attention row: fused, the row's softmax kernel answers it
        instead of writing a bool [batch, heads, seq, seq] for aten to read."""
        x = self.operand(node.args[0])
        source = self.graph[x].value
        dims = node.args[1] if len(node.args) > 1 else None
        if self.everything(dims, source):
            raise NotFusible("any over every dim")
        axis = self.reduction_axis(dims, source)
        if value.kind is not axis:
            raise NotFusible("any whose result does not keep the [M, D] place of its rows or columns")
        ones = self.add(Op.CAST, [x], Value(torch.float32, source.kind, source.shape, source.m, source.d),
                        Cast(torch.float32), name=f"{node.name}_ones")
        counted = Value(torch.float32, value.kind, value.shape, value.m, value.d)
        count = self.add(Op.SUM, [ones], counted, Reduce(axis), name=f"{node.name}_count")
        return self.pointwise(Op.GT, [count, self.const(0.0)], value, node.name)

    @staticmethod
    def check_reducible(op: Op, axis: Kind, source: Value, value: Value) -> None:
        if op in (Op.ARGMAX, Op.ARGMIN) and axis is not Kind.ROW:
            raise NotFusible(f"{op.value} over the leading dims")
        if not source.is_floating and op is not Op.SUM:
            raise NotFusible(f"{op.value} of integers: the kernels reduce floats")
        if axis is Kind.COL and not (value.is_floating and value.dtype.itemsize <= 4):
            raise NotFusible(f"a {value.dtype} reduction over the leading dims: partials are fp32")

    def lower_extreme(self, node, val):
        """max.dim / min.dim: the row's extreme and its first index, both over D."""
        if len(node.args) < 2:
            raise NotFusible("max/min over every dim")
        x = self.operand(node.args[0])
        source = self.graph[x].value
        axis = self.reduction_axis([node.args[1]], source)
        extreme, index = EXTREME_ATEN[node.target]
        values, indices = classify(val[0]), classify(val[1])
        self.check_reducible(index, axis, source, indices)
        self.check_fits(extreme, [x], values)
        return (self.add(extreme, [x], values, Reduce(axis), name=f"{node.name}_values"),
                self.add(index, [x], indices, Reduce(axis), name=f"{node.name}_indices"))

    def count_reduced(self, source: Value, axis: Kind) -> str:
        """1 / (number of elements reduced): a constant over D, a SYMBOL over M."""
        return self.inverse(sympy.Integer(source.d) if axis is Kind.ROW else source.m)

    def inverse(self, count: sympy.Expr) -> str:
        """1 / count as a scalar: a constant, or a SYMBOL when it depends on the sizes."""
        inverse = 1 / count
        if inverse.free_symbols:
            return self.add(Op.SYMBOL, (), Value(torch.float32, Kind.SCALAR), Symbol(inverse), name="inv_count")
        return self.const(float(inverse))

    @staticmethod
    def everything(dims, source: Value) -> bool:
        """Whether `dims` (None and [] mean all) covers every dim of an [M, D] value."""
        if source.kind is not Kind.FULL:
            return False
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            return True
        dims = [dims] if isinstance(dims, int) else dims
        return sorted(d % len(source.shape) for d in dims) == list(range(len(source.shape)))

    def lower_total(self, node, op: Op, x: str, value: Value, mean: bool = False) -> str:
        """A reduction to one value (a loss): each row reduced over D inside the kernel, then
        one small aten call over the M row results."""
        source = self.graph[x].value
        if not source.is_floating and op is not Op.SUM:
            raise NotFusible(f"{op.value} of integers: the kernels reduce floats")
        dtype = value.dtype if not value.is_floating else \
            torch.float64 if value.dtype == torch.float64 else torch.float32
        row = Value(dtype, Kind.ROW, tuple(source.shape[:-1]) + (sympy.Integer(1),), m=source.m)
        rows = self.add(op, [x], row, Reduce(Kind.ROW), name=f"{node.name}_rows")
        if mean:
            rows = self.add(Op.MUL, [rows, self.const(1.0 / source.d)], row, name=f"{node.name}_row_means")
        finish = aten.mean.default if mean else TOTALS[op]
        args = (ValueRef(rows), []) if op in (Op.MAX, Op.MIN) else (ValueRef(rows),)
        total = self.add(Op.EXTERN, [rows], Value(dtype, Kind.SCALAR, ()), Extern(finish, args, ()),
                         name=f"{node.name}_total")
        if dtype == value.dtype:
            return self.add(Op.VIEW, [total], value, name=node.name)
        return self.add(Op.CAST, [total], value, Cast(value.dtype), name=node.name)

    def lower_mean(self, node, value: Value) -> str:
        x = self.operand(node.args[0])
        source = self.graph[x].value
        if not source.is_floating:
            raise NotFusible("mean of integers")
        dims = node.args[1] if len(node.args) > 1 else None
        if self.everything(dims, source):
            return self.lower_total(node, Op.SUM, x, value, mean=True)
        subset = self.leading_subset(dims, source)
        if subset is not None:
            dims, with_d = subset
            total = self.lower_leading_sum(node, x, dims, with_d, value, f"{node.name}_sum")
            count = sympy.Mul(*[source.shape[j] for j in dims]) * (source.d if with_d else 1)
            return self.pointwise(Op.MUL, [total, self.inverse(count)], value, node.name)
        axis = self.reduction_axis(dims, source)
        if axis is Kind.COL and source.dtype.itemsize > 4:
            raise NotFusible(f"a {source.dtype} mean over the leading dims: partials are fp32")
        total = self.add(Op.SUM, [x], value, Reduce(axis), name=f"{node.name}_sum")
        return self.pointwise(Op.MUL, [total, self.count_reduced(source, axis)], value, node.name)

    def lower_var_mean(self, node, val):
        """Two passes over the row in registers: mean, then the sum of squared deviations."""
        x = self.operand(node.args[0])
        source = self.graph[x].value
        dims = node.args[1] if len(node.args) > 1 else None
        correction = node.kwargs.get("correction", 1)
        correction = 1 if correction is None else correction
        subset = self.leading_subset(dims, source)
        if subset is not None:
            return self.lower_leading_var_mean(node, x, *subset, correction, val)
        axis = self.reduction_axis(dims, source)
        if axis is not Kind.ROW:
            raise NotFusible("variance over the leading dims")
        var_fake = val[0] if isinstance(val, (tuple, list)) else val
        stat = classify(var_fake)
        full = Value(torch.float32 if source.dtype != torch.float64 else source.dtype, Kind.FULL,
                     source.shape, source.m, source.d)
        total = self.add(Op.SUM, [x], stat, Reduce(Kind.ROW), name=f"{node.name}_sum")
        mean = self.add(Op.MUL, [total, self.const(1.0 / source.d)], stat, name=f"{node.name}_mean")
        diff = self.add(Op.SUB, [x, mean], full, name=f"{node.name}_diff")
        square = self.add(Op.MUL, [diff, diff], full, name=f"{node.name}_sq")
        squares = self.add(Op.SUM, [square], stat, Reduce(Kind.ROW), name=f"{node.name}_sqsum")
        var = self.add(Op.MUL, [squares, self.const(1.0 / max(source.d - correction, 0) if source.d > correction
                                                    else float("nan"))], stat, name=f"{node.name}_var")
        return (var, mean) if node.target is aten.var_mean.correction else var

    def lower_leading_var_mean(self, node, x: str, dims: list, with_d: bool, correction, val):
        """Variance and mean over some leading dims and D (BatchNorm's per-channel statistics of
        [N, C, H, W]): the mean, then the sum of squared deviations, each a sum of rows in a kernel
        that reads x as it is (under autocast: the bf16 activation, upcast in registers), finished
        over the leading dims (`lower_leading_sum`). Aten's var_mean would read x from memory:
        the fp32 upcast written whole for it, twice the activation's bytes, alive for the call."""
        source = self.graph[x].value
        stat = classify(val[0] if isinstance(val, (tuple, list)) else val)
        if not source.is_floating or not stat.is_floating:
            raise NotFusible("variance of integers")
        acc = torch.float64 if torch.float64 in (source.dtype, stat.dtype) else torch.float32
        wide_stat = Value(acc, stat.kind, stat.shape, stat.m, stat.d)
        wide = Value(acc, Kind.FULL, source.shape, source.m, source.d)
        count = sympy.Mul(*[source.shape[j] for j in dims]) * (source.d if with_d else 1)
        total = self.lower_leading_sum(node, x, dims, with_d, wide_stat, f"{node.name}_sum")
        mean = self.pointwise(Op.MUL, [total, self.inverse(count)], wide_stat, f"{node.name}_mean")
        if source.dtype != acc:
            x = self.add(Op.CAST, [x], wide, Cast(acc), name=f"{node.name}_wide")
        diff = self.pointwise(Op.SUB, [x, mean], wide, f"{node.name}_diff")
        square = self.pointwise(Op.MUL, [diff, diff], wide, f"{node.name}_sq")
        squares = self.lower_leading_sum(node, square, dims, with_d, wide_stat, f"{node.name}_sqsum")
        divisor = sympy.sympify(count - correction)
        scale = self.const(float("nan")) if divisor.is_number and divisor <= 0 else self.inverse(divisor)
        var = self.pointwise(Op.MUL, [squares, scale], wide_stat, f"{node.name}_var")
        if stat.dtype != acc:
            var = self.add(Op.CAST, [var], stat, Cast(stat.dtype), name=f"{node.name}_var_{_short(stat.dtype)}")
            mean = self.add(Op.CAST, [mean], stat, Cast(stat.dtype), name=f"{node.name}_mean_{_short(stat.dtype)}")
        return (var, mean) if node.target is aten.var_mean.correction else var


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
