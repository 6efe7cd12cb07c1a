"""backend: `torch.compile(model, backend="memfuse")`. Dynamo captures, AOTAutograd traces the
joint graph, memfuse lowers, plans, schedules and runs it.

AOTAutograd owns the autograd.Function and its contract: the forward graph returns
(*outputs, *saved), the backward graph takes (*saved, *tangents) and returns one gradient per
primal. memfuse's partition function does the real work (memfuse.driver.compile, the compile
driver: lower the joint graph, plan, build both Programs) and hands AOTAutograd two small fx
graphs honouring that contract whose body is one call into the built Program; the compilers
return those Programs.
What the backward needs besides tensors (the dropout seed, the size symbols, saved integer
inputs) travels in one small int64 CPU tensor: the last saved value.

Size symbols come from Dynamo's ShapeEnv: each one is read per call from a SymInt argument or
from a dim of a tensor argument (`SizeSource`). Dynamo owns the guards.
"""
from __future__ import annotations

import contextlib
import itertools
import operator
from dataclasses import dataclass, field
from typing import Optional

import sympy
import torch
from torch._guards import CompileContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from memfuse.patterns.attention import OutputMasks
from memfuse.capture import decomposition_table
from memfuse.base.config import Config, config_with_options
from memfuse.driver.compile import AotGraph, Compiled, Programs, compile_program
from memfuse.driver.fallback import graph_fallback
from memfuse.patterns import rewrite_graph
from memfuse.ir.patterns import trace_modes
from memfuse.ir.captured import Captured
from memfuse.ir.targets import InputError
from memfuse.base import torch_private
from memfuse.plan import MemoryBudgetError, Plan
from memfuse.runtime import offload
from memfuse.runtime.function import _draw_seed
from memfuse.runtime.program import Program


@dataclass(frozen=True)
class SizeSource:
    """Where a call reads one size symbol: argument `input` itself (a SymInt argument, dim None)
    or dim `dim` of tensor argument `input`."""
    input: int
    dim: Optional[int] = None

    def read(self, args) -> int:
        value = args[self.input]
        return int(value) if self.dim is None else value.shape[self.dim]


def memfuse_backend(gm: torch.fx.GraphModule, example_inputs, *, config: Optional[Config] = None,
                    options: Optional[dict] = None):
    """The `torch.compile` backend: AOTAutograd with memfuse's partition and compilers. A graph
    memfuse fails to compile, wherever it fails, runs through torch (`_through_torch`); in strict
    mode the failure is an error. `options` (torch.compile's `options=`) set Config fields
    (config.OPTIONS: `{"memory_budget": 0.5}`); an unknown one or a bad value is an error.

    Through Dynamo's `aot_autograd` helper, as torch's own AOT backends, not a bare
    `aot_module_simplified`: Dynamo's DDPOptimizer (a graph split at DDP's bucket boundaries)
    reads the helper's call counter to know that each piece went through AOTAutograd, whose
    first call then returns fake outputs for the next piece's compile. Without it that fake
    first call would reach the user at run time.

    Everything memfuse does happens while this call runs: AOTAutograd traces, calls the
    partition function (which builds the forward and the backward Program) and then the forward
    or inference compiler, all before returning. The backward compiler, which AOTAutograd may
    call later (at the first `.backward()`), only hands over the step the partition built."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.exc import RestartAnalysis, ShortenTraceback, SkipFrame
    config = config_with_options(config or Config(), options)
    record = GraphRecord(_graph_name(gm), _input_names(gm))
    original = gm
    rewritten = rewrite_graph(gm, config)        # the patterns' (memfuse.patterns)
    gm, record.decisions = rewritten.graph, rewritten.decisions
    compilers = _Compilers(config, record)
    backend = aot_autograd(fw_compiler=compilers.forward, bw_compiler=compilers.backward,
                           inference_compiler=compilers.inference, partition_fn=compilers.partition,
                           decompositions=decomposition_table())
    try:
        with trace_modes():     # the patterns' (memfuse.ir.patterns: attention masks reach the trace dense)
            compiled = backend(gm, example_inputs)
    except (RestartAnalysis, SkipFrame, ShortenTraceback):
        raise                  # Dynamo's own signals (restart the trace, skip the frame), not failures
    except MemoryBudgetError:
        raise                  # the caller's budget, below what the graph can need: theirs to change
    except Exception as e:
        return _through_torch(original, record, e, config)
    return FirstRunGuard(rewritten.attach(compiled), original, record, config, compilers.first_runs)


def _through_torch(gm: torch.fx.GraphModule, record: GraphRecord, error: Exception, config: Config,
                   first_run: str = ""):
    """A graph memfuse could not compile (or whose program's `first_run` failed: FirstRunGuard)
    runs as Dynamo captured it, op by op through torch:
    exactly what eager runs, so it fails only where eager fails, and autograd records each op as
    in eager, so gradients are eager's. Not AOTAutograd again with torch's partition: the failure
    may be AOTAutograd's own trace (with memfuse's decompositions), and a second trace would cost
    a compile for nothing. The decision (logged, counted; in strict mode an error) is the
    driver's: memfuse.driver.fallback.graph_fallback."""
    record.through_torch = graph_fallback(record.name, error, config.strict or config.compile_only, first_run)
    run = gm.forward

    def through_torch(*args):
        if _watching:
            _saw(record)
        return run(*args)
    return torch._dynamo.disable(through_torch)    # Dynamo never traces the fallback itself


