"""graphs: `memory_efficient_fusion(fn, cuda_graphs=True)`, replaying CUDA graphs of the forward
and backward programs instead of launching their kernels one by one from Python.

At small sizes a fused step is host-bound: every launch costs more host time than the kernel
takes on the GPU. A CUDA graph replays a whole program for one launch. Per exact call signature
(the front-cache key of api.FusedFunction: shapes, dtypes, devices, requires_grad, contiguity,
grad mode, constants) the first call warms the programs up on a side stream (kernels compile on
their first launch, and a capture must not compile), then captures the forward program into one
graph and the backward program into another, as `torch.cuda.make_graphed_callables` does.

What is static, per captured instance:
- inputs: a tensor argument is *borrowed* (the graph reads it where it lies: parameters, and any
  tensor that comes back at the same address) or *owned* (a graph buffer it is copied into, when
  its address differs). A signature starts with every contiguous argument borrowed; a call with a
  borrowed argument elsewhere turns that position into a copied one and captures anew (once).
- outputs and saved values live in the graph's memory and are rewritten by its next
  replay. An instance is replayed only when it is free: its last forward's backward has run (or
  can no longer run), and nobody outside holds a tensor it returned (the storage use count, the
  way torch's cudagraph trees check it). Otherwise another instance is captured (a fused function
  called twice before one backward, an output kept across steps), up to
  `Config.cuda_graphs_limit` instances per function; calls beyond it run without graphs.
- gradients are returned without a copy, as views of graph memory. AccumulateGrad adopts one as
  a leaf's `.grad` when that `.grad` is None; the instance is then busy until the `.grad` is
  dropped (`zero_grad()`, `.grad = None`). Accumulating without zeroing therefore alternates two
  instances: the second adds into the `.grad` the first one handed over. Gradients that
  `torch.autograd.grad` returns, or a hook keeps, hold their instance the same way. A buffer the
  backward program returns for two inputs (x and residual, without dropout) goes back as one
  tensor object twice, as on the normal path, so AccumulateGrad copies it for one of them (two
  views would both be adopted, and the two `.grad`s would share memory).
- dropout: kernels read the seed from a [1] int64 tensor (Config.seed_from_memory). Each instance
  owns one, drawn from torch's CPU generator when it is captured (so `torch.manual_seed` before
  the first call reproduces a run); the forward graph advances it in place before its kernels,
  the backward graph reads the value its forward used (the instance is busy in between).

Without CUDA tensors (the Triton interpreter, CPU runs) there are no graphs: the call runs the
normal path, with the same seed-from-memory kernels, and says so once in the log.

Failures follow the other fronts' rules (driver.fallback). The warm-up is the programs' first run:
where it fails, the signature's compiled entry is retired and the call (and every later one of its
key) runs through torch, logged and counted (`first_run_fallbacks`). A capture that fails after a
good warm-up (a host sync, an allocation outside the graph's pool) leaves the programs correct but
not capturable: that signature runs without graphs from then on, said once. Strict mode raises both.
"""
from __future__ import annotations

import logging
import weakref
from typing import Callable, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfuse.base import torch_private
from memfuse.base.debug import STATS, topic_log
from memfuse.driver.fallback import STRICT, EagerCall, StrictModeError
from memfuse.ir.graph import Op
from memfuse.ir.targets import InputError

log = logging.getLogger("memfuse")
cache_log = topic_log("cache")


class CudaGraphRecorder:
    """How a program run becomes replayable: warm up on a side stream, then capture."""

    def supports(self, device: torch.device) -> bool:
        return device.type == "cuda"

    def warm_up(self, body: Callable[[], list], device: torch.device) -> None:
        torch.cuda.synchronize(device)
        with torch.cuda.stream(torch.cuda.Stream(device)):
            body()
        torch.cuda.synchronize(device)

    def capture(self, body: Callable[[], list], device: torch.device) -> tuple[list, Callable[[], None]]:
        graph = torch.cuda.CUDAGraph()
        # its own memory pool (see _Instance.capture); other threads' CUDA calls may go on
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            results = body()
        return results, graph.replay


