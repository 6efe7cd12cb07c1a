"""A scheduled graph made runnable: one Program per graph (forward, backward).

Everything a step needs is worked out once, when the program is built, and written out as one
Python function per program (`Program.source`): size expressions, allocations, kernel argument
order, the column sums' rows. A call reads the size symbols off the inputs, draws a seed and runs
that function.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional

import sympy
import torch
from sympy.printing.lambdarepr import LambdaPrinter

from memfuse.base import torch_private
from memfuse.base.config import Config
from memfuse.base.debug import STATS, timed
from memfuse.base.source import Lines
from memfuse.buffers import Origin, plan_buffers, verify_buffer_plan
from memfuse.codegen import dtype_name, generate
from memfuse.ir.graph import Op, ValueRef
from memfuse.ir.views import VIEW_TARGETS, Layout, contiguous, view_layout
from memfuse.runtime.aten_groups import AtenGroup
from memfuse.runtime.externs import substitute
from memfuse.runtime.launchers import KernelLaunch, SkippedLaunch
from memfuse.runtime import offload
from memfuse.schedule.steps import ExternStep, KernelGroup, Schedule


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
    (autograd and AOTAutograd track what a returned view aliases).
    `offloaded`: saved values kept in host memory (Plan.offloaded, runtime.offload): a forward
    copies those it returns out after the step that makes them, a backward fetches those it takes
    ahead of their first reader."""

    def __init__(self, schedule: Schedule, symbols: list, config: Config, contiguous_inputs=frozenset(),
                 device_inputs=frozenset(), saved_inputs=frozenset(), returns_gradients: bool = False,
                 offloaded=frozenset()):
        self.graph = schedule.graph
        self.offloaded = frozenset(offloaded)
        self.returns_gradients = returns_gradients
        self.schedule = schedule
        self.symbols = symbols
        self.config = config
        self.contiguous_inputs = frozenset(contiguous_inputs)
        self.device_inputs = frozenset(device_inputs)
        self.steps = [self._prepare(step) for step in schedule.steps]
        self.buffers = plan_buffers(schedule)
        # always, not only under Config.check: a plan that makes a buffer twice or reads one
        # before it is made fails the compile (the call then runs through torch, logged) instead
        # of the program failing in the training loop
        verify_buffer_plan(self.buffers, schedule)
        # by plan step: where offloaded values are copied out, dropped, fetched and waited for
        self.offload_steps = OffloadSteps(self, self.buffers)
        self.source, self.run = _ProgramWriter(self, self.device_inputs).write()
        self.source_unhooked, self.run_unhooked = (self.source, self.run) if not saved_inputs else \
            _ProgramWriter(self, self.device_inputs | frozenset(saved_inputs)).write()
        self.runs = 0        # calls of a compile-only program (memfuse.check_compiles reports them)
        if config.compile_only:
            self.run, self.run_unhooked = self._counted(self.run), self._counted(self.run_unhooked)

    def _counted(self, run: Callable) -> Callable:
        def counted_run(inputs, sizes, device):
            self.runs += 1
            return run(inputs, sizes, device)
        return counted_run

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
        return (SkippedLaunch if self.config.compile_only else KernelLaunch)(step, kernel, self.config)


