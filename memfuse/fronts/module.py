"""module: `memory_efficient_fusion(module)`, an nn.Module drop-in whose forward and backward run fused.

The wrapper shares the original's parameter, buffer and submodule dicts (and its state-dict
hooks), so names, `state_dict` keys, `parameters()`, `.to()` and the optimizer see exactly what
they saw before; a checkpoint moves freely between a wrapped and a plain model.

A call is the original's forward, functionalized: `functional_call(module, {name: tensor}, args)`
inside a function whose tensor inputs are the parameters and buffers (kept static) followed by
the user's arguments. That function goes through `FusedFunction` (function.py), which keys on the
tensors (and pytrees of them, and rebuilds the output's structure); this module adds what the
tensors do not say: every submodule's plain attributes (training mode, dropout's p, a norm's
eps: a forward reads them as constants of its trace), the autocast state, and the call's argument
layout. A call FusedFunction cannot compile runs the same function on the module's own tensors:
the original's forward, through torch.

The module tree is walked once (`TreeWatch`), not per call: a call checks by identity that every
value the walk read is still there (C loops over the submodules' dicts, ~10x cheaper than a walk).
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.func import functional_call
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_leaves

from memfuse.fronts.function import FusedFunction, _CacheEntry, autocast_state
from memfuse.ir.captured import MutatedInputError, Retrace
from memfuse.base.config import Config
from memfuse.driver.fallback import EagerCall
from memfuse.fronts.split import through_backend

# Per-instance state of nn.Module that the wrapper takes over from the original, so that
# everything reading it (state_dict, load_state_dict, named_parameters, _apply) agrees.
SHARED_STATE = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                "_load_state_dict_post_hooks")


class ShardedParameterError(RuntimeError):
    """A parameter is still a DTensor (sharded) when the fused forward runs."""


@dataclass(frozen=True)
class CallKey:
    """What a FusedModule call is specialized on beyond its tensors."""
    attributes: tuple            # every submodule's plain attributes, training included (_attributes)
    autocast: tuple              # (device type, enabled, dtype)
    state: tuple                 # parameter and buffer names, in call order
    num_args: int
    kwarg_names: tuple


class BoundForward:
    """`fused_module.forward`: calls the fused forward and shows the original forward's signature,
    as wrappers do (`inspect.signature`: HuggingFace Trainer keeps only the dataset columns the
    forward names). A plain object, not a closure: deepcopy and pickle copy it with its module."""

    __name__ = "forward"

    def __init__(self, module: "FusedModule"):
        self.__self__ = module

    def __call__(self, *args, **kwargs):
        return self.__self__._fused_forward(*args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.__self__.original.forward)

    @property
    def __doc__(self) -> "str | None":
        return self.__self__.original.forward.__doc__


class ForwardWithSignature:
    """The class attribute `forward` of a FusedModule class: on an instance, binds a BoundForward
    on first read and keeps it in the instance's __dict__, which later reads find first (no
    descriptor per call; an assignment, `model.forward = ...` as accelerate's autocast does,
    replaces it). On the class, a function with the signature of the wrapped class's forward:
    clients read the class too (Trainer's `find_labels(type(model))`, `can_return_loss`)."""

    def __init__(self, wrapped: "type | None" = None):
        self.wrapped = wrapped
        self.function = None

    def __get__(self, module, owner=None):
        if module is not None:
            bound = module.__dict__["forward"] = BoundForward(module)
            return bound
        if self.function is None:
            def forward(module, *args, **kwargs):
                return module._fused_forward(*args, **kwargs)
            forward.__qualname__ = f"{owner.__qualname__}.forward"
            if self.wrapped is not None:
                forward.__signature__ = inspect.signature(self.wrapped.forward)
                forward.__doc__ = self.wrapped.forward.__doc__
            self.function = forward
        return self.function


@functools.lru_cache(maxsize=None)
def fused_class(wrapped: type) -> type:
    """The FusedModule subclass for a wrapped module's class: named after it, `forward` with its
    signature on the class (what clients that inspect `type(model)` read)."""
    return type(f"Fused{wrapped.__name__}", (FusedModule,),
                {"forward": ForwardWithSignature(wrapped), "__module__": __name__,
                 "__qualname__": f"Fused{wrapped.__qualname__}", "__doc__": FusedModule.__doc__})


def _new_fused(wrapped: type) -> "FusedModule":
    """Unpickling and deepcopy: an empty instance of `fused_class(wrapped)`, whose state is set
    next (a class made at run time is not importable by name)."""
    return nn.Module.__new__(fused_class(wrapped))


class FusedModule(nn.Module):
    """`memory_efficient_fusion(module)`: the same parameters, buffers and state_dict keys as
    `module`, a fused forward and backward. Read the original through `.original`."""

    def __new__(cls, module: "nn.Module | None" = None, *args, **kwargs):
        if cls is FusedModule and module is not None:
            cls = fused_class(type(module))
        return super().__new__(cls)

    def __init__(self, module: nn.Module, config: Config, *, cuda_graphs: bool = False):
        super().__init__()
        state = self.__dict__
        for name in SHARED_STATE:
            state[name] = module.__dict__[name]
        state["_version"] = getattr(module, "_version", 1)     # state_dict metadata, per module type
        state["_memfuse_original"] = module
        state["_memfuse_config"] = config
        state["_memfuse_cuda_graphs"] = cuda_graphs
        state["_memfuse_calls"] = {}                           # CallKey -> _ModuleCall
        state["_memfuse_watch"] = None                         # TreeWatch of the last call
        self.training = module.training

    @property
    def original(self) -> nn.Module:
        return self.__dict__["_memfuse_original"]

    @torch.compiler.disable   # inside torch.compile: a graph break around the fused call
    def _fused_forward(self, *args, **kwargs):
        call, values, device = self._call_for(args, kwargs)
        if call.key.autocast[1]:
            # The trace ran under autocast and holds its casts; the compiled steps must not be
            # autocast a second time.
            with torch.autocast(device.type, enabled=False):
                return call.write_back(call.fused(*values), values)
        return call.write_back(call.fused(*values), values)

    forward = ForwardWithSignature()

    def compiled_for(self, *args, **kwargs) -> "_CacheEntry | EagerCall":
        """The compiled program (cache entry) a call with these arguments runs, compiled if it is
        not cached yet, or the EagerCall saying why such a call runs through torch; nothing runs."""
        call, values, _ = self._call_for(args, kwargs)
        return call.fused.compiled_for(*values)

    def _call_for(self, args: tuple, kwargs: dict) -> tuple:
        """(the _ModuleCall of this call's CallKey, the values it takes, the device). The tree's
        parameters, buffers and attributes come from the last call's TreeWatch while it holds."""
        watch = self._memfuse_watch
        if watch is None or not watch.holds():
            watch = self.__dict__["_memfuse_watch"] = TreeWatch(self.original)
        tensors = watch.tensors
        device = tensors[0].device if tensors else _device(tensors, args, kwargs)
        autocast = autocast_state(device.type)
        shape = (autocast, len(args), *kwargs)
        call = watch.calls.get(shape)
        if call is None:
            call = watch.calls[shape] = self._call_of(CallKey(watch.attributes, autocast, watch.names, len(args),
                                                              tuple(kwargs)), watch)
        return call, (*tensors, *args, *kwargs.values()), device

    def _call_of(self, key: CallKey, watch: "TreeWatch") -> "_ModuleCall":
        call = self._memfuse_calls.get(key)
        if call is None:
            module = self.original
            _check_not_sharded(module, watch.names, watch.tensors)
            call = self._memfuse_calls[key] = _ModuleCall(module, key, self._memfuse_config,
                                                          self._memfuse_cuda_graphs)
        return call

    def _name(self) -> str:
        return type(self.original).__qualname__

    # -- the original's identity: state_dict, train/eval, attributes, printing ---------------
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self.original._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs):
        self.original._load_from_state_dict(*args, **kwargs)

    def train(self, mode: bool = True) -> "FusedModule":
        self.original.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            original = self.__dict__.get("_memfuse_original")
            if original is None:
                raise
            return getattr(original, name)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_memfuse_calls"] = {}     # compiled programs are rebuilt on first use, never copied
        state["_memfuse_watch"] = None
        if isinstance(state.get("forward"), BoundForward):   # bound to this instance: a copy binds its own
            del state["forward"]
        return state

    def __reduce_ex__(self, protocol):
        if type(self) is not fused_class(type(self.original)):   # a class made from it (FSDP2's): importable or not, as made
            return super().__reduce_ex__(protocol)
        return _new_fused, (type(self.original),), self.__getstate__()

    def _get_name(self) -> str:
        return f"memfuse.Fused[{self.original._get_name()}]"

    def extra_repr(self) -> str:
        return self.original.extra_repr()


