"""check_compiles: compile what a training step compiles, at the real sizes, without a GPU.

    report = memfuse.check_compiles(model, **batch, style="backend")    # or style="whole"
    print(report)          # one line per compiled graph: its kernels, its program runs

One training step (forward, the loss, backward) runs under FakeTensorMode with Config.compile_only:
the model's parameters and buffers and the arguments are fake tensors of their real shapes (the
model's own are swapped for fakes during the call, no memory copied; a model built under a
FakeTensorMode is used as it is), Dynamo and AOTAutograd trace them as usual, and memfuse runs every
stage, codegen included (the Triton source of every kernel, loaded as a Python module). Its
programs then run on the fakes: they allocate, view and call their externs' fake implementations,
and launch no kernel (`launches_skipped` counts what they would have launched). So every graph of
the step is compiled (in the backend style every Dynamo graph, its AOT forward and backward; in
the whole style the fused forward and backward), the backward compiled lazily too, at the cost of
the compile alone: seconds and almost no memory for a model of any size.

A compile that fails raises memfuse's error (there is nothing to fall back for): a Dynamo graph
or a call that would run through torch. Ops and kernel groups memfuse sends to aten by design are
counted in the report (`aten_groups`); `strict=True` refuses them too (Config.strict).

What differs from a compile on the GPU (docs/debugging.md): Triton's own compile of the generated
source is not run (it needs the GPU's compiler), so an error there, and anything decided at a
kernel's launch (alignment, out of resources), is not seen; decisions memfuse or torch make by
device (CUDA's autocast op lists, matmul padding "auto", attention's kernel choice) follow the
CPU's. Parameters on a CUDA device are not supported here: the compile runs on the CPU.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from memfuse.base.config import Config
from memfuse.base.debug import STATS
from memfuse.fronts import backend
from memfuse.fronts.module import FusedModule
from memfuse.fronts.wrap import memory_efficient_fusion
from memfuse.runtime.launchers import KernelLaunch
from memfuse.runtime.program import Program

STYLES = ("backend", "whole")


@dataclasses.dataclass(frozen=True)
class GraphCheck:
    """One graph compiled: its kernels and extern/aten steps per side, and how often the step ran
    each program (0 runs of a backward: the step's backward never reached it)."""
    name: str
    forward_kernels: int
    backward_kernels: Optional[int]     # None: no backward program (nothing needed a gradient)
    aten_groups: int                    # kernel groups run through aten by design, both sides
    forward_runs: int
    backward_runs: int

    def __str__(self) -> str:
        backward = "no backward" if self.backward_kernels is None else \
            f"backward {self.backward_kernels} kernels (ran {self.backward_runs}x)"
        return (f"{self.name}: forward {self.forward_kernels} kernels (ran {self.forward_runs}x), {backward}, "
                f"{self.aten_groups} groups through aten")


@dataclasses.dataclass(frozen=True)
class CompileCheck:
    """What `check_compiles` compiled: every graph, and the kernel launches its programs skipped."""
    style: str
    graphs: tuple
    launches_skipped: int

    @property
    def backward_covered(self) -> bool:
        """Every graph with a backward program ran it: the step's backward was compiled and run."""
        return all(g.backward_runs > 0 for g in self.graphs if g.backward_kernels is not None)

    def __str__(self) -> str:
        lines = [f"memfuse.check_compiles ({self.style}): {len(self.graphs)} graphs compiled, "
                 f"{self.launches_skipped} kernel launches skipped"]
        return "\n".join(lines + [f"  {g}" for g in self.graphs])


def check_compiles(target: Callable, *args, style: str = "backend", loss: Optional[Callable] = None,
                   config: Optional[Config] = None, strict: bool = False, **kwargs) -> CompileCheck:
    """Compile one training step of `target(*args, **kwargs)` (a module or function) in `style`
    ("backend": torch.compile(target, backend="memfuse"); "whole": memory_efficient_fusion(target))
    on fake tensors, launching nothing (module docstring); the loss is `loss(output)`, by default
    the output's `loss` (a HuggingFace model given labels), else the sum of its floating-point
    tensors. Runs under the caller's autocast: wrap the call in `torch.autocast("cpu",
    dtype=torch.bfloat16)` for a bf16 step. Raises memfuse's error where a compile fails."""
    if style not in STYLES:
        raise ValueError(f"memfuse: check_compiles: style must be one of {STYLES}, got {style!r}")
    config = dataclasses.replace(config or Config(), compile_only=True, strict=strict or (config or Config()).strict)
    skipped = STATS["launches_skipped"]
    with _faked(target, args, kwargs) as (args, kwargs):
        if style == "backend":
            with backend.watch() as records:
                compiled = torch.compile(target, backend=_compile_only_backend(config))
                _backward(compiled(*args, **kwargs), loss)
            programs = [(r.name, r.function) for r in records if r.function is not None]
        else:
            wrapped = memory_efficient_fusion(target, config=config)
            _backward(wrapped(*args, **kwargs), loss)
            programs = [(name, entry.function) for name, entry in _entries(wrapped)]
    return CompileCheck(style, tuple(_graph_check(name, function) for name, function in programs),
                        STATS["launches_skipped"] - skipped)


def _compile_only_backend(config: Config) -> Callable:
    """memfuse's backend with `config`, named as Dynamo's errors show it ("memfuse")."""
    def memfuse(gm: torch.fx.GraphModule, example_inputs):
        return backend.memfuse_backend(gm, example_inputs, config=config)
    return memfuse


def _backward(output, loss: Optional[Callable]) -> None:
    value = loss(output) if loss is not None else _default_loss(output)
    if value.requires_grad:
        value.backward()


def _default_loss(output) -> torch.Tensor:
    found = getattr(output, "loss", None) if not isinstance(output, dict) else output.get("loss")
    if isinstance(found, torch.Tensor):
        return found
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise TypeError("memfuse: check_compiles: the output has no floating-point tensor to take a loss of; "
                        "pass loss=")
    return sum(t.float().sum() for t in floats)


def _entries(wrapped) -> list:
    """(name, cache entry) of every program a memory_efficient_fusion wrapper compiled."""
    functions = [call.fused for call in wrapped._memfuse_calls.values()] if isinstance(wrapped, FusedModule) \
        else [wrapped]
    return [(f"{fused._name()}#{k}", entry) for fused in functions
            for k, entry in enumerate(e for e in fused.cache.values() if hasattr(e, "function"))]


def _graph_check(name: str, function) -> GraphCheck:
    forward, backward = function.forward, function.backward
    return GraphCheck(name, _kernels(forward), None if backward is None else _kernels(backward),
                      sum(_aten_groups(p) for p in (forward, backward) if p is not None),
                      forward.runs, 0 if backward is None else backward.runs)


def _kernels(program: Program) -> int:
    return sum(isinstance(step, KernelLaunch) for step in program.steps)


def _aten_groups(program: Program) -> int:
    return sum(getattr(step, "aten_reason", None) is not None for step in program.schedule.steps)


# -- fake tensors ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _faked(target, args: tuple, kwargs: dict):
    """Inside: the fake mode on, `target`'s parameters and buffers fake (its own restored on the way
    out), yields the arguments with every tensor fake. The mode is the one `target`'s tensors or the
    arguments were made in (tensors it holds elsewhere, plain attributes, were made in it too), else
    a new one; it takes real tensors meanwhile: the constants a graph holds (a `torch.tensor` in the
    model's forward) reach the programs as inputs. Programs read their fake tensors' data pointers
    (0: nothing is launched with them): allowed explicitly, its deprecation warning silenced."""
    module = target if isinstance(target, torch.nn.Module) else None
    state = [*module.parameters(), *module.buffers()] if module is not None else []
    mode = next((t.fake_mode for t in (*state, *tree_leaves((args, kwargs))) if isinstance(t, FakeTensor)), None) \
        or FakeTensorMode()
    took_real = mode.allow_non_fake_inputs
    mode.allow_non_fake_inputs = True
    swapped = _swap_in_fakes(module, mode) if module is not None else []
    try:
        fake_args, fake_kwargs = tree_map(functools.partial(_fake, mode), (args, kwargs))
        with mode, torch._functorch.config.patch(fake_tensor_allow_unsafe_data_ptr_access=True), \
                warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            yield fake_args, fake_kwargs
    finally:
        for holder, name, original in reversed(swapped):
            holder[name] = original
        mode.allow_non_fake_inputs = took_real


def _fake(mode: FakeTensorMode, value):
    if not isinstance(value, torch.Tensor) or _made_in(value, mode):
        return value
    fake = mode.from_tensor(value)
    return fake.requires_grad_(value.requires_grad) if value.is_leaf else fake


def _made_in(tensor: torch.Tensor, mode: FakeTensorMode) -> bool:
    return isinstance(tensor, FakeTensor) and tensor.fake_mode is mode


def _swap_in_fakes(module: torch.nn.Module, mode: FakeTensorMode) -> list:
    """Put a fake of every real parameter and buffer of `module` in its place (tied ones stay
    tied); [(dict, name, the original)] to put back."""
    swapped, made = [], {}
    for sub in module.modules():
        for holder, is_parameter in ((sub._parameters, True), (sub._buffers, False)):
            for name, tensor in list(holder.items()):
                if tensor is None or _made_in(tensor, mode):
                    continue
                fake = made.get(id(tensor))
                if fake is None:
                    fake = mode.from_tensor(tensor)
                    if is_parameter:
                        fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
                    made[id(tensor)] = fake
                swapped.append((holder, name, tensor))
                holder[name] = fake
    return swapped