class FirstRunGuard:
    """What the backend hands Dynamo for a graph it compiled: the compiled function, whose first
    call is guarded (memfuse.driver.fallback: the first run's rules). A failure there, or in the
    first backward (FirstRuns), runs the graph through torch from then on (`_through_torch`); the
    call whose forward failed runs through torch at once. Every call costs one more Python call."""

    __slots__ = ("run", "compiled", "gm", "record", "config", "first_runs")

    def __init__(self, compiled, gm: torch.fx.GraphModule, record: GraphRecord, config: Config,
                 first_runs: "FirstRuns"):
        self.run = self._first_call
        self.compiled, self.gm, self.record, self.config = compiled, gm, record, config
        self.first_runs = first_runs
        first_runs.on_failure = self.fall_back

    def __call__(self, *args):
        return self.run(*args)

    def _first_call(self, *args):
        try:
            outputs = self.compiled(*args)
        except InputError:           # the inputs' fault, as in eager: the program stays
            raise
        except Exception as error:   # noqa: BLE001 -- the first run's failure: the graph runs through torch
            return self.fall_back(error, "forward")(*args)
        if not any(isinstance(a, FakeTensor) for a in args):   # DDPOptimizer's compile-time call proves nothing
            self.run = self.compiled
        return outputs

    def fall_back(self, error: Exception, program: str):
        """From now on the graph runs through torch, for `error` in the first `program` run; the
        function that runs it so. Once: a later failure finds it decided."""
        if self.record.through_torch is None:
            self.run = _through_torch(self.gm, self.record, error, self.config, program)
            if program == "forward":      # no memfuse backward will run: the forwards kept nothing for one
                self.first_runs.kept.clear()
        return self.run


class FirstRuns:
    """A training graph's programs until its backward has run once (memfuse.driver.fallback: the
    first run's rules). Each forward until then keeps its primals under a ticket (a slot of the
    context it saves, 0 once the backward is proven); a failed backward computes its gradients
    through torch: the joint graph AOTAutograd traced (functional: the forward and the gradients,
    no input written), interpreted on the kept primals and the tangents. At most KEPT forwards are
    kept (a loop that runs forwards without a backward keeps no more); a backward whose primals
    were dropped raises its failure."""

    KEPT = 8

    def __init__(self):
        self.backward_proven = False
        self.joint: Optional[tuple] = None    # (joint graph, number of forward outputs)
        self.kept: dict = {}                  # ticket -> the primals a forward ran on
        self.tickets = itertools.count(1)
        self.on_failure = None                # FirstRunGuard.fall_back

    def keep(self, args: list) -> int:
        """The ticket of a forward run on `args` (the primals, kept): 0 once the backward is proven."""
        if self.backward_proven:
            return 0
        ticket = next(self.tickets)
        self.kept[ticket] = list(args)
        while len(self.kept) > self.KEPT:
            del self.kept[next(iter(self.kept))]
        return ticket

    def proven(self) -> None:
        self.backward_proven = True
        self.kept.clear()
        self.joint = None

    def backward_through_torch(self, error: Exception, ticket: int, tangents: list) -> list:
        """The gradients of the forward `ticket` through torch, the graph run through torch from now
        on (an error in strict mode); `error` raised where the primals or the joint graph are gone."""
        primals = self.kept.pop(ticket, None)
        if primals is None or self.joint is None or self.on_failure is None:
            raise error
        self.on_failure(error, "backward")
        joint, num_fwd_outputs = self.joint
        with torch.no_grad():
            outputs = torch.fx.Interpreter(joint).run(*primals, *tangents, enable_io_processing=False)
        return list(outputs[num_fwd_outputs:])


