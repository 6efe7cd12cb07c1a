"""explain: what was fused, what was saved, and why, read from a compiled program's records.

    report = memfuse.explain(fn, *example_args, **kwargs)   # prints the report, returns it
    report.saved, report.kernels, report.fallbacks           # the same facts as data
    report.draw("plan.svg")                                  # the min-cut as a picture

Nothing here re-runs a stage: `build_report` reads what capture (fallbacks, the aten graph),
plan (saved values, decisions with reasons), schedule (kernel groups, why nodes did not fuse)
and codegen (kernel sources, bytes per row) recorded on a FusedFunction's cache entry. The same
report feeds MEMFUSE_LOG and MEMFUSE_DUMP_DIR: `report_compile` is debug's compile hook, registered
on `import memfuse` (debug, the ground floor, never imports this module).
"""
from __future__ import annotations

import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import sympy
import torch
from torch._dynamo.eval_frame import OptimizedModule

from memfuse.fronts.function import FusedFunction
from memfuse.fronts.backend import watch
from memfuse.buffers import format_buffer_plan
from memfuse.base.debug import STATS, human_bytes, topic_log
from memfuse.reports.draw import MemoryDrawing, PlanDrawing, ProgramMemory, memory_drawing, plan_drawing
from memfuse.driver.fallback import EagerCall
from memfuse.ir.graph import EXTERNAL, LEAF, RANDOM, REDUCTION, Graph, Op, Reshape, format_graph, value_bytes
from memfuse.ir.patterns import SECTIONS
from memfuse.fronts.module import FusedModule
from memfuse.plan import Decision
from memfuse.schedule.steps import ExternStep, KernelGroup
from memfuse.fronts.wrap import memory_efficient_fusion


FAMILIES = ("pointwise", "reductions", "random", "extern", "leaves")


# -- the report's rows -------------------------------------------------------------------------
@dataclass(frozen=True)
class GraphSize:
    nodes: int
    families: dict                     # family (FAMILIES) -> node count

    def __str__(self) -> str:
        return f"{self.nodes} nodes: " + ", ".join(f"{self.families[f]} {f}" for f in FAMILIES)


@dataclass(frozen=True)
class SavedRow:
    """One value the forward keeps alive for the backward."""
    name: str
    kind: str                          # full / row / col / scalar / tensor (ir.Kind)
    shape: tuple                       # at the example sizes
    dtype: Optional[torch.dtype]
    bytes: int
    is_input: bool
    reason: str
    argument: Optional[str] = None     # the user's argument name, for inputs
    offloaded: bool = False            # kept in host memory until the backward (Plan.offloaded)


@dataclass(frozen=True)
class DecisionRow:
    name: str
    op: str
    decision: Decision
    reason: str


@dataclass(frozen=True)
class KernelRow:
    """One kernel group of a program: a generated Triton kernel, or a group run through aten."""
    program: str                       # "forward" / "backward"
    name: str
    ops: tuple                         # (node name, op name), in order
    inputs: tuple                      # values read (tensors and per-call scalars)
    outputs: tuple                     # values written for later steps
    column_sums: tuple                 # reductions over M, finished by the kernel's last program
    rows: Optional[int]                # M at the example sizes (None: no rows)
    d: Optional[int]
    bytes_per_row: int                 # from the generated source (0 for aten groups)
    bytes: int                         # tensors read + written at the example sizes
    path: Optional[str] = None         # the generated source file (in the kernel cache)
    aten_reason: Optional[str] = None  # why this group runs through aten instead
    tile: Optional[tuple] = None       # (BLOCK_M, BLOCK_D): rows and columns one program holds
    persistent: bool = False           # a fixed grid whose programs loop over tiles
    passes: Optional[int] = None       # looped kernels: walks over each row (None: the row in registers)
    online: tuple = ()                 # looped kernels: sums of exp carried with their row max (one pass fewer each)
    not_online: tuple = ()             # looped kernels: (sum, why) for the sums of exp that keep their own pass
    twin_of: Optional[str] = None      # the earlier kernel of the same code whose function it launches (codegen)

    @property
    def is_kernel(self) -> bool:
        return self.aten_reason is None


@dataclass(frozen=True)
class ExternRow:
    program: str
    name: str
    target: str


@dataclass(frozen=True)
class NotFusedRow:
    program: str
    node: str
    input: str
    reason: str


