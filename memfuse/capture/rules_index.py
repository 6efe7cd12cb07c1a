"""Lowering rules for data-dependent addressing along D: scatter and gather with one index per row
of an [M, D] value, fused where every index is known to lie in [0, D) (`index_in_range`) or is
checked in the same call (an IndexCheck)."""
from __future__ import annotations

from typing import Optional

import sympy
import torch

from memfuse.capture.tables import EXTERN_REASONS, NotFusible
from memfuse.capture.values import shape_text
from memfuse.ir import views
from memfuse.ir.graph import BINARY, UNARY, Extern, Graph, Kind, Node, Op, Reduce, Value, ValueRef
from memfuse.ir.targets import IndexCheck

aten = torch.ops.aten


class IndexRules:
    """The scatter and gather rules of memfuse.capture.lower.Lowering (a mixin: the state is the
    Lowering's)."""

    def lower_scatter(self, node, value: Value) -> str:
        """scatter(self, -1, index, src) and scatter(self, -1, index, value) with one index per
        row: where(column == index, src, self), when every index is known to lie in [0, D)
        (`index_in_range`: an argmax/argmin over rows of D, or an index a gather over rows of D
        checked, as nll_loss's backward scatters its one-hot at the targets its forward gathered).
        Any other index could be out of range, which eager reports: that stays an extern."""
        base, dim, index, src = (self.operand(a) if isinstance(a, torch.fx.Node) else a for a in node.args[:4])
        if value.kind is not Kind.FULL or dim % len(value.shape) != len(value.shape) - 1 \
                or self.graph[index].value.kind is not Kind.ROW or not index_in_range(self.graph, index, value.d):
            raise NotFusible(EXTERN_REASONS[node.target])
        if not isinstance(src, str):     # scatter.value: a number
            src = self.const(src, value.dtype)
        if self.graph[src].value.kind not in (Kind.ROW, Kind.SCALAR):
            # row i takes src[i][0], the element beside its one index, not src[i][index]
            raise NotFusible(f"a scatter of a {self.graph[src].value.kind.value} source: one index per row "
                             "takes the row's first source element")
        full_bool = Value(torch.bool, Kind.FULL, value.shape, value.m, value.d)
        self.check_fits(Op.EQ, [index], full_bool)
        column = self.add(Op.IOTA, [], Value(torch.int64, Kind.COL, (sympy.Integer(value.d),), d=value.d),
                          name=f"{node.name}_column")
        hit = self.pointwise(Op.EQ, [column, index], full_bool, f"{node.name}_hit")
        return self.pointwise(Op.WHERE, [hit, src, base], value, node.name)

    def lower_gather(self, node, value: Value) -> str:
        """gather(x, -1, index) with one index per row of a FULL x: the row's sum of
        where(column == index, x, 0), a row reduction fused into the kernel that computes x, so
        x need not be written (cross-entropy picks the target's log-probability this way). The
        index is computed in that kernel too where it is an elementwise function of one tensor
        in memory (`index_in_rows`). aten's gather raises on an index outside [0, D): unless
        `index_in_range` knows it is inside, an IndexCheck of the index runs in the same call
        and its 0 is added to the picked values (the result waits for the check)."""
        source, dim, index = (self.operand(a) if isinstance(a, torch.fx.Node) else a for a in node.args[:3])
        x, picks = self.graph[source].value, self.graph[index].value
        if node.kwargs.get("sparse_grad", False) or not isinstance(dim, int) or x.kind is not Kind.FULL \
                or dim % len(x.shape) != len(x.shape) - 1 or picks.kind is not Kind.ROW \
                or len(picks.shape) != len(x.shape) or not all(views.same(a, b) for a, b in zip(picks.shape, x.shape[:-1])):
            raise NotFusible(EXTERN_REASONS[node.target])
        if x.dtype == torch.bool:
            raise NotFusible("a gather of booleans: the pick is a row sum")
        checked = index_in_range(self.graph, index, x.d)
        column = self.add(Op.IOTA, [], Value(torch.int64, Kind.COL, (sympy.Integer(x.d),), d=x.d),
                          name=f"{node.name}_column")
        hit = self.pointwise(Op.EQ, [column, self.index_in_rows(index, picks) or index],
                             Value(torch.bool, Kind.FULL, x.shape, x.m, x.d), f"{node.name}_hit")
        picked = self.pointwise(Op.WHERE, [hit, source, self.const(0, x.dtype)], Value(x.dtype, Kind.FULL, x.shape, x.m, x.d),
                                f"{node.name}_picked")
        if checked:
            return self.add(Op.SUM, [picked], value, Reduce(Kind.ROW), name=node.name)
        picks_sum = self.add(Op.SUM, [picked], value, Reduce(Kind.ROW), name=f"{node.name}_sum")
        return self.pointwise(Op.ADD, [picks_sum, self.index_check(node, index, x.d, value.dtype)], value, node.name)

    def index_check(self, node, index: str, width: int, dtype: torch.dtype) -> str:
        """An extern IndexCheck of the tensor `index` reads (through reads that keep every
        element: a check of the same values): a 0 of `dtype`."""
        checked = _through_reads(self.graph, index, covering=True)
        return self.add(Op.EXTERN, [checked], Value(dtype, Kind.SCALAR, ()),
                        Extern(IndexCheck(width, dtype), (ValueRef(checked),), ()), name=f"{node.name}_check")

    def index_in_rows(self, index: str, rows: Value) -> Optional[str]:
        """`index` rebuilt as ROW values over reads of the tensor in memory it is an elementwise
        function of (cross-entropy's where(t != ignore, t, 0), unsqueezed), so the kernel of the
        rows computes it instead of reading it from a kernel of another space; None where it is
        not such a function. Only order-keeping steps (VIEW nodes, same element count) are looked
        through, so the rebuilt read visits the tensor's elements in the index's order."""
        node = self.graph[index]
        if node.op is Op.STRIDED and node.attr.window is None and not node.attr.summed \
                and _reads_each_once(self.graph, node) and views.reshape(self.graph[node.inputs[0]].value.shape,
                                                                     rows.shape) is not None:
            return self.elementwise_in_rows(node.inputs[0], rows)
        return None

    def elementwise_in_rows(self, name: str, rows: Value) -> Optional[str]:
        node = self.graph[name]
        if node.value.kind is Kind.SCALAR or node.op in (Op.CONSTANT, Op.SYMBOL):
            return name
        if not views.same(sympy.Mul(*node.value.shape), sympy.Mul(*rows.shape)):
            return None
        if node.op is Op.VIEW:
            return self.elementwise_in_rows(node.inputs[0], rows)
        value = Value(node.value.dtype, rows.kind, rows.shape, rows.m, rows.d)
        if node.op in UNARY | BINARY | {Op.WHERE}:
            inputs = [self.elementwise_in_rows(i, rows) for i in node.inputs]
            return None if None in inputs else self.add(node.op, inputs, value, node.attr, name=f"{name}_rows")
        if node.op in (Op.INPUT, Op.EXTERN, Op.GETITEM):
            step = views.reshape(node.value.shape, rows.shape)
            source = self.access(name)
            return None if step is None else self.strided(f"{name}_rows", source.then(*step, rows.shape), value,
                                                          f"view{shape_text(rows.shape)}")
        return None