class EagerRecorder:
    """The graph semantics without a GPU, for tests: a replay runs the body again and copies its
    results into the tensors the capture returned (static outputs that each replay overwrites)."""

    rebinds = True                       # a replay reruns Python: it reads the call's tensors

    def supports(self, device: torch.device) -> bool:
        return True

    def warm_up(self, body: Callable[[], list], device: torch.device) -> None:
        body()

    def capture(self, body: Callable[[], list], device: torch.device) -> tuple[list, Callable[[], None]]:
        results = body()

        def replay() -> None:
            for static, fresh in zip(results, body()):
                if static is not None and static is not fresh:
                    static.copy_(fresh)
        return results, replay


default_recorder = CudaGraphRecorder      # tests emulate graphs on CPU with EagerRecorder


class GraphedFunction:
    """The CUDA-graph front of one FusedFunction: exact signature -> captured instances."""

    def __init__(self, fused, recorder=None):
        self.fused = fused
        self.limit = fused.config.cuda_graphs_limit
        self.recorder = recorder or default_recorder()
        self.signatures: dict = {}       # exact key -> _Signature
        self.instances = 0               # captured over all signatures (bounded by the limit)
        self.told: set = set()           # reasons already logged

    def __call__(self, values: list):
        key = self.fused._exact_key(values)     # flat values (FusedFunction.__call__): all hashable
        signature = self.signatures.get(key)
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if signature is None:
            if not tensors or not self.recorder.supports(tensors[0].device):
                self._tell("device", "cuda_graphs=True ignored for %s tensors: CUDA graphs need CUDA tensors; "
                           "running without graphs", tensors[0].device.type if tensors else "no")
                return self._without_graphs(values)
            entry, _ = self.fused._lookup(values)
            if isinstance(entry, EagerCall):     # a compile that failed
                return self.fused.run_eager(entry, values)
            signature = self.signatures[key] = _Signature(entry, self.fused._name())
        if signature.ungraphed:
            return _format(signature.entry, signature.entry.function(tensors))
        try:
            instance = self._instance(signature, tensors)
        except _WarmUpFailed as failure:
            del self.signatures[key]
            decision = self.fused._first_run_failed(signature.entry, failure.program, failure.__cause__)
            return self.fused.run_eager(decision, values)
        except _CaptureFailed as failure:
            if self.fused.config.strict:
                raise StrictModeError(f"{failure}{STRICT}") from failure.__cause__
            signature.ungraphed = True
            self._tell("capture", "%s", failure)
            return _format(signature.entry, signature.entry.function(tensors))
        if instance is None:
            return _format(signature.entry, signature.entry.function(tensors))
        STATS["graph_replays"] += 1
        return _format(signature.entry, instance(tensors))

    def _instance(self, signature: "_Signature", tensors: list) -> Optional["_Instance"]:
        """A free instance whose borrowed inputs are where these tensors are; else a new one."""
        stale = None
        for instance in signature.instances:
            if instance.busy():
                continue
            moved = instance.moved(tensors)
            if not moved:
                return instance
            stale = instance, moved
        if stale is not None:            # arguments that move between calls are copied from now on
            instance, moved = stale
            signature.owned.update(moved)
            signature.instances.remove(instance)
            self.instances -= 1
            cache_log.info("memfuse: %s: cuda_graphs: tensor argument(s) %s moved; copying them into "
                           "graph buffers from now on", self.fused._name(), sorted(moved))
        if self.instances >= self.limit:
            self._tell("limit", "cuda_graphs: %d graphs captured (Config.cuda_graphs_limit); new shapes "
                       "and overlapping calls run without graphs", self.limit)
            return None
        instance = _Instance.capture(signature, tensors, self.recorder)
        signature.instances.append(instance)
        self.instances += 1
        STATS["graph_captures"] += 1
        cache_log.info("memfuse: %s: cuda_graphs: captured instance %d (%d for this signature)", self.fused._name(),
                       self.instances, len(signature.instances))
        return instance

    def _without_graphs(self, values: list):
        entry, tensors = self.fused._lookup(values)
        if isinstance(entry, EagerCall):     # a compile that failed
            return self.fused.run_eager(entry, values)
        return _format(entry, entry.function(tensors))

    def _tell(self, reason: str, message: str, *args) -> None:
        if reason not in self.told:
            self.told.add(reason)
            log.warning("memfuse: %s: " + message, self.fused._name(), *args)