@dataclass(frozen=True)
class PlacedRow:
    """Where the scheduler put a value other than where its inputs are, and why (Schedule.placed)."""
    program: str
    node: str
    reason: str


@dataclass(frozen=True)
class PaddingRow:
    """One extern matmul's padding decision (memfuse.schedule.padding.MatmulPadding) in one program."""
    program: str
    padding: Any                       # padding.MatmulPadding


@dataclass(frozen=True)
class FallbackRow:
    node: str
    target: str
    reason: str


@dataclass(frozen=True)
class SavedMemory:
    """Storages saved for backward beyond the inputs, as measured with saved_tensors_hooks."""
    bytes: int
    tensors: int


@dataclass
class Report:
    name: str
    joint: GraphSize
    forward: GraphSize
    backward: Optional[GraphSize]
    saved: list                        # SavedRow, in forward-output order
    saved_bytes: int                   # planned bytes beyond the inputs (Plan.saved_bytes)
    decisions: list                    # DecisionRow for every op the plan decided on
    kernels: list                      # KernelRow, forward program then backward
    externs: list                      # ExternRow
    not_fused: list                    # NotFusedRow
    fallbacks: list                    # FallbackRow
    specialized: Optional[str] = None  # why leading sizes joined the compile key
    eager_saved: Optional[SavedMemory] = None     # eager autograd on the example args
    memfuse_saved: Optional[SavedMemory] = None   # the fused function, measured the same way
    entry: Any = field(default=None, repr=False, compare=False)   # the cache entry read
    paddings: list = field(default_factory=list)   # PaddingRow per extern matmul, forward then backward
    budget: Any = None                 # plan.Budget or plan.PeakBudget: what Config.memory_budget changed
    placed: list = field(default_factory=list)     # PlacedRow, forward then backward
    merged: dict = field(default_factory=dict)      # Captured.merged: duplicate dropped -> node kept
    # Captured.decisions: each pattern's decisions by its name (memfuse.ir.patterns), also read as
    # attributes (`report.<pattern name>`)
    patterns: dict = field(default_factory=dict)
    # (argument, its dims that are size symbols of the program: a new value reuses it), per argument
    symbolic_sizes: list = field(default_factory=list)

    def __getattr__(self, name: str):
        patterns = self.__dict__.get("patterns", {})
        if name in patterns:
            return patterns[name]
        if name in SECTIONS:           # a registered pattern that decided nothing here
            return []
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def kernels_of(self, program: str, generated_only: bool = True) -> list:
        return [k for k in self.kernels if k.program == program and (k.is_kernel or not generated_only)]

    def decided(self, decision: Decision) -> list:
        return [d.name for d in self.decisions if d.decision is decision]

    def __str__(self) -> str:
        return format_report(self)

    def drawing(self):
        """The min-cut as drawing data (draw.PlanDrawing): nodes, roles, positions, saved values."""
        return plan_drawing(self.entry.captured, self.entry.plan, title=self.name)

    def draw(self, path) -> PlanDrawing:
        """Write the min-cut picture to `path` (.png, .svg, .pdf or .dot); returns the drawing."""
        drawing = self.drawing()
        drawing.save(path)
        return drawing

    def to_dot(self) -> str:
        return self.drawing().to_dot()


# -- building it from a cache entry ------------------------------------------------------------
def family(op: Op) -> str:
    if op in LEAF:
        return "leaves"
    if op in EXTERNAL:
        return "extern"
    if op in REDUCTION:
        return "reductions"
    if op in RANDOM:
        return "random"
    return "pointwise"


def graph_size(graph: Graph) -> GraphSize:
    counts = Counter(family(node.op) for node in graph.nodes.values())
    return GraphSize(len(graph.nodes), {f: counts.get(f, 0) for f in FAMILIES})


