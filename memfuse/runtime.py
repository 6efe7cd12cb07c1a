"""runtime: run scheduled graphs. One Program per graph (forward, backward), one autograd.Function.

Everything a step needs is prepared once, when the program is built: the argument order of each
kernel, lambdas for sizes derived from the input shapes, output allocation shapes. A call only
reads the size symbols off the inputs, draws a seed, allocates, launches and finishes the
column sums.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import sympy
import torch
from triton import knobs

from .codegen import CompiledKernel, generate
from .config import Config
from .debug import STATS
from .ir import Graph, Kind, Op, ValueRef
from .ops import OPS, REDUCERS, accumulate_dtype, compute_dtype
from .schedule import ExternStep, KernelGroup, Schedule
from .tuning import LaunchConfig, TuningCache, cpu_config, default_config

log = logging.getLogger("memfuse")


# torch's integer sympy functions (sizes traced under Dynamo hold them, e.g. FloorDiv(s0, 2)).
SIZE_FUNCTIONS = {
    "FloorDiv": lambda a, b: a // b, "CleanDiv": lambda a, b: a // b, "CeilDiv": lambda a, b: -(-a // b),
    "ModularIndexing": lambda x, div, mod: (x // div) % mod, "PythonMod": lambda a, b: a % b,
    "Mod": lambda a, b: a % b, "IntTrueDiv": lambda a, b: a / b, "FloatTrueDiv": lambda a, b: a / b,
    "PowByNatural": lambda a, b: a ** b, "FloatPow": lambda a, b: a ** b, "CeilToInt": math.ceil,
    "FloorToInt": math.floor, "TruncToInt": math.trunc, "TruncToFloat": lambda x: float(math.trunc(x)),
    "RoundToInt": round, "ToFloat": float, "Identity": lambda x: x, "Max": max, "Min": min,
    "Where": lambda c, a, b: a if c else b,
}


def _size_fn(exprs, symbols: list) -> Callable:
    """A plain Python function of the symbol values, built once (sympy is too slow per call)."""
    return sympy.lambdify(symbols, list(exprs) if isinstance(exprs, (list, tuple)) else exprs,
                          [SIZE_FUNCTIONS, "math"])


NEUTRAL = {Op.SUM: 0.0, Op.MAX: float("-inf"), Op.MIN: float("inf")}


class KernelLaunch:
    """One generated kernel, with everything a call needs prepared."""

    def __init__(self, group: KernelGroup, kernel: CompiledKernel, rows: Optional[Callable],
                 alloc: list, finish: list, partials_dtypes: dict, config: Config):
        self.group = group
        self.kernel = kernel
        self.config = config
        self.rows = rows                 # symbol values -> M (None: a kernel without rows)
        self.alloc = alloc               # (name, dtype, shape fn) for each written value
        self.finish = finish             # (reducer op, [(name, cast dtype or None, shape fn or None)])
        self.persistent = kernel.source.persistent
        self.d = kernel.source.constexprs["D"]
        self.grids: dict = {}            # device -> (LaunchConfig, most programs)
        self.partials_dtypes = partials_dtypes   # reducer op -> dtype of its partials buffer
        self.build_args = _argument_builder(kernel.source.args)
        self.launcher = Launcher(kernel)
        self._partials: dict = {}
        self.configs: dict = {}          # device -> LaunchConfig

    def __call__(self, env: dict, symbol_values: tuple, device: torch.device) -> None:
        rows = self.rows(*symbol_values) if self.rows is not None else 1
        for name, dtype, shape in self.alloc:
            env[name] = torch.empty(shape(*symbol_values), dtype=dtype, device=device)
        grid = self.grids.get(device)
        if grid is None or grid[0] is not self.configs.get(device):
            grid = self._grid(device)
        config, most = grid
        # at least one tile: with M = 0 the column outputs (a weight grad of zeros) are still written
        tiles = max(1, -(-rows // config.block_m))
        programs = min(tiles, most) if self.persistent else tiles
        if self.rows is None:
            programs = tiles = 1
        partials = self.partials(programs, device) if self.finish else None
        if programs > 0:
            self.launcher(programs, self.build_args(env, partials, rows, -(-tiles // programs), _contiguous),
                          device, config)
            STATS["kernels_launched"] += 1
        for op, outputs in self.finish:
            if programs > 0:
                totals = partials[op].sum(0) if op is Op.SUM else REDUCERS[op][2](partials[op], 0)
            else:
                totals = torch.full((len(outputs), self.d), NEUTRAL[op], device=device)
            for j, (name, cast, shape) in enumerate(outputs):
                total = totals[j] if cast is None else totals[j].to(cast)
                env[name] = total if shape is None else total.reshape(shape(*symbol_values))

    def _grid(self, device: torch.device) -> tuple:
        config = self.launch_config(device, self.config)
        most = _sm_count(device) * config.programs_per_sm if device.type == "cuda" else self.config.cpu_programs
        self.grids[device] = (config, most)
        return config, most

    def launch_config(self, device: torch.device, config: Config) -> LaunchConfig:
        chosen = self.configs.get(device)
        if chosen is None:
            block_d = self.kernel.source.constexprs["BLOCK_D"]
            if device.type == "cuda":
                name = torch.cuda.get_device_name(device)
                chosen = TuningCache(config.cache_dir).get(name, Path(self.kernel.path).stem) or \
                    default_config(block_d, self.kernel.source.persistent)
            else:
                chosen = cpu_config(block_d, config.tile_elements)
            self.configs[device] = chosen
        return chosen

    def partials(self, programs: int, device: torch.device) -> dict:
        """[programs, n, D] fp32 buffers, reused across calls: the finishing sum that reads
        them is queued on the same stream before the next launch can overwrite them."""
        key = (programs, device)
        buffers = self._partials.get(key)
        if buffers is None:
            d = self.kernel.source.constexprs["D"]
            buffers = {op: torch.empty((max(programs, 1), len(names), d), device=device,
                                       dtype=self.partials_dtypes[op])
                       for op, names in self.finish}
            self._partials[key] = buffers
        return buffers


def _argument_builder(args: list) -> Callable:
    """A function that lists a kernel's arguments from the environment: written out once as
    Python, so a call walks no argument roles."""
    items = []
    namespace: dict = {}
    for a in args:
        if a.role == "read":
            items.append(f"contiguous(env[{a.value!r}])")
        elif a.role == "in_place":      # an input read by its own strides: no copy
            items.append(f"env[{a.value!r}]")
        elif a.role == "stride":        # of the tensor as the kernel reads it (made contiguous or not)
            in_place = any(b.role == "in_place" and b.value == a.value for b in args)
            tensor = f"env[{a.value!r}]" if in_place else f"contiguous(env[{a.value!r}])"
            items.append(f"{tensor}.stride({a.dim})")
        elif a.role in ("write", "scalar"):
            items.append(f"env[{a.value!r}]")
        elif a.role == "partials":
            namespace[f"reduce_{a.value}"] = Op(a.value)
            items.append(f"partials[reduce_{a.value}]")
        else:
            items.append("rows" if a.role == "rows" else "tiles_per_program")
    source = f"def build_args(env, partials, rows, tiles_per_program, contiguous):\n    return [{', '.join(items)}]\n"
    exec(compile(source, "<memfuse argument builder>", "exec"), namespace)
    return namespace["build_args"]


class Launcher:
    """Launches a @triton.jit kernel, skipping Triton's generic launch path once compiled.

    Triton's `kernel[grid](...)` re-binds and re-specializes every argument on each call (10-40 us
    on a GPU host). Every scalar of a memfuse kernel is `do_not_specialize`, so the only
    specialization left is the 16-byte alignment of the pointers: the compiled kernel is kept per
    alignment pattern and called directly. The interpreter, and any launch hook a profiler
    installs, take the generic path."""

    def __init__(self, kernel: CompiledKernel):
        self.fn = kernel.fn
        self.source = kernel.source
        self.compiled: dict = {}
        self.constexprs: dict = {}       # LaunchConfig -> keyword constexprs, positional constexprs
        # memfuse allocates outputs and partials itself (aligned): only inputs can be unaligned
        self.pointers = [i for i, a in enumerate(kernel.source.args) if a.role in ("read", "in_place")]

    def __call__(self, programs: int, args: list, device: torch.device, config: LaunchConfig) -> None:
        named = self.constexprs.get(config)
        if named is None:
            d, block_d = self.source.constexprs["D"], self.source.constexprs["BLOCK_D"]
            named = ({"D": d, "BLOCK_M": config.block_m, "BLOCK_D": block_d}, (d, config.block_m, block_d))
            self.constexprs[config] = named
        keywords, positional = named
        if device.type != "cuda" or _launch_hooks_installed():
            self.fn[(programs,)](*args, **keywords, num_warps=config.num_warps)
            return
        key = (device.index, config, tuple(args[i].data_ptr() % 16 == 0 for i in self.pointers))
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.fn[(programs,)](*args, **keywords, num_warps=config.num_warps)
            return
        compiled.run(programs, 1, 1, _raw_stream(device.index), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *positional)


@dataclass
class AtenGroup:
    graph: Graph
    group: KernelGroup
    rows: Optional[Callable]
    shapes: dict                         # name -> shape fn, for materialized values
    view_shapes: dict = None             # STRIDED node -> shape fn

    def __call__(self, env: dict, symbol_values: tuple, device) -> None:
        _run_aten_group(self.graph, self, env, symbol_values)


@dataclass
class ExternCall:
    name: str
    target: object
    args: tuple
    kwargs: dict
    getitem: Optional[int] = None
    reshape: Optional[Callable] = None   # symbol values -> shape, for a view/cast of a finished value

    def __call__(self, env: dict, symbol_values: tuple, device) -> None:
        if self.getitem is not None:
            env[self.name] = env[self.args[0]][self.getitem]
        elif self.reshape is not None:   # self.target holds the dtype
            env[self.name] = env[self.args[0]].reshape(self.reshape(*symbol_values)).to(self.target)
        else:
            args = _resolve(self.args, env)
            kwargs = {k: _resolve(v, env) for k, v in self.kwargs.items()}
            env[self.name] = self.target(*args, **kwargs)
            STATS["extern_calls"] += 1


class Program:
    """A scheduled graph, ready to run: `run(inputs, symbol_values) -> outputs`."""

    def __init__(self, schedule: Schedule, symbols: list, config: Config):
        self.graph = schedule.graph
        self.schedule = schedule
        self.symbols = symbols
        self.config = config
        g = self.graph
        self.constants = {n: node.attr.value for n, node in g.nodes.items() if node.op is Op.CONSTANT}
        self.size_scalars = [(n, _size_fn(node.attr.expr, symbols), node.value.dtype.is_floating_point)
                             for n, node in g.nodes.items() if node.op is Op.SYMBOL]
        self.steps = [self._prepare(step) for step in schedule.steps]
        self.last_env = None             # filled when record_env is set (benchmarks/tune.py)
        self.record_env = False

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
            logging.getLogger("memfuse.fallbacks").info("memfuse: %s runs through aten: %s", step.name, step.aten_reason)
            STATS["fallbacks"] += 1
            shapes = {n: self._shape_fn(n) for n in step.outputs + step.column_sums}
            views = {n: self._shape_fn(n) for n in step.nodes if g[n].op is Op.STRIDED}
            return AtenGroup(g, step, self._rows_fn(step), shapes, views)
        kernel = generate(g, step, self.config)
        STATS["kernels_generated"] += 1
        alloc = [(n, g[n].value.dtype, self._shape_fn(n)) for n in step.outputs]
        finish, partials_dtypes = [], {}
        for op, names in kernel.source.column_sums.items():
            buffer_dtype = max((accumulate_dtype(g[n].value.dtype) for n in names), key=lambda t: t.itemsize)
            partials_dtypes[op] = buffer_dtype
            finish.append((op, [(n, None if g[n].value.dtype == buffer_dtype else g[n].value.dtype,
                                 None if g[n].value.shape == (step.space.d,) else self._shape_fn(n))
                                for n in names]))
        return KernelLaunch(step, kernel, self._rows_fn(step), alloc, finish, partials_dtypes, self.config)

    # -- running ---------------------------------------------------------------------------
    def run(self, inputs: list, symbol_values: tuple, device: torch.device) -> list:
        env = dict(self.constants)
        env.update(zip(self.graph.inputs, inputs))
        for name, fn, is_float in self.size_scalars:
            value = fn(*symbol_values)
            env[name] = float(value) if is_float else int(value)
        for step in self.steps:
            step(env, symbol_values, device)
        if self.record_env:
            self.last_env = (dict(env), symbol_values, device)
        return [env[o] if o is not None else None for o in self.graph.outputs]

    def launch(self, step, env: dict, symbol_values: tuple, device) -> None:
        """Run one step on a recorded environment (for tuning and timing)."""
        step(env, symbol_values, device)


_SM_COUNTS: dict = {}


def _launch_hooks_installed() -> bool:
    """Whether a profiler asked Triton for launch hooks (a HookChain in newer Triton, else None)."""
    hook = knobs.runtime.launch_enter_hook
    return hook is not None and bool(getattr(hook, "calls", True))

_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


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
    for name, shape in step.shapes.items():
        value = local[name]
        full = torch.broadcast_to(value, _canonical_shape(graph[name].value.kind, rows, d))
        env[name] = full.to(graph[name].value.dtype).reshape(shape(*symbol_values)).contiguous()


def _read_view(node, root: torch.Tensor, shape, env: dict) -> tuple:
    """A STRIDED node's (values, inside its window) by index arithmetic in torch (ir.Strided)."""
    a = node.attr

    def entry(e):
        return int(env[e.name]) if isinstance(e, ValueRef) else e
    shape = [int(n) for n in shape]
    grids = torch.meshgrid(*[torch.arange(n, device=root.device) for n in shape], indexing="ij") if shape else []
    flat = torch.zeros(shape, dtype=torch.int64, device=root.device)
    inside = torch.ones(shape, dtype=torch.bool, device=root.device)
    for k, w in enumerate(a.window or ()):
        if w is not None:
            inside &= (grids[k] >= entry(w[0])) & (grids[k] < entry(w[1]))
    dense = root.contiguous()
    for j, (coeffs, const) in enumerate(a.index):
        index = sum((entry(c) * g for c, g in zip(coeffs, grids)), torch.zeros_like(flat)) + entry(const)
        flat += index * dense.stride(j)
    if dense.numel() == 0:
        values = torch.zeros(shape, dtype=root.dtype, device=root.device)
    else:
        values = dense.reshape(-1)[torch.where(inside, flat, 0)]
    return values, inside


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