class _WarmUpFailed(Exception):
    """The warm-up (the programs' first run) failed in `program` ("forward" or "backward"); the
    failure is the exception's __cause__."""

    def __init__(self, program: str):
        super().__init__(program)
        self.program = program


class _CaptureFailed(RuntimeError):
    """The programs ran, but capturing them into a CUDA graph failed."""


def _format(entry, outputs):
    return entry.rebuild(tuple(outputs))


class _Signature:
    def __init__(self, entry, name: str):
        self.entry = entry               # api._CacheEntry: the compiled programs
        self.name = name                 # the fused function's name, for messages
        self.instances: list = []
        self.owned: set = set()          # tensor positions always copied into graph buffers
        self.ungraphed = False           # its capture failed: it runs without graphs


def _warm_up(recorder, body: Callable[[], None], device: torch.device, running: list) -> None:
    """The recorder's warm-up of `body`, a failure in it raised as _WarmUpFailed naming the program
    that was running (`running[0]`); an input's own error passes through, as in eager."""
    try:
        recorder.warm_up(body, device)
    except InputError:
        raise
    except Exception as error:   # noqa: BLE001 -- the first run's failure: the caller runs the original
        raise _WarmUpFailed(running[0]) from error


class _Instance:
    """One captured forward graph (and backward graph), with its static tensors."""

    def __init__(self, compiled, inputs: list, borrowed: list, rebinds: bool):
        self.compiled = compiled
        self.inputs = inputs             # graph input per position: owned buffer, or the borrowed tensor
        self.borrowed = borrowed         # [(position, data_ptr)] read where the caller's tensor lies
        self.borrowed_positions = [i for i, _ in borrowed]
        self.owned = [i for i in range(len(inputs)) if i not in self.borrowed_positions]
        self.rebinds = rebinds           # emulated graphs read borrowed tensors from `inputs` on replay
        self.seed: Optional[torch.Tensor] = None   # [1] int64, advanced by each forward replay
        self.forward: Callable[[], None] = _nothing
        self.backward: Optional[Callable[[], None]] = None
        self.outputs: list = []          # the user outputs (graph memory)
        self.non_differentiable = compiled.non_differentiable   # output positions
        self.keep: list = []             # saved values in graph memory, kept for the backward graph
        self.tangents: list = []         # [(output index, graph buffer)]
        self.grads: list = []            # one per input (graph memory or None)
        self.returned: list = []         # [(StorageWeakRef, use count when nobody else holds it)]
        self.generation = 0              # forward replays so far
        self.waiting = None              # weakref to the ctx of the call whose backward is pending

    # -- capture ---------------------------------------------------------------------------
    @staticmethod
    def capture(signature: _Signature, tensors: list, recorder) -> "_Instance":
        """Warm up, then capture the forward (seed advance first) and the backward. Each graph gets
        its own memory pool, so a forward replay never writes where the backward left the gradients."""
        compiled = signature.entry.function
        device = tensors[0].device
        with torch.no_grad():
            inputs, borrowed = [], []
            for i, t in enumerate(tensors):
                if i in signature.owned or not t.is_contiguous():
                    inputs.append(torch.empty(t.shape, dtype=t.dtype, device=device).copy_(t))
                else:
                    borrowed.append((i, t.data_ptr()))
                    inputs.append(t.detach())
            instance = _Instance(compiled, inputs, borrowed, getattr(recorder, "rebinds", False))
            try:
                instance._capture(recorder, device)
            except (_WarmUpFailed, InputError):
                raise
            except Exception as e:   # noqa: BLE001 -- the programs ran in the warm-up: only the capture failed
                raise _CaptureFailed(
                    f"cuda_graphs=True: capturing its programs into a CUDA graph failed ({type(e).__name__}: {e}); "
                    f"running without graphs for this call signature. A step that syncs with the host or "
                    f"allocates outside the graph's pool (an aten fallback: MEMFUSE_LOG=fallbacks lists them) "
                    f"cannot be captured") from e
        instance.unbind()                # borrowed tensors are not kept: only their addresses
        instance.returned = _storage_counts(instance.outputs + instance.grads)
        return instance

    def _capture(self, recorder, device: torch.device) -> None:
        compiled, inputs = self.compiled, self.inputs
        symbol_values = compiled.symbol_values(inputs)
        n = compiled.num_fwd_outputs
        if compiled.has_seed:
            self.seed = _initial_seed(device)
        seed = [self.seed] if self.seed is not None else []
        stride = _seed_stride(compiled)

        def run_forward() -> list:
            return compiled.forward.run(inputs + seed, symbol_values, device)

        def advance_and_run_forward() -> list:
            if self.seed is not None:
                self.seed.add_(stride)
            return run_forward()

        if compiled.backward is None:
            _warm_up(recorder, run_forward, device, running=["forward"])
            outs, self.forward = recorder.capture(advance_and_run_forward, device)
            self.outputs = outs[:n]
            return

        running = ["forward"]

        def warm_up() -> None:
            outs = run_forward()
            tangents = [torch.zeros_like(outs[i], memory_format=torch.contiguous_format)
                        for i in compiled.differentiable]
            running[0] = "backward"
            compiled.backward.run(outs[n:] + seed + tangents, symbol_values, device)

        _warm_up(recorder, warm_up, device, running)
        outs, self.forward = recorder.capture(advance_and_run_forward, device)
        self.outputs = outs[:n]
        # a saved primal input is read where the caller's tensor lies (the ctx keeps it alive)
        saved = [_position(t, inputs, self.borrowed_positions) for t in outs[n:]]
        self.keep = [t for t in saved if isinstance(t, torch.Tensor)]
        self.tangents = [(i, torch.zeros_like(outs[i], memory_format=torch.contiguous_format))
                         for i in compiled.differentiable]

        def run_backward() -> list:
            saved_now = [inputs[t] if isinstance(t, int) else t for t in saved]
            return compiled.backward.run(saved_now + seed + [t for _, t in self.tangents], symbol_values, device)

        grads, self.backward = recorder.capture(run_backward, device)
        self.grads = list(grads)

    # -- a call ----------------------------------------------------------------------------
    def busy(self) -> bool:
        """A pending backward needs this instance's saved values, or a tensor it returned is
        still held outside (a replay would rewrite it)."""
        waiting = self.waiting
        if waiting is not None and waiting() is not None:
            return True
        for ref, count in self.returned:
            if _use_count(ref.cdata) > count:
                return True
        return False

    def moved(self, tensors: list) -> list:
        """Borrowed positions whose tensor is not at the captured address."""
        return [i for i, ptr in self.borrowed if tensors[i].data_ptr() != ptr]

    def copy_inputs(self, tensors) -> None:
        inputs = self.inputs
        for i in self.owned:
            if inputs[i].data_ptr() != tensors[i].data_ptr():
                inputs[i].copy_(tensors[i])

    def bind(self, borrowed: list) -> None:
        """Emulated graphs only: the borrowed tensors a replay reads (a CUDA graph reads addresses)."""
        for i, t in zip(self.borrowed_positions, borrowed):
            self.inputs[i] = t.detach()

    def unbind(self) -> None:
        for i in self.borrowed_positions:
            self.inputs[i] = None

    def replay_forward(self, tensors) -> None:
        self.copy_inputs(tensors)
        self.generation += 1
        if self.rebinds:
            self.bind([tensors[i] for i in self.borrowed_positions])
            self.forward()
            self.unbind()
        else:
            self.forward()

    def replay_backward(self, borrowed: list, grad_outputs) -> None:
        for i, buffer in self.tangents:
            grad = grad_outputs[i]
            if grad.data_ptr() != buffer.data_ptr():
                buffer.copy_(grad)
        if self.rebinds:
            self.bind(borrowed)
            self.backward()
            self.unbind()
        else:
            self.backward()

    def returned_grads(self) -> list:
        """Detached views of the gradient buffers: one tensor object per buffer object."""
        views: dict = {}
        for g in self.grads:
            if g is not None and id(g) not in views:
                views[id(g)] = g.detach()
        return [None if g is None else views[id(g)] for g in self.grads]

    def __call__(self, tensors: list) -> tuple:
        if self.backward is None:
            with torch.no_grad():
                self.replay_forward(tensors)
            return tuple(o.detach() for o in self.outputs)
        return _GraphedFunction.apply(self, *tensors)