class _ProgramWriter:
    """Writes a Program's `run` as Python source. Local names: graph values keep their node
    names; everything memfuse binds starts with `mf_`."""

    def __init__(self, program: Program, device_inputs: frozenset):
        self.program = program
        self.device_inputs = device_inputs   # inputs taken as raw pointers (Program)
        self.graph = program.graph
        self.sizes = {s: sympy.Symbol(f"mf_s{i}") for i, s in enumerate(program.symbols)}
        self.printed: dict = {}      # size expression -> its Python text (`expr`)
        # (the math that _SIZE_PRINTER writes: mf_floor(mf_s0/2) for a view(2, -1, D))
        self.namespace: dict = {"mf_allocators": _ALLOCATORS, "mf_allocator": _allocator, "mf_STATS": STATS,
                                "mf_reinterpret": _reinterpret, "mf_check_view": _check_view, "torch": torch,
                                "mf_in_layout": _in_layout,
                                "mf_floor": math.floor, "mf_ceil": math.ceil, "mf_copysign": math.copysign}
        self.out = Lines()
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
        self.namespace.update(OFFLOAD_NAMESPACE)
        if program.config.compile_only:
            self.namespace.update(COMPILE_ONLY_NAMESPACE)
        self.offloads = program.offload_steps

    @timed("program")
    def write(self) -> tuple:
        g = self.graph
        self.out("def run(mf_inputs, mf_sizes, device):")
        self.out.indent()          # the body: every line below
        if g.inputs:
            self.out(f"{', '.join(g.inputs)}, = mf_inputs")
            self.out("mf_inputs.clear()")
        if self.sizes:
            self.out(f"{', '.join(str(s) for s in self.sizes.values())}, = mf_sizes")
        for name, node in g.nodes.items():
            if node.op is Op.CONSTANT:
                self.namespace[name] = node.attr.value
            elif node.op is Op.SYMBOL:
                cast = "float" if node.value.dtype.is_floating_point else "int"
                self.out(f"{name} = {cast}({self.expr(node.attr.expr)})")
        self.frees(0)
        for k, (step, prepared) in enumerate(zip(self.program.schedule.steps, self.program.steps), 1):
            self.fetches(k)
            if isinstance(prepared, KernelLaunch):
                self.kernel(step, prepared, k)
            elif isinstance(prepared, AtenGroup):
                self.aten_group(step, prepared)
            else:
                self.extern(step.name)
            self.copies_out(k)
            self.frees(k)
        if self.extern_calls:
            self.out(f"mf_STATS['extern_calls'] += {self.extern_calls}")
        host = self.offloads.host
        outputs = ", ".join(host.get(o, o) if o is not None else "None" for o in g.outputs)
        self.out(f"return [{outputs}]")
        source = self.out.text()
        name = f"<memfuse program {id(self.program):x}>"
        exec(compile(source, name, "exec"), self.namespace)
        return source, self.namespace["run"]

    def expr(self, e) -> str:
        """A size expression over the leading-dim symbols, as Python."""
        if isinstance(e, (list, tuple)):
            items = [self.expr(x) for x in e]
            return f"({items[0]},)" if len(items) == 1 else f"({', '.join(items)})"
        if type(e) is int:
            return str(e)
        text = self.printed.get(e)
        if text is None:     # sympy's printer is slow, and a program prints the same sizes many times
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
            self.out(f"{b.name} = {made}; del {old.name}")
            self.layouts[b.name] = (layout, None)
            return
        if not self.allocates:
            self.allocates = True
            self.out("mf_empty_strided = mf_allocators.get(device) or mf_allocator(device)")
        self.out(f"{b.name} = mf_empty_strided({shape}, {strides}, {b.dtype})")
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
            self.out(f"del {', '.join(names)}")

    def fetches(self, step: int) -> None:
        """Before step `step`: the fetches of offloaded inputs it issues (Config.offload_fetch_ahead
        launching steps before their first reader), then the waits for those it reads first."""
        for name in self.offloads.fetch_at.get(step, ()):
            self.out(f"{name}, mf_{name}_ready = mf_fetch({name}, device)   # read at step {self.offloads.first_read[name]}")
        for name in self.offloads.wait_at.get(step, ()):
            self.out(f"mf_arrive(mf_{name}_ready, device); del mf_{name}_ready")

    def copies_out(self, step: int) -> None:
        """After step `step`: host copies of the offloaded values it made, and the device tensors of
        those it read last in the forward dropped, with the copies made of them for kernels."""
        for name in self.offloads.made_at.get(step, ()):
            self.out(f"{self.offloads.host[name]} = mf_offload({name}, device)")
        names = []
        for name in self.offloads.drop_at.get(step, ()):
            copies = {self.contiguous.get(name, name), self.unit_stride.get(name, name)}
            copies |= {local for (value, _), local in self.in_layouts.items() if value == name}
            names += [name] + sorted(copies - {name})
        if names:
            self.out(f"del {', '.join(names)}")

    def bind(self, value, prefix: str) -> str:
        name = f"mf_{prefix}_{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def kernel(self, group: KernelGroup, launch: KernelLaunch, step: int) -> None:
        self.out(f"# {group.name}: a kernel over [M, D={group.space.d}]")
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
                local = f"mf_stride{len(self.out.lines)}"
                self.out(f"{local} = {tensor}.stride({arg.dim})")
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
        self.out(f"{group.name}(device, {rows}, {direct}, ({', '.join(values)}{',' if len(values) == 1 else ''}))")
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
        self.out(f"{name} = mf_reinterpret({row.totals}, {self.expr(shape)}, {self.expr(_contiguous_strides(shape))}, "
                  f"{row.offset})")
        self.layouts[name] = (contiguous(shape), None)

    def pointer(self, tensor: str) -> str:
        """The local holding the data pointer of `tensor` (a local), written once."""
        local = self.pointers.get(tensor)
        if local is None:
            local = self.pointers[tensor] = f"mf_pointer{len(self.pointers)}"
            self.out(f"{local} = {tensor}.data_ptr()")
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
            self.out(f"{local} = {value} if {value}.stride(-1) == 1 else {value}.contiguous()")
        return local

    def made_contiguous(self, value: str) -> str:
        """The local holding `value` as kernels read it: an input or an aten result may be
        strided (or unaligned); written once, before its first use."""
        local = self.contiguous.get(value)
        if local is None:
            local = self.contiguous[value] = f"mf_{value}"
            self.out(f"{local} = {value} if {value}.is_contiguous() else {value}.contiguous()")
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
            self.out(f"{local} = mf_in_layout({value}, {self.expr(strides)})")
        return local

    def aten_group(self, group: KernelGroup, step: AtenGroup) -> None:
        runner = self.bind(step, "aten")
        inputs = ", ".join(f"{n!r}: {n}" for n in group.inputs)
        outputs = list(step.shapes)
        self.out(f"# {group.name}: through aten ({group.aten_reason})")
        self.out(f"{', '.join(outputs)}, = {runner}({{{inputs}}}, mf_sizes, device)")

    def extern(self, name: str) -> None:
        node = self.graph[name]
        source = node.inputs[0] if node.inputs else None
        if node.op is Op.GETITEM:
            self.out(f"{name} = {source}[{node.attr.index}]")
        elif name in self.plan.rows:
            self.row(name)
        elif node.op is Op.VIEW and self.graph[source].value.dtype == node.value.dtype:
            self.view(name, source, torch.ops.aten.reshape.default, (), f"{source}.reshape({self.expr(node.value.shape)})")
        elif node.op in (Op.VIEW, Op.CAST):
            cast = "" if self.graph[source].value.dtype == node.value.dtype else f".to({node.value.dtype})"
            self.out(f"{name} = {source}.reshape({self.expr(node.value.shape)}){cast}")
        else:
            args = [self.argument(a) for a in node.attr.args]
            args += [f"{k}={self.argument(v)}" for k, v in node.attr.kwargs]
            method = TENSOR_METHODS.get(node.attr.target)
            if node.attr.target is torch.ops.aten.permute.default and list(node.attr.args[1]) == [1, 0]:
                call = f"{args[0]}.t()"        # half a permute's host time: no list to read
            elif method is not None and not node.attr.kwargs:
                call = f"{args[0]}.{method}({', '.join(args[1:])})"
            else:
                call = f"{self.bind(self.implementation(node.attr.target), 'aten')}({', '.join(args)})"
            if node.attr.target in VIEW_TARGETS and not node.attr.kwargs and isinstance(node.attr.args[0], ValueRef):
                self.view(name, node.attr.args[0].name, node.attr.target, node.attr.args[1:], call)
            else:
                self.out(f"{name} = {call}")
                if node.attr.target in MATMULS:    # a fresh row-major tensor
                    self.layouts[name] = (contiguous(node.value.shape), None)
            self.extern_calls += 1         # counted once a run, at its end (one line, not one a call)

    def implementation(self, target):
        """What an extern step calls: the target's substitute or registered implementation
        (runtime.externs), or, in a compile-only program, the target itself, through the
        dispatcher to its fake implementation (memfuse's own ops launch Triton kernels)."""
        return target if self.program.config.compile_only else substitute(target)

    def view(self, name: str, source: str, target, args: tuple, call: str) -> None:
        """An extern view: made from its source's memory by strides (`mf_reinterpret`) where the
        source's layout is known (layouts.view_layout), under the flag that says the source is
        contiguous where the program only guesses so (`layout`); else, and for what a forward
        returns, the method `call`."""
        node = self.graph[name]
        known = self.layout(source)
        layout = view_layout(target, args, known[0], node.value.shape)
        if layout is None:
            self.out(f"{name} = {call}")
            return
        flag = known[1]
        self.layouts[name] = (layout, flag)
        if name in self.graph.outputs and not self.program.returns_gradients:
            self.out(f"{name} = {call}")
            return
        made = f"mf_reinterpret({source}, {self.expr(layout.shape)}, {self.expr(layout.strides)}, {self.expr(layout.offset)})"
        self.out(f"{name} = {made}" + (f" if {flag} else {call}" if flag else ""))
        if self.program.config.check:      # the tests' runs: the same view as torch makes it
            self.out(f"{f'if {flag}: ' if flag else ''}mf_check_view({name!r}, {name}, {call})")

    def layout(self, value: str) -> tuple:
        """(Layout, flag) of a local a view is made from: known for what memfuse allocated or
        made by strides, a matmul's result, an input the compile key says is contiguous (flag
        None); for anything else (an input from the caller, which a saved-tensors hook may have
        unpacked in any layout; another aten result, a view torch made) contiguous under a flag
        read once, when its first view is made: `x.is_contiguous()`."""
        known = self.layouts.get(value)
        if known is None:
            flag = f"mf_{value}_contiguous"
            self.out(f"{flag} = {value}.is_contiguous()")
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


