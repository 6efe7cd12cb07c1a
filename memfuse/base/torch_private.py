"""torch's private internals that memfuse uses for host speed, in one place.

Each entry says what it does, why memfuse uses it, and the public fallback taken where torch
lacks it (None where there is none: memfuse then needs the entry). Every entry was checked on
torch 2.11 (the GPU machine) and torch 2.13 (the CPU machine); tests/base/test_torch_private.py
fails if torch changes under any of them (gone, not callable, or behaving otherwise on a small
tensor). Nothing else in memfuse reaches into `torch._C` for speed: a new fast path gets an entry
here, with its fallback and its test.
"""
from __future__ import annotations

import contextlib
import inspect
import threading
from typing import Callable, Optional

import torch

CHECKED_ON = ("2.11", "2.13")   # torch versions every entry below was checked on


# -- allocation and views ------------------------------------------------------------------------
def empty_strided(device_type: str) -> Optional[Callable]:
    """`(sizes, strides, dtype) -> an uninitialized tensor` on the current device of `device_type`:
    inductor's `torch._C._dynamo.guards._empty_strided_cpu` / `_cuda`. Why: they skip
    torch.empty_strided's argument parser and dispatcher, most of an allocation's host time, and a
    program allocates every output of every kernel. Fallback: None (the caller then uses
    `torch.empty_strided(sizes, strides, dtype=dtype, device=device)`)."""
    if device_type not in ("cpu", "cuda"):
        return None
    return getattr(torch._C._dynamo.guards, f"_empty_strided_{device_type}", None)


def as_strided_at(t: torch.Tensor, sizes: tuple, strides: tuple, offset: int) -> torch.Tensor:
    return t.as_strided(sizes, strides, t.storage_offset() + offset)


# `(tensor, sizes, strides, offset) -> a tensor over the same memory, at the tensor's own storage
# offset plus `offset`: inductor's `torch._C._dynamo.guards._reinterpret_tensor`. Why: it makes no
# view for autograd to track (cheaper to make, and to hand back as a gradient, than a view), where
# a program takes a column sum's row out of its kernel's totals or makes an extern's view by
# strides. Fallback: `tensor.as_strided(sizes, strides, tensor.storage_offset() + offset)`.
reinterpret_tensor: Callable = getattr(torch._C._dynamo.guards, "_reinterpret_tensor", as_strided_at)


# `(device index) -> the current CUDA stream of that device, as a raw pointer (int)`:
# `torch._C._cuda_getCurrentRawStream`. Why: Triton's C launcher takes the stream as an int, and
# this is one C call, where `torch.cuda.current_stream(index).cuda_stream` builds a Stream object.
# Fallback: None without CUDA support in torch (nothing launches directly there then).
raw_stream: Optional[Callable] = getattr(torch._C, "_cuda_getCurrentRawStream", None)


# `(cdata) -> how many references hold the storage at cdata` (a StorageWeakRef's `cdata`):
# `torch._C._storage_Use_Count`. Why: a CUDA-graphed function learns, in one C call, whether the
# caller still holds an output it returned (the next replay would overwrite it). Fallback: None
# (required: there is no public way to read a storage's reference count).
storage_use_count: Callable = torch._C._storage_Use_Count


# -- autograd ------------------------------------------------------------------------------------
# `(ignore_is_tracing) -> None, or the innermost (pack, unpack) pair of saved-tensors hooks`:
# `torch._C._autograd._top_saved_tensors_default_hooks`, what autograd's SavedVariable reads. Why: a
# backward program takes the saved tensors as raw pointers when no hook can have unpacked them
# into something else. Fallback: a getter that always reports hooks (the checked program runs).
saved_tensors_hooks: Callable = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks",
                                        lambda ignore_is_tracing: ())


def function_apply_c(function: type) -> Callable:
    """The C half of `function.apply` for a torch.autograd.Function subclass:
    `torch._C._FunctionBase.apply`. Why: the Python half (torch.autograd.Function.apply) routes
    functorch transforms, unwraps dead functorch wrappers and binds defaults for a setup_context
    memfuse does not define, on every call; a repeated call does the first two itself
    (`functorch_transforms_active`, `unwrap_if_dead`) and calls the C half. Fallback: None
    (required: autograd.Function is built on it)."""
    return super(torch.autograd.Function, function).apply


def call_backward_directly(function: type) -> None:
    """Make autograd's node for `function` call its backward directly: the engine runs a custom
    Function's backward through its node's `apply` (`function._backward_cls.apply`, a Python
    method, BackwardCFunction.apply) that looks the backward up again on every call, in two frames.
    Fallback: where torch has no `_backward_cls`, nothing is changed (the engine's own path)."""
    backward_cls = getattr(function, "_backward_cls", None)
    if backward_cls is not None:
        backward_cls.apply = function.backward