class _ModuleCall:
    """The function FusedFunction compiles for one CallKey: (*params_and_buffers, *args,
    *kwarg_values) -> the module's output. Run on the module's own tensors it is the original's
    forward through torch, what a call FusedFunction cannot compile runs.

    A buffer the forward writes in place (BatchNorm's running statistics in training) is written,
    in the trace, into a copy the function returns beside the output (`written`: the buffers'
    positions, learned by the first trace, which then asks for another: Retrace), and
    `write_back` copies it into the buffer after the call, as AOTAutograd's runtime does for
    Dynamo's graphs. Run through torch, the forward writes into the buffers themselves."""

    def __init__(self, module: nn.Module, key: CallKey, config: Config, cuda_graphs: bool = False):
        self.module = module
        self.key = key
        self.written: tuple = ()     # positions (in key.state) of the buffers the forward writes in place
        self.__qualname__ = type(module).__qualname__
        self.fused = FusedFunction(self, config, static_prefix=len(key.state), cuda_graphs=cuda_graphs,
                                   names=_argument_names(module, key))

    def __call__(self, *values):
        key = self.key
        count = len(key.state)
        state = dict(zip(key.state, values[:count]))
        tracing = any(isinstance(v, FunctionalTensor) for v in values[:count])
        for i in self.written if tracing else ():
            state[key.state[i]] = values[i].clone()       # written into a copy, returned
        rest = values[count:]
        args, kwargs = rest[:key.num_args], dict(zip(key.kwarg_names, rest[key.num_args:]))
        device_type, enabled, dtype = key.autocast
        if enabled:   # the caller switched autocast off around the compiled call: run under it
            with torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=False):
                out = _call_module(self.module, state, args, kwargs)
        else:
            out = _call_module(self.module, state, args, kwargs)
        self._check_no_mutation(values)
        if not self.written:
            return out
        return out, tuple(state[key.state[i]] for i in self.written)

    def write_back(self, result, values: tuple):
        """The module's output; the buffers the forward wrote (their new values returned beside
        the output) copied into the module's own, unless they are those (run through torch)."""
        if not self.written:
            return result
        out, new = result
        with torch.no_grad():
            for i, value in zip(self.written, new):
                if value is not values[i]:
                    values[i].copy_(value)
        return out

    def split_runner(self, config: Config) -> Callable:
        """(the values this call takes) -> the output: the module itself through torch.compile with
        memfuse's backend, where memfuse's trace stopped at a read of a tensor's value (fronts.split).
        The module's own call, not functional_call: the values' parameters and buffers are its own,
        and Dynamo is free to break the graph inside its forward. Autocast as the call's, outside the compiled
        frames."""
        key, module = self.key, self.module
        entry = module._call_impl if fused_in_place(module) else module

        def call_module(*args, **kwargs):
            return entry(*args, **kwargs)
        # a function around the module: torch.compile of a module marks the module itself
        # (`_is_torch_compile`), a new attribute that would make the next call walk the tree again
        compiled = through_backend(call_module, config)
        device_type, enabled, dtype = key.autocast

        def run(values: list):
            rest = values[len(key.state):]
            args, kwargs = rest[:key.num_args], dict(zip(key.kwarg_names, rest[key.num_args:]))
            with torch.autocast(device_type, dtype=dtype, enabled=True, cache_enabled=False) if enabled else \
                    contextlib.nullcontext():
                return compiled(*args, **kwargs)
        return run

    def _check_no_mutation(self, values) -> None:
        """While tracing (the values are FunctionalTensors): no argument written in place; a buffer
        written in place is written into a copy by the next trace (Retrace)."""
        try:
            from torch._functorch._aot_autograd.functional_utils import has_data_mutation
        except ImportError:   # torch moved it: AOTAutograd's own (unnamed) error still fires
            return
        count = len(self.key.state)
        names = self.fused.names
        mutated = [i for i, v in enumerate(values) for leaf in tree_leaves(v)
                   if isinstance(leaf, FunctionalTensor) and has_data_mutation(leaf)]
        arguments = [f"argument '{names[i]}'" for i in mutated if i >= count]
        if arguments:
            raise MutatedInputError(
                f"memfuse: {self.__qualname__}.forward writes in place into its {', '.join(arguments)}; "
                f"memfuse cannot fuse a forward that mutates its arguments")
        if mutated:
            self.written = tuple(sorted(set(self.written) | set(mutated)))
            raise Retrace(f"memfuse: {self.__qualname__}.forward writes in place into its "
                          f"{', '.join(repr(names[i]) for i in mutated)}: traced again, writing copies")