def _input_names(gm: torch.fx.GraphModule) -> list:
    """The primals' names as the user knows them: Dynamo's source of each graph input (`L['x']`,
    `L['self']._modules['fc']._parameters['weight']`), after the graph's own parameters and
    buffers, which AOTAutograd lifts in front of them."""
    names = [n for n, _ in gm.named_parameters()] + [n for n, _ in gm.named_buffers()]
    for node in gm.graph.find_nodes(op="placeholder"):
        source = getattr(node.meta.get("grapharg"), "source", None)
        name = source.name if source is not None else node.target
        names.append(name() if callable(name) else name)    # a method before torch 2.13
    return names


def _graph_name(gm: torch.fx.GraphModule) -> str:
    """`dynamo_<frame>/<compile>`: Dynamo's compile id, as TORCH_LOGS and tlparse show it."""
    compile_id = CompileContext.current_compile_id()
    return f"dynamo_{compile_id}" if compile_id is not None else f"dynamo_{id(gm):x}"


# -- what the backend made of each graph, and which graphs a call runs ------------------------------
@dataclass
class GraphRecord:
    """What the backend made of one Dynamo graph, for the compile hook and `explain`: once memfuse
    compiled it, the fields `explain.build_report` reads, named as on FusedFunction's cache entry
    (`captured`, `plan`, `function` with the `.forward` and `.backward` Programs, `input_names`);
    else why the graph runs through torch."""
    name: str
    input_names: list
    captured: Optional[Captured] = None
    plan: Optional[Plan] = None
    function: Optional[Programs] = None
    through_torch: Optional[str] = None   # the failure, when the graph runs through torch
    decisions: dict = field(default_factory=dict)    # each pattern's decisions on the graph (memfuse.patterns)


_watching: list = []   # the lists of the open watch() blocks: empty but while explain runs a call


@contextlib.contextmanager
def watch():
    """Collect the GraphRecords of the graphs that run inside the block, memfuse's and those run
    through torch, each once, in the order they first ran: a graph Dynamo had cached counts as
    much as one compiled in the block. Every forward (and inference) call of a backend graph
    checks for open blocks: one truth test of a list."""
    seen: list = []
    _watching.append(seen)
    try:
        yield seen
    finally:
        _watching.remove(seen)


