"""backend: `torch.compile(model, backend="memfuse")`. Dynamo captures, AOTAutograd traces the
joint graph, memfuse lowers, plans, schedules and runs it.

AOTAutograd owns the autograd.Function and its contract: the forward graph returns
(*outputs, *saved), the backward graph takes (*saved, *tangents) and returns one gradient per
primal. memfuse's partition function does the real work (lower the joint graph with capture's
lowering, plan, build both Programs) and hands AOTAutograd two small fx graphs honouring that
contract whose body is one call into the built Program; the compilers return those Programs.
What the backward needs besides tensors (the dropout seed, the size symbols, saved integer
inputs) travels in one small int64 CPU tensor: the last saved value.

Size symbols come from Dynamo's ShapeEnv: each one is read per call from a SymInt argument or
from a dim of a tensor argument (`SizeSource`). Dynamo owns the guards.
"""
from __future__ import annotations

import logging
import operator
import time
from dataclasses import dataclass
from typing import Optional

import sympy
import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .capture import Captured, decomposition_table, lower_graph
from .config import Config
from .debug import STATS, dump
from .ir import Graph, Symbol, format_graph, verify
from .plan import Plan, plan
from .precompile import precompile
from .runtime import Program, _draw_seed
from .schedule import schedule

log = logging.getLogger("memfuse")


@dataclass(frozen=True)
class SizeSource:
    """Where a call reads one size symbol: argument `input` itself (a SymInt argument, dim None)
    or dim `dim` of tensor argument `input`."""
    input: int
    dim: Optional[int] = None

    def read(self, args) -> int:
        value = args[self.input]
        return int(value) if self.dim is None else value.shape[self.dim]


def memfuse_backend(gm: torch.fx.GraphModule, example_inputs, *, config: Optional[Config] = None):
    """The `torch.compile` backend: AOTAutograd with memfuse's partition and compilers.

    Through Dynamo's `aot_autograd` helper, as torch's own AOT backends, not a bare
    `aot_module_simplified`: Dynamo's DDPOptimizer (a graph split at DDP's bucket boundaries)
    reads the helper's call counter to know that each piece went through AOTAutograd, whose
    first call then returns fake outputs for the next piece's compile. Without it that fake
    first call would reach the user at run time."""
    from torch._dynamo.backends.common import aot_autograd
    compilers = _Compilers(config or Config(), name=f"dynamo_{id(gm):x}")
    backend = aot_autograd(fw_compiler=compilers.forward, bw_compiler=compilers.backward,
                           inference_compiler=compilers.inference, partition_fn=compilers.partition,
                           decompositions=decomposition_table())
    return backend(gm, example_inputs)


def register() -> None:
    """Make `backend="memfuse"` known to Dynamo on `import memfuse`; idempotent. When Dynamo has
    already found the `torch_dynamo_backends` entry point it registers the backend itself (and
    would refuse a second registration), so this one steps aside."""
    from torch._dynamo.backends import registry
    if "memfuse" in registry._COMPILER_FNS or registry._BACKENDS.get("memfuse") is not None:
        return
    registry.register_backend(memfuse_backend, name="memfuse")