def fuse_in_place(module: nn.Module, config: Config, *, cuda_graphs: bool = False) -> nn.Module:
    """`memory_efficient_fusion(module, in_place=True)`: `module` itself, whose calls run a
    FusedModule of it, set as its `_compiled_call_impl` (what `module(...)` calls first, as
    `nn.Module.compile` sets it). The module keeps its class, so clients that check it by isinstance
    (HuggingFace Trainer saving a PreTrainedModel with its configuration) see what they were given.
    Set in `__dict__`, not as a submodule: no state_dict key, not in `modules()`. A copy (deepcopy,
    pickle) is the plain module, as after `nn.Module.compile`: nn.Module's __getstate__ leaves
    `_compiled_call_impl` out."""
    module.__dict__["_compiled_call_impl"] = FusedModule(module, config, cuda_graphs=cuda_graphs)
    return module


def fused_in_place(module: nn.Module) -> bool:
    """Whether `module(...)` calls a FusedModule of it (fuse_in_place)."""
    return isinstance(module.__dict__.get("_compiled_call_impl"), FusedModule)


def _call_module(module: nn.Module, state: dict, args: tuple, kwargs: dict):
    """The module's forward (and its hooks) on `state`'s tensors: functional_call. A module fused in
    place is reached through its `_call_impl`, as nn.Module.compile's compiled function reaches it:
    `module(...)` would call the fused call again."""
    if not fused_in_place(module):
        return functional_call(module, state, args, kwargs)
    with _reparametrize_module(module, state, tie_weights=True, strict=False):
        return module._call_impl(*args, **kwargs)