def build_report(entry, name: str) -> Report:
    """Read a FusedFunction cache entry (api._CacheEntry) into a Report; runs nothing."""
    captured, the_plan, function = entry.captured, entry.plan, entry.function
    joint, hints = captured.joint, captured.hints
    arguments = dict(zip(joint.inputs[:captured.num_primals], entry.input_names))
    saved = [SavedRow(s.name, joint[s.name].value.kind.value, _example_shape(joint[s.name].value.shape, hints),
                      joint[s.name].value.dtype, s.bytes, s.is_input, s.reason, arguments.get(s.name),
                      s.name in the_plan.offloaded)
             for s in the_plan.saved]
    decisions = [DecisionRow(n, joint[n].op.value, d, reason) for n, (d, reason) in the_plan.decisions.items()]
    kernels, externs, not_fused, paddings, placed = [], [], [], [], []
    for program_name, program in (("forward", function.forward), ("backward", function.backward)):
        if program is not None:
            _read_program(program_name, program, hints, kernels, externs, not_fused)
            paddings.extend(PaddingRow(program_name, p) for p in program.schedule.paddings)
            placed.extend(PlacedRow(program_name, *row) for row in program.schedule.placed)
    fallbacks = [FallbackRow(*f) for f in captured.fallbacks]
    return Report(name, graph_size(joint), graph_size(the_plan.forward),
                  graph_size(the_plan.backward) if the_plan.backward is not None else None,
                  saved, the_plan.saved_bytes, decisions, kernels, externs, not_fused, fallbacks,
                  captured.specialized, entry=entry, paddings=paddings, budget=the_plan.budget, placed=placed,
                  merged=dict(captured.merged),
                  patterns={name: list(decisions) for name, decisions in captured.decisions.items()},
                  symbolic_sizes=[(argument, dims) for name, argument in arguments.items()
                                  if (dims := tuple(d for d, size in enumerate(joint[name].value.shape)
                                                    if not getattr(size, "is_number", True)))])


def _read_program(program_name: str, program, hints: dict, kernels: list, externs: list,
                  not_fused: list) -> None:
    graph = program.graph
    for step, prepared in zip(program.schedule.steps, program.steps):
        if isinstance(step, ExternStep):
            externs.append(ExternRow(program_name, step.name, _extern_target(graph, step.name)))
        elif isinstance(step, KernelGroup):
            kernels.append(_kernel_row(program_name, graph, step, getattr(prepared, "kernel", None), hints,
                                       next(iter(getattr(prepared, "configs", {}).values()), None)))
    not_fused.extend(NotFusedRow(program_name, *row) for row in program.schedule.not_fused)


def _kernel_row(program_name: str, graph: Graph, group: KernelGroup, kernel, hints: dict, config) -> KernelRow:
    """`config`: the launch configuration the kernel last ran with (None if it never ran)."""
    moved = [n for n in group.inputs + group.outputs + group.column_sums
             if graph[n].op not in (Op.CONSTANT, Op.SYMBOL, Op.SEED)]
    rows = None if group.space.m is None else _example_int(group.space.m, hints)
    source = kernel.source if kernel is not None else None
    return KernelRow(program_name, group.name, tuple((n, graph[n].op.value) for n in group.nodes),
                     tuple(n for n in group.inputs if graph[n].op is not Op.CONSTANT),
                     tuple(group.outputs), tuple(group.column_sums), rows, group.space.d,
                     source.bytes_per_row if source is not None else 0,
                     sum(value_bytes(graph[n].value, hints) for n in moved),
                     kernel.path if kernel is not None else None, group.aten_reason,
                     (config.block_m if config is not None else None, source.constexprs["BLOCK_D"])
                     if source is not None else None,
                     source.persistent if source is not None else False,
                     *((source.passes, source.online, source.not_online) if source is not None else ()),
                     twin_of=kernel.twin_of if kernel is not None else None)


def _extern_target(graph: Graph, name: str) -> str:
    node = graph[name]
    if node.op is Op.EXTERN and node.attr.target is torch.ops.aten.mm.dtype:
        return f"{node.attr.target} (a cast of the product to fp32, written by the matmul: no cast kernel)"
    if node.op is Op.EXTERN:
        return str(node.attr.target)
    if node.op is Op.GETITEM:
        return f"getitem {node.attr.index} of {node.inputs[0]}"
    if isinstance(node.attr, Reshape):
        return f"{node.op.value} of {node.inputs[0]} in memory, read by aten (a reshape in the runtime)"
    return f"{node.op.value} of a finished column sum (a reshape in the runtime)"


def _example_int(expr, hints: dict):
    """The size at the example arguments; the expression itself if it is not theirs to fix."""
    if isinstance(expr, int):
        return expr
    value = sympy.sympify(expr).subs(hints)
    return int(value) if value.is_number else str(value)


def _example_shape(shape: tuple, hints: dict) -> tuple:
    return tuple(_example_int(s, hints) for s in shape)


# -- printing -----------------------------------------------------------------------------------
def _dtype(dtype) -> str:
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