class _Compilers:
    """One Dynamo graph's compilers. `partition` builds both Programs; `forward` and `backward`
    return the steps it built; `inference` compiles a forward-only graph (nothing needs a grad)."""

    def __init__(self, config: Config, name: str):
        self.config = config
        self.name = name

    def partition(self, joint: torch.fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_):
        start = time.perf_counter()
        primals, _ = joint_inputs
        placeholders = joint.graph.find_nodes(op="placeholder")
        captured = _lower(joint, placeholders[:len(primals)], trace_joint=True)
        if captured.num_fwd_outputs != num_fwd_outputs:
            raise RuntimeError(f"memfuse: lowered {captured.num_fwd_outputs} forward outputs, "
                               f"AOTAutograd expects {num_fwd_outputs}")
        the_plan = plan(captured)
        self._dump(captured, the_plan)
        device = _device(placeholders)
        fakes = _Fakes(detect_fake_mode([n.meta.get("val") for n in placeholders]), captured, device)
        with unset_fake_temporarily():
            forward = self._program(the_plan.forward, captured, "forward")
            backward = self._program(the_plan.backward, captured, "backward")
            precompile([forward, backward], device, self.config)
        saved = [s.name for s in the_plan.saved]
        saved_ints = [captured.joint[n].value.dtype is None for n in saved]
        forward_step = ForwardStep(forward, captured, the_plan.num_fwd_outputs, saved_ints, device)
        backward_step = BackwardStep(backward, captured, saved_ints, device)
        fw_module = _forward_module(joint, placeholders[:len(primals)], the_plan, saved_ints, forward_step, fakes)
        bw_module = _backward_module(joint, placeholders[len(primals):], the_plan, saved_ints, backward_step, fakes)
        STATS["compiles"] += 1
        log.info("memfuse: compiled %s (torch.compile) in %.3f s: saves %d bytes beyond the inputs",
                 self.name, time.perf_counter() - start, the_plan.saved_bytes)
        return fw_module, bw_module

    def forward(self, gm: torch.fx.GraphModule, example_inputs):
        return _boxed(gm.get_submodule("memfuse_forward"))

    def backward(self, gm: torch.fx.GraphModule, example_inputs):
        return _boxed(gm.get_submodule("memfuse_backward"))

    def inference(self, gm: torch.fx.GraphModule, example_inputs):
        start = time.perf_counter()
        placeholders = gm.graph.find_nodes(op="placeholder")
        captured = _lower(gm, placeholders, trace_joint=False)
        the_plan = plan(captured)
        self._dump(captured, the_plan)
        with unset_fake_temporarily():
            forward = self._program(the_plan.forward, captured, "forward")
            precompile([forward], _device(placeholders), self.config)
        STATS["compiles"] += 1
        log.info("memfuse: compiled %s (torch.compile, inference) in %.3f s", self.name,
                 time.perf_counter() - start)
        return _boxed(ForwardStep(forward, captured, the_plan.num_fwd_outputs, [], _device(placeholders),
                                  inference=True))

    def _program(self, graph: Graph, captured: Captured, kind: str) -> Program:
        if self.config.check:
            verify(graph)
        return Program(schedule(graph, self.config, kind), list(captured.symbols), self.config)

    def _dump(self, captured: Captured, the_plan: Plan) -> None:
        dump(f"{self.name}.joint.txt", format_graph(captured.joint))
        dump(f"{self.name}.forward.txt", format_graph(the_plan.forward))
        if the_plan.backward is not None:
            dump(f"{self.name}.backward.txt", format_graph(the_plan.backward))
        for name, target, reason in captured.fallbacks:
            message = f"memfuse: {name} ({target}) runs through aten: {reason}"
            if self.config.strict:
                raise NotImplementedError(message + " (strict mode: MEMFUSE_STRICT=1 / Config.strict)")
            log.info(message)


# -- lowering with Dynamo's size symbols ---------------------------------------------------------
def _lower(gm: torch.fx.GraphModule, primals: list, trace_joint: bool) -> Captured:
    sources, hints = _size_sources(primals)
    captured = lower_graph(gm, sources, hints, num_primals=len(primals), trace_joint=trace_joint)
    missing = _free_symbols(captured.joint) - set(sources)
    if missing:
        raise NotImplementedError(
            f"memfuse: the graph's sizes use {sorted(map(str, missing))}, which no argument carries "
            f"(as a SymInt argument or a dim of a tensor argument), e.g. a data-dependent size; "
            f"memfuse cannot size its buffers from them")
    return captured


def _size_sources(primals: list) -> tuple[dict, dict]:
    """sympy.Symbol -> SizeSource, preferring SymInt arguments, and the traced value of each."""
    sources, hints = {}, {}

    def note(size, source):
        if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol) \
                and size.node.expr not in sources:
            sources[size.node.expr] = source
            hints[size.node.expr] = size.node.hint
    for i, node in enumerate(primals):
        note(node.meta.get("val"), SizeSource(i))
    for i, node in enumerate(primals):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d, size in enumerate(val.shape):
                note(size, SizeSource(i, d))
    return sources, hints


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


def _device(placeholders: list) -> torch.device:
    """Where the program allocates: the accelerator of any tensor argument, else the CPU."""
    devices = [n.meta["val"].device for n in placeholders if isinstance(n.meta.get("val"), torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), torch.device("cpu"))


# -- the steps AOTAutograd calls ----------------------------------------------------------------
def _boxed(step):
    """AOTAutograd's boxed calling convention: the step takes the argument list over and empties it."""
    def run(args):
        return step.boxed(args)
    run._boxed_call = True
    return run


class ForwardStep(torch.nn.Module):
    """primals -> (*outputs, *saved tensors, context); context = [seed, *symbols, *saved ints]."""

    def __init__(self, program: Program, captured: Captured, num_outputs: int, saved_ints: list,
                 device: torch.device, inference: bool = False):
        super().__init__()
        self.program = program
        self.sources = list(captured.symbols.values())
        self.has_seed = captured.has_seed
        self.num_outputs = num_outputs
        self.saved_ints = saved_ints
        self.device = device
        self.inference = inference

    def forward(self, *args):
        return self.boxed(list(args))

    def boxed(self, args: list):
        """Runs on `args` and empties it (the program does): a tensor nothing else holds goes after
        its last reader."""
        symbol_values = tuple(source.read(args) for source in self.sources)
        seed = _draw_seed(self.device) if self.has_seed else 0
        if self.has_seed:
            args.append(seed)
        outs = self.program.run(args, symbol_values, self.device)
        if self.inference:
            return outs[:self.num_outputs]
        saved = outs[self.num_outputs:]
        tensors = [v for v, is_int in zip(saved, self.saved_ints) if not is_int]
        ints = [int(v) for v, is_int in zip(saved, self.saved_ints) if is_int]
        context = torch.tensor([seed, *symbol_values, *ints], dtype=torch.int64)
        return (*outs[:self.num_outputs], *tensors, context)

    def __deepcopy__(self, memo):
        return self   # compiled kernels are shared, never copied (AOTAutograd deep-copies graphs)