def _argument_names(module: nn.Module, key: CallKey) -> list:
    """The name of each value a _ModuleCall takes: parameters and buffers, then the forward's
    positional arguments (by its signature) and keyword arguments."""
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    positional = [params[i] if i < len(params) else f"args[{i}]" for i in range(key.num_args)]
    return [*key.state, *positional, *key.kwarg_names]


PLAIN_ATTRIBUTE_TYPES = frozenset((bool, int, float, str, type(None)))


def _attributes(module: nn.Module) -> tuple:
    """The plain attributes (bool, int, float, str, None) of every submodule, in modules() order:
    `training`, dropout's `p`, a norm's `eps`, flags. A forward reads them as constants of its
    trace, so changing one (`model.drop.p = 0.0`) must select another program, as Dynamo's guards
    would. Attributes of other objects a forward reads (a HuggingFace config) are not watched."""
    return tuple(tuple(v for v in m.__dict__.values() if type(v) in PLAIN_ATTRIBUTE_TYPES)
                 for m in module.modules())


class TreeWatch:
    """One walk of a module tree: its parameter and buffer names and tensors (`_state`), its plain
    attributes (`_attributes`), and what `holds()` checks on every call to know the walk still
    describes the tree: the size of each submodule's `__dict__`, `_parameters`, `_buffers` and
    `_modules`, and, by identity, every tensor and submodule in them and every plain attribute's
    value. An assignment (`layer.drop.p = 0.0`, a new Parameter, a replaced submodule) puts a new
    object there: the next call walks again. The watch holds what it compares, so an id is never
    reused while it looks. `calls`: (autocast state, number of positional arguments, keyword
    names) -> the _ModuleCall, for this walk."""

    def __init__(self, module: nn.Module):
        self.names, self.tensors = (tuple(part) for part in _state(module))
        self.attributes = _attributes(module)
        self.calls: dict = {}
        modules = list(module.modules())
        self._dicts = [d for m in modules for d in (m.__dict__, m._parameters, m._buffers, m._modules)]
        # an empty one stays empty while its size does: only the others' values are compared
        self._holders = [d for m in modules for d in (m._parameters, m._buffers, m._modules) if d]
        attributes = [(m.__dict__, k) for m in modules for k, v in m.__dict__.items()
                      if type(v) in PLAIN_ATTRIBUTE_TYPES]
        self._attribute_dicts = [d for d, _ in attributes]
        self._attribute_names = [k for _, k in attributes]
        self._sizes = self._sizes_now()
        self._objects = self._objects_now()

    def _sizes_now(self) -> tuple:
        return tuple(map(len, self._dicts))

    def _objects_now(self) -> tuple:
        return (*itertools.chain.from_iterable(map(dict.values, self._holders)),
                *map(operator.getitem, self._attribute_dicts, self._attribute_names))

    def holds(self) -> bool:
        """Whether the tree still has what the walk read (C loops: no Python code per submodule)."""
        if self._sizes_now() != self._sizes:
            return False
        try:
            return all(map(operator.is_, self._objects_now(), self._objects))
        except KeyError:     # an attribute deleted and another added: the sizes agree, the names do not
            return False