# -- functorch -----------------------------------------------------------------------------------
# `() -> bool`: whether a functorch transform (vmap, grad, jvp) is active:
# `torch._C._are_functorch_transforms_active`, what autograd.Function.apply asks itself. Why: a
# fused function runs eagerly under a transform, and its repeated call asks once, in C. Fallback:
# None (required: autograd.Function.apply calls it too).
functorch_transforms_active: Callable = torch._C._are_functorch_transforms_active

# `(tensor) -> the tensor, unwrapped if it is a dead functorch wrapper`:
# `torch._C._functorch.unwrap_if_dead`, as autograd.Function.apply does to its arguments. Why: a
# repeated call that skips the Python half of apply (`function_apply_c`) does it itself.
# Fallback: None (required, as for autograd.Function.apply).
unwrap_if_dead: Callable = torch._C._functorch.unwrap_if_dead

# `(tensor) -> bool`: whether the tensor is a functorch wrapper:
# `torch._C._functorch.is_functorch_wrapped_tensor`. Why: tensor guards made with plain tensors
# fail on wrappers, whose dispatch keys differ: a call with a wrapper makes none. Fallback: a test
# that says every tensor may be one (no tensor guards are made).
is_functorch_wrapped_tensor: Callable = getattr(torch._C._functorch, "is_functorch_wrapped_tensor",
                                                lambda tensor: True)


# -- autocast and guards -------------------------------------------------------------------------
# `() -> bool`: whether autocast is on for any device: `torch._C._is_any_autocast_enabled`. Why:
# a repeated call asks in one C call, where the public way asks per device. Fallback:
# `torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")`.
any_autocast_enabled: Callable = getattr(torch._C, "_is_any_autocast_enabled", None) or \
    (lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))

# `TensorGuards(*tensors, dynamic_dims_sizes=, dynamic_dims_strides=)`, whose `.check(*tensors)`
# compares the tensors' Python type, dispatch keys, dtype, device, requires_grad, sizes and
# strides with those it was made from, in one C++ call: Dynamo's
# `torch._C._dynamo.guards.TensorGuards`. Why: a repeated call finds its compiled function without
# reading each tensor's properties into a key. Fallback: None (the key lookup).
TensorGuards: Optional[type] = getattr(torch._C._dynamo.guards, "TensorGuards", None)


# -- tracing -------------------------------------------------------------------------------------
@contextlib.contextmanager
def compiling_flag():
    """`torch.compiler.is_compiling()` answers True in the block, as under torch.compile and
    torch.export (non-strict export sets the same flag, `torch.compiler._is_compiling_flag`). Why:
    libraries then take their trace-friendly paths while memfuse traces. Fallback: where torch has
    no such flag, the block runs as it is (libraries take their eager paths)."""
    if not hasattr(torch.compiler, "_is_compiling_flag"):
        yield
        return
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before


@contextlib.contextmanager
def scripted_functions_as_python():
    """A TorchScript function (`@torch.jit.script def f`, a `torch.jit.ScriptFunction`) called in
    the block runs its Python original, which `torch.jit.script` keeps on it as
    `_torchdynamo_inline` (what Dynamo inlines in its place); one without an original runs in the
    TorchScript interpreter as before. Why: the interpreter is no tracer's friend: it asks a
    symbolic tensor for concrete sizes (`numel()` fails with "Cannot call numel() on tensor with
    symbolic sizes/strides"; `size(0)` silently specializes the trace on that size), and a function
    it already optimized on real tensors runs its specialized graph on fake ones. The Python original
    traces op by op like the rest of the model. Fallback: where torch keeps no original, the
    block runs as it is."""
    with _SCRIPTED.lock:
        if _SCRIPTED.tracing == 0:
            torch.jit.ScriptFunction.__call__ = _call_python_original
        _SCRIPTED.tracing += 1
    _SCRIPTED.here.on = getattr(_SCRIPTED.here, "on", 0) + 1
    try:
        yield
    finally:
        _SCRIPTED.here.on -= 1
        with _SCRIPTED.lock:
            _SCRIPTED.tracing -= 1
            if _SCRIPTED.tracing == 0:
                torch.jit.ScriptFunction.__call__ = _SCRIPTED.interpreted


class _ScriptedState:
    """scripted_functions_as_python's state: the class's own `__call__` (the interpreter), how many
    blocks are open in any thread (the patch is in place while any is), and whether this thread is in
    one (another thread's TorchScript calls meanwhile run in the interpreter, as outside)."""

    def __init__(self):
        self.interpreted = torch.jit.ScriptFunction.__dict__["__call__"]
        self.lock = threading.Lock()
        self.tracing = 0
        self.here = threading.local()


_SCRIPTED = _ScriptedState()


def _call_python_original(fn, *args, **kwargs):
    original = inspect.getattr_static(fn, "_torchdynamo_inline", None) if getattr(_SCRIPTED.here, "on", 0) else None
    if original is None:
        return _SCRIPTED.interpreted(fn, *args, **kwargs)
    return original(*args, **kwargs)