class BackwardStep(torch.nn.Module):
    """(*saved tensors, context, *tangents) -> one gradient (or None) per primal."""

    def __init__(self, program: Program, captured: Captured, saved_ints: list, device: torch.device):
        super().__init__()
        self.program = program
        self.num_symbols = len(captured.symbols)
        self.has_seed = captured.has_seed
        self.saved_ints = saved_ints
        self.num_tensors = saved_ints.count(False)
        self.device = device
        # per saved value: (is an int, its position among the saved ints or the saved tensors)
        self.slots = [(is_int, saved_ints[:i].count(is_int)) for i, is_int in enumerate(saved_ints)]

    def forward(self, *args):
        return self.boxed(list(args))

    def boxed(self, args: list):
        """Moves the saved tensors and tangents out of `args` (AOTAutograd's list: it holds the only
        references once the node's are cleared) into the program's input list, which the program
        empties: each one goes after its last reader."""
        context = args[self.num_tensors].tolist()
        symbol_values, ints = tuple(context[1:1 + self.num_symbols]), context[1 + self.num_symbols:]
        inputs = [ints[j] if is_int else args[j] for is_int, j in self.slots]
        if self.has_seed:
            inputs.append(context[0])
        inputs += args[self.num_tensors + 1:]
        args.clear()
        return self.program.run(inputs, symbol_values, self.device)

    def __deepcopy__(self, memo):
        return self


# -- the fx graphs AOTAutograd reads: signatures and fake values, bodies that call the steps -----
def _forward_module(joint, primals, the_plan, saved_ints, step, fakes) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    env = {}
    for node in primals:
        env[node.name] = _placeholder(graph, node.name, node.meta["val"])
    call = graph.call_module("memfuse_forward", tuple(env[n.name] for n in primals))
    joint_outputs = joint.graph.find_nodes(op="output")[0].args[0]
    outputs, index = [], 0
    for fx_out in joint_outputs[:the_plan.num_fwd_outputs]:
        outputs.append(_item(graph, call, index, _val(fx_out)))
        index += 1
    saved_tensors = [s for s, is_int in zip(the_plan.saved, saved_ints) if not is_int]
    for s in saved_tensors:
        if s.is_input:
            outputs.append(env[s.name])
        else:
            outputs.append(_item(graph, call, index, fakes.value(s.name)))
        index += 1
    outputs.append(_item(graph, call, index, fakes.context(saved_ints)))
    graph.output(tuple(outputs))
    return torch.fx.GraphModule({"memfuse_forward": step}, graph)


def _backward_module(joint, tangents, the_plan, saved_ints, step, fakes) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    args = []
    for s, is_int in zip(the_plan.saved, saved_ints):
        if not is_int:
            args.append(_placeholder(graph, s.name, fakes.value(s.name)))
    args.append(_placeholder(graph, "memfuse_context", fakes.context(saved_ints)))
    for node in tangents:
        args.append(_placeholder(graph, node.name, node.meta["val"]))
    call = graph.call_module("memfuse_backward", tuple(args))
    joint_outputs = joint.graph.find_nodes(op="output")[0].args[0]
    grads = [None if fx_out is None else _item(graph, call, i, _val(fx_out))
             for i, fx_out in enumerate(joint_outputs[the_plan.num_fwd_outputs:])]
    graph.output(tuple(grads))
    return torch.fx.GraphModule({"memfuse_backward": step}, graph)


def _placeholder(graph: torch.fx.Graph, name: str, val) -> torch.fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _item(graph: torch.fx.Graph, call: torch.fx.Node, index: int, val) -> torch.fx.Node:
    node = graph.call_function(operator.getitem, (call, index))
    node.meta["val"] = val
    return node


def _val(fx_out):
    return fx_out.meta.get("val") if isinstance(fx_out, torch.fx.Node) else fx_out


class _Fakes:
    """Fake tensors for values AOTAutograd has no fx node for: saved IR values and the context."""

    def __init__(self, mode, captured: Captured, device: torch.device):
        self.mode = mode
        self.captured = captured
        self.device = device
        self.made: dict = {}

    def value(self, name: str):
        """An IR value's (symbolic) shape and dtype, contiguous; one fake per value."""
        if name not in self.made:
            value = self.captured.joint[name].value
            sizes = []
            for size in value.shape:
                expr = sympy.sympify(size)
                sizes.append(int(expr) if expr.is_number else self.mode.shape_env.create_symintnode(
                    expr, hint=int(expr.subs(self.captured.hints))))
            with self.mode:
                self.made[name] = torch.empty(sizes, dtype=value.dtype, device=self.device)
        return self.made[name]

    def context(self, saved_ints: list):
        with self.mode:
            return torch.empty((1 + len(self.captured.symbols) + sum(saved_ints),), dtype=torch.int64)