def _state(module: nn.Module) -> tuple[list, list]:
    """Parameter and buffer names and tensors (tied ones once), in a fixed order."""
    names, tensors = [], []
    for name, t in module.named_parameters():
        names.append(name)
        tensors.append(t)
    for name, t in module.named_buffers():
        names.append(name)
        tensors.append(t)
    return names, tensors


def _check_not_sharded(module: nn.Module, names: list, tensors: list) -> None:
    """On a compile: every parameter must be a plain tensor by now. Under FSDP2 the hooks of
    `fully_shard(fused_module)` gather them before forward; hooks on `.original` never fire,
    since memfuse runs the original's forward traced, not through its __call__."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor
    sharded = [name for name, t in zip(names, tensors) if isinstance(t, DTensor)]
    if sharded:
        raise ShardedParameterError(
            f"memfuse: {type(module).__qualname__}'s {', '.join(repr(n) for n in sharded[:4])}"
            f"{' ...' if len(sharded) > 4 else ''} are DTensors (sharded) when the fused forward runs. "
            f"Under FSDP2 apply fully_shard to the FusedModule, the module in the model tree, not to its "
            f"`.original`: FSDP's hooks gather the parameters before the wrapper's forward. Parameters "
            f"that stay sharded through forward (tensor parallelism) are not supported.")


def _device(tensors: list, args: tuple, kwargs: dict) -> torch.device:
    for t in (*tensors, *args, *kwargs.values()):
        if isinstance(t, torch.Tensor):
            return t.device
    raise TypeError("memfuse: a fused module needs a tensor parameter, buffer or argument")