def format_report(r: Report) -> str:
    lines = [f"memfuse.explain: {r.name}"]
    lines += _graph_lines(r) + _pattern_lines(r) + _saved_lines(r)
    lines += _decision_lines(r) + _kernel_lines(r) + padding_lines(r)
    lines += in_place_lines(r) + buffer_lines(r)
    lines += _fallback_lines(r)
    return "\n".join(lines)


def _graph_lines(r: Report) -> list:
    lines = ["", "graphs", f"  joint     {r.joint}", f"  forward   {r.forward}"]
    lines.append(f"  backward  {r.backward}" if r.backward is not None else "  backward  none (no input needs a gradient)")
    if r.symbolic_sizes:
        dims = "; ".join(f"{argument} dim{'s' if len(d) > 1 else ''} {', '.join(map(str, d))}"
                         for argument, d in r.symbolic_sizes)
        lines.append(f"  sizes     symbols of the program, a new value compiles nothing: {dims}; "
                     f"every other dim is fixed in it")
    if r.specialized:
        lines.append(f"  leading sizes are part of the compile key: {r.specialized}")
    if r.merged:
        pairs = ", ".join(f"{dropped} -> {kept}" for dropped, kept in r.merged.items())
        lines.append(f"  merged    {len(r.merged)} duplicates (written to memory, or from constants alone), "
                     f"one node each: {pairs}")
    return lines


def _pattern_lines(r: Report) -> list:
    """Each registered pattern's decisions under its title (memfuse.ir.patterns.register_report)."""
    lines = []
    for name, section in SECTIONS.items():
        decisions = r.patterns.get(name)
        if decisions:
            lines += ["", section.title] + [f"  {section.line(d)}" for d in decisions]
    return lines


def _saved_lines(r: Report) -> list:
    lines = ["", f"saved for backward ({len(r.saved)} values)"]
    width = max([len(s.name) for s in r.saved] + [4])
    for s in r.saved:
        what = f"input {s.argument!r}" if s.is_input and s.argument else "input" if s.is_input else \
            "computed, offloaded to host" if s.offloaded else "computed"
        lines.append(f"  {s.name:<{width}}  {s.kind:<6} {_dtype(s.dtype):<8} {str(list(s.shape)):<14} "
                     f"{human_bytes(s.bytes):>9}  {what}: {s.reason}")
    lines.append(f"  beyond the inputs: {human_bytes(r.saved_bytes)} planned")
    offloaded = [s for s in r.saved if s.offloaded]
    if offloaded:
        lines.append(f"  offloaded to host memory: {human_bytes(sum(s.bytes for s in offloaded))} in {len(offloaded)} "
                     f"values ({', '.join(s.name for s in offloaded)}), fetched back ahead of their first backward reader")
    if r.budget is not None:      # a byte budget's: the target, the peaks, a line per moved value
        lines += [f"  {line}" for line in str(r.budget).splitlines()]
    if r.memfuse_saved is not None:
        lines.append("  measured on the example args (saved_tensors_hooks, unique storages not among the inputs):")
        lines.append(f"    memfuse          {human_bytes(r.memfuse_saved.bytes):>9} in {r.memfuse_saved.tensors} tensors")
    if r.eager_saved is not None:
        lines.append(f"    eager autograd   {human_bytes(r.eager_saved.bytes):>9} in {r.eager_saved.tensors} tensors")
    return lines


def _decision_lines(r: Report) -> list:
    lines = ["", "decisions (plan)"]
    groups: dict = {}
    for d in r.decisions:
        if d.decision is not Decision.SAVE:
            groups.setdefault((d.decision, d.reason), []).append(f"{d.name}" if d.name == d.op else f"{d.name}({d.op})")
    if not groups:
        lines.append("  (none)")
    for (decision, reason), names in groups.items():
        lines.append(f"  {decision.value} ({len(names)}): {reason}")
        lines.append(f"    {', '.join(names)}")
    return lines


def _kernel_lines(r: Report) -> list:
    lines = ["", "kernels"]
    for program in ("forward", "backward"):
        rows = [k for k in r.kernels if k.program == program]
        externs = [e for e in r.externs if e.program == program]
        if not rows and not externs:
            continue
        generated = sum(k.is_kernel for k in rows)
        lines.append(f"  {program}: {generated} generated kernel(s), {len(rows) - generated} aten group(s), "
                     f"{len(externs)} extern step(s)")
        for k in rows:
            lines += _one_kernel(k)
        for e in externs:
            lines.append(f"    extern {e.name}: {e.target}")
    if r.not_fused:
        lines.append("  not fused (node, input: reason)")
        for n in r.not_fused:
            lines.append(f"    {n.program} {n.node} <- {n.input}: {n.reason}")
    if r.placed:
        lines.append("  placed (node: where it runs, and why)")
        for p in r.placed:
            lines.append(f"    {p.program} {p.node}: {p.reason}")
    return lines


