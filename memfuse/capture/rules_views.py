"""Lowering rules for views: a view that keeps the [M, D] order is a register copy; one that moves
elements (permute, slice, select, split, cat, pad, slice_scatter, select_backward, a broadcast)
is a STRIDED node reading a tensor in memory through an access map (memfuse.ir.views). Each
STRIDED read is kept as one record (`StridedRead`), so later views compose with it, slice its
window, or read it again at a moved index (the rewrite_* modules)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import sympy
import torch

from memfuse.capture.tables import NotFusible
from memfuse.capture.values import classify, shape_text, to_expr
from memfuse.ir import views
from memfuse.ir.graph import Kind, Op, Symbol, Value, ValueRef, fits, place
from memfuse.ir.views import strided_attr

aten = torch.ops.aten


@dataclass(frozen=True)
class StridedRead:
    """How one STRIDED node reads: its access map (over the value's dims, then the summed ones),
    the window it reads inside (None: everywhere) with the value read outside it (`fallback`),
    the sizes of the dims it adds up (a sum over leading dims), and whether a slice may move its
    window (`movable`: a pad, or a cat's part read over a constant or over such a read)."""
    access: views.AccessMap
    shape: tuple                       # the value's shape
    window: Optional[tuple] = None
    fallback: Optional[str] = None
    summed: tuple = ()
    movable: bool = False

    @property
    def view(self) -> Optional[views.AccessMap]:
        """The access map of a plain view (no window, no sum), with the value's shape: what a view
        of this read composes with."""
        if self.window is not None or self.summed:
            return None
        m = self.access
        return views.AccessMap(m.root, self.shape, m.coeffs, m.consts, m.contiguous_root, m.last_stride_one)

    @property
    def is_sum(self) -> bool:
        """A sum over leading dims with no window: it can be read again at a moved index."""
        return self.window is None and bool(self.summed)


@dataclass(frozen=True)
class AtenView:
    """An aten view no fx node names (a split's part as `aten.narrow`), as keep_aten_views reads
    one: its target, fx arguments and fake value."""
    target: object
    args: tuple
    meta: dict
    kwargs: dict = field(default_factory=dict)


class ViewRules:
    """The view rules of memfuse.capture.lower.Lowering (a mixin: the state is the Lowering's)."""

    def keeps_order(self, node) -> bool:
        """A permute or slice that leaves every element where it was (moves size-1 dims, or
        slices a whole dim): a plain view."""
        source = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], torch.fx.Node) else None
        if not isinstance(source, torch.Tensor):
            return False
        if node.target is aten.permute.default:
            # (static 1s only: comparing a size symbol would add a guard to the trace)
            moved = [d % source.dim() for d in node.args[1] if not (isinstance(source.shape[d], int)
                                                                   and source.shape[d] == 1)]
            return moved == sorted(moved)
        if node.target is aten.slice.Tensor:
            dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1:])[:4]
            size = source.shape[dim]
            whole_end = end is None or (isinstance(end, int) and isinstance(size, int) and end >= size) \
                or (isinstance(end, int) and end >= 2 ** 62)
            return start in (0, None) and step == 1 and whole_end
        return False

    # -- views read in place (memfuse.ir.views) ---------------------------------------------
    def lower_view(self, node, value: Value) -> str:
        """A view that keeps the [M, D] order is a register copy; one that does not (a reshape
        that splits D, a size-1 dim that changes the space) reads its source in place."""
        x = self.operand(node.args[0])
        if fits(self.graph[x].value, value, Op.VIEW):
            return self.add(Op.VIEW, [x], value, name=node.name)
        read = self.broadcast(x, value) if node.target is aten.expand.default else x
        if read != x:
            return read if self.graph[read].value.shape == value.shape else \
                self.add(Op.VIEW, [read], value, name=node.name)
        if node.target is aten.expand.default or self.graph[x].value.dtype != value.dtype:
            raise NotFusible(f"{self.graph[x].value.kind.value} input {x} does not fit a "
                             f"{value.kind.value} result in one [M, D] space")
        source = self.access(x)
        step = views.reshape(source.shape, value.shape)
        if step is None:
            raise NotFusible(f"a reshape that is not provably a split of dims ({shape_text(source.shape)} -> "
                             f"{shape_text(value.shape)}: merged dims, or sizes the trace does not relate, as from a -1): "
                             f"not a strided view")
        return self.strided(node.name, source.then(*step, value.shape), value, f"view{shape_text(value.shape)}")

    def access(self, name: str) -> "views.AccessMap":
        """How `name` reads from memory: through the views it came from, down to a tensor the
        program holds (an input, an extern result) or to a value a kernel must write first."""
        view = self.plain_view(name)
        if view is not None:
            return view
        node = self.graph[name]
        if node.op is Op.VIEW and self.graph[node.inputs[0]].op is not Op.CONSTANT:
            source = self.access(node.inputs[0])
            # a reshape of its source, or a broadcast of it (an expand: stride 0 along the repeated dims)
            step = views.reshape(source.shape, node.value.shape) or views.expand(source.shape, node.value.shape)
            if step is not None:
                return source.then(*step, node.value.shape)
        return self.in_memory(name)

    def in_memory(self, name: str) -> views.AccessMap:
        """The identity map of a tensor in memory: made contiguous, or an input read by its strides."""
        return views.identity(name, self.graph[name].value.shape, name not in self.in_place,
                              self.last_stride_one.get(name, True))

    def read_in_place(self, name: str) -> str:
        """The STRIDED node that reads a non-contiguous input by its own strides (no copy)."""
        if self.in_place[name] is None:
            value = self.graph[name].value
            if value.kind in (Kind.SCALAR, Kind.TENSOR):
                return name
            self.in_place[name] = self.strided(f"{name}_in_place", self.in_memory(name),
                                               value, "its own strides")
        return self.in_place[name]

    def broadcast(self, name: str, value: Value) -> str:
        """An operand whose leading dims broadcast against `value`'s ([B, D], [1, B, D] or [T, 1, D]
        against [T, B, D]): read in place with stride 0 along the repeated dims, to `value`'s
        leading dims and, for an [M, D] result, its own last dim (a [..., 1] operand stays a row
        value, broadcast over the columns in registers). An operand that fits, or does not
        broadcast, comes back as is."""
        src = self.graph[name].value
        if src.kind in (Kind.SCALAR, Kind.TENSOR) or value.kind not in (Kind.FULL, Kind.ROW) \
                or fits(src, value, Op.VIEW):
            return name
        shape = tuple(value.shape[:-1]) + (src.shape[-1] if value.kind is Kind.FULL else value.shape[-1],)
        key = (name, shape)
        if key not in self.broadcasts:
            step = views.expand(src.shape, shape)
            if step is None or not fits(place(src.dtype, shape), value, Op.VIEW):
                return name
            self.broadcasts[key] = self.strided(f"{name}_broadcast", self.access(name).then(*step, shape),
                                                place(src.dtype, shape), f"broadcast to {shape_text(shape)}")
        return self.broadcasts[key]

    def size_operand(self, expr):
        """An access-map entry as the IR holds it: an int, or a ValueRef to a SYMBOL node."""
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_number:
            return int(expr)
        if expr not in self.size_symbols:
            label = re.sub(r"\W+", "_", str(expr).replace("-", "minus").replace("+", "plus")).strip("_")
            self.size_symbols[expr] = self.add(Op.SYMBOL, (), Value(torch.int64, Kind.SCALAR), Symbol(expr),
                                               name=f"size_{label}")
        return ValueRef(self.size_symbols[expr])

    def strided(self, name: str, m: "views.AccessMap", value: Value, describe: str,
                window: Optional[tuple] = None, fallback: Optional[str] = None, summed: tuple = (),
                movable: bool = False) -> str:
        """A STRIDED node reading `m.root` through `m`; `summed`: the sizes of the dims after the
        value's that the read adds up (a sum over leading dims); `movable`: a slice may move its
        window (StridedRead)."""
        if value.kind in (Kind.SCALAR, Kind.TENSOR):
            raise NotFusible(f"a view of shape {shape_text(value.shape)} is outside the [M, D] space")
        attr = strided_attr(m, value, describe, self.size_operand, window, summed)
        if fallback is not None:
            self.check_fits(Op.STRIDED, [fallback], value)
        inputs = [m.root] + ([fallback] if fallback is not None else []) + attr.scalars()
        out = self.add(Op.STRIDED, inputs, value, attr, name=name)
        self.reads[out] = StridedRead(m, tuple(value.shape), window, fallback, tuple(summed), movable)
        return out

    def plain_view(self, name: str) -> Optional[views.AccessMap]:
        """The access map of `name` where it is a plain strided view (no window, no sum), else None."""
        read = self.reads.get(name)
        return None if read is None else read.view

    def summed_read(self, name: str) -> Optional[StridedRead]:
        """The read of `name` where it is a sum over leading dims with no window, else None."""
        read = self.reads.get(name)
        return read if read is not None and read.is_sum else None

    def movable_read(self, name: str) -> Optional[StridedRead]:
        """The read of `name` where it is a windowed read a slice may move (a pad, a cat's chain)."""
        read = self.reads.get(name)
        return read if read is not None and read.movable else None

    def lower_strided(self, node, value: Value) -> str:
        target = node.target
        if target is aten.cat.default:
            return self.lower_cat(node, value)
        if target is aten.slice_scatter.default:
            return self.lower_slice_scatter(node, value)
        if target is aten.select_backward.default:
            return self.lower_select_backward(node, value)
        if target is aten.constant_pad_nd.default:
            return self.lower_constant_pad(node, value)
        windowed = self.windowed_read(self.env_name(node.args[0]))
        if target is aten.slice.Tensor and windowed is not None and (list(node.args[4:5]) + [1])[0] == 1:
            return self.lower_slice_of_windowed(node, windowed, value)
        source = self.access(self.env_name(node.args[0]))
        rank = len(source.shape)
        if target is aten.permute.default:
            step = views.permute(source.shape, node.args[1])
            summed = self.view_of_small_sum(source, step, value, node.name, f"permute{tuple(node.args[1])}")
            computed = summed or self.permute_of_computed(node, value)
            return computed or self.strided(node.name, source.then(*step), value, f"permute{tuple(node.args[1])}")
        dim = node.args[1] % rank
        if target is aten.select.int:
            index = self.index_expr(node.args[2], source.shape[dim])
            return self.strided(node.name, source.then(*views.select(source.shape, dim, index)), value,
                                f"select(dim={dim})")
        start, step = self.index_expr((list(node.args[2:3]) + [None])[0] or 0, source.shape[dim]),             (list(node.args[4:5]) + [1])[0]
        if not isinstance(step, int) or step < 1:
            raise NotFusible(f"a slice with step {step}")
        length = value.shape[dim]
        return self.strided(node.name, source.then(*views.slice_(source.shape, dim, start, step, length)), value,
                            f"slice(dim={dim})")

    def env_name(self, arg) -> str:
        """The value an fx argument names, past the in-place wrapper (views compose their maps)."""
        if not isinstance(arg, torch.fx.Node) or not isinstance(self.env[arg], str):
            raise NotFusible(f"argument {arg!r} is not a tensor")
        return self.env[arg]

    @staticmethod
    def index_expr(index, size):
        """A start or index as sympy, negative ones counted from the end."""
        expr = to_expr(index.meta["val"]) if isinstance(index, torch.fx.Node) else to_expr(index)
        if expr.is_number and expr < 0:
            expr = expr + size
        return expr

    def lower_split(self, node, val) -> tuple:
        """split_with_sizes (chunk, split): one strided read per part."""
        source = self.access(self.env_name(node.args[0]))
        dim = (node.args[2] if len(node.args) > 2 else 0) % len(source.shape)
        parts, start = [], sympy.Integer(0)
        for k, part in enumerate(val):
            value = classify(part)
            length = value.shape[dim]
            step = views.slice_(source.shape, dim, start, 1, length)
            name = self.strided(f"{node.name}_{k}", source.then(*step), value, f"split part {k} (dim={dim})")
            if start.is_Integer and sympy.sympify(length).is_Integer:   # aten's own view of the part
                self.aten_views[name] = AtenView(aten.narrow.default, (node.args[0], dim, int(start), int(length)),
                                                 {"val": part})
            parts.append(name)
            start = start + length
        return tuple(parts)

    def lower_cat(self, node, value: Value) -> str:
        """Each part read where its range along `dim` lies, over the parts before it. A part empty
        along `dim` holds nothing and is left out; where one part is left it is the whole result, a
        copy in registers like a clone (HuggingFace's partial-rotary code cats the rotated head dims
        with the rest, none at a rotary factor of 1: without this the rotated values are written
        to memory and copied again, both ways)."""
        rank = len(value.shape)
        dim = (node.args[1] if len(node.args) > 1 else 0) % rank
        parts = [(k, part) for k, part in enumerate(node.args[0])
                 if self.graph[self.env_name(part)].value.shape[dim] != 0]
        if len(parts) == 1 and parts[0][1].meta["val"].dtype == value.dtype:
            whole = self.operand(parts[0][1])
            if fits(self.graph[whole].value, value, Op.VIEW):
                return self.add(Op.VIEW, [whole], value, name=node.name)
        result, start = self.const(0, value.dtype), sympy.Integer(0)
        for k, part in parts:
            name = self.env_name(part)
            shape = self.graph[name].value.shape
            if len(shape) != rank or part.meta["val"].dtype != value.dtype:
                raise NotFusible("a cat of parts of other ranks or dtypes")
            end = start + shape[dim]
            window = tuple((start, end) if j == dim else None for j in range(rank))
            step = views.shift(rank, dim, start)
            computed = self.columns_in_registers(name, step, value, window, f"{node.name}_part{k}")
            if computed is not None:
                result = self.pointwise(Op.WHERE, [self.column_window(start, end, value), computed, result], value,
                                        f"{node.name}_part{k}")
            else:
                before, access = result, self.access(name).then(*step, value.shape)
                # a chain a slice can move: parts over a constant, or over such a chain
                movable = self.graph[before].op is Op.CONSTANT or self.movable_read(before) is not None
                result = self.strided(f"{node.name}_part{k}", access, value, f"cat part {k} (dim={dim})", window,
                                      before, movable=movable)
            start = end
        return result

    def lower_slice_scatter(self, node, value: Value) -> str:
        base, name = self.operand(node.args[0]), self.env_name(node.args[1])
        rank = len(value.shape)
        dim, start, end, step = (list(node.args[2:]) + [0, None, None, 1][len(node.args) - 2:])[:4]
        dim = dim % rank
        if step != 1:
            raise NotFusible(f"a slice_scatter with step {step}")
        start = self.index_expr(start or 0, value.shape[dim])
        if self.graph[name].value.shape[dim] == 0:
            return base        # nothing scattered (the gradient of a cat's empty part): the base itself
        if sympy.simplify(sympy.sympify(self.graph[name].value.shape[dim]) - value.shape[dim]) == 0:
            # the whole dim scattered (the backward of `x[...]` or `x[:]`, a slice of every index):
            # the source itself, so a join of parts (rewrite_joins) sees the window inside it
            return name
        end = start + self.graph[name].value.shape[dim]
        window = tuple((start, end) if j == dim else None for j in range(rank))
        shift = views.shift(rank, dim, start)
        computed = self.columns_in_registers(name, shift, value, window, node.name) \
            if self.graph[base].value.kind in (Kind.FULL, Kind.SCALAR) else None
        if computed is not None:
            return self.pointwise(Op.WHERE, [self.column_window(start, end, value), computed, base], value, node.name)
        return self.strided(node.name, self.access(name).then(*shift, value.shape), value,
                            f"slice_scatter(dim={dim})", window, base)

    def lower_constant_pad(self, node, value: Value) -> str:
        """F.pad's constant mode (HuggingFace pads the labels it shifts for a causal LM's loss): the
        source read at index i - before along each padded dim, where that lies inside it, the fill
        value elsewhere; a negative pad crops, a read with no window."""
        name, pads = self.env_name(node.args[0]), list(node.args[1])
        fill = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        shape = self.graph[name].value.shape
        rank = len(value.shape)
        if len(pads) % 2 or len(pads) > 2 * rank or not all(isinstance(p, int) for p in pads):
            raise NotFusible(f"a pad by {pads}: whole numbers, two a dim, expected")
        access, window = self.access(name), [None] * rank
        for k in range(len(pads) // 2):
            dim, before, after = rank - 1 - k, pads[2 * k], pads[2 * k + 1]
            if before == after == 0:
                continue
            access = access.then(*views.shift(rank, dim, before), value.shape)
            if before > 0 or after > 0:
                window[dim] = (before, before + shape[dim])
        if all(w is None for w in window):
            return self.strided(node.name, access, value, f"constant_pad_nd({pads}) crop")
        fill = self.const(fill, value.dtype)
        return self.strided(node.name, access, value, f"constant_pad_nd({pads})", tuple(window), fill, movable=True)


    def lower_select_backward(self, node, value: Value) -> str:
        grad = self.access(self.env_name(node.args[0]))
        rank = len(value.shape)
        dim = node.args[2] % rank
        index = self.index_expr(node.args[3], value.shape[dim])
        window = tuple((index, index + 1) if j == dim else None for j in range(rank))
        return self.strided(node.name, grad.then(*views.unselect(grad.shape, dim), value.shape), value,
                            f"select_backward(dim={dim})", window, self.const(0, value.dtype))
