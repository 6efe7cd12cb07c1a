"""runtime: run scheduled graphs. One Program per graph (forward, backward), one autograd.Function.

Everything a step needs is worked out once, when the program is built, and written out as one
Python function per program (`Program.source`): size expressions, allocations, kernel argument
order, the column sums' rows. A call reads the size symbols off the inputs, draws a seed and runs
that function.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from pathlib import Path
from typing import Callable, Optional

import sympy
import torch
from sympy.printing.lambdarepr import LambdaPrinter
from triton.runtime.errors import OutOfResources

from memfuse.buffers import Origin, plan_buffers, verify_buffer_plan
from memfuse.codegen import CompiledKernel, dtype_name, generate
from memfuse.base.config import Config
from memfuse.base.debug import STATS, timed
from memfuse.runtime.externs import substitute
from memfuse.ir.graph import Graph, Kind, Op, ValueRef
from memfuse.base.launch import INT32_MAX, launch_hooks_installed, launcher_call, raw_stream
from memfuse.ir.views import VIEW_TARGETS, Layout, contiguous, view_layout
from memfuse.ir.patterns import with_output_hooks
from memfuse.ir.ops import OPS, REDUCERS, accumulate_dtype, compute_dtype
from memfuse.schedule.groups import ExternStep, KernelGroup, Schedule
from memfuse.codegen.tuning import LaunchConfig, TuningCache, cpu_config, source_config

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


class KernelLaunch:
    """One generated kernel, with everything a call needs prepared.

    `__call__(device, rows, aligned, values)` takes the kernel's value arguments (inputs,
    scalars, outputs and column totals, in signature order), appends the partial-sum buffers,
    the counter of programs done and the grid scalars, and launches. A kernel with column sums
    finishes them itself (its last program writes the totals): one launch, nothing after it.

    The partials and the counter are per kernel and device, shared by every launch of this
    kernel there (and baked into every CUDA graph that captured it): launches on one stream run
    in order, so each finds the counter at 0 and the partials free. Two launches of the same
    kernel running at once on different streams (one fused function called concurrently from
    two streams) would mix their partials and tickets: unsafe, and not supported."""

    def __init__(self, group: KernelGroup, kernel: CompiledKernel, config: Config):
        self.group = group
        self.kernel = kernel
        self.config = config
        self.persistent = kernel.source.persistent
        self.has_rows = group.space.m is not None
        self.d = kernel.source.constexprs["D"]
        self.reductions = list(kernel.source.column_sums.items())   # (op, [column-sum names])
        self.partials_dtypes = kernel.source.partials_dtypes   # reducer op -> dtype of its partials buffer
        self.launcher = Launcher(kernel)
        self.configs: dict = {}          # device -> LaunchConfig
        self.grids: dict = {}            # device -> (LaunchConfig, most programs)
        self._partials: dict = {}
        self._counters: dict = {}        # device -> [1] int32 programs done, 0 between launches
        self.record = False              # keep the last call's arguments (benchmarks/tune.py)
        self.recorded = None
        self.direct: dict = {}           # device -> DirectLaunch, once compiled there for aligned inputs

    def __call__(self, device: torch.device, rows: Optional[int], pointers: Optional[tuple], values: tuple):
        """Launch on `values`, the kernel's value arguments (inputs, scalars, outputs and column
        totals, in signature order). `pointers` is the same with raw device pointers in place of
        the tensors the caller vouches for (memfuse's own, inputs known to be on `device`), or None
        when an input is not 16-byte aligned.

        The hot path, every call after a kernel's first on a GPU: an aligned call on a device where
        the kernel is compiled (`direct`) does the grid arithmetic and calls Triton's launcher. On
        a host-bound step every Python call between the program and the driver shows (DESIGN.md,
        host floor). Inside `launch_log()` every call takes the general path, which records it."""
        direct = self.direct.get(device) if pointers is not None else None
        if direct is None or direct.config is not self.configs.get(device) or self.record or _LAUNCH_LOG is not None \
                or launch_hooks_installed():
            if self.record:
                self.recorded = (device, rows, pointers, values)
            return self._launch(device, rows, pointers is not None, values)
        if rows is None:                 # a kernel over [D] alone
            programs, grid = 1, ()
        elif rows > INT32_MAX:           # the compiled kernel's sizes are 32-bit
            return self._launch(device, rows, False, values)
        elif self.persistent:
            tiles = -(-rows // direct.block_m) or 1
            programs = tiles if tiles < direct.most else direct.most
            grid = (rows, -(-tiles // programs))
        else:
            programs = -(-rows // direct.block_m) or 1
            grid = (rows,)
        column_sums = ()
        if self.reductions:
            column_sums = direct.column_sums.get(programs) or direct.column_sum_pointers(programs)
        direct.call(programs, 1, 1, raw_stream(direct.stream_index), *direct.leading, *pointers, *column_sums, *grid,
                    *direct.constexprs)
        STATS["kernels_launched"] += 1

    def _launch(self, device: torch.device, rows: Optional[int], aligned: bool, values: tuple):
        """The general path: the first call on a device, the interpreter, unaligned inputs, launch
        hooks, a recorded call; a compiled aligned launch on a GPU sets up the direct one."""
        grid = self.grids.get(device)
        if grid is None or grid[0] is not self.configs.get(device):
            grid = self._grid(device)
        config, most = grid
        if rows is None:
            programs = tiles = 1
        else:
            # at least one tile: with M = 0 the column outputs (a weight grad of zeros) are still written
            tiles = max(1, -(-rows // config.block_m))
            programs = min(tiles, most) if self.persistent else tiles
        args = list(values)
        if self.reductions:
            if programs > FINISH_GROUPS_MAX ** 2:
                raise ValueError(f"memfuse: {self.kernel.source.name}: {programs} programs, more than the column-sum "
                                 f"finish counts ({FINISH_GROUPS_MAX ** 2})")
            args.extend(self.partials(programs, device))
            args.append(self.counter(device))
        if self.has_rows:
            args.append(rows)
            if self.persistent:
                args.append(-(-tiles // programs))
        # the precompiled kernel takes 32-bit sizes (Triton's i32 for small ints): past that, Triton's
        # generic path compiles the 64-bit variant (sizes are leading dims: none exceeds the rows)
        direct = aligned and (rows is None or rows <= INT32_MAX)
        try:
            self.launcher(programs, args, device, config, direct)
        except OutOfResources:
            if config.num_stages == 1:
                raise
            # a deeper pipeline than this kernel's tiles fit in shared memory: run unpipelined, with as
            # many programs an SM as the pipeline had tiles in flight (one program an SM, unpipelined,
            # waits on each load: GPT-2's GELU backward ran at a third of the bandwidth so)
            fallback = dataclasses.replace(config, num_stages=1,
                                           programs_per_sm=config.programs_per_sm * config.num_stages)
            log.info("memfuse: %s: %s does not fit, launching with %s", self.kernel.source.name, config, fallback)
            self.configs[device] = fallback
            self.grids.pop(device)
            return self._launch(device, rows, aligned, values)
        STATS["kernels_launched"] += 1
        if _LAUNCH_LOG is not None:
            _LAUNCH_LOG.append(self.launch_record(rows, programs, tiles, config))
        direct_launch = self.direct.get(device)
        if direct and device.type == "cuda" and (direct_launch is None or direct_launch.config is not config):
            compiled = self.launcher.compiled.get((device.index, config))
            if compiled is not None:
                self.direct[device] = DirectLaunch(self, device, config, most, compiled)

    def launch_record(self, rows: Optional[int], programs: int, tiles: int, config: LaunchConfig) -> "LaunchRecord":
        source = self.kernel.source
        return LaunchRecord(source.name, self.kernel.function_name, self.kernel.path, source.summary, rows, self.d,
                            programs, config,
                            (rows or 0) * source.bytes_per_row + source.bytes_per_launch,
                            self.partials_bytes(programs, tiles), self)

    def partials_bytes(self, programs: int, tiles: int) -> int:
        """Bytes of the column sums' partials a launch writes and reads back (finish_column_sums):
        each program writes its row (a looped kernel: each tile adds into it, read and written), the
        groups' last programs read them and write one row per group, the last group reads those."""
        if not self.reductions:
            return 0
        group_size = math.ceil(math.sqrt(programs))
        groups = -(-programs // group_size)
        rows = 2 * (tiles if self.kernel.source.passes is not None else programs) + 2 * groups
        row_bytes = sum(len(names) * self.d * self.partials_dtypes[op].itemsize for op, names in self.reductions)
        return rows * row_bytes

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
                    source_config(self.kernel.source)
            else:
                chosen = cpu_config(block_d, config.tile_elements)
            self.configs[device] = chosen
        return chosen

    def partials(self, programs: int, device: torch.device) -> list:
        """[programs, n, D] buffers, one per reduction, reused across calls: the launch's last
        program has read them before the next launch on the stream can overwrite them."""
        key = (programs, device)
        buffers = self._partials.get(key)
        if buffers is None:
            buffers = [torch.empty((max(programs, 1), len(names), self.d), device=device,
                                   dtype=self.partials_dtypes[op])
                       for op, names in self.reductions]
            self._partials[key] = buffers
        return buffers

    def counter(self, device: torch.device) -> torch.Tensor:
        """The kernel's int32 ticket counters on `device` (the groups' last, then one per group of
        the finish: row_kernel.finish_column_sums): zeroed once here, then set back to 0 by the
        programs that finish each level (so a CUDA-graph replay also starts from 0)."""
        counter = self._counters.get(device)
        if counter is None:
            counter = self._counters[device] = torch.zeros(1 + FINISH_GROUPS_MAX, dtype=torch.int32, device=device)
        return counter


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """One kernel launch as `launch_log` records it: what the kernel is and what it must move at
    the launch's sizes (benchmarks/kernel_sol.py sets it against the launch's GPU time)."""
    kernel: str               # the kernel's own name (explain's)
    function: str             # the launched Triton function's: what a profiler calls it (a twin's is its first's)
    path: str                 # its generated source (content-addressed: same-named kernels of two graphs differ)
    summary: str              # KernelSource.summary: its walk, reductions, reads, writes, ops
    rows: Optional[int]       # M of this launch (None: a kernel over [D] alone)
    d: int
    programs: int
    config: LaunchConfig
    must_move: int            # bytes: every [M, D], [M] and [D] value read or written once, the totals
    partials: int             # bytes of fp32 column partials written and read back, on top (0: no column sums)
    launch: Optional["KernelLaunch"] = dataclasses.field(default=None, repr=False, compare=False)   # to time it again


_LAUNCH_LOG: Optional[list] = None   # the list launch_log() is filling, else None


@contextlib.contextmanager
def launch_log():
    """Record every memfuse kernel launch in the block, in launch order: `with launch_log() as
    records:` gives a list of LaunchRecord. Launches take the general path meanwhile (more host
    time per launch; the same kernels, configurations and grids on the GPU). Not nestable."""
    global _LAUNCH_LOG
    if _LAUNCH_LOG is not None:
        raise RuntimeError("memfuse: launch_log() is already recording: one log at a time")
    _LAUNCH_LOG = records = []
    try:
        yield records
    finally:
        _LAUNCH_LOG = None


class Launcher:
    """Launches a @triton.jit kernel, skipping Triton's generic launch path once compiled.

    Triton's `kernel[grid](...)` re-binds and re-specializes every argument on each call (10-40 us
    on a GPU host). Every scalar of a memfuse kernel is `do_not_specialize`, so the only
    specialization left is the 16-byte alignment of the pointers and the width of the ints (i32
    below 2**31): memfuse allocates outputs and partials itself, so a call whose inputs are all
    aligned and whose rows fit 32 bits (the caller says so: `direct`) runs the kernel compiled for
    that case directly (precompile hands it over). The interpreter, unaligned inputs, 2**31 rows
    or more and any launch hook a profiler installs take the generic path."""

    def __init__(self, kernel: CompiledKernel):
        self.fn = kernel.fn
        self.source = kernel.source
        self.compiled: dict = {}         # (device index, LaunchConfig) -> compiled kernel, aligned inputs, i32 sizes
        self.constexprs: dict = {}       # LaunchConfig -> keyword constexprs, positional constexprs

    def keywords(self, config: LaunchConfig) -> dict:
        """The kernel's constexprs for a launch configuration, in signature order."""
        return {"D": self.source.constexprs["D"], "BLOCK_M": config.block_m,
                "BLOCK_D": self.source.constexprs["BLOCK_D"], "NUM_STAGES": config.num_stages}

    def __call__(self, programs: int, args: list, device: torch.device, config: LaunchConfig, direct: bool) -> None:
        named = self.constexprs.get(config)
        if named is None:
            keywords = self.keywords(config)
            named = self.constexprs[config] = (keywords, tuple(keywords.values()))
        keywords, positional = named
        if device.type != "cuda" or not direct or launch_hooks_installed():
            self.fn[(programs,)](*args, **keywords, num_warps=config.num_warps)
            return
        compiled = self.compiled.get((device.index, config))
        if compiled is None:
            self.compiled[(device.index, config)] = self.fn[(programs,)](*args, **keywords, num_warps=config.num_warps)
            return
        compiled.run(programs, 1, 1, raw_stream(device.index), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *positional)


class DirectLaunch:
    """What KernelLaunch's hot path needs of its kernel compiled on one GPU: the grid's terms, the
    launcher call and the arguments around the kernel's own, the column sums' buffers as pointers.
    Valid for one LaunchConfig: KernelLaunch drops to its general path when the configuration
    changes (tuning, an out-of-resources retry)."""

    __slots__ = ("kernel_launch", "device", "config", "block_m", "most", "stream_index", "call", "leading",
                 "constexprs", "column_sums")

    def __init__(self, launch: KernelLaunch, device: torch.device, config: LaunchConfig, most: int, compiled):
        self.kernel_launch = launch
        self.device = device
        self.config = config
        self.block_m = config.block_m
        self.most = most
        self.stream_index = device.index      # a CUDA tensor's device always names its index
        self.call, self.leading = launcher_call(compiled)
        self.constexprs = tuple(launch.launcher.keywords(config).values())
        self.column_sums: dict = {}           # programs -> pointers of (partials..., counter)

    def column_sum_pointers(self, programs: int) -> tuple:
        """The column sums' buffers for a grid of `programs`, as pointers (KernelLaunch keeps the
        buffers, per device and grid, for good)."""
        launch = self.kernel_launch
        buffers = (*launch.partials(programs, self.device), launch.counter(self.device))
        pointers = self.column_sums[programs] = tuple(b.data_ptr() for b in buffers)
        return pointers


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


class Program:
    """A scheduled graph, ready to run: `run(inputs, symbol_values, device) -> outputs`.

    `run` is one Python function written out when the program is built (`source`): each step
    is a few lines of it (allocate outputs, launch a kernel, take its column sums' rows, call
    an aten op, drop what it read last), so a call walks no list of steps and no dictionary of
    values. `inputs` is a list the program takes over: it empties it once unpacked, and drops
    each input after its last reader (`buffers`, the BufferPlan), so what the caller passed in
    and holds nowhere else is freed as early as any intermediate.

    `contiguous_inputs`: inputs every caller passes contiguous (what the compile key says of a
    primal, tangents made contiguous); the others are made contiguous where a kernel reads them.
    `device_inputs`: inputs every caller passes on the launch device (the compile key checks the
    primals, autograd the tangents); kernels take them as raw pointers, the others as tensors.
    `saved_inputs`: what the forward saved. A saved-tensors hook may unpack anything in their
    place; without one autograd hands back the very tensors the forward saved, on the device:
    `run_unhooked` takes them as raw pointers too (`source_unhooked`). `returns_gradients`: a
    backward's outputs, which may be views made by strides; a forward returns torch's own views
    (autograd and AOTAutograd track what a returned view aliases)."""

    def __init__(self, schedule: Schedule, symbols: list, config: Config, contiguous_inputs=frozenset(),
                 device_inputs=frozenset(), saved_inputs=frozenset(), returns_gradients: bool = False):
        self.graph = schedule.graph
        self.returns_gradients = returns_gradients
        self.schedule = schedule
        self.symbols = symbols
        self.config = config
        self.contiguous_inputs = frozenset(contiguous_inputs)
        self.device_inputs = frozenset(device_inputs)
        self.steps = [self._prepare(step) for step in schedule.steps]
        self.buffers = plan_buffers(schedule)
        if config.check:
            verify_buffer_plan(self.buffers, schedule)
        self.source, self.run = _ProgramWriter(self, self.device_inputs).write()
        self.source_unhooked, self.run_unhooked = (self.source, self.run) if not saved_inputs else \
            _ProgramWriter(self, self.device_inputs | frozenset(saved_inputs)).write()

    def _shape_fn(self, name: str) -> Callable:
        return _size_fn(self.graph[name].value.shape, self.symbols)

    def _prepare(self, step):
        g = self.graph
        if isinstance(step, ExternStep):
            return step
        if step.aten_reason is not None:
            logging.getLogger("memfuse.fallbacks").info("memfuse: %s runs through aten: %s", step.name, step.aten_reason)
            STATS["fallbacks"] += 1
            shapes = {n: self._shape_fn(n) for n in step.outputs + step.column_sums}
            rows = None if step.space.m is None else _size_fn(step.space.m, self.symbols)
            views = {n: self._shape_fn(n) for n in step.nodes if g[n].op is Op.STRIDED}
            return AtenGroup(g, step, rows, shapes, views)
        kernel = generate(g, step, self.config)
        STATS["kernels_generated"] += 1
        return KernelLaunch(step, kernel, self.config)


class _ProgramWriter:
    """Writes a Program's `run` as Python source. Local names: graph values keep their node
    names; everything memfuse binds starts with `mf_`."""

    def __init__(self, program: Program, device_inputs: frozenset):
        self.program = program
        self.device_inputs = device_inputs   # inputs taken as raw pointers (Program)
        self.graph = program.graph
        self.sizes = {s: sympy.Symbol(f"mf_s{i}") for i, s in enumerate(program.symbols)}
        self.printed: dict = {}      # size expression -> its Python text (`expr`)
        # (the math that _SIZE_PRINTER writes: floor(s0/2) for a view(2, -1, D))
        self.namespace: dict = {"mf_allocators": _ALLOCATORS, "mf_allocator": _allocator, "mf_STATS": STATS,
                                "mf_reinterpret": _reinterpret, "mf_check_view": _check_view, "torch": torch,
                                "mf_in_layout": _in_layout,
                                "floor": math.floor, "ceil": math.ceil, "copysign": math.copysign}
        self.lines: list = []
        self.plan = program.buffers
        # values memfuse allocates (aligned, contiguous)
        self.allocated = {b.name for b in self.plan.buffers.values() if b.origin in (Origin.OUTPUT, Origin.TOTALS)}
        self.allocates = False           # whether an allocation was written (the allocator is taken)
        self.contiguous: dict = {v: v for v in program.contiguous_inputs}   # value -> its local as kernels read it
        self.unit_stride: dict = {}      # value -> its local for kernels reading it through access maps only
        self.in_layouts: dict = {}       # (value, strides) -> its local for kernels whose rows run in another order
        self.pointers: dict = {}         # local -> the local holding its data pointer
        # local -> (Layout, None or the local flag it holds under): what views of it are made from
        self.layouts: dict = {v: (contiguous(self.graph[v].value.shape), None) for v in program.contiguous_inputs}
        self.extern_calls = 0

    @timed("program")
    def write(self) -> tuple:
        g = self.graph
        self.line("def run(mf_inputs, mf_sizes, device):")
        if g.inputs:
            self.line(f"    {', '.join(g.inputs)}, = mf_inputs")
            self.line("    mf_inputs.clear()")
        if self.sizes:
            self.line(f"    {', '.join(str(s) for s in self.sizes.values())}, = mf_sizes")
        for name, node in g.nodes.items():
            if node.op is Op.CONSTANT:
                self.namespace[name] = node.attr.value
            elif node.op is Op.SYMBOL:
                cast = "float" if node.value.dtype.is_floating_point else "int"
                self.line(f"    {name} = {cast}({self.expr(node.attr.expr)})")
        self.frees(0)
        for k, (step, prepared) in enumerate(zip(self.program.schedule.steps, self.program.steps), 1):
            if isinstance(prepared, KernelLaunch):
                self.kernel(step, prepared, k)
            elif isinstance(prepared, AtenGroup):
                self.aten_group(step, prepared)
            else:
                self.extern(step.name)
            self.frees(k)
        if self.extern_calls:
            self.line(f"    mf_STATS['extern_calls'] += {self.extern_calls}")
        outputs = ", ".join(o if o is not None else "None" for o in g.outputs)
        self.line(f"    return [{outputs}]")
        source = "\n".join(self.lines) + "\n"
        name = f"<memfuse program {id(self.program):x}>"
        exec(compile(source, name, "exec"), self.namespace)
        return source, self.namespace["run"]

    def line(self, text: str) -> None:
        self.lines.append(text)

    def expr(self, e) -> str:
        """A size expression over the leading-dim symbols, as Python."""
        if isinstance(e, (list, tuple)):
            items = [self.expr(x) for x in e]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if type(e) is int:
            return str(e)
        text = self.printed.get(e)
        if text is None:     # sympy's printer costs ~0.3 ms; a program prints the same sizes many times
            text = self.printed[e] = _SIZE_PRINTER.doprint(sympy.sympify(e).xreplace(self.sizes))
        return text

    def allocate(self, allocation, layouts: dict) -> None:
        """A buffer the plan allocates: a new tensor through the device's allocator (`_allocator`,
        taken once per call before the first allocation), or the storage of a dead one of the same
        dtype and elements, whose local it takes over. Contiguous, or in the strides its kernel
        writes it in (`layouts`: KernelGroup.layouts, rows in another order)."""
        b = self.plan.buffers[allocation.buffer]
        layout = Layout(tuple(b.shape), layouts[b.name]) if b.name in layouts else contiguous(b.shape)
        shape, strides = self.expr(b.shape), self.expr(layout.strides)
        if allocation.reuses is not None:
            old = self.plan.buffers[allocation.reuses]
            same = self.layouts.get(old.name, (None,))[0] == layout
            made = old.name if same else f"mf_reinterpret({old.name}, {shape}, {strides}, 0)"
            self.line(f"    {b.name} = {made}; del {old.name}")
            self.layouts[b.name] = (layout, None)
            return
        if not self.allocates:
            self.allocates = True
            self.line("    mf_empty_strided = mf_allocators.get(device) or mf_allocator(device)")
        self.line(f"    {b.name} = mf_empty_strided({shape}, {strides}, {b.dtype})")
        self.layouts[b.name] = (layout, None)

    def frees(self, step: int) -> None:
        """Drop the locals plan step `step` read last (with the copies made for kernels), except one
        a later allocation takes over."""
        names = []
        for f in self.plan.steps[step].frees:
            if f.reused_by is None:
                copies = {self.contiguous.get(f.buffer, f.buffer), self.unit_stride.get(f.buffer, f.buffer)}
                copies |= {local for (value, _), local in self.in_layouts.items() if value == f.buffer}
                names += [f.buffer] + sorted(copies - {f.buffer})
        if names:
            self.line(f"    del {', '.join(names)}")

    def bind(self, value, prefix: str) -> str:
        name = f"mf_{prefix}_{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def kernel(self, group: KernelGroup, launch: KernelLaunch, step: int) -> None:
        self.line(f"    # {group.name}: a kernel over [M, D={group.space.d}]")
        for allocation in self.plan.steps[step].allocations:     # outputs, [n, D] column totals
            self.allocate(allocation, group.layouts)
        totals = {dtype_name(dtype): local for dtype, local in self.plan.totals(step).items()}
        strided_only = self.strided_only(group)
        values, pointers, reads = [], [], []    # the general path's, the direct path's, the reads' pointers
        for arg in launch.kernel.source.args:
            if arg.role in ("read", "in_place") and (arg.value not in self.allocated or arg.value in group.layouts):
                # an input (an in-place one is read by its own strides), or an extern step's result:
                # a raw pointer only where the caller vouches for the device (`device_inputs`); an
                # extern result may view what a saved-tensors hook unpacked, so it stays a tensor
                tensor = self.as_read(arg.value, strided_only, group.layouts.get(arg.value)) \
                    if arg.role == "read" else arg.value
                reads.append(self.pointer(tensor))
                values.append(tensor)
                pointers.append(reads[-1] if arg.value in self.device_inputs else tensor)
            elif arg.role == "stride":         # of the tensor as the kernel reads it
                in_place = any(b.role == "in_place" and b.value == arg.value for b in launch.kernel.source.args)
                tensor = arg.value if in_place or arg.value in self.allocated else \
                    self.as_read(arg.value, strided_only, group.layouts.get(arg.value))
                local = f"mf_stride{len(self.lines)}"
                self.line(f"    {local} = {tensor}.stride({arg.dim})")
                values.append(local)
                pointers.append(local)
            elif arg.role in ("read", "write"):    # memfuse allocated it
                values.append(arg.value)
                pointers.append(f"{arg.value}.data_ptr()")
            elif arg.role == "scalar":
                values.append(arg.value)
                pointers.append(arg.value)
            elif arg.role == "stream_base":
                values.append(str(arg.constant))
                pointers.append(str(arg.constant))
            elif arg.role == "totals":
                values.append(totals[arg.value])
                pointers.append(f"{totals[arg.value]}.data_ptr()")
            elif arg.role not in ("partials", "counter", "rows", "tiles"):
                raise NotImplementedError(f"memfuse: {group.name}: no runtime value for argument role {arg.role!r}")
        rows = "None" if group.space.m is None else self.expr(group.space.m)
        direct = f"({', '.join(pointers)}{',' if len(pointers) == 1 else ''})"
        if reads:      # memfuse allocates aligned memory: only what it did not allocate is checked
            direct = f"None if ({' | '.join(reads)}) & 15 else {direct}"
        self.namespace[group.name] = launch
        self.line(f"    {group.name}(device, {rows}, {direct}, ({', '.join(values)}{',' if len(values) == 1 else ''}))")
        for name in self.plan.steps[step].made:
            if name in self.plan.rows:
                self.row(name)

    def row(self, name: str) -> None:
        """A column sum (or the reshape that is its only reader, at the reshape's step: the plan's
        Row) = D values of its kernel's totals, in name's shape: a tensor over the totals' memory
        made by inductor's `_reinterpret_tensor` (no view for autograd to track: cheaper to make,
        and to hand back as a gradient, than `totals[j]`; aligned only if D is)."""
        row = self.plan.rows[name]
        shape = tuple(self.graph[name].value.shape)
        self.line(f"    {name} = mf_reinterpret({row.totals}, {self.expr(shape)}, {self.expr(_contiguous_strides(shape))}, "
                  f"{row.offset})")
        self.layouts[name] = (contiguous(shape), None)

    def pointer(self, tensor: str) -> str:
        """The local holding the data pointer of `tensor` (a local), written once."""
        local = self.pointers.get(tensor)
        if local is None:
            local = self.pointers[tensor] = f"mf_pointer{len(self.pointers)}"
            self.line(f"    {local} = {tensor}.data_ptr()")
        return local

    def strided_only(self, group: KernelGroup) -> set:
        """The tensors `group` reads only through access maps (STRIDED nodes: its strides, per call),
        never as a plain [M, D] block (codegen's `roots_only`)."""
        g = self.graph
        roots = {g[n].inputs[0] for n in group.nodes if g[n].op is Op.STRIDED}
        plain = {i for n in group.nodes for i in g[n].inputs[g[n].op is Op.STRIDED:]}
        return roots - plain - set(group.outputs)

    def as_read(self, value: str, strided_only: set, strides: Optional[tuple] = None) -> str:
        """The local a kernel reads `value` from: contiguous, or in `strides` (a kernel whose rows run
        in another order reads its plain rows in that order's layout), or any layout whose last
        stride is 1 when the kernel reads it only through access maps (an aten result in other
        strides, like attention's gradients [B, H, S, D] laid out as [B, S, H, D], is read where it
        lies)."""
        if strides is not None:
            return self.made_in_layout(value, strides)
        if value not in strided_only or not self.graph[value].value.shape or value in self.contiguous:
            return self.made_contiguous(value)
        local = self.unit_stride.get(value)
        if local is None:
            local = self.unit_stride[value] = f"mf_{value}_strided"
            self.line(f"    {local} = {value} if {value}.stride(-1) == 1 else {value}.contiguous()")
        return local

    def made_contiguous(self, value: str) -> str:
        """The local holding `value` as kernels read it: an input or an aten result may be
        strided (or unaligned); written once, before its first use."""
        local = self.contiguous.get(value)
        if local is None:
            local = self.contiguous[value] = f"mf_{value}"
            self.line(f"    {local} = {value} if {value}.is_contiguous() else {value}.contiguous()")
        return local

    def made_in_layout(self, value: str, strides: tuple) -> str:
        """The local holding `value` in `strides`: itself where it lies so (what memfuse allocated in
        them is known to), else a copy into them, checked per call (an extern's result follows
        its inputs' layouts: attention's gradients lie as its query does)."""
        if self.layouts.get(value) == (Layout(tuple(self.graph[value].value.shape), strides), None):
            return value
        local = self.in_layouts.get((value, strides))
        if local is None:
            local = self.in_layouts[(value, strides)] = f"mf_{value}_rows{len(self.in_layouts)}"
            self.line(f"    {local} = mf_in_layout({value}, {self.expr(strides)})")
        return local

    def aten_group(self, group: KernelGroup, step: AtenGroup) -> None:
        runner = self.bind(step, "aten")
        inputs = ", ".join(f"{n!r}: {n}" for n in group.inputs)
        outputs = list(step.shapes)
        self.line(f"    # {group.name}: through aten ({group.aten_reason})")
        self.line(f"    {', '.join(outputs)}, = {runner}({{{inputs}}}, mf_sizes, device)")

    def extern(self, name: str) -> None:
        node = self.graph[name]
        source = node.inputs[0] if node.inputs else None
        if node.op is Op.GETITEM:
            self.line(f"    {name} = {source}[{node.attr.index}]")
        elif name in self.plan.rows:
            self.row(name)
        elif node.op is Op.VIEW and self.graph[source].value.dtype == node.value.dtype:
            self.view(name, source, torch.ops.aten.reshape.default, (), f"{source}.reshape({self.expr(node.value.shape)})")
        elif node.op in (Op.VIEW, Op.CAST):
            cast = "" if self.graph[source].value.dtype == node.value.dtype else f".to({node.value.dtype})"
            self.line(f"    {name} = {source}.reshape({self.expr(node.value.shape)}){cast}")
        else:
            args = [self.argument(a) for a in node.attr.args]
            args += [f"{k}={self.argument(v)}" for k, v in node.attr.kwargs]
            method = TENSOR_METHODS.get(node.attr.target)
            if node.attr.target is torch.ops.aten.permute.default and list(node.attr.args[1]) == [1, 0]:
                call = f"{args[0]}.t()"        # half a permute's host time: no list to read
            elif method is not None and not node.attr.kwargs:
                call = f"{args[0]}.{method}({', '.join(args[1:])})"
            else:
                call = f"{self.bind(substitute(node.attr.target), 'aten')}({', '.join(args)})"
            if node.attr.target in VIEW_TARGETS and not node.attr.kwargs and isinstance(node.attr.args[0], ValueRef):
                self.view(name, node.attr.args[0].name, node.attr.target, node.attr.args[1:], call)
            else:
                self.line(f"    {name} = {call}")
                if node.attr.target in MATMULS:    # a fresh row-major tensor
                    self.layouts[name] = (contiguous(node.value.shape), None)
            self.extern_calls += 1         # counted once a run, at its end (one line, not one a call)

    def view(self, name: str, source: str, target, args: tuple, call: str) -> None:
        """An extern view: made from its source's memory by strides (`mf_reinterpret`) where the
        source's layout is known (layouts.view_layout), under the flag that says the source is
        contiguous where the program only guesses so (`layout`); else, and for what a forward
        returns, the method `call`."""
        node = self.graph[name]
        known = self.layout(source)
        layout = view_layout(target, args, known[0], node.value.shape)
        if layout is None:
            self.line(f"    {name} = {call}")
            return
        flag = known[1]
        self.layouts[name] = (layout, flag)
        if name in self.graph.outputs and not self.program.returns_gradients:
            self.line(f"    {name} = {call}")
            return
        made = f"mf_reinterpret({source}, {self.expr(layout.shape)}, {self.expr(layout.strides)}, {self.expr(layout.offset)})"
        self.line(f"    {name} = {made}" + (f" if {flag} else {call}" if flag else ""))
        if self.program.config.check:      # the tests' runs: the same view as torch makes it
            self.line(f"    {f'if {flag}: ' if flag else ''}mf_check_view({name!r}, {name}, {call})")

    def layout(self, value: str) -> tuple:
        """(Layout, flag) of a local a view is made from: known for what memfuse allocated or
        made by strides, a matmul's result, an input the compile key says is contiguous (flag
        None); for anything else (an input from the caller, which a saved-tensors hook may have
        unpacked in any layout; another aten result, a view torch made) contiguous under a flag
        read once, when its first view is made: `x.is_contiguous()`."""
        known = self.layouts.get(value)
        if known is None:
            flag = f"mf_{value}_contiguous"
            self.line(f"    {flag} = {value}.is_contiguous()")
            known = self.layouts[value] = (contiguous(self.graph[value].value.shape), flag)
        return known

    def argument(self, value) -> str:
        if isinstance(value, ValueRef):
            return value.name
        if isinstance(value, (list, tuple)):
            items = [self.argument(v) for v in value]
            inner = ", ".join(items) + ("," if isinstance(value, tuple) and len(items) == 1 else "")
            return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
        if value is None or isinstance(value, (bool, int)):
            return repr(value)
        return self.bind(value, "arg")


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.mm.dtype, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

# aten calls a program makes as the tensor's own method: the same kernel, without the Python
# frames of an OpOverload call (2-6 us of host each on a CPU: a layer's backward makes dozens)
TENSOR_METHODS = {
    torch.ops.aten.permute.default: "permute",
    torch.ops.aten.view.default: "view",
    torch.ops.aten.reshape.default: "reshape",
    torch.ops.aten.narrow.default: "narrow",
    torch.ops.aten.t.default: "t",
    torch.ops.aten.unsqueeze.default: "unsqueeze",
    torch.ops.aten.expand.default: "expand",
    torch.ops.aten.mm.default: "mm",
    torch.ops.aten.addmm.default: "addmm",
    torch.ops.aten.bmm.default: "bmm",
}


_SIZE_PRINTER = LambdaPrinter({"allow_unknown_functions": True, "fully_qualified_modules": False, "inline": True})


_SM_COUNTS: dict = {}
FINISH_GROUPS_MAX = 256   # groups of about sqrt(programs) programs: grids up to 65536 programs
_ALLOCATORS: dict = {}   # device -> (sizes, strides, dtype) -> an uninitialized tensor there


def _allocator(device: torch.device) -> Callable:
    """The allocator programs use on `device`: inductor's `_empty_strided_cpu` / `_cuda` where
    torch has them (they skip torch.empty's argument parser and dispatcher, most of its host
    time). The CUDA one allocates on the current device, the device memfuse launches on
    (docs/distributed.md: `torch.cuda.set_device`)."""
    allocate = getattr(torch._C._dynamo.guards, f"_empty_strided_{device.type}", None) \
        if device.type in ("cpu", "cuda") else None
    if allocate is None:
        def allocate(sizes, strides, dtype):
            return torch.empty_strided(sizes, strides, dtype=dtype, device=device)
    _ALLOCATORS[device] = allocate
    return allocate


def _contiguous_strides(shape: tuple) -> tuple:
    return tuple(sympy.Mul(*shape[k + 1:]) for k in range(len(shape)))


def _in_layout(t: torch.Tensor, strides: tuple) -> torch.Tensor:
    """`t` where it lies in `strides` (dims of size 1 may have any), else a copy of it in them."""
    if all(have == want or size == 1 for have, want, size in zip(t.stride(), strides, t.shape)):
        return t
    made = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
    made.copy_(t)
    return made


def _as_strided_at(t: torch.Tensor, sizes: tuple, strides: tuple, offset: int) -> torch.Tensor:
    return t.as_strided(sizes, strides, t.storage_offset() + offset)


def _check_view(name: str, made: torch.Tensor, expected: torch.Tensor) -> None:
    """Under `config.check`: a view the program made by strides reads the elements torch's own
    view reads (the strides of dims of size 1 may differ: no element is read through them)."""
    same = made.shape == expected.shape and made.storage_offset() == expected.storage_offset() \
        and made.untyped_storage().data_ptr() == expected.untyped_storage().data_ptr() \
        and all(a == b for a, b, n in zip(made.stride(), expected.stride(), made.shape) if n > 1)
    if not same:
        raise AssertionError(f"memfuse: view {name}: made as {tuple(made.shape)} {made.stride()} at "
                             f"{made.storage_offset()}, torch makes {tuple(expected.shape)} {expected.stride()} at "
                             f"{expected.storage_offset()}")


# (tensor, sizes, strides, offset) -> a tensor over its memory: inductor's, else a view
_reinterpret = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", _as_strided_at)




def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


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


# -- autograd -----------------------------------------------------------------------------------
class CompiledFunction:
    """A plan made runnable: a forward Program, and a backward one when gradients are needed.
    `contiguous[i]`: tensor input i is contiguous in every call (the compile key says so), so the
    forward need not check it. The backward checks its tangents, and what it reads of the
    forward: a saved-tensors hook may unpack anything."""

    def __init__(self, plan, captured, config: Config, build_schedule, contiguous=()):
        self.plan = plan
        self.symbol_order = list(captured.symbols)
        self.symbol_sources = [captured.symbols[s] for s in self.symbol_order]
        self.has_seed = captured.has_seed
        self.seed_from_memory = config.seed_from_memory   # kernels read a [1] seed tensor
        self.num_fwd_outputs = plan.num_fwd_outputs
        self.differentiable = captured.differentiable_outputs
        self.non_differentiable = [i for i in range(self.num_fwd_outputs) if i not in self.differentiable]
        reads = ", ".join(f"inputs[{i}].shape[{d}]" for i, d in self.symbol_sources)
        self.symbol_values = eval(f"lambda inputs: ({reads}{',' if len(self.symbol_sources) == 1 else ''})")
        primals = plan.forward.inputs[:len(contiguous)]
        self.forward = Program(build_schedule(plan.forward, "forward"), self.symbol_order, config,
                               {name for name, known in zip(primals, contiguous) if known}, plan.forward.inputs)
        self.backward = None
        if plan.backward is not None:    # inputs: what the forward saved, [the seed], the tangents
            inputs = plan.backward.inputs
            saved = len(inputs) - len(self.differentiable) - self.has_seed
            self.backward = Program(build_schedule(plan.backward, "backward"), self.symbol_order, config,
                                    device_inputs=inputs[saved:], saved_inputs=inputs[:saved], returns_gradients=True)
        # (*tensor inputs) -> the forward's outputs: what a repeated call runs (api._Front)
        self.apply = self.forward_only if self.backward is None else functools.partial(_function_apply, self)
        # what the caller's outputs need after a run (memfuse.ir.patterns.OutputHook: the chunked loss
        # head's returned logits get their own backward): the caller's outputs are the first ones
        self.output_hooks = captured.output_hooks
        self.num_user_outputs = self.num_fwd_outputs - sum(h.extra_outputs for h in self.output_hooks)
        if self.output_hooks:
            self.apply = self._with_output_hooks

    def run_forward(self, inputs) -> tuple:
        """(outputs, size values, seed input, device) of a forward run on the tensor inputs. The
        seed input is () without random ops, else a fresh draw, as a Python int or, for kernels
        that read it from memory, a [1] tensor on the device."""
        device = inputs[0].device
        seed = ()
        if self.has_seed:
            seed = _draw_seed(device)
            seed = (torch.tensor([seed], dtype=torch.int64, device=device),) if self.seed_from_memory else (seed,)
        symbol_values = self.symbol_values(inputs)
        return self.forward.run([*inputs, *seed], symbol_values, device), symbol_values, seed, device

    def forward_only(self, *inputs) -> tuple:
        return tuple(self.run_forward(inputs)[0][:self.num_fwd_outputs])

    def __call__(self, inputs: list) -> tuple:
        if self.output_hooks:
            return self._with_output_hooks(*inputs)
        if self.backward is None:
            return self.forward_only(*inputs)
        return _MemfuseFunction.apply(self, *inputs)

    def _with_output_hooks(self, *inputs) -> tuple:
        outputs = self.forward_only(*inputs) if self.backward is None else _function_apply(self, *inputs)
        return tuple(with_output_hooks(outputs, inputs, self.output_hooks, self.num_user_outputs))


SEED_LIMIT = 2 ** 31 - 1   # seeds are int32 kernel scalars (and kernels add a stream index)


_SEED_DRAWS: dict = {}   # device -> its seed draw (reading `device.type` costs more than a dict lookup)


def _draw_seed(device: torch.device) -> int:
    """A fresh seed in [0, SEED_LIMIT), with no kernel and no GPU sync: on CUDA from the device's
    default generator (`philox_seed_draw`; `torch.manual_seed` and `torch.cuda.manual_seed`
    reproduce a run, as for torch's own dropout), elsewhere from torch's CPU generator."""
    draw = _SEED_DRAWS.get(device)
    if draw is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            draw = philox_seed_draw(torch.cuda.default_generators[index])
        else:
            draw = _cpu_seed
        _SEED_DRAWS[device] = draw
    return draw()


def _cpu_seed() -> int:
    return int(torch.randint(0, SEED_LIMIT, (), dtype=torch.int64))


def philox_seed_draw(generator) -> Callable[[], int]:
    """Seeds from a CUDA generator's Philox state (seed, offset): each draw reserves one offset
    step (4, the unit torch's generator allows) as torch's own random kernels reserve theirs, so
    the next draw reads the next offset. Cheaper than a `torch.randint` draw (a host tensor op per
    call). The seed is the pair's hash (CPython's tuple hash: xxHash rounds over the ints' own
    hashes, the same in every process, PYTHONHASHSEED or not), which spreads successive offsets
    over unrelated seeds, never neighbours (kernels draw from seed + stream index), in one C call
    where splitmix64 on Python ints cost 0.5 us. Inside a CUDA-graph capture the state is off
    limits: the CPU generator's seed is captured, as before (a constant of the graph)."""
    get_offset, set_offset, initial_seed = generator.get_offset, generator.set_offset, generator.initial_seed

    def philox_draw() -> int:
        try:
            offset = get_offset()
        except RuntimeError:
            if not torch.cuda.is_current_stream_capturing():
                raise
            return _cpu_seed()
        set_offset(offset + 4)
        return hash((initial_seed(), offset)) % SEED_LIMIT
    return philox_draw


class _MemfuseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compiled: CompiledFunction, *inputs):
        outs, symbol_values, seed, device = compiled.run_forward(inputs)
        n = compiled.num_fwd_outputs
        ctx.save_for_backward(*outs[n:])
        # the backward's run: one attribute, not five; which program variant (Program.run_unhooked)
        # as autograd's SavedVariable decides whether to pack through a default hook
        ctx.call = (compiled, symbol_values, seed, device, _saved_tensors_hooks(False) is None)
        if compiled.non_differentiable:
            ctx.mark_non_differentiable(*[outs[i] for i in compiled.non_differentiable])
            ctx._materialize_non_diff_grads = False   # the backward drops their gradients: no zeros made
        return tuple(outs[:n])

    @staticmethod
    def backward(ctx, *grad_outputs):
        """The backward program takes the saved tensors over: read once into its input list, then
        autograd's references go (`maybe_clear_saved_tensors`: unless the graph is retained for
        another backward), so each one is freed after its last reader. The tangents stay alive
        until this returns: the engine holds them for the call."""
        compiled, symbol_values, seed, device, unhooked = ctx.call
        tangents = [grad_outputs[i] for i in compiled.differentiable] if compiled.non_differentiable else grad_outputs
        inputs = [*ctx.saved_tensors, *seed, *tangents]
        ctx.maybe_clear_saved_tensors()
        run = compiled.backward.run_unhooked if unhooked else compiled.backward.run
        return (None, *run(inputs, symbol_values, device))


_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks   # (ignore_is_tracing) -> None or hooks

# The autograd engine runs a custom Function's backward through its node's `apply`, a Python
# method (BackwardCFunction.apply) that looks the backward up again on every call, in two frames;
# memfuse's node calls it directly.
_MemfuseFunction._backward_cls.apply = _MemfuseFunction.backward


# The C half of `_MemfuseFunction.apply`. Its Python half (torch.autograd.Function.apply) costs
# about 3.5 us a call on a CPU host for three things: routing functorch transforms (vmap, grad)
# to custom_function_call, unwrapping dead functorch wrappers, binding defaults for a
# setup_context memfuse does not define. A repeated call (api._Front) does the first two itself
# and calls this.
_function_apply = super(torch.autograd.Function, _MemfuseFunction).apply