class OffloadSteps:
    """Where a program's text copies offloaded values out (a forward: those it returns) and fetches
    them back (a backward: those it takes), by plan step (BufferPlan.steps: ENTRY is step 0).
    A forward copies a value out right after the step that makes it and drops its device tensor
    after its last forward reader; a backward issues a fetch `Config.offload_fetch_ahead` launching
    steps (kernels, aten calls; views and tuple elements launch nothing) before its first reader
    and waits for it right before that reader, never earlier: fetching all at the start would
    hold every offloaded value at once, the peak offloading removed. What the device holds of an
    offloaded value (for a peak prediction): a forward's from `made_at` to `drop_at`, a backward's
    fetched copy from `fetch_at` to its last reader (the buffer plan's free)."""

    def __init__(self, program: Program, plan):
        g = program.graph
        self.made_at: dict = {}      # step -> values it makes that are copied out after it
        self.drop_at: dict = {}      # step -> values whose device tensor goes after it
        self.host: dict = {}         # value -> the local of its host copy (what the forward returns)
        self.fetch_at: dict = {}     # step -> values whose fetch is issued before it
        self.wait_at: dict = {}      # step -> values the compute stream waits for before it
        self.first_read: dict = {}   # value -> the step that reads its fetched copy first
        outputs, inputs = set(g.outputs), set(g.inputs)
        reads = [set(step.reads) for step in plan.steps]
        for name in sorted(program.offloaded):
            readers = [k for k, names in enumerate(reads) if name in names]
            if name in outputs and name not in inputs:
                made = [k for k, step in enumerate(plan.steps) if name in step.made]
                if not made:
                    raise NotImplementedError(f"memfuse: offloaded value {name} is made by no step of the forward "
                                              f"(a constant or an input): nothing to copy out")
                self.made_at.setdefault(made[0], []).append(name)
                self.drop_at.setdefault(max([made[0], *readers]), []).append(name)
                self.host[name] = f"mf_host_{name}"
            elif name in inputs and readers:
                first = readers[0]
                self.first_read[name] = first
                self.wait_at.setdefault(first, []).append(name)
                self.fetch_at.setdefault(self._issue_step(program, first), []).append(name)

    @staticmethod
    def _issue_step(program: Program, first: int) -> int:
        """The plan step before which a fetch read first at `first` is issued."""
        g, ahead, step = program.graph, program.config.offload_fetch_ahead, first
        while step > 1 and ahead > 0:
            step -= 1
            prepared = program.steps[step - 1]
            node = g.nodes.get(getattr(prepared, "name", None))
            launches = not isinstance(prepared, ExternStep) or node is not None and (
                node.op is Op.CAST or node.op is Op.EXTERN and node.attr.target not in VIEW_TARGETS)
            ahead -= launches
        return step


MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.mm.dtype, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}

# aten calls a program makes as the tensor's own method: the same kernel, without the Python
# frames of an OpOverload call (host time per call, and a layer's backward makes dozens)
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


class _SizePrinter(LambdaPrinter):
    """Size expressions as Python calling the math functions the program binds under `mf_` names
    (`mf_floor(mf_s0/2)`): a value of the program may have a math function's name (an aten.floor
    node is `floor`), and a local of that name would shadow the function in the whole program."""

    def _module_format(self, fqn: str, register: bool = True) -> str:
        return "mf_" + super()._module_format(fqn, register)


_SIZE_PRINTER = _SizePrinter({"allow_unknown_functions": True, "fully_qualified_modules": False, "inline": True})


_ALLOCATORS: dict = {}   # device -> (sizes, strides, dtype) -> an uninitialized tensor there


def _allocator(device: torch.device) -> Callable:
    """The allocator programs use on `device`: inductor's `_empty_strided_cpu` / `_cuda` where
    torch has them (they skip torch.empty's argument parser and dispatcher, most of its host
    time). The CUDA one allocates on the current device, the device memfuse launches on
    (docs/distributed.md: `torch.cuda.set_device`)."""
    allocate = torch_private.empty_strided(device.type)
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
_reinterpret = torch_private.reinterpret_tensor


def _dispatched_allocator(device: torch.device) -> Callable:
    """torch.empty_strided through the dispatcher, so that FakeTensorMode sees it."""
    def allocate(sizes, strides, dtype):
        return torch.empty_strided(sizes, strides, dtype=dtype, device=device)
    return allocate


# A compile-only program (Config.compile_only) runs on fake tensors: its allocations and views go
# through the dispatcher, where FakeTensorMode makes fakes; inductor's allocator and reinterpret
# (torch_private) are C++ calls past it that would allocate real memory or lose the fake.
COMPILE_ONLY_NAMESPACE = {"mf_allocators": {}, "mf_allocator": _dispatched_allocator,
                          "mf_reinterpret": torch_private.as_strided_at,
                          "mf_offload": offload.offload_fake, "mf_fetch": offload.fetch_fake}

# the calls a program's text makes for offloaded values (runtime.offload)
OFFLOAD_NAMESPACE = {"mf_offload": offload.offload, "mf_fetch": offload.fetch, "mf_arrive": offload.arrive}