def _one_kernel(k: KernelRow) -> list:
    space = f"[M={k.rows if k.rows is not None else '-'}, D={k.d if k.d is not None else '-'}]"
    head = f"    {k.name}: {len(k.ops)} ops over {space}"
    if not k.is_kernel:
        head += f", runs through aten: {k.aten_reason}"
    lines = [head, f"      ops:    {', '.join(op for _, op in k.ops)}",
             f"      reads:  {', '.join(k.inputs) or '-'}", f"      writes: {', '.join(k.outputs) or '-'}"]
    if k.column_sums:
        lines.append(f"      column sums (over M): {', '.join(k.column_sums)}")
    if k.is_kernel:
        grid = "a persistent grid looping over tiles" if k.persistent else "one tile per program"
        lines.append(f"      tile:   {k.tile[0]} rows x {k.tile[1]} columns, {grid}")
        if k.passes is not None:
            lines.append(f"      looped: {k.passes} pass(es) over each row, in chunks of {k.tile[1]} columns")
        for online in k.online:
            lines.append(f"      online: {online}: a running max, the sum rescaled as it grows (no pass of its own)")
        for name, why in k.not_online:
            lines.append(f"      not online: {name}: {why}")
        partials = " (+ fp32 column partials per program)" if k.column_sums else ""
        lines.append(f"      moves {k.bytes_per_row} B per row, {human_bytes(k.bytes)} at the example sizes{partials}")
        twin = f" (shared with {k.twin_of}: the same code over other values, one binary)" if k.twin_of else ""
        lines.append(f"      source: {k.path}{twin}")
    return lines


def padding_lines(r: Report) -> list:
    """Each extern matmul's operand padding (memfuse.schedule.padding): which of M, N, K were padded to
    what, or why none was."""
    if not r.paddings:
        return []
    lines = ["", "matmul padding (cuBLAS alignment: Config.pad_matmuls)"]
    for row in r.paddings:
        lines.append(f"  {row.program} {row.padding}")
    return lines


def in_place_lines(r: Report) -> list:
    """The aten calls that write in place into memory nobody else reads (memfuse.schedule.reinplace)."""
    rows = [(name, s) for name, program in (("forward", r.entry.function.forward),
                                            ("backward", r.entry.function.backward))
            if program is not None for s in program.schedule.in_place]
    if not rows:
        return []
    return ["", "aten calls written in place (no clone, no second buffer)"] + [f"  {name} {s}" for name, s in rows]


def buffer_lines(r: Report) -> list:
    """The buffer plan of each program (memfuse.buffers): what each step allocates or reuses, binds
    and drops, and why, with the bytes the program holds at the example sizes."""
    lines = ["", "buffers (allocate / bind / drop per step; bytes held at the example sizes)"]
    for name, program in (("forward", r.entry.function.forward), ("backward", r.entry.function.backward)):
        if program is not None:
            lines.append(f"  {name}")
            lines += ["  " + line for line in format_buffer_plan(program.buffers, r.entry.captured.hints).splitlines()]
    return lines


def _fallback_lines(r: Report) -> list:
    lines = ["", "fallbacks (ops run through aten)"]
    for f in r.fallbacks:
        lines.append(f"  {f.node} ({f.target}): {f.reason}")
    for k in r.kernels:
        if not k.is_kernel:
            lines.append(f"  group {k.name} ({len(k.ops)} ops): {k.aten_reason}")
    if len(lines) == 2:
        lines.append("  (none)")
    return lines


# -- MEMFUSE_LOG and MEMFUSE_DUMP_DIR ----------------------------------------------------------
def report_compile(name: str, entry, folder: Optional[Path]) -> None:
    """debug's compile hook (registered on `import memfuse`): log the entry's report on the
    topic loggers, and dump it to `folder` when MEMFUSE_DUMP_DIR is set."""
    report = build_report(entry, name)
    log_report(report)
    if folder is not None:
        write_dump(report, folder)


