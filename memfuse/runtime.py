"""runtime: run scheduled graphs. One Program per graph (forward, backward), one autograd.Function.

Everything a step needs is prepared once, when the program is built: the argument order of each
kernel, lambdas for sizes derived from the input shapes, output allocation shapes. A call only
reads the size symbols off the inputs, draws a seed, allocates, launches and finishes the
column sums.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

import sympy
import torch

from .codegen import CompiledKernel, generate
from .config import Config
from .debug import STATS
from .ir import Extern, Graph, Kind, Op, ValueRef
from .ops import OPS, REDUCERS, compute_dtype
from .schedule import ExternStep, KernelGroup, Schedule

log = logging.getLogger("memfuse")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _size_fn(exprs, symbols: list) -> Callable:
    """A plain Python function of the symbol values, built once (sympy is too slow per call)."""
    return sympy.lambdify(symbols, list(exprs) if isinstance(exprs, (list, tuple)) else exprs, "math")


@dataclass
class KernelLaunch:
    group: KernelGroup
    kernel: CompiledKernel
    rows: Optional[Callable]             # symbol values -> M
    alloc: list                          # (name, dtype, shape fn) for each written value
    finish: list                         # (reducer op, [(name, dtype, shape fn)])


@dataclass
class AtenGroup:
    group: KernelGroup
    rows: Optional[Callable]
    shapes: dict                         # name -> shape fn, for materialized values


@dataclass
class ExternCall:
    name: str
    target: object
    args: tuple
    kwargs: dict
    getitem: Optional[int] = None
    reshape: Optional[Callable] = None   # symbol values -> shape, for a view/cast of a finished value


class Program:
    """A scheduled graph, ready to run: `run(inputs, symbol_values) -> outputs`."""

    def __init__(self, schedule: Schedule, symbols: list, config: Config):
        self.graph = schedule.graph
        self.schedule = schedule
        self.symbols = symbols
        self.config = config
        g = self.graph
        self.constants = {n: node.attr.value for n, node in g.nodes.items() if node.op is Op.CONSTANT}
        self.size_scalars = [(n, _size_fn(node.attr.expr, symbols), node.value.dtype)
                             for n, node in g.nodes.items() if node.op is Op.SYMBOL]
        self.steps = [self._prepare(step) for step in schedule.steps]

    def _shape_fn(self, name: str) -> Callable:
        return _size_fn(self.graph[name].value.shape, self.symbols)

    def _rows_fn(self, group: KernelGroup) -> Optional[Callable]:
        return None if group.space.m is None else _size_fn(group.space.m, self.symbols)

    def _prepare(self, step):
        g = self.graph
        if isinstance(step, ExternStep):
            node = g[step.name]
            if node.op is Op.GETITEM:
                return ExternCall(step.name, None, (node.inputs[0],), {}, getitem=node.attr.index)
            if node.op in (Op.VIEW, Op.CAST):
                return ExternCall(step.name, node.value.dtype, (node.inputs[0],), {}, reshape=self._shape_fn(step.name))
            return ExternCall(step.name, node.attr.target, node.attr.args, dict(node.attr.kwargs))
        if step.aten_reason is not None:
            log.info("memfuse: %s runs through aten: %s", step.name, step.aten_reason)
            STATS["fallbacks"] += 1
            shapes = {n: self._shape_fn(n) for n in step.outputs + step.column_sums}
            return AtenGroup(step, self._rows_fn(step), shapes)
        kernel = generate(g, step, self.config)
        STATS["kernels_generated"] += 1
        alloc = [(n, g[n].value.dtype, self._shape_fn(n)) for n in step.outputs]
        finish = [(op, [(n, g[n].value.dtype, self._shape_fn(n)) for n in names])
                  for op, names in kernel.source.column_sums.items()]
        return KernelLaunch(step, kernel, self._rows_fn(step), alloc, finish)

    # -- running ---------------------------------------------------------------------------
    def run(self, inputs: list, symbol_values: tuple, device: torch.device) -> list:
        env = dict(self.constants)
        env.update(zip(self.graph.inputs, inputs))
        for name, fn, dtype in self.size_scalars:
            value = fn(*symbol_values)
            env[name] = float(value) if dtype.is_floating_point else int(value)
        for step in self.steps:
            if isinstance(step, KernelLaunch):
                self._launch(step, env, symbol_values, device)
            elif isinstance(step, ExternCall):
                self._extern(step, env, symbol_values)
            else:
                _run_aten_group(self.graph, step, env, symbol_values)
        return [env[o] if o is not None else None for o in self.graph.outputs]

    def _launch(self, step: KernelLaunch, env: dict, symbol_values: tuple, device) -> None:
        source = step.kernel.source
        rows = int(step.rows(*symbol_values)) if step.rows is not None else 1
        for name, dtype, shape in step.alloc:
            env[name] = torch.empty(shape(*symbol_values), dtype=dtype, device=device)
        # at least one tile: with M = 0 the column outputs (a weight grad of zeros) are still written
        tiles = max(1, _cdiv(rows, source.constexprs["BLOCK_M"]))
        programs = min(tiles, self._max_programs(device)) if source.persistent else tiles
        if step.group.space.m is None:
            programs = tiles = 1
        partials = {op: torch.empty((max(programs, 1), len(names), source.constexprs["D"]),
                                    dtype=torch.float32, device=device)
                    for op, names in step.finish}
        if programs > 0:
            args = []
            for arg in source.args:
                if arg.role == "read":
                    args.append(_contiguous(env[arg.value]))
                elif arg.role in ("write", "scalar"):
                    args.append(env[arg.value])
                elif arg.role == "partials":
                    args.append(partials[_reducer(arg.value)])
                elif arg.role == "rows":
                    args.append(rows)
                else:
                    args.append(_cdiv(tiles, programs))
            step.kernel.fn[(programs,)](*args, **source.constexprs)
            STATS["kernels_launched"] += 1
        for op, outputs in step.finish:
            _, neutral, reduce = REDUCERS[op]
            if programs > 0:
                totals = reduce(partials[op], 0) if op is not Op.SUM else partials[op].sum(0)
            else:
                totals = torch.full((len(outputs), source.constexprs["D"]), float(neutral.strip("float()'")),
                                    device=device)
            for j, (name, dtype, shape) in enumerate(outputs):
                env[name] = totals[j].to(dtype).reshape(shape(*symbol_values))

    def _max_programs(self, device: torch.device) -> int:
        if device.type == "cuda":
            return _sm_count(device) * self.config.programs_per_sm
        return self.config.cpu_programs

    def _extern(self, step: ExternCall, env: dict, symbol_values: tuple) -> None:
        if step.getitem is not None:
            env[step.name] = env[step.args[0]][step.getitem]
            return
        if step.reshape is not None:   # step.target holds the dtype
            env[step.name] = env[step.args[0]].reshape(step.reshape(*symbol_values)).to(step.target)
            return
        args = _resolve(step.args, env)
        kwargs = {k: _resolve(v, env) for k, v in step.kwargs.items()}
        env[step.name] = step.target(*args, **kwargs)
        STATS["extern_calls"] += 1


_SM_COUNTS: dict = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _reducer(name: str) -> Op:
    return Op(name)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _resolve(arg, env):
    if isinstance(arg, ValueRef):
        return env[arg.name]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_resolve(a, env) for a in arg)
    return arg


# -- groups the code generator declined, run op by op in the [M, D] layout ---------------------
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


def _run_aten_group(graph: Graph, step: AtenGroup, env: dict, symbol_values: tuple) -> None:
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
        if node.op is Op.RAND:
            raise NotImplementedError(f"memfuse: {name}: random values in a group that runs through aten "
                                      f"({group.aten_reason})")
        if node.op is Op.VIEW:
            result = read(node.inputs[0])
        elif node.op is Op.CAST:
            result = read(node.inputs[0]).to(node.attr.dtype)
            if result.dtype.is_floating_point:
                result = result.to(compute_dtype(result.dtype))
        elif node.op in REDUCERS:
            source = read(node.inputs[0]).to(torch.float32)
            dim = 1 if node.attr.axis is Kind.ROW else 0
            result = REDUCERS[node.op][2](source, dim, keepdim=True)
        else:
            result = OPS[node.op].torch(*[read(i) for i in node.inputs])
        local[name] = result
    for name, shape in step.shapes.items():
        value = local[name]
        full = torch.broadcast_to(value, _canonical_shape(graph[name].value.kind, rows, d))
        env[name] = full.to(graph[name].value.dtype).reshape(shape(*symbol_values)).contiguous()


def _canonical_shape(kind: Kind, rows: int, d: Optional[int]) -> tuple:
    return {Kind.FULL: (rows, d), Kind.ROW: (rows, 1), Kind.COL: (1, d)}.get(kind, ())


# -- autograd -----------------------------------------------------------------------------------
class CompiledFunction:
    """A plan made runnable: a forward Program, and a backward one when gradients are needed."""

    def __init__(self, plan, captured, config: Config, build_schedule):
        self.plan = plan
        self.symbol_order = list(captured.symbols)
        self.symbol_sources = [captured.symbols[s] for s in self.symbol_order]
        self.has_seed = captured.has_seed
        self.num_fwd_outputs = plan.num_fwd_outputs
        self.differentiable = captured.differentiable_outputs
        self.forward = Program(build_schedule(plan.forward, "forward"), self.symbol_order, config)
        self.backward = None if plan.backward is None else \
            Program(build_schedule(plan.backward, "backward"), self.symbol_order, config)

    def symbol_values(self, inputs) -> tuple:
        return tuple(inputs[i].shape[d] for i, d in self.symbol_sources)

    def run_forward(self, inputs: list):
        symbol_values = self.symbol_values(inputs)
        seed = [_draw_seed()] if self.has_seed else []
        outs = self.forward.run(list(inputs) + seed, symbol_values, inputs[0].device)
        return outs, symbol_values, seed

    def __call__(self, inputs: list):
        if self.backward is None:
            return tuple(self.run_forward(inputs)[0][:self.num_fwd_outputs])
        return _MemfuseFunction.apply(self, *inputs)


def _draw_seed() -> int:
    """From torch's CPU generator: `torch.manual_seed` reproduces a run, and no GPU sync."""
    return int(torch.randint(0, 2 ** 31 - 1, (), dtype=torch.int64))


class _MemfuseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compiled: CompiledFunction, *inputs):
        outs, symbol_values, seed = compiled.run_forward(list(inputs))
        n = compiled.num_fwd_outputs
        user_outputs, saved = outs[:n], outs[n:]
        ctx.save_for_backward(*saved)
        ctx.compiled, ctx.symbol_values, ctx.seed = compiled, symbol_values, seed
        ctx.device = inputs[0].device
        non_diff = [o for i, o in enumerate(user_outputs) if i not in compiled.differentiable]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return tuple(user_outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        compiled = ctx.compiled
        tangents = [_contiguous(grad_outputs[i]) for i in compiled.differentiable]
        grads = compiled.backward.run(list(ctx.saved_tensors) + ctx.seed + tangents, ctx.symbol_values, ctx.device)
        return (None, *grads)
