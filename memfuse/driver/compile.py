"""The compile driver: one function, `compile_program`, that both front doors call, one line a stage:

    capture, patterns   trace the function (memory_efficient_fusion) or lower AOTAutograd's graph
                        (torch.compile) to the IR, with what the plug-ins (memfuse.patterns) found
    plan                save, recompute or regenerate each value (memfuse.plan: the min-cut)
    check               the IR verifier (Config.check), strict mode, the count of aten fallbacks
    schedule            group the nodes into kernels, forward and backward (memfuse.schedule)
    runtime             buffers, codegen and the program text, built by runtime.Program
    precompile          hand the kernels to Triton before the first call (on a GPU)

What a front knows that capture does not (its graph or function, the example tensors, where each
size is read, the loss heads it chunked before the trace, the masks it marked) comes in as a
frozen Source: nothing patches `Captured` after the driver returns. The driver alone checks the
IR (Config.check), refuses what strict mode refuses, counts compiles and aten fallbacks, times
the compile, logs its line and hands the result to the compile hooks (memfuse.reports).

A compile that fails becomes a decision to run through torch in `compile_or_decide` (the wrapper's
calls, an EagerCall: memfuse.driver.fallback); a torch.compile graph whose compile fails, which
includes AOTAutograd's own trace around this driver, in `graph_fallback` (fallback.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, NamedTuple, Optional, Union

import sympy
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memfuse.base.config import Config
from memfuse.base.debug import STATS, on_compile, timed, topic_log
from memfuse.base.progress import ProgressLine
from memfuse.capture import capture, lower_graph
from memfuse.ir.captured import Captured, Retrace
from memfuse.driver.fallback import STRICT, EagerCall, StrictModeError, compile_failed
from memfuse.ir.graph import Graph, Op, Symbol, verify
from memfuse.patterns.attention import MaskDecision, OutputMasks, returned_masks
from memfuse.patterns import rewrite_graph
from memfuse.plan import MemoryBudgetError, Plan, plan
from memfuse.runtime.precompile import enabled as precompile_enabled, precompile, start_driver
from memfuse.runtime.function import CompiledFunction
from memfuse.runtime.program import Program
from memfuse.schedule.groups import schedule
from memfuse.schedule.steps import Schedule

log = logging.getLogger("memfuse")
cache_log = topic_log("cache")
recompile_log = topic_log("recompiles")
fallback_log = topic_log("fallbacks")


# -- what a front hands the driver -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TracedFunction:
    """memory_efficient_fusion's source: a function of tensors that capture traces with AOTAutograd.
    `fn(*tensors)` returns a tuple of tensors (the front's wrapper around the user's function)."""
    name: str
    fn: Callable
    tensors: tuple
    static: tuple                   # per tensor: every dim static (parameters, a module's state)
    trace_joint: bool               # a gradient is needed: trace the backward too
    contiguous: tuple               # per tensor: contiguous in every call (the compile key says so)
    input_names: tuple              # the user's name of each tensor, as explain shows it
    returned_logits: bool = True    # the caller can take chunked logits fn returns (not with CUDA graphs)
    marked_inputs: tuple = ()       # (input name, form) per mask argument a backend graph marked (attention)
    symbolic_last: bool = False     # integer inputs' last dims as size symbols (capture.trace.symbolic_last_dim)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def compiled_message(self, seconds: float, the_plan: Plan) -> tuple:
        return cache_log, "memfuse: compiled %s in %.3f s: saves %d bytes beyond the inputs", \
            (self.name, seconds, the_plan.saved_bytes)


@dataclasses.dataclass(frozen=True)
class AotGraph:
    """torch.compile's source: a graph AOTAutograd traced from Dynamo's, already decomposed
    (capture.decomposition_table), joint (primals, tangents) or forward-only (`trace_joint` False),
    with where a call reads each size symbol (`sizes`: symbol -> SizeSource) and its traced value."""
    name: str
    gm: torch.fx.GraphModule
    num_primals: int
    trace_joint: bool
    sizes: dict                     # sympy.Symbol -> the front's SizeSource
    hints: dict                     # sympy.Symbol -> traced size
    device: torch.device
    input_names: tuple              # the primals' names as the user knows them
    num_fwd_outputs: Optional[int] = None   # what AOTAutograd expects of a joint graph
    decisions: tuple = ()           # (pattern name, its decisions) of the Dynamo-graph rewrite (rewrite_graph)

    def compiled_message(self, seconds: float, the_plan: Plan) -> tuple:
        if not self.trace_joint:
            return log, "memfuse: compiled %s (torch.compile, inference) in %.3f s", (self.name, seconds)
        return log, "memfuse: compiled %s (torch.compile) in %.3f s: saves %d bytes beyond the inputs", \
            (self.name, seconds, the_plan.saved_bytes)


Source = Union[TracedFunction, AotGraph]


class Programs(NamedTuple):
    """torch.compile's runtime: the two Programs its forward and backward steps run."""
    forward: Program
    backward: Optional[Program]          # None for an inference graph


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What the driver made of a source, named as the reports read it (memfuse.reports.explain):
    `function` is a CompiledFunction (a traced function) or Programs (a torch.compile graph)."""
    name: str
    captured: Captured
    plan: Plan
    function: Union[CompiledFunction, Programs]
    input_names: list
    output_masks: Optional[OutputMasks] = None   # a graph's returned masks, marked by its forward step
    # a traced function's: the function capture traced, the patterns' wrappers in (the chunked loss
    # head), returning what the program returns; what a failed first backward recomputes through torch
    traced: Optional[Callable] = None


# -- the driver ------------------------------------------------------------------------------------
@timed("compile")
def compile_program(source: Source, config: Config) -> Compiled:
    """Compile `source` into runnable programs: one line per stage (module docstring). Raises
    where a stage fails; the caller decides what runs instead (compile_or_decide, graph_fallback).
    Outside any FakeTensorMode the caller runs under (a compile-only step's, memfuse.check_compiles):
    capture traces in a mode of its own, and the stages compute on real values."""
    with unset_fake_temporarily():
        return _compile_program(source, config)


def _compile_program(source: Source, config: Config) -> Compiled:
    start = time.perf_counter()
    kernels_before = STATS["kernels_generated"]
    if precompile_enabled(source.device, config):
        start_driver(source.device)        # Triton's driver set-up runs beside the trace
    line = ProgressLine(source.name)       # the stage on a terminal's progress line (base.progress)
    try:
        line.stage("capture")
        captured, output_masks, traced = _capture_with_patterns(source, config)   # capture, patterns
        line.stage("plan")
        the_plan = plan(captured, config.memory_budget)                     # plan
        the_plan.offloaded = _offloaded(source.name, the_plan, captured, config)   # offload
        _check(source.name, the_plan, captured, config)                     # verify, strict mode, aten count
        line.stage("schedule")
        schedules = _schedules(the_plan, config)                            # schedule
        line.stage("codegen")
        function = _runtime(source, the_plan, captured, schedules, config)  # buffers, codegen, runtime
        precompile([function.forward, function.backward], source.device, config, progress=line.kernels)
    except BaseException:
        line.clear()
        raise
    compiled = Compiled(source.name, captured, the_plan, function, list(source.input_names), output_masks, traced)
    _compiled(source, compiled, time.perf_counter() - start)            # counter, log line, compile hooks
    line.finish(STATS["kernels_generated"] - kernels_before)
    return compiled


def compile_or_decide(source: TracedFunction, config: Config) -> Union[Compiled, EagerCall]:
    """The compiled program, or where compiling fails the decision to run the call through torch
    (an error in strict mode, chained to the failure). Strict mode's own errors are raised as they
    are. A GraphError (the IR verifier's, a schedule's "cannot read in one space": memfuse's own
    limit or bug) is a decision like any failure: a loop that runs in eager never sees it. A byte
    budget below the least the step can need (MemoryBudgetError) is the caller's setting to change,
    raised as it is: running through torch would silently ignore the budget the caller set."""
    try:
        return compile_program(source, config)
    except (StrictModeError, Retrace, MemoryBudgetError):
        raise
    except Exception as e:   # noqa: BLE001 -- any failure to compile: the original runs, with the reason
        decision = compile_failed(source.name, e)
        if config.strict or config.compile_only:     # compile-only: nothing to fall back for
            raise StrictModeError(f"{decision}{STRICT}") from e
        fallback_log.debug("memfuse: %s: compiling failed", source.name, exc_info=e)
        return decision


# -- capture ---------------------------------------------------------------------------------------
def _capture(source: Source, fn: Optional[Callable] = None) -> Captured:
    """Trace `fn` (the source's function, as the patterns wrapped it) or lower the source's graph."""
    if isinstance(source, TracedFunction):
        return capture(fn, source.tensors, trace_joint=source.trace_joint, static_inputs=source.static,
                       input_names=source.input_names, symbolic_last=source.symbolic_last)
    return _lower(source)


@timed("capture")
def _lower(source: AotGraph) -> Captured:
    """Lower an AOTAutograd graph with the front's size sources; every size must have one."""
    captured = lower_graph(source.gm, dict(source.sizes), dict(source.hints), num_primals=source.num_primals,
                           trace_joint=source.trace_joint)
    if source.num_fwd_outputs is not None and captured.num_fwd_outputs != source.num_fwd_outputs:
        raise RuntimeError(f"memfuse: lowered {captured.num_fwd_outputs} forward outputs, "
                           f"AOTAutograd expects {source.num_fwd_outputs}")
    missing = _free_symbols(captured.joint) - set(source.sizes)
    if missing:
        raise NotImplementedError(
            f"memfuse: the graph's sizes use {sorted(map(str, missing))}, which no argument carries "
            f"(as a SymInt argument or a dim of a tensor argument), e.g. a data-dependent size; "
            f"memfuse cannot size its buffers from them")
    return captured


def _free_symbols(graph: Graph) -> set:
    found = set()
    for node in graph.nodes.values():
        exprs = list(node.value.shape) + [node.value.m]
        if isinstance(node.attr, Symbol):
            exprs.append(node.attr.expr)
        for e in exprs:
            if isinstance(e, sympy.Expr):
                found |= e.free_symbols
    return found


# -- patterns: the one place the driver calls the plug-ins (memfuse.patterns) -----------------------
def _capture_with_patterns(source: Source, config: Config) -> tuple:
    """(the captured graph with what the patterns decided, the marks a graph's forward step puts on
    the masks it returns, the function a traced function's capture traced last). Loss heads: a traced function's are chunked while it is traced
    (memfuse.patterns.rewrite_graph with trace=); a torch.compile graph's were rewritten in Dynamo's
    graph before AOTAutograd traced it (rewrite_graph of it: the front passes the decisions). Attention masks:
    capture's own decisions, then those of the masks a traced function is passed marked, or a
    graph returns."""
    if isinstance(source, TracedFunction):
        traced = []

        def trace(fn):
            traced.append(fn)
            return _capture(source, fn)
        rewritten = rewrite_graph(source.fn, config, trace=trace, returned_logits=source.returned_logits)
        captured = rewritten.graph
        masks = [MaskDecision("argument", name, True,
                              f"marked {form} by the backend graph that returned it (memfuse.patterns.attention): traced "
                              f"as a mask built from its sizes; a call with it unmarked compiles another program")
                 for name, form in source.marked_inputs]
        return dataclasses.replace(captured, decisions=_with_masks({**captured.decisions, **rewritten.decisions},
                                                                   masks),
                                   output_hooks=rewritten.output_hooks), None, traced[-1]
    captured = _capture(source)
    masks, output_masks = _returned_masks(source, captured.num_fwd_outputs, config)
    return dataclasses.replace(captured, decisions=_with_masks({**captured.decisions, **dict(source.decisions)}, masks),
                               aten_graph=source.gm), output_masks, None


def _with_masks(decisions: dict, masks: list) -> dict:
    """The patterns' decisions with the front's mask decisions after capture's."""
    return {**decisions, "attention_masks": [*decisions.get("attention_masks", []), *masks]}


def _returned_masks(source: AotGraph, count: int, config: Config) -> tuple:
    """([MaskDecision], OutputMasks or None): the marks for the graph's returned attention masks
    and values built from sizes (memfuse.patterns.attention)."""
    masks, sized = returned_masks(source.gm, count)
    if not masks and not sized:
        return [], None
    log.info("memfuse: %s returns attention masks (outputs %s) and values built from sizes alone (outputs %s): "
             "marked for the FusedModules and graphs that receive them", source.name, [m[0] for m in masks], sized)
    names = [n.name for n in source.gm.graph.find_nodes(op="placeholder")]
    decisions = []
    for position, reads in masks:
        read = ", ".join(names[i] for i in reads) or "sizes alone"
        when = ("looked at every call" if config.check_returned_masks else
                "left unmarked where one of them carries no such mark (check_returned_masks looks at it every call)")
        decisions.append(MaskDecision(
            f"output {position}", "returned", True,
            f"marked with its form for the fused layers that receive it: reads {read}; looked at once per set of "
            f"sizes and of the marks of the inputs it reads (values other graphs built from sizes), {when}"))
    return decisions, OutputMasks(masks, sized, every_call=config.check_returned_masks)


# -- checks, schedule, runtime ---------------------------------------------------------------------
def _check(name: str, the_plan: Plan, captured: Captured, config: Config) -> None:
    """The IR verifier on both sides (Config.check, MEMFUSE_CHECK); ops without a lowering run
    through aten inside the program, counted, and refused in strict mode; leading sizes the trace
    specialized on, logged."""
    if config.check:
        for _, graph in _sides(the_plan):
            verify(graph)
    for node, target, reason in captured.fallbacks:
        if config.strict:
            raise StrictModeError(f"memfuse: {node} ({target}) runs through aten: {reason}{STRICT}")
    STATS["fallbacks"] += len(captured.fallbacks)
    if captured.specialized:
        recompile_log.info("memfuse: %s: leading sizes join the compile key: %s", name, captured.specialized)


def _offloaded(name: str, the_plan: Plan, captured: Captured, config: Config) -> tuple:
    """The saved values kept in host memory (Plan.offloaded): the planner's choice, or those
    Config.offload_saved names (a debugging and benchmark knob: "all" is every offloadable value of
    at least offload_min_bytes). Offloadable: a tensor the forward computes and does not return
    (an input stays where its caller holds it; a returned one stays on the device for the caller).
    None under CUDA graphs (Config.seed_from_memory): a graph replays device memory on one stream."""
    chosen = config.offload_saved or the_plan.offloaded
    if not chosen or the_plan.backward is None:
        return ()
    if config.seed_from_memory:
        log.info("memfuse: %s: saved values stay on the device under CUDA graphs: offloading is off", name)
        return ()
    returned = set(the_plan.forward.outputs[:the_plan.num_fwd_outputs])
    why_not = {}
    for s in the_plan.saved:
        node = captured.joint[s.name]
        if s.is_input or node.op in (Op.CONSTANT, Op.SYMBOL):
            why_not[s.name] = "an input or a constant: it is not the forward's to move"
        elif node.value.dtype is None:
            why_not[s.name] = "not a tensor"
        elif s.name in returned:
            why_not[s.name] = "the forward returns it: it stays on the device for the caller"
    offloadable = [s for s in the_plan.saved if s.name not in why_not]
    if chosen == "all":
        return tuple(s.name for s in offloadable if s.bytes >= config.offload_min_bytes)
    # names are per graph (a model's graphs each have an `mm`): one a graph does not save, or cannot
    # offload, is skipped there with a warning, never a reason to run the graph through torch
    saved = [s.name for s in the_plan.saved]
    for value in chosen:
        if value not in saved:
            log.warning("memfuse: %s: offload_saved names %r, which this graph's plan does not save (saved: %s)",
                        name, value, ", ".join(saved) or "-")
        elif value in why_not:
            log.warning("memfuse: %s: saved value %r stays on the device: %s", name, value, why_not[value])
    return tuple(s.name for s in offloadable if s.name in set(chosen))


def _sides(the_plan: Plan) -> list:
    """[(kind, graph)]: the forward, and the backward where there is one."""
    return [("forward", the_plan.forward)] + ([("backward", the_plan.backward)] if the_plan.backward is not None else [])


def _schedules(the_plan: Plan, config: Config) -> dict:
    """kind ("forward", "backward") -> its Schedule."""
    return {kind: _schedule(graph, config, kind) for kind, graph in _sides(the_plan)}


def _schedule(graph: Graph, config: Config, kind: str) -> Schedule:
    """The schedule; in strict mode a group the code generator declines is an error too."""
    result = schedule(graph, config, kind)
    if config.strict:
        for group in result.kernels:
            if group.aten_reason is not None:
                ops = ", ".join(graph[n].op.value for n in group.nodes)
                raise StrictModeError(f"memfuse: {group.name} ({ops}) runs through aten: {group.aten_reason}{STRICT}")
    return result


def _runtime(source: Source, the_plan: Plan, captured: Captured, schedules: dict, config: Config):
    """Buffers, kernels and the program text (runtime.Program): for a traced function behind
    autograd (CompiledFunction), for a torch.compile graph as two Programs its steps call."""
    if isinstance(source, TracedFunction):
        return CompiledFunction(the_plan, captured, config, lambda graph, kind: schedules[kind],
                                contiguous=list(source.contiguous))
    symbols = list(captured.symbols)
    backward = schedules.get("backward")
    return Programs(Program(schedules["forward"], symbols, config, offloaded=the_plan.offloaded),
                    None if backward is None else Program(backward, symbols, config, returns_gradients=True,
                                                          offloaded=the_plan.offloaded))


def _compiled(source: Source, compiled: Compiled, seconds: float) -> None:
    """The counter, the log line and the compile hooks (reports: MEMFUSE_LOG, MEMFUSE_DUMP_DIR)."""
    STATS["compiles"] += 1
    logger, message, args = source.compiled_message(seconds, compiled.plan)
    logger.info(message, *args)
    on_compile(source.name, compiled)