def log_report(r: Report) -> None:
    """The report, one topic logger per section: summaries at INFO, details at DEBUG."""
    graphs, plan_log, kernels, fallbacks = (topic_log(t) for t in ("graphs", "plan", "kernels", "fallbacks"))
    graphs.info("memfuse: %s: joint %s", r.name, r.joint)
    if graphs.isEnabledFor(logging.DEBUG) and r.entry is not None:
        graphs.debug("memfuse: %s: joint graph\n%s", r.name, format_graph(r.entry.captured.joint))
        graphs.debug("memfuse: %s: forward graph\n%s", r.name, format_graph(r.entry.plan.forward))
        if r.entry.plan.backward is not None:
            graphs.debug("memfuse: %s: backward graph\n%s", r.name, format_graph(r.entry.plan.backward))
    computed = [s for s in r.saved if not s.is_input]
    plan_log.info("memfuse: %s: saves %s beyond the inputs (%d computed values: %s), %d inputs; "
                  "recomputes %d ops, regenerates %d", r.name, human_bytes(r.saved_bytes), len(computed),
                  ", ".join(s.name for s in computed) or "-", len(r.saved) - len(computed),
                  len(r.decided(Decision.RECOMPUTE)), len(r.decided(Decision.REGENERATE)))
    for d in r.decisions:
        plan_log.debug("memfuse: %s: %s %s: %s", r.name, d.decision.value, d.name, d.reason)
    for k in r.kernels:
        if k.is_kernel:
            kernels.info("memfuse: %s: %s %s: %d ops, reads %s, writes %s%s, %d B per row, %s",
                         r.name, k.program, k.name, len(k.ops), ", ".join(k.inputs) or "-",
                         ", ".join(k.outputs) or "-",
                         f", column sums {', '.join(k.column_sums)}" if k.column_sums else "",
                         k.bytes_per_row, k.path)
    for n in r.not_fused:
        kernels.debug("memfuse: %s: %s: %s not fused with its input %s: %s", r.name, n.program, n.node,
                      n.input, n.reason)
    for p in r.placed:
        kernels.debug("memfuse: %s: %s: %s placed: %s", r.name, p.program, p.node, p.reason)
    for f in r.fallbacks:
        fallbacks.info("memfuse: %s: %s (%s) runs through aten: %s", r.name, f.node, f.target, f.reason)


def write_dump(r: Report, folder: Path) -> Path:
    """Graphs (IR text and the aten FX code), the report, the plan as DOT, and every kernel's source."""
    folder.mkdir(parents=True, exist_ok=True)
    entry = r.entry
    files = {"joint.ir.txt": format_graph(entry.captured.joint),
             "forward.ir.txt": format_graph(entry.plan.forward),
             "explain.txt": str(r) + "\n",
             "plan.dot": r.to_dot()}
    if entry.plan.backward is not None:
        files["backward.ir.txt"] = format_graph(entry.plan.backward)
    aten = entry.captured.aten_graph
    if aten is not None:
        files["joint.aten.py"] = aten.print_readable(print_output=False)
    for name, program in (("forward", entry.function.forward), ("backward", entry.function.backward)):
        if program is not None:
            files[f"{name}.program.py"] = program.source
        for prepared in (program.steps if program is not None else []):
            kernel = getattr(prepared, "kernel", None)
            if kernel is not None:
                files[f"kernels/{kernel.source.name}.py"] = kernel.source.source
    for name, text in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    topic_log("kernels").info("memfuse: %s: dumped graphs, plan and %d kernels to %s", r.name,
                              sum(n.startswith("kernels/") for n in files), folder)
    return folder


# -- explain() ---------------------------------------------------------------------------------
def explain(fn, *example_args, **kwargs) -> "Report | EagerCall":
    """Compile `fn` (a function, an nn.Module, or a memfuse FusedFunction or FusedModule) for the
    example arguments, print what was fused, saved and why, and return the report. For a call
    memfuse runs through torch instead, it prints and returns that decision (eager.EagerCall: why,
    and the way out).

    It also measures the bytes saved for backward on the example arguments, for eager autograd
    and for the fused function, by running each forward once under saved_tensors_hooks (torch's
    random state is restored after each run). The counters of `memfuse.stats()` are left as
    they were."""
    if is_torch_compiled(fn):     # torch.compile(model, backend="memfuse"): a report per graph
        return explain_torch_compiled(fn, example_args, kwargs)
    fused, entry = compile_entry(fn, example_args, kwargs)
    if isinstance(entry, EagerCall):
        print(f"memfuse.explain: {entry.name}\n\n{entry}")
        return entry
    report = build_report(entry, fused._name())
    with _counters_kept():
        report.eager_saved = measure_saved(fused.original if isinstance(fused, FusedModule) else fused.fn,
                                           example_args, kwargs)
        report.memfuse_saved = measure_saved(fused, example_args, kwargs)
    print(report)
    return report


