"""capture, the lowering: an AOTAutograd graph (aten, decomposed to primitives) to memfuse's IR,
node by node, through one table of rules (`RULES`: target -> rule, `default_rule` for the rest).

Each rule turns one fx node into IR nodes or raises NotFusible; that node then becomes an EXTERN
(an aten call) with the reason recorded. Random ops become RAND nodes fed by one seed. The rules
live by op family (rules_pointwise, rules_reduce, rules_views, rules_index), the fusion rewrites
that read a value again at a moved index each in a module of its own (rewrite_*).
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Optional

import torch

from memfuse.capture.fx_passes import composed_permutes, without_unused
from memfuse.capture.indexing import index_by_aranges
from memfuse.capture.merge import merge_stored_duplicates, merged_name
from memfuse.capture.rewrite_columns import ColumnsInRegisters
from memfuse.capture.rewrite_permutes import PermutesOfComputed
from memfuse.capture.rewrite_sums import SumsThroughViews
from memfuse.capture.rewrite_joins import JoinsOfPaddedParts
from memfuse.capture.rewrite_windows import SlicesOfWindows
from memfuse.capture.rules_index import IndexRules
from memfuse.capture.rules_pointwise import PointwiseRules
from memfuse.capture.rules_reduce import ReductionRules
from memfuse.capture.rules_views import ViewRules
from memfuse.capture.tables import (CAST_ATEN, DIVIDE_ATEN, EXTREME_ATEN, FILL_ATEN, NOOP_ATEN, POINTWISE_ATEN,
                                    RAND_ATEN, REDUCE_ATEN, RESHAPED_ATEN, STRIDED_ATEN, VIEW_ATEN, NotFusible,
                                    extern_reasons)
from memfuse.capture.values import classify, to_expr
from memfuse.ir.aten import ANY_STRIDES_ATEN, MATMUL_ATEN
from memfuse.ir.captured import Captured
from memfuse.ir.graph import (Constant, Extern, Graph, Index, Kind, Matmul, Node, Op, Symbol, Value, ValueRef, fits,
                              value_refs, verify)
from memfuse.ir.targets import TensorConstant
from memfuse.ir.patterns import RULES as EXTERN_RULES, Reads, called_op, rewrite_aten, rule as extern_rule

aten = torch.ops.aten


def lower_graph(gm: torch.fx.GraphModule, symbols: dict, hints: dict, *, num_primals: int,
                trace_joint: bool) -> Captured:
    """Lower an AOTAutograd graph traced elsewhere (memfuse.fronts.backend: Dynamo's), already decomposed
    with `decomposition_table()`: a joint graph (primals, tangents) or a forward-only one.
    `symbols` maps each size symbol to where a call reads it; `hints` gives its traced value."""
    return Lowering(gm, symbols, hints).run(num_primals=num_primals, trace_joint=trace_joint)


class Lowering(ViewRules, ColumnsInRegisters, SumsThroughViews, PermutesOfComputed, SlicesOfWindows, JoinsOfPaddedParts,
               PointwiseRules,
               ReductionRules, IndexRules):
    """The state of one lowering (the IR graph being built, the fx -> IR names, the strided reads)
    and its driver; the rules are the mixins', by family."""

    def __init__(self, gm: torch.fx.GraphModule, symbols: dict, hints: dict, strided_inputs=None):
        self.gm = gm
        # primal positions passed in with non-contiguous strides -> whether their last stride is 1
        self.strided_inputs = strided_inputs or {}
        self.last_stride_one: dict = {}   # non-contiguous input -> whether its last stride is 1
        self.reads: dict = {}          # every STRIDED node -> its rules_views.StridedRead
        self.in_place: dict = {}       # non-contiguous input -> the STRIDED node that reads it
        self.broadcasts: dict = {}     # (value, shape) -> the STRIDED node that reads it broadcast
        self.aten_views: dict = {}     # STRIDED node lowered from an aten view op -> its fx node
        self.size_symbols: dict = {}   # sympy expression -> SYMBOL node
        self.symbols = symbols
        self.hints = hints
        self.graph = Graph()
        self.env: dict = {}            # fx node -> value name (or tuple of names)
        self.constants: dict = {}
        self.fallbacks: list = []
        self.rng_streams = 0
        self.tensor_constants: dict = {}   # constant name -> the 0-d tensor it came from

    def run(self, num_primals: int, trace_joint: bool) -> Captured:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        rewritten, decisions = rewrite_aten(self.gm)      # the patterns' (memfuse.ir.patterns)
        if rewritten | composed_permutes(self.gm) | index_by_aranges(self.gm):
            without_unused(self.gm)          # the nodes nothing reads now
        for position, node in enumerate(placeholders):
            self.env[node] = self.graph.add(Node(node.name, Op.INPUT, (), classify(node.meta["val"])))
            self.graph.inputs.append(node.name)
            if position in self.strided_inputs and position < num_primals:
                self.in_place[node.name] = None   # wrapped on first use (operand)
                self.last_stride_one[node.name] = self.strided_inputs[position]
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                self.env[node] = self.lower(node)
            elif node.op == "get_attr":
                self.env[node] = self.lower_tensor_constant(node)
            elif node.op == "output":
                outs = node.args[0]
                self.graph.outputs = [self.env[o] if o is not None else None for o in outs]
        self.graph, merged = merge_stored_duplicates(self.graph)
        self.env = {fx: merged_name(name, merged) for fx, name in self.env.items()}
        self.keep_aten_views()
        has_seed = self.rng_streams > 0
        if has_seed:   # the seed sits between primals and tangents in the call order
            self.graph.inputs.insert(num_primals, "seed")
        num_tangents = len(placeholders) - num_primals
        verify(self.graph)
        # a joint trace whose outputs need no gradient (ints, bools) holds the forward only
        has_grads = trace_joint and num_tangents > 0
        return Captured(self.graph, num_primals, num_tangents,
                        len(self.graph.outputs) - (num_primals if has_grads else 0),
                        self.symbols, self.hints, has_seed, self.fallbacks, merged=merged,
                        decisions=decisions)

    # -- helpers ---------------------------------------------------------------------
    def add(self, op: Op, inputs, value: Value, attr=None, name: Optional[str] = None) -> str:
        base = name or op.value
        unique, k = base, 0
        while unique in self.graph.nodes:
            k += 1
            unique = f"{base}_{k}"
        return self.graph.add(Node(unique, op, tuple(inputs), value, attr))

    def const(self, value, dtype: Optional[torch.dtype] = None) -> str:
        """A scalar constant; with `dtype`, the value rounded to it as a 0-d tensor of that dtype."""
        if dtype is None:
            dtype = torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) \
                else torch.float32
        else:
            value = torch.tensor(value, dtype=dtype).item()
        key = (type(value), value, dtype)
        if key not in self.constants:
            self.constants[key] = self.add(Op.CONSTANT, (), Value(dtype, Kind.SCALAR), Constant(value),
                                           name="const")
        return self.constants[key]

    def operand(self, arg) -> str:
        """The value name of an fx argument: a traced value, a Python number, or a size."""
        if isinstance(arg, torch.fx.Node):
            name = self.env[arg]
            if isinstance(name, str) and name in self.in_place:
                return self.read_in_place(name)
            return name
        if isinstance(arg, (bool, int, float)):
            return self.const(arg)
        raise NotFusible(f"argument {arg!r} is not a tensor or number")

    def seed(self) -> str:
        if "seed" not in self.graph.nodes:
            self.graph.add(Node("seed", Op.SEED, (), Value(torch.int64, Kind.SCALAR)))
        return "seed"

    def check_fits(self, op: Op, inputs, value: Value) -> None:
        for inp in inputs:
            if not fits(self.graph[inp].value, value, op):
                raise NotFusible(f"{self.graph[inp].value.kind.value} input {inp} does not fit a "
                                 f"{value.kind.value} result in one [M, D] space")

    def pointwise(self, op: Op, inputs, value: Value, name: str) -> str:
        inputs = [self.broadcast(i, value) for i in inputs]
        self.check_fits(op, inputs, value)
        return self.add(op, inputs, value, name=name)

    # -- lowering rules ----------------------------------------------------------------
    def lower(self, node: torch.fx.Node):
        val = node.meta.get("val")
        if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)):
            return self.lower_symbol(node, val)
        try:
            name = self.lower_tensor_op(node, val)
        except NotFusible as reason:
            return self.lower_extern(node, val, str(reason))
        if getattr(node.target, "is_view", False) and name == node.name and \
                self.graph[name].op in (Op.STRIDED, Op.VIEW):
            self.aten_views[name] = node
        return name

    def lower_symbol(self, node, val) -> str:
        expr = to_expr(val) if not isinstance(val, (torch.SymBool, bool)) else None
        if expr is None:
            raise NotImplementedError(f"memfuse: boolean size expression {node.format_node()}")
        if expr.free_symbols:
            dtype = torch.float32 if isinstance(val, (torch.SymFloat, float)) else torch.int64
            return self.add(Op.SYMBOL, (), Value(dtype, Kind.SCALAR), Symbol(expr), name=node.name)
        number = float(expr) if isinstance(val, (torch.SymFloat, float)) else int(expr)
        return self.const(number)


    def lower_tensor_op(self, node, val):
        return RULES.get(node.target, default_rule)(self, node, val)

    def lower_getitem(self, node, val):
        source = self.env[node.args[0]]
        if isinstance(source, tuple):
            return source[node.args[1]]
        return self.add(Op.GETITEM, (source,), classify(val), Index(node.args[1]), name=node.name)

    def lower_tensor_constant(self, node) -> str:
        """A tensor the function closed over: a scalar constant when it has one element,
        else an extern step that hands the tensor out."""
        tensor = getattr(self.gm, node.target)
        value = classify(tensor)
        if value.kind is Kind.SCALAR and tensor.dim() == 0 and tensor.dtype in (
                torch.float32, torch.bool, torch.int64, torch.int32):
            name = self.const(tensor.item(), tensor.dtype)
            self.tensor_constants[name] = tensor
            return name
        return self.add(Op.EXTERN, [], value, Extern(TensorConstant(tensor), (), ()), name=node.name)

    def keep_aten_views(self) -> None:
        """A view that only aten calls read, and read in any strides (a transposed weight for mm;
        attention's query, key, value and gradients, whose last dim stays in place), stays an
        aten view: a strided read is a kernel that copies it, aten reads it where it lies. An
        `aten.view` of it becomes `aten.reshape`, which copies only where the strides need it
        (attention's output, laid out as its query, needs none). A custom op (Reads.AS_TRACED) takes
        a strided view as aten made it, the strides eager hands it. Not a fallback. A reshape (VIEW)
        stays one only for ops registered as reading any strides (memfuse.ir.patterns): a matmul operand's reshape is the producing
        kernel's to write (padding.py)."""
        users = self.graph.users()
        outputs = set(self.graph.outputs)
        for name in reversed([n for n in self.aten_views if n in self.graph.nodes]):   # a view of such a view first
            readers = [self.graph[u] for u in users[name]]
            strided = self.graph[name].op is Op.STRIDED
            registered = {op for op, r in EXTERN_RULES.items() if r.reads is Reads.ANY_STRIDES}
            in_any_strides = ANY_STRIDES_ATEN | registered if strided else registered
            if self.last_dim_in_place(name if strided else self.graph[name].inputs[0]):
                in_any_strides = in_any_strides | {op for op, r in EXTERN_RULES.items()
                                                   if r.reads is Reads.LAST_DIM_IN_PLACE} \
                    | (RESHAPED_ATEN if strided else set())
            if not readers or name in outputs or any(
                    r.op is not Op.EXTERN or (called_op(r.attr.target) not in in_any_strides
                                              and not (strided and extern_rule(r.attr.target).reads is Reads.AS_TRACED))
                    for r in readers):
                continue
            for r in readers:
                if r.attr.target in RESHAPED_ATEN:
                    self.graph.nodes[r.name] = Node(r.name, r.op, r.inputs, r.value,
                                                    dataclasses.replace(r.attr, target=aten.reshape.default))
            node = self.aten_views[name]
            inputs, value, attr = self.extern_call(node, node.meta["val"])
            if not strided and any(extern_rule(r.attr.target).reads is Reads.LAST_DIM_IN_PLACE for r in readers):
                attr = dataclasses.replace(attr, target=aten.reshape.default)   # of a view kept in its strides
            self.graph.nodes[name] = Node(name, Op.EXTERN, tuple(inputs), value, attr)
            for inp in inputs:
                users[inp].append(name)

    def last_dim_in_place(self, name: str) -> bool:
        """Whether view `name` keeps its root's last dim last, stride 1 (attention reads it so)."""
        m = self.plain_view(name)
        if m is None or not m.last_stride_one or not m.shape or not m.coeffs:
            return False
        last = len(m.shape) - 1       # the view's last index moves the root's last by 1, no other
        return m.coeffs[-1][last] == 1 and all(row[last] == 0 for row in m.coeffs[:-1])

    def lower_extern(self, node, val, reason: str) -> str:
        self.fallbacks.append((node.name, str(node.target), reason))
        return self.add(Op.EXTERN, *self.extern_call(node, val), name=node.name)

    def extern_call(self, node, val) -> tuple:
        """(inputs, value, Extern) of `node` as an aten call on the lowered values."""
        def ref(arg):
            if isinstance(arg, torch.fx.Node):
                name = self.env[arg]
                if isinstance(name, tuple):
                    raise NotImplementedError(f"memfuse: extern {node.target} reads a lowered tuple")
                if name in self.tensor_constants:   # aten wants the tensor, not its value
                    return self.tensor_constants[name]
                return ValueRef(name)
            if isinstance(arg, (list, tuple)):
                return type(arg)(ref(a) for a in arg)
            return arg
        args = tuple(ref(a) for a in node.args)
        kwargs = tuple((k, ref(v)) for k, v in node.kwargs.items())
        inputs = value_refs(args) + value_refs(tuple(v for _, v in kwargs))
        value = classify(val) if isinstance(val, torch.Tensor) else Value(None, Kind.TENSOR)
        if node.target in MATMUL_ATEN and isinstance(val, torch.Tensor):   # the device decides padding
            return list(dict.fromkeys(inputs)), value, Matmul(node.target, args, kwargs, val.device.type)
        return list(dict.fromkeys(inputs)), value, Extern(node.target, args, kwargs)