def _saw(record: GraphRecord) -> None:
    for seen in _watching:
        if not any(r is record for r in seen):
            seen.append(record)


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
    return the steps it built; `inference` compiles a forward-only graph (nothing needs a grad).

    AOTAutograd calls the partition function and the compilers inside its FakeTensorMode, where an
    operation on a real tensor is refused; memfuse's stages compute on real values (a lifted tensor
    constant is read with `.item()`, a constant rounded through `torch.tensor`, kernels built), so
    they run with the mode unset. The fx graphs handed back carry fakes made in that mode on
    purpose (`_Fakes`)."""

    def __init__(self, config: Config, record: GraphRecord):
        self.config = config
        self.record = record
        self.first_runs = FirstRuns()

    def partition(self, joint: torch.fx.GraphModule, joint_inputs, *, num_fwd_outputs: int, **_):
        with unset_fake_temporarily():   # see _Compilers: memfuse computes on real values
            return self._partition(joint, len(joint_inputs[0]), num_fwd_outputs)

    def _partition(self, joint: torch.fx.GraphModule, num_primals: int, num_fwd_outputs: int):
        placeholders = joint.graph.find_nodes(op="placeholder")
        device = program_device(joint.graph)
        compiled = compile_program(self._source(joint, placeholders[:num_primals], device, num_fwd_outputs), self.config)
        self.first_runs.joint = (joint, num_fwd_outputs)
        forward, backward = compiled.function
        captured, the_plan = self._compiled(compiled)
        fakes = _Fakes(detect_fake_mode([n.meta.get("val") for n in placeholders]), captured, device, the_plan.offloaded)
        saved = [s.name for s in the_plan.saved]
        saved_ints = [captured.joint[n].value.dtype is None for n in saved]
        forward_step = ForwardStep(forward, captured, the_plan.num_fwd_outputs, saved_ints, device,
                                   masks=compiled.output_masks, first_runs=self.first_runs)
        backward_step = BackwardStep(backward, captured, saved_ints, device, self.first_runs)
        fw_module = _forward_module(joint, placeholders[:num_primals], the_plan, saved_ints, forward_step, fakes)
        bw_module = _backward_module(joint, placeholders[num_primals:], the_plan, saved_ints, backward_step, fakes)
        return fw_module, bw_module

    def forward(self, gm: torch.fx.GraphModule, example_inputs):
        return _boxed(gm.get_submodule("memfuse_forward"), self.record)

    def backward(self, gm: torch.fx.GraphModule, example_inputs):
        return _boxed(gm.get_submodule("memfuse_backward"))

    def inference(self, gm: torch.fx.GraphModule, example_inputs):
        with unset_fake_temporarily():
            return self._inference(gm)

    def _inference(self, gm: torch.fx.GraphModule):
        placeholders = gm.graph.find_nodes(op="placeholder")
        device = program_device(gm.graph)
        compiled = compile_program(self._source(gm, placeholders, device), self.config)
        captured, the_plan = self._compiled(compiled)
        return _boxed(ForwardStep(compiled.function.forward, captured, the_plan.num_fwd_outputs, [], device,
                                  inference=True, masks=compiled.output_masks), self.record)

    def _source(self, gm: torch.fx.GraphModule, primals: list, device: torch.device,
                num_fwd_outputs: Optional[int] = None) -> AotGraph:
        """What the driver compiles: the graph (joint when AOTAutograd says how many forward outputs
        it has), where each size symbol is read (Dynamo's ShapeEnv), the loss heads chunked in
        Dynamo's graph before AOTAutograd traced it."""
        sizes, hints = _size_sources(primals)
        return AotGraph(self.record.name, gm, len(primals), trace_joint=num_fwd_outputs is not None, sizes=sizes,
                        hints=hints, device=device, input_names=tuple(self.record.input_names),
                        num_fwd_outputs=num_fwd_outputs, decisions=tuple(self.record.decisions.items()))

    def _compiled(self, compiled: Compiled) -> tuple:
        """Note the compile in the graph's record (explain reads it); (captured, plan)."""
        self.record.captured, self.record.plan, self.record.function = compiled.captured, compiled.plan, \
            compiled.function
        return compiled.captured, compiled.plan


# -- Dynamo's size symbols -------------------------------------------------------------------------
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


def program_device(graph: torch.fx.Graph) -> torch.device:
    """Where the program allocates and launches: the accelerator of any tensor of the graph, its
    arguments' and those it makes (`torch.arange(n, device=...)` in a graph that takes no tensor,
    or no argument at all: transformers' mask built at static sizes), else the CPU. A CPU tensor beside an accelerator
    is what eager allows: a 0-d tensor (a scalar) or a value only read for sizes. A graph on two
    accelerators is refused (a compile failure: it runs through torch)."""
    devices = {_normalized(n.meta["val"].device) for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    accelerators = sorted((d for d in devices if d.type != "cpu"), key=str)
    if len(accelerators) > 1:
        raise NotImplementedError(f"memfuse: the graph computes on several devices ({', '.join(map(str, accelerators))}): "
                                  f"a program launches on one")
    return accelerators[0] if accelerators else torch.device("cpu")


def _normalized(device: torch.device) -> torch.device:
    """A device with its index (a fake tensor's `cuda` is the current device)."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


# -- the steps AOTAutograd calls ----------------------------------------------------------------
def _boxed(step, record: Optional[GraphRecord] = None):
    """AOTAutograd's boxed calling convention: the step takes the argument list over and empties
    it. A forward step names its graph's record, which it shows to open `watch()` blocks."""
    def run(args):
        if _watching and record is not None:
            _saw(record)
        return step.boxed(args)
    run._boxed_call = True
    return run


class ForwardStep(torch.nn.Module):
    """primals -> (*outputs, *saved tensors, context); context = [seed, *symbols, *saved ints, ticket]
    (FirstRuns: the forward's primals kept for a failing first backward, 0 once one succeeded).
    Returned masks built from sizes leave marked with their form (`masks`, memfuse.patterns.attention)."""

    def __init__(self, program: Program, captured: Captured, num_outputs: int, saved_ints: list,
                 device: torch.device, inference: bool = False, masks: Optional[OutputMasks] = None,
                 first_runs: Optional[FirstRuns] = None):
        super().__init__()
        self.first_runs = first_runs      # a training graph's: its primals kept until a backward ran
        self.masks = masks
        self.program = program
        self.sources = list(captured.symbols.values())
        self.has_seed = captured.has_seed
        self.num_outputs = num_outputs
        self.saved_ints = saved_ints
        self.device = device
        self.inference = inference
        # a compile-only program runs under FakeTensorMode: the context is made outside it, a host
        # tensor whose values the backward step reads
        self.context = _host_context if program.config.compile_only else _context

    def forward(self, *args):
        return self.boxed(list(args))

    def boxed(self, args: list):
        """Runs on `args` and empties it (the program does): a tensor nothing else holds goes after
        its last reader."""
        symbol_values = tuple(source.read(args) for source in self.sources)
        first_runs = self.first_runs
        ticket = first_runs.keep(args) if first_runs is not None and not first_runs.backward_proven else 0
        seed = _draw_seed(self.device) if self.has_seed else 0
        if self.has_seed:
            args.append(seed)
        input_marks = self.masks.read_marks(args) if self.masks is not None else None
        outs = self.program.run(args, symbol_values, self.device)
        if self.masks is not None:
            self.masks.mark(outs, symbol_values, input_marks)
        if self.inference:
            return outs[:self.num_outputs]
        if self.program.offloaded and torch_private.saved_tensors_hooks(False) is not None:
            offload.settle(self.device)    # a saved-tensors hook may read the host copies (runtime.offload)
        saved = outs[self.num_outputs:]
        tensors = [v for v, is_int in zip(saved, self.saved_ints) if not is_int]
        ints = [int(v) for v, is_int in zip(saved, self.saved_ints) if is_int]
        return (*outs[:self.num_outputs], *tensors, self.context([seed, *symbol_values, *ints, ticket]))

    def __deepcopy__(self, memo):
        return self   # compiled kernels are shared, never copied (AOTAutograd deep-copies graphs)


def _context(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _host_context(values: list) -> torch.Tensor:
    with unset_fake_temporarily():
        return torch.tensor(values, dtype=torch.int64)


class BackwardStep(torch.nn.Module):
    """(*saved tensors, context, *tangents) -> one gradient (or None) per primal."""

    def __init__(self, program: Program, captured: Captured, saved_ints: list, device: torch.device,
                 first_runs: FirstRuns):
        super().__init__()
        self.first_runs = first_runs
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
        symbol_values, ints = tuple(context[1:1 + self.num_symbols]), context[1 + self.num_symbols:-1]
        inputs = [ints[j] if is_int else args[j] for is_int, j in self.slots]
        if self.has_seed:
            inputs.append(context[0])
        tangents = args[self.num_tensors + 1:]
        inputs += tangents
        args.clear()
        ticket = context[-1]
        if not ticket:
            return self.program.run(inputs, symbol_values, self.device)
        try:                          # a forward run before any backward succeeded (FirstRuns)
            gradients = self.program.run(inputs, symbol_values, self.device)
        except InputError:
            raise
        except Exception as error:   # noqa: BLE001 -- the first run's failure: through torch, from the primals
            return self.first_runs.backward_through_torch(error, ticket, tangents)
        self.first_runs.proven()
        return gradients

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

    def __init__(self, mode, captured: Captured, device: torch.device, offloaded: tuple = ()):
        self.mode = mode
        self.captured = captured
        self.device = device
        self.offloaded = frozenset(offloaded)   # saved values the forward hands over in host memory
        self.made: dict = {}

    def value(self, name: str):
        """An IR value's (symbolic) shape and dtype, contiguous, on the program's device or, offloaded
        (Plan.offloaded), on the host; one fake per value."""
        if name not in self.made:
            value = self.captured.joint[name].value
            sizes = []
            for size in value.shape:
                expr = sympy.sympify(size)
                sizes.append(int(expr) if expr.is_number else self.mode.shape_env.create_symintnode(
                    expr, hint=int(expr.subs(self.captured.hints))))
            with self.mode:
                device = torch.device("cpu") if name in self.offloaded else self.device
                self.made[name] = torch.empty(sizes, dtype=value.dtype, device=device)
        return self.made[name]

    def context(self, saved_ints: list):
        with self.mode:   # the seed, the symbols, the saved ints, the ticket
            return torch.empty((2 + len(self.captured.symbols) + sum(saved_ints),), dtype=torch.int64)