# -- index ranges: when a scatter's index is known to lie in [0, D) ------------------------------
def index_in_range(graph: Graph, index: str, width: int) -> bool:
    """Whether every value of `index` lies in [0, width): it is an argmax/argmin over rows of
    `width`, or the same elementwise function of the same tensor as an index checked against
    `width` in this graph: by an IndexCheck (a fused gather's) or by an aten gather over rows of
    `width` (each raises on an index outside; AOTAutograd's graphs hold no dead code, so the
    check runs in the same call, in the forward: cross-entropy's forward gathers the target
    logit at where(t != ignore, t, 0), its backward scatters the one-hot at the same values)."""
    origin = index
    while graph[origin].op is Op.VIEW:
        origin = graph[origin].inputs[0]
    producer = graph[origin]
    if producer.op in (Op.ARGMAX, Op.ARGMIN) and graph[producer.inputs[0]].value.d == width:
        return True
    mine = elementwise_of_one(graph, index, covering=False)
    return mine is not None and any(elementwise_of_one(graph, checked, covering=True) == mine
                                    for checked in _checked_indices(graph, width))


def _checked_indices(graph: Graph, width: int):
    """The index tensors that an IndexCheck or an aten gather over rows of `width` checks."""
    for node in graph.nodes.values():
        if node.op is not Op.EXTERN:
            continue
        if isinstance(node.attr.target, IndexCheck) and node.attr.target.width == width:
            yield node.attr.args[0].name
        elif node.attr.target is aten.gather.default:
            source, dim, checked = node.attr.args[:3]
            if not (isinstance(source, ValueRef) and isinstance(checked, ValueRef) and isinstance(dim, int)):
                continue
            shape = graph[source.name].value.shape
            if shape and dim % len(shape) == len(shape) - 1 and shape[-1] == width:
                yield checked.name


def elementwise_of_one(graph: Graph, name: str, covering: bool) -> Optional[tuple]:
    """(root, expression) when `name` is a pointwise function, element by element, of one tensor
    read in one way (the `entry`: a read of `root`) and of scalars; else None. Reads (VIEW,
    STRIDED without a window or sums) above the expression and at its entry are looked through:
    every value `name` holds is then the expression of a value `root` holds. With `covering`, only
    reads that keep every element of their source are looked through, so the converse holds too."""
    entries, roots = set(), set()

    def form(n: str):
        node = graph[n]
        if node.op in UNARY | BINARY | {Op.WHERE}:
            return (node.op, node.attr, node.value.dtype, tuple(form(i) for i in node.inputs))
        root = _through_reads(graph, n, covering)
        if graph[root].op in (Op.CONSTANT, Op.SYMBOL):
            return (graph[root].op, graph[root].attr)
        entries.add(n)
        roots.add(root)
        return ("entry",)

    expression = form(_through_reads(graph, name, covering))
    return (roots.pop(), expression) if len(entries) == 1 else None


def _through_reads(graph: Graph, name: str, covering: bool) -> str:
    while True:
        node = graph[name]
        plain_read = node.op is Op.STRIDED and node.attr.window is None and not node.attr.summed
        if node.op is Op.VIEW or plain_read and (not covering or _reads_each_once(graph, node)):
            name = node.inputs[0]
        else:
            return name


def _reads_each_once(graph: Graph, node: Node) -> bool:
    """A STRIDED read that visits every element of its root once: a permute, or a reshape that
    adds or drops size-1 dims (each root dim of size > 1 is one value dim of the same size)."""
    value_shape, root_shape = node.value.shape, graph[node.inputs[0]].value.shape
    used = set()
    for j, (coefficients, constant) in enumerate(node.attr.index):
        if views.same(root_shape[j], 1):
            continue
        hits = [k for k, c in enumerate(coefficients) if not (isinstance(c, int) and c == 0)]
        if constant != 0 or len(hits) != 1 or hits[0] in used or hits[0] >= len(value_shape):
            return False
        k = hits[0]
        unit = isinstance(coefficients[k], int) and coefficients[k] == 1
        if not unit or not views.same(value_shape[k], root_shape[j]):
            return False
        used.add(k)
    return all(views.same(value_shape[k], 1) for k in range(len(value_shape)) if k not in used)