# -- the dispatch: target -> rule(lowering, fx node, traced value) ----------------------------------
def tensor_rule(rule: Callable) -> Callable:
    """A rule for a node with one tensor result in the [M, D] space: `rule(lowering, node, value)`
    with the result placed (classify); another result is an extern with the reason."""
    def checked(lowering: Lowering, node, val):
        if not isinstance(val, torch.Tensor):
            raise NotFusible(extern_reasons().get(node.target, "produces a tuple"))
        value = classify(val)
        if value.kind is Kind.TENSOR:
            raise NotFusible(f"shape {tuple(val.shape)} is outside the [M, D] space")
        return rule(lowering, node, value)
    return checked


@tensor_rule
def default_rule(lowering: Lowering, node, value: Value):
    raise NotFusible(extern_reasons().get(node.target, f"no lowering for {node.target}"))


def _view_or_strided(lowering: Lowering, node, value: Value) -> str:
    """A permute or slice that keeps every element in place is a view; other moves read in place."""
    if lowering.keeps_order(node):
        return lowering.lower_view(node, value)
    return lowering.lower_strided(node, value)


def _rules() -> dict:
    """Each target's rule; where a target is in several families, the first listed here wins."""
    families = [
        ({operator.getitem}, Lowering.lower_getitem),
        (NOOP_ATEN, lambda lowering, node, val: None),
        ({aten.var_mean.correction, aten.var.correction}, Lowering.lower_var_mean),
        (EXTREME_ATEN, Lowering.lower_extreme),
        ({aten.split_with_sizes.default}, Lowering.lower_split),
        (POINTWISE_ATEN, tensor_rule(lambda lowering, node, value: lowering.lower_pointwise(
            node, POINTWISE_ATEN[node.target], value))),
        (DIVIDE_ATEN, tensor_rule(Lowering.lower_divide)),
        ({aten.relu.default}, tensor_rule(Lowering.lower_relu)),
        ({aten.clamp.default, aten.clamp.Tensor}, tensor_rule(Lowering.lower_clamp)),
        ({aten.pow.Tensor_Scalar}, tensor_rule(Lowering.lower_pow)),
        (VIEW_ATEN, tensor_rule(Lowering.lower_view)),
        (STRIDED_ATEN, tensor_rule(_view_or_strided)),
        (CAST_ATEN, tensor_rule(Lowering.lower_cast)),
        (FILL_ATEN, tensor_rule(Lowering.lower_fill)),
        (RAND_ATEN, tensor_rule(Lowering.lower_rand)),
        (REDUCE_ATEN, tensor_rule(lambda lowering, node, value: lowering.lower_reduction(
            node, REDUCE_ATEN[node.target], value))),
        ({aten.any.dim}, tensor_rule(Lowering.lower_any)),
        ({aten.scatter.src, aten.scatter.value}, tensor_rule(Lowering.lower_scatter)),
        ({aten.gather.default}, tensor_rule(Lowering.lower_gather)),
        ({aten.mean.dim, aten.mean.default}, tensor_rule(Lowering.lower_mean)),
        ({aten.polygamma.default}, tensor_rule(Lowering.lower_polygamma)),
    ]
    rules: dict = {}
    for targets, rule in families:
        for target in targets:
            rules.setdefault(target, rule)
    return rules


RULES = _rules()