def compile_entry(fn, args: tuple, kwargs: dict):
    """(FusedFunction or FusedModule, cache entry or eager.EagerCall) for these arguments: `fn`
    itself when it is one (its cache is reused), else a fresh wrapper. The counters are left as
    they were."""
    fused = fn if isinstance(fn, (FusedFunction, FusedModule)) else memory_efficient_fusion(fn)
    with _counters_kept():
        return fused, fused.compiled_for(*args, **kwargs)


@contextlib.contextmanager
def _counters_kept():
    counters = Counter(STATS)
    try:
        yield
    finally:
        STATS.clear()
        STATS.update(counters)


def measure_saved(fn, args: tuple, kwargs: dict) -> SavedMemory:
    """Run `fn(*args, **kwargs)` once and sum the unique storages autograd saves for backward
    that are not storages of the arguments (or of the module's parameters and buffers)."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if isinstance(fn, torch.nn.Module):
        tensors += list(fn.parameters()) + list(fn.buffers())
    inputs = {_storage_key(t) for t in tensors}
    found: dict = {}

    def pack(t):
        key = _storage_key(t)
        if key not in inputs:
            found[key] = t.untyped_storage().nbytes()
        return t

    with _forked_rng(tensors), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    del out
    return SavedMemory(sum(found.values()), len(found))


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def _forked_rng(tensors):
    """torch's CPU generator and those of the arguments' GPUs, restored on exit."""
    devices = sorted({t.device.index if t.device.index is not None else torch.cuda.current_device()
                      for t in tensors if t.device.type == "cuda"})
    return torch.random.fork_rng(devices=devices)


def draw_plan(fn, *example_args, path=None, **kwargs) -> PlanDrawing:
    """Compile `fn` for the example arguments and draw its plan; written to `path` when given
    (.png, .svg, .pdf or .dot). `path` is taken by this call, never passed on to `fn`. A call
    that runs through torch has no plan to draw: a ValueError says why."""
    fused, entry = compile_entry(fn, example_args, kwargs)
    if isinstance(entry, EagerCall):
        raise ValueError(f"memfuse.draw_plan: no plan to draw: {entry}")
    drawing = plan_drawing(entry.captured, entry.plan, title=fused._name())
    if path is not None:
        drawing.save(path)
    return drawing


def draw_memory(fn, *example_args, path=None, **kwargs) -> MemoryDrawing:
    """Compile `fn` for the example arguments and draw the bytes one training step holds while each
    step of its forward, then of its backward, runs (memfuse.buffers' plan at the example sizes),
    saved tensors as their own band; written to `path` when given (.png, .svg or .pdf). `fn` may be
    a function, an nn.Module, a memory_efficient_fusion wrapper or a `torch.compile(...,
    backend="memfuse")` model (then the call runs once: every graph's forward in the order they ran,
    their backwards in reverse). `path` is taken by this call, never passed on to `fn`."""
    if is_torch_compiled(fn):
        name, programs = _compiled_programs(fn, example_args, kwargs)
    else:
        fused, entry = compile_entry(fn, example_args, kwargs)
        if isinstance(entry, EagerCall):
            raise ValueError(f"memfuse.draw_memory: no programs to draw: {entry}")
        name, programs = fused._name(), _programs(entry, "")
    drawing = memory_drawing(programs, title=name)
    if path is not None:
        drawing.save(path)
    return drawing


def _programs(entry, prefix: str, saved_elsewhere: int = 0) -> list:
    """[forward, backward] ProgramMemory of a compiled entry (api's cache entry, a GraphRecord);
    `saved_elsewhere`: what the saved activations of other graphs hold meanwhile."""
    saved = frozenset(s.name for s in entry.plan.saved if not s.is_input)
    return [ProgramMemory(f"{prefix}{kind}", program.buffers, saved, entry.captured.hints, saved_elsewhere)
            for kind, program in (("forward", entry.function.forward), ("backward", entry.function.backward))
            if program is not None]


def _compiled_programs(compiled, args: tuple, kwargs: dict) -> tuple:
    """(name, ProgramMemory list) of a torch.compile'd call, run once to see its graphs."""
    with _counters_kept(), watch() as records:
        compiled(*args, **kwargs)
    records = [r for r in records if r.through_torch is None]
    if not records:
        raise ValueError("memfuse.draw_memory: the call ran no graph through memfuse's backend: compile it with "
                         "torch.compile(..., backend=\"memfuse\")")
    # the saved activations of graph k are held from its forward until its backward, which runs
    # after those of the graphs after it: each program counts those of the graphs before it
    before = [sum(r.plan.saved_bytes for r in records[:k]) for k in range(len(records))]
    programs = [_programs(r, f"{r.name} ", held) for r, held in zip(records, before)]
    forwards, backwards = [p[0] for p in programs], [p[1] for p in reversed(programs) if len(p) > 1]
    return _compiled_name(compiled), forwards + backwards


# -- torch.compile(model, backend="memfuse") ---------------------------------------------------
@dataclass(frozen=True)
class TorchGraphRow:
    """A graph of the call that runs through torch: memfuse could not compile it."""
    name: str
    reason: str


@dataclass
class ModelReport:
    """explain() of a model compiled with `torch.compile(..., backend="memfuse")`: one Report per
    graph memfuse compiled that the call ran, the graphs it ran through torch and why, and what
    the whole call saves for backward, compiled and eager."""
    name: str
    graphs: list                       # Report, in the order the call first ran them
    through_torch: list                # TorchGraphRow
    compiled_saved: SavedMemory
    eager_saved: SavedMemory

    def __str__(self) -> str:
        return format_model_report(self)


def is_torch_compiled(fn) -> bool:
    """`torch.compile(module)` (an OptimizedModule) or `torch.compile(function)`."""
    return isinstance(fn, OptimizedModule) or hasattr(fn, "_torchdynamo_orig_callable")


def explain_torch_compiled(compiled, args: tuple, kwargs: dict) -> ModelReport:
    """Run `compiled(*args, **kwargs)` once, watching which graphs it runs (Dynamo compiles those
    it has not compiled yet), and read what the backend recorded for each; measure the bytes the
    call saves for backward against the original's, run the same way. Counters and torch's random
    state are left as they were."""
    original = compiled._orig_mod if isinstance(compiled, OptimizedModule) else compiled._torchdynamo_orig_callable
    name = _compiled_name(compiled)
    with _counters_kept():
        eager_saved = measure_saved(original, args, kwargs)
        with watch() as records:
            compiled_saved = measure_saved(compiled, args, kwargs)
    if not records:
        raise ValueError(f"memfuse.explain: {name} ran no graph through memfuse's backend: compile it with "
                         f"torch.compile(..., backend=\"memfuse\"), and check that the call reaches a graph "
                         f"(TORCH_LOGS=graph_breaks says what Dynamo skipped)")
    report = ModelReport(name, [build_report(r, r.name) for r in records if r.through_torch is None],
                         [TorchGraphRow(r.name, r.through_torch) for r in records if r.through_torch is not None],
                         compiled_saved, eager_saved)
    print(report)
    return report


def _compiled_name(compiled) -> str:
    """The name of what `torch.compile` wrapped: a module's class, a function's qualified name."""
    original = compiled._orig_mod if isinstance(compiled, OptimizedModule) else compiled._torchdynamo_orig_callable
    return type(original).__name__ if isinstance(original, torch.nn.Module) else \
        getattr(original, "__qualname__", type(original).__name__)


def format_model_report(r: ModelReport) -> str:
    graphs = len(r.graphs) + len(r.through_torch)
    lines = [f"memfuse.explain: {r.name} (torch.compile, backend=\"memfuse\"): the call ran {graphs} graph(s), "
             f"{len(r.graphs)} compiled by memfuse, {len(r.through_torch)} through torch",
             "  saved for backward by the whole call (saved_tensors_hooks, unique storages not among the "
             "inputs, parameters and buffers):",
             f"    compiled         {human_bytes(r.compiled_saved.bytes):>9} in {r.compiled_saved.tensors} tensors",
             f"    eager autograd   {human_bytes(r.eager_saved.bytes):>9} in {r.eager_saved.tensors} tensors"]
    if r.through_torch:
        lines += ["", "graphs run through torch (memfuse could not compile them)"]
        lines += [f"  {g.name}: {g.reason}" for g in r.through_torch]
    for report in r.graphs:
        lines += ["", format_report(report)]
    return "\n".join(lines)