_use_count = torch_private.storage_use_count


def _nothing() -> None:
    pass


def _position(t: torch.Tensor, inputs: list, borrowed: list):
    """The borrowed input position `t` is, else `t` itself."""
    return next((i for i in borrowed if inputs[i] is t), t)


class _GraphedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, instance: _Instance, *tensors):
        instance.replay_forward(tensors)
        ctx.instance, ctx.generation = instance, instance.generation
        instance.waiting = weakref.ref(ctx)
        # borrowed inputs stay alive (and version-checked) until the backward graph has read them
        ctx.save_for_backward(*[tensors[i] for i in instance.borrowed_positions])
        outputs = [o.detach() for o in instance.outputs]    # new tensors: autograd owns their grad_fn
        if instance.non_differentiable:
            ctx.mark_non_differentiable(*[outputs[i] for i in instance.non_differentiable])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        instance = ctx.instance
        borrowed = ctx.saved_tensors     # raises if a borrowed input was modified in place since
        if ctx.generation != instance.generation:
            raise RuntimeError(
                "memfuse: cuda_graphs: this backward's forward values were overwritten by a later forward "
                "replay of the same graph (a second backward with retain_graph=True after another call). "
                "Run the backward before calling the fused function again, or use cuda_graphs=False.")
        instance.replay_backward(borrowed, grad_outputs)
        instance.waiting = None
        return (None, *instance.returned_grads())


def _initial_seed(device: torch.device) -> torch.Tensor:
    """A 62-bit start drawn from torch's CPU generator: instances advance consecutive ranges of
    seeds, and far-apart random starts keep two instances' ranges from meeting."""
    start = torch.randint(0, 2 ** 62, (), dtype=torch.int64)
    return start.reshape(1).to(device)


def _seed_stride(compiled) -> int:
    """Seeds one forward replay consumes: each random op draws from seed + its stream index."""
    streams = [node.attr.stream for node in compiled.plan.forward.nodes.values() if node.op is Op.RAND]
    return max(streams, default=0) + 1


def _storage_counts(tensors: list) -> list:
    """Each distinct storage among `tensors`, with its use count while only the instance holds it."""
    seen, counts = set(), []
    for t in tensors:
        if t is None:
            continue
        ref = StorageWeakRef(t.untyped_storage())
        if ref.cdata in seen:
            continue
        seen.add(ref.cdata)
        counts.append((ref, _use_count(ref.cdata)))
    return counts
