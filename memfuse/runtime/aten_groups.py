"""Groups the code generator declined, run op by op in torch in the [M, D] layout: `AtenGroup`."""
from __future__ import annotations

from typing import Callable, Optional

import torch

from memfuse.ir.graph import Graph, Kind, Op, ValueRef
from memfuse.ir.ops import OPS, REDUCERS, accumulate_dtype, compute_dtype
from memfuse.schedule.steps import KernelGroup


class AtenGroup:
    """A group the code generator declined, run op by op: `(inputs, symbol values, device) -> outputs`."""

    def __init__(self, graph: Graph, group: KernelGroup, rows: Optional[Callable], shapes: dict, view_shapes: dict):
        self.graph = graph
        self.group = group
        self.rows = rows
        self.shapes = shapes             # name -> shape fn, for materialized values
        self.view_shapes = view_shapes   # STRIDED node -> shape fn

    def __call__(self, inputs: dict, symbol_values: tuple, device) -> list:
        return _run_aten_group(self.graph, self, inputs, symbol_values, device)


def _canonical(t, kind: Kind, rows: int, d: Optional[int]):
    if not isinstance(t, torch.Tensor):
        return t
    if kind is Kind.FULL:
        return t.reshape(rows, d)
    if kind is Kind.ROW:
        return t.reshape(rows, 1)
    if kind is Kind.COL:
        return t.reshape(1, -1)
    return t.reshape(())


def _run_aten_group(graph: Graph, step: AtenGroup, env: dict, symbol_values: tuple, device) -> list:
    group = step.group
    rows = int(step.rows(*symbol_values)) if step.rows is not None else 1
    d = group.space.d
    local = {}

    def read(name):
        if name in local:
            return local[name]
        node = graph[name]
        value = env[name]
        if isinstance(value, torch.Tensor):
            value = _canonical(value, node.value.kind, rows, d)
            if value.dtype.is_floating_point:
                value = value.to(compute_dtype(value.dtype))
        return value

    for name in group.nodes:
        node = graph[name]
        if node.op is Op.RAND and rows * d != 0:
            raise NotImplementedError(f"memfuse: {name}: random values in a group that runs through aten "
                                      f"({group.aten_reason})")
        if node.op is Op.RAND:   # no elements (rows of length 0): no random values to draw
            result = torch.empty(rows, d, dtype=compute_dtype(node.value.dtype), device=device)
        elif node.op is Op.VIEW:
            result = read(node.inputs[0])
        elif node.op is Op.IOTA:   # the column index (a cat's window, a scatter's hit)
            result = torch.arange(node.value.d, dtype=torch.int64, device=device).view(1, -1)
        elif node.op is Op.STRIDED and node.inputs[0] in local:   # a padded store: zero columns appended
            value = torch.broadcast_to(local[node.inputs[0]], (rows, d))
            result = torch.nn.functional.pad(value, (0, node.value.d - d))
        elif node.op is Op.STRIDED:
            shape = step.view_shapes[name](*symbol_values)
            values, inside = (_canonical(t, node.value.kind, rows, d)
                              for t in _read_view(node, env[node.inputs[0]], shape, env))
            if values.dtype.is_floating_point:
                values = values.to(compute_dtype(values.dtype))
            fallback = read(node.inputs[1]) if node.attr.has_fallback else torch.zeros((), dtype=values.dtype, device=values.device)
            result = torch.where(inside, values, fallback)
        elif node.op is Op.CAST:
            result = read(node.inputs[0]).to(node.attr.dtype)
            if result.dtype.is_floating_point:
                result = result.to(compute_dtype(result.dtype))
        elif node.op in REDUCERS:
            source = read(node.inputs[0])
            source = source.to(accumulate_dtype(source.dtype))
            dim = 1 if node.attr.axis is Kind.ROW else 0
            result = REDUCERS[node.op][2](source, dim, keepdim=True)
        else:
            result = OPS[node.op].torch(*[read(i) for i in node.inputs])
        local[name] = result
    results = []
    for name, shape in step.shapes.items():
        value = local[name]
        if not isinstance(value, torch.Tensor):   # a fill with a constant (zeros under a scatter)
            value = torch.tensor(value, dtype=graph[name].value.dtype, device=device)
        kind = graph[name].value.kind
        full = torch.broadcast_to(value, _canonical_shape(kind, rows, graph[name].value.d if kind is Kind.FULL else d))
        results.append(full.to(graph[name].value.dtype).reshape(shape(*symbol_values)).contiguous())
    return results


def _read_view(node, root: torch.Tensor, shape, env: dict) -> tuple:
    """A STRIDED node's (values, inside its window) by index arithmetic in torch (ir.Strided);
    the summed dims are indexed after the value's, then added up."""
    a = node.attr

    def entry(e):
        return int(env[e.name]) if isinstance(e, ValueRef) else e
    value_shape = [int(n) for n in shape]
    shape = value_shape + [entry(n) for n in a.summed]
    grids = torch.meshgrid(*[torch.arange(n, device=root.device) for n in shape], indexing="ij") if shape else []
    flat = torch.zeros(shape, dtype=torch.int64, device=root.device)
    inside = torch.ones(value_shape, dtype=torch.bool, device=root.device)
    for k, w in enumerate(a.window or ()):
        if w is not None:
            inside &= (grids[k] >= entry(w[0])) & (grids[k] < entry(w[1]))
    dense = root.contiguous()
    for j, (coeffs, const) in enumerate(a.index):
        index = sum((entry(c) * g for c, g in zip(coeffs, grids)), torch.zeros_like(flat)) + entry(const)
        flat += index * dense.stride(j)
    if dense.numel() == 0:
        values = torch.zeros(shape, dtype=root.dtype, device=root.device)
    elif a.summed:
        values = dense.reshape(-1)[flat]
    else:
        values = dense.reshape(-1)[torch.where(inside, flat, 0)]
    if a.summed:
        dtype = accumulate_dtype(node.value.dtype) if node.value.is_floating else node.value.dtype
        values = values.to(dtype).sum(tuple(range(len(value_shape), len(shape))))
    return values, inside


def _canonical_shape(kind: Kind, rows: int, d: Optional[int]) -> tuple:
    return {Kind.FULL: (rows, d), Kind.ROW: (rows, 1), Kind.COL: (1, d)}.get(kind, ())

