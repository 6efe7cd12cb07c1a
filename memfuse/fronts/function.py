"""The user-facing wrapper: `memory_efficient_fusion(fn)`, its compile cache and its guards.

A compiled program is keyed by what it was specialized on: grad mode, the autocast state, and
per tensor argument its dtype, device, rank, last dim (D), requires_grad, layout (contiguous;
else whether its last stride is 1) and which leading dims are 0, 1 or equal to each other; an
integer or bool tensor's last dim (token ids, labels: a sequence length) is keyed as a leading
dim, since the trace holds it as a size symbol (capture.trace.symbolic_last_dim);
non-tensor arguments are constants of the graph and part of the key. An argument may also be a
pytree (tuple, list, dict, registered dataclass or pytree node) of tensors and constants: its
leaves are keyed as above and the structure (tree spec) joins the key. Leading sizes and strides
are not in the key: a new batch or sequence size reuses the program. A trace that guards on a
non-contiguous input's strides (a contiguity check: its row stride is not D) keeps its program
for every call whose sizes and strides keep those guards, checked at the lookup; another layout
compiles its own.

A call memfuse cannot compile runs the original function through torch, op by op (`EagerCall`:
the decision, its reason and the way out, logged once on the `fallbacks` topic, counted in
`stats()["eager_calls"]`; strict mode raises instead): an argument it cannot trace (an object the
call may mutate, such as a KV cache), a functorch transform around the call, or a compile that
failed (a function writing into its input, ...); the last is decided once per compile key, and
so is a compiled program whose first run fails, forward or backward (memfuse.driver.fallback: the
first run's rules). Tensor arguments on two devices run the call through torch too. An error the
original raises then is the user's, as in eager. A trace that stops where the function reads a
tensor's value (`if t.any():`, `.item()`) runs the key through torch.compile with memfuse's
backend instead, split at the read (fronts.split).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
from typing import Callable, Optional

import sympy
import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from memfuse.patterns.attention import mask_like, marked_form
from memfuse.base import torch_private
from memfuse.base.config import Config
from memfuse.base.source import Lines
from memfuse.base.debug import STATS, describe_key_change, topic_log
from memfuse.capture.trace import symbolic_last_dim
from memfuse.driver.compile import TracedFunction, compile_or_decide
from memfuse.driver.fallback import (STRICT, EagerCall, StrictModeError, count_first_run_fallback,
                                     first_run_failed, mixed_devices, say_once, under_transform,
                                     untraceable_argument)
from memfuse.fronts.cuda_graphs import GraphedFunction
from memfuse.fronts.outputs import CONSTANT_TYPES, key_path, output_tensors
from memfuse.fronts.split import VALUE_READS, SplitCall, split_call, through_backend
from memfuse.ir.captured import Retrace
from memfuse.ir.targets import InputError
from memfuse.runtime.function import CompiledFunction
from memfuse.runtime.program import SIZE_FUNCTIONS

cache_log = topic_log("cache")
recompile_log = topic_log("recompiles")
LEAF_TYPES = (torch.Tensor, *CONSTANT_TYPES)   # what a traced argument or output is made of
EXACT_CACHE_SIZE = 4096   # distinct exact argument shapes remembered in the front cache


class FusedFunction:
    """`static_prefix`: the first N tensor arguments keep every dim static and their whole shape
    joins the compile key (a module's parameters and buffers; nn.Parameter arguments always do).
    `names`: the user's name of each bound value where fn's signature does not say it (a module's
    parameters, buffers and arguments, module.py)."""

    def __init__(self, fn: Callable, config: Config, *, static_prefix: int = 0, cuda_graphs: bool = False,
                 names: Optional[list] = None):
        self.fn = fn
        self.config = config
        self.static_prefix = static_prefix
        self.graphs = GraphedFunction(self) if cuda_graphs else None   # CUDA-graph replays (cuda_graphs.py)
        self.cache: dict = {}                 # compile key -> _CacheEntry, or EagerCall where the compile failed
        self.shape_specialized: set = set()   # keys whose traces guard on the leading sizes
        self.recipes: dict = {}               # (n positional, keywords) -> binding recipe
        self.exact: dict = {}                 # exact shapes and types -> entry (front cache)
        self.fronts: dict = {}                # n positional [, keywords] -> _Front: the hot path
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None
        params = list(self.signature.parameters.values()) if self.signature is not None else []
        only_varargs = len(params) == 1 and params[0].kind is inspect.Parameter.VAR_POSITIONAL
        self.binds = not only_varargs and any(
            p.default is not inspect.Parameter.empty or p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD
            for p in params)
        # keyword-only parameters close the bound values and are passed back by name
        self.keyword_only = [] if self.signature is None else [
            name for name, p in self.signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        self.names = names if names is not None else [p.name for p in params]
        self.positions_shown = names is None   # a signature's names come with their position
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        front = self.fronts.get((len(args), *kwargs) if kwargs else len(args))
        if front is not None:
            outputs = front.call(args, kwargs)
            if outputs is not MISS:
                return outputs
        STATS["front_misses"] += 1
        values = self._bind(args, kwargs)
        if torch_private.functorch_transforms_active():
            return self.run_eager(under_transform(self._name()), values)
        if self.graphs is not None and _flatten(values).tree is None:
            return self.graphs(values)
        entry, tensors = self._lookup(values)
        if isinstance(entry, EagerCall):
            return self.run_eager(entry, values)
        if not entry.proven:
            return self._first_run(entry, args, kwargs, values, tensors)
        self._remember(args, kwargs, values, entry)
        return entry.rebuild(_run(entry, tensors))

    def _first_run(self, entry: "_CacheEntry", args: tuple, kwargs: dict, values: list, tensors: list):
        """A compiled program's first call: where it fails (Triton's compile at the first launch, a
        launch's checks, an extern's), the call and every later one of its key run through torch
        (driver.fallback: the first run's rules; strict mode raises). The front cache serves the
        key only once a call ran."""
        try:
            outputs = _run(entry, tensors)
        except InputError:           # the inputs' fault, as in eager: the program stays
            raise
        except Exception as error:   # noqa: BLE001 -- the first run's failure: the original runs, with the reason
            decision = self._first_run_failed(entry, "forward", error)
            return self.run_eager(decision, values)
        entry.proven = True
        self._remember(args, kwargs, values, entry)
        return entry.rebuild(outputs)

    def _first_run_failed(self, entry: "_CacheEntry", program: str, error: Exception) -> EagerCall:
        """The decision to run `entry`'s key through torch from now on (once: a later failure of
        the same entry finds it made); an error in strict mode, chained to the failure."""
        decision = first_run_failed(self._name(), program, error)
        if self.config.strict:
            raise StrictModeError(f"{decision}{STRICT}") from error
        if entry.retired is None:
            entry.retired = decision
            for table in (self.cache, self.exact):
                for key, value in table.items():
                    if value is entry:
                        table[key] = decision
            self.fronts.clear()          # the front caches may serve it: rebuilt by the next calls
            count_first_run_fallback(error)
        return entry.retired

    def _backward_through_torch(self, entry: "_CacheEntry", eager: Callable, error: Exception, inputs: tuple,
                                versions: list, grad_outputs: tuple) -> tuple:
        """The gradients of a call whose first backward program failed, through torch: the original
        function again on the inputs the forward kept, under autograd (runtime.function._first_backward)."""
        decision = self._first_run_failed(entry, "backward", error)
        say_once(decision)
        changed = [i for i, (t, version) in enumerate(zip(inputs, versions)) if t._version != version]
        if changed:
            raise RuntimeError(f"memfuse: {self._name()}: its backward program failed and the gradients would be "
                               f"recomputed through torch, but tensor inputs {changed} were modified in place since "
                               f"the forward") from error
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
            outputs = eager(*leaves)     # the program's outputs: the caller's, then an output hook's
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if g is not None and o.requires_grad]
        wanted = [leaf for leaf in leaves if leaf.requires_grad]
        gradients = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                         if pairs and wanted else [None] * len(wanted))
        return tuple(next(gradients) if leaf.requires_grad else None for leaf in leaves)

    def run_eager(self, decision: "EagerCall", values: list):
        """Run fn as written on the bound values, op by op through torch: the call `decision` says
        memfuse cannot compile. Logged once per reason; an error in strict mode and compile-only. A
        call whose trace read a tensor's value runs through torch.compile instead (SplitCall, fronts.split)."""
        if isinstance(decision, SplitCall):
            return decision(values)
        if self.config.strict or self.config.compile_only:
            raise StrictModeError(f"{decision}{STRICT}")
        say_once(decision)
        STATS["eager_calls"] += 1
        return self._call(values)

    def _remember(self, args: tuple, kwargs: dict, values: list, entry: "_CacheEntry") -> None:
        """Enter a call that went through `_lookup` in the front of its call shape, made for the
        argument pattern (`_pattern`: which values are tensors, constants, or tuples, lists and
        dicts of them) of the shape's first call. Calls with deeper pytree arguments stay on the
        slower path."""
        pattern = _pattern(values)
        if _any_autocast() or pattern is None:   # the front serves calls with autocast off
            return
        if any(marked_form(t) for t in _flatten(values).leaves if isinstance(t, torch.Tensor)):
            return       # its guards do not read masks' marks (memfuse.patterns.attention): the key does
        shape = (len(args), *kwargs) if kwargs else len(args)
        front = self.fronts.get(shape)
        if front is None:
            front = self.fronts[shape] = _Front(self._binding(len(args), tuple(kwargs)), pattern)
        if front.pattern == pattern and len(front.entries) < EXACT_CACHE_SIZE:
            key, tensors = front.read(args, kwargs)
            front.entries[key] = (entry.function.apply, entry.rebuild, _tensor_guards(tensors))

    def compiled_for(self, *args, **kwargs) -> "_CacheEntry | EagerCall":
        """The compiled program (cache entry) these arguments select, compiled if it is not
        cached yet, or the EagerCall saying why such a call runs through torch; nothing runs.
        `memfuse.explain` reads its records."""
        return self._lookup(self._bind(args, kwargs))[0]

    def _lookup(self, values: list) -> tuple:
        """(cache entry or EagerCall, the tensor leaves) for a call's bound values."""
        flat = _flatten(values)
        untraceable = flat.untraceable()
        if untraceable is not None:     # not cached: the object is new in every call
            leaf = flat.leaves[untraceable]
            return untraceable_argument(self._name(), self._leaf_name(flat.tree, untraceable), leaf), []
        tensors = [v for v in flat.leaves if isinstance(v, torch.Tensor)]
        if not tensors:
            raise TypeError(f"memfuse: {self._name()} got no tensor arguments; nothing to compile")
        exact = self._exact_key(flat.leaves, flat.tree)
        compiled = self.exact.get(exact)
        if compiled is not None:
            if isinstance(compiled, _CacheEntry):
                STATS["cache_hits"] += 1
            return compiled, tensors
        compiled = self._lookup_key(flat, tensors)
        if len(self.exact) < EXACT_CACHE_SIZE:
            self.exact[exact] = compiled
        return compiled, tensors

    def _exact_key(self, leaves: list, tree: Optional[TreeSpec] = None) -> tuple:
        """Exact shapes and types (and the strides of a non-contiguous tensor) of a call's leaves,
        and their tree: a front cache before the compile key, which costs more to build
        (equality classes of sizes, parameter checks). Same exact key, same compile key."""
        parts = [(v.shape, v.dtype, v.device, v.requires_grad, v.is_contiguous() or v.stride(), type(v),
                  marked_form(v)) if isinstance(v, torch.Tensor) else (type(v), v) for v in leaves]
        return (torch.is_grad_enabled(), _autocast_now(), tree, *parts)

    def _lookup_key(self, flat: "_Flat", tensors: list):
        try:
            key = self._key(flat)
        except _MixedDevices as mixed:   # decided per exact key (it holds each tensor's device)
            return mixed.decision
        shapes = tuple(t.shape for t in tensors)
        compiled, slot, broken = self._find(key, shapes, tensors)
        if compiled is None:
            where = slot + (shapes,) if slot in self.shape_specialized else slot
            recompile = self._log_miss(where, flat.tree, broken)
            compiled = self._compile_or_decide(flat, where)
            if isinstance(compiled, EagerCall):
                self.cache[where] = compiled
                return compiled
            STATS["recompiles"] += recompile
            if compiled.captured.specialized and slot not in self.shape_specialized:
                self.shape_specialized.add(slot)
                where = slot + (shapes,)
            self.cache[where] = compiled
        elif isinstance(compiled, _CacheEntry):
            STATS["cache_hits"] += 1
            if cache_log.isEnabledFor(logging.DEBUG):
                cache_log.debug("memfuse: %s: cache hit (%d compiled programs)", self._name(), len(self.cache))
        return compiled

    def _find(self, key: tuple, shapes: tuple, tensors: list) -> tuple:
        """(entry or None, its slot, the layout guard the last entry tried broke). A slot is the
        compile key, followed by the shapes where its trace specialized on them (`shape_specialized`).
        A trace may also guard on strides (a slice's row stride is not D): its entry serves every
        call whose sizes and strides keep those guards; other layouts get slots of their own,
        `key` + LayoutVariant(1), (2), ... A failed compile's EagerCall serves its whole key."""
        variant, slot, broken = 0, key, None
        while (entry := self.cache.get(slot + (shapes,) if slot in self.shape_specialized else slot)) is not None:
            broken = entry.broken_guard(tensors) if isinstance(entry, _CacheEntry) else None
            if broken is None:
                return entry, slot, None
            variant += 1
            slot = key + (LayoutVariant(variant),)
        return None, slot, broken

    def _log_miss(self, key: tuple, tree: Optional[TreeSpec], broken: str | None = None) -> bool:
        """A miss on a function with compiled programs is a recompile: say which key part changed."""
        if not self.cache:
            cache_log.info("memfuse: %s: cache miss (first call), compiling", self._name())
            return False
        change = f"the strides break the trace's layout guard {broken}" if broken else \
            describe_key_change(self.cache, key, lambda position: self._leaf_name(tree, position))
        cache_log.info("memfuse: %s: cache miss on a new key (%d programs compiled), compiling", self._name(),
                       len(self.cache))
        recompile_log.info("memfuse: %s: recompile #%d of this function: %s", self._name(), len(self.cache), change)
        return True

    # -- binding and the compile key ------------------------------------------------------
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def _bind(self, args, kwargs) -> list:
        """Arguments in parameter order, defaults filled in. The recipe for a given number of
        positional arguments and set of keywords is worked out once, with `Signature.bind`."""
        if not kwargs and not self.binds and (self.signature is None or len(args) == len(self.signature.parameters)):
            return list(args)
        recipe = self._binding(len(args), tuple(kwargs))
        return [args[i] if source == "arg" else kwargs[i] if source == "kw" else i for source, i in recipe]

    def _binding(self, n_args: int, keywords: tuple) -> list:
        """Where each value `_bind` returns comes from: ("arg", position), ("kw", name) or
        ("default", value)."""
        if not keywords and not self.binds and (self.signature is None or n_args == len(self.signature.parameters)):
            return [("arg", i) for i in range(n_args)]
        recipe = self.recipes.get((n_args, keywords))
        if recipe is None:
            recipe = self.recipes[(n_args, keywords)] = self._recipe(n_args, keywords)
        return recipe

    def _recipe(self, n_args: int, keywords: tuple) -> list:
        if self.signature is None:
            raise TypeError(f"memfuse: {self._name()} has no signature to bind keyword arguments to")
        try:
            bound = self.signature.bind(*[_Slot("arg", i) for i in range(n_args)],
                                        **{k: _Slot("kw", k) for k in keywords})
        except TypeError as e:
            raise TypeError(f"memfuse: {self._name()}{self.signature}: {e}") from e
        bound.apply_defaults()
        recipe = []
        for param, value in bound.arguments.items():
            kind = self.signature.parameters[param].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                if value:
                    raise TypeError(f"memfuse: {self._name()}: **{param} arguments are not supported")
                continue
            for item in (value if kind is inspect.Parameter.VAR_POSITIONAL else (value,)):
                recipe.append((item.source, item.index) if isinstance(item, _Slot) else ("default", item))
        return recipe

    def _call(self, values: list):
        """Call fn with values as `_bind` flattened them: keyword-only ones by name."""
        k = len(self.keyword_only)
        if not k:
            return self.fn(*values)
        return self.fn(*values[:-k], **dict(zip(self.keyword_only, values[-k:])))

    def _key(self, flat: "_Flat") -> tuple:
        """What a compiled program is specialized on (module docstring). On the hot path: kept to
        plain attribute reads."""
        sizes: dict = {}
        parts = []
        device = None
        needs_grad = False
        tensor_index = 0
        for position, v in enumerate(flat.leaves):
            if isinstance(v, torch.Tensor):
                if device is None:
                    device = v.device
                elif v.device != device:
                    raise _MixedDevices(mixed_devices(self._name(), self._leaf_name(flat.tree, position), v.device,
                                                      device))
                shape = v.shape
                rank = len(shape)
                static = tensor_index < self.static_prefix or isinstance(v, torch.nn.Parameter)
                # token ids, labels: the last dim is a size too (Config.symbolic_token_dims)
                symbolic = self.config.symbolic_token_dims and symbolic_last_dim(v, static)
                if static:
                    lead = ("static", tuple(shape))       # traced with every dim static
                else:
                    # sizes 0 and 1 stand for themselves; others by equality class (-1, -2, ...)
                    lead = () if rank < 2 and not symbolic else \
                        tuple(s if s < 2 else sizes.setdefault(s, -1 - len(sizes))
                              for s in (shape if symbolic else shape[:-1]))
                tensor_index += 1
                needs_grad = needs_grad or v.requires_grad
                last = SIZE_SYMBOL if symbolic else shape[-1] if rank else None
                parts.append(("T", v.dtype, device, rank, last, lead, v.requires_grad,
                              _layout(v), isinstance(v, torch.nn.Parameter), marked_form(v)))
            else:
                parts.append(("C", type(v), v))
        if device is not None:
            _, enabled, dtype = autocast_state(device.type)
            if enabled:                  # the trace holds autocast's casts
                parts.append(("autocast", dtype))
        if flat.tree is not None:        # how the leaves are nested in the arguments
            parts.append(("tree", flat.tree))
        return (needs_grad and torch.is_grad_enabled(), *parts)

    def _is_static(self, tensor_index: int, t: torch.Tensor) -> bool:
        return tensor_index < self.static_prefix or isinstance(t, torch.nn.Parameter)

    def _arg_name(self, position: int, path: str = "") -> str:
        """How messages name the bound value at `position` (and a leaf `path` inside it)."""
        if position >= len(self.names):
            return f"at position {position}{path}"
        return f"'{self.names[position]}{path}'" + (f" (position {position})" if self.positions_shown else "")

    def _leaf_name(self, tree: Optional[TreeSpec], position: int) -> str:
        """How messages name a call's leaf: its argument, with its path inside a pytree argument."""
        return self._arg_name(*_leaf_path(tree, position))

    def _input_name(self, tree: Optional[TreeSpec], position: int) -> str:
        """The user's name of a call's leaf, as explain's rows show it: `hidden_states`, `pair[0]`."""
        argument, path = _leaf_path(tree, position)
        return f"{self.names[argument] if argument < len(self.names) else f'arg{argument}'}{path}"

    # -- compiling --------------------------------------------------------------------------
    def _compile_or_decide(self, flat: "_Flat", key: tuple) -> "_CacheEntry | EagerCall":
        """The compiled program (memfuse.driver.compile), or where compiling fails the decision to
        run this key through torch."""
        while True:
            rebuilds = []              # how the trace's output is rebuilt from its tensors
            reads = []                 # reads of a tensor's value that stopped the trace (fronts.split)
            try:
                source = self._source(flat, key, rebuilds, reads)
                compiled = compile_or_decide(source, self.config)
                if isinstance(compiled, EagerCall) and not reads and _has_symbolic_last_dims(source):
                    compiled = self._with_static_last_dims(source, compiled, rebuilds)
                break
            except Retrace:            # the function returns more now (module.py: buffers written in place)
                continue
        if isinstance(compiled, EagerCall):
            if not reads:
                return compiled
            split = getattr(self.fn, "split_runner", None)     # a module's (module._ModuleCall)
            return split_call(self._name(), reads[0],
                              split(self.config) if split else through_backend(self._call, self.config))
        entry = _CacheEntry(compiled.function, rebuilds[0], flat.tree, compiled.captured, compiled.plan,
                            input_names=compiled.input_names)
        compiled.function.backward_through_torch = functools.partial(
            self._backward_through_torch, entry, _under_autocast_of(compiled.traced, key))
        return entry

    def _with_static_last_dims(self, source: TracedFunction, failed: EagerCall, rebuilds: list):
        """A compile with integer inputs' last dims as symbols failed: compile again with them
        static. The program then holds those sizes, so its shapes join the compile key (its
        `specialized` says why; a new sequence length compiles again), logged."""
        rebuilds.clear()
        compiled = compile_or_decide(dataclasses.replace(source, symbolic_last=False), self.config)
        if isinstance(compiled, EagerCall):
            return failed
        recompile_log.info("memfuse: %s: compiling with the integer inputs' last dims as size symbols failed (%s); "
                           "compiled with them static: the shapes join the compile key", self._name(), failed.reason)
        compiled.captured.specialized = (f"integer inputs' last dims are static: compiling them as size symbols "
                                         f"failed ({failed.reason})")
        return compiled

    def _source(self, flat: "_Flat", key: tuple, rebuilds: list, reads: list) -> TracedFunction:
        """What the driver traces: fn on the call's tensors, the other leaves as constants, its
        output's tensors returned and how to rebuild the output from them appended to `rebuilds`;
        where fn reads a tensor's value, the error that stops the trace appended to `reads`."""
        positions = [i for i, v in enumerate(flat.leaves) if isinstance(v, torch.Tensor)]
        tensors = [flat.leaves[i] for i in positions]
        # a mask the backend's graph built from sizes and marked (memfuse.patterns.attention): built here again
        marks = {i: marked_form(flat.leaves[i]) for i in positions}
        # the call's other leaves: no tensor of the compiling call stays alive with the function (a
        # failed first backward runs it again: Compiled.traced)
        template, tree = [None if isinstance(v, torch.Tensor) else v for v in flat.leaves], flat.tree

        def traced(*tensor_args):
            leaves = list(template)
            for i, t in zip(positions, tensor_args):
                leaves[i] = mask_like(t, marks[i]) if marks[i] else t
            try:
                out = self._call(leaves if tree is None else tree_unflatten(leaves, tree))
            except VALUE_READS as read:
                reads.append(read)
                raise
            outputs, rebuild = output_tensors(out, self._name())
            rebuilds.append(rebuild)
            return outputs

        return TracedFunction(self._name(), traced, tuple(tensors),
                              static=tuple(self._is_static(i, t) for i, t in enumerate(tensors)),
                              trace_joint=key[0], contiguous=tuple(t.is_contiguous() for t in tensors),
                              input_names=tuple(self._input_name(flat.tree, i) for i in positions),
                              returned_logits=self.graphs is None,
                              symbolic_last=self.config.symbolic_token_dims,
                              marked_inputs=tuple((self._input_name(flat.tree, i), form) for i, form in marks.items() if form))


def _under_autocast_of(fn: Callable, key: tuple) -> Callable:
    """`fn` run under the autocast state its compile key holds (the trace's: `_key`), wherever it is
    called from (a backward runs outside the caller's autocast block)."""
    dtype = next((part[1] for part in key if isinstance(part, tuple) and part[:1] == ("autocast",)), None)
    device_type = next((part[2].type for part in key if isinstance(part, tuple) and part[:1] == ("T",)), "cpu")

    def under_autocast(*tensors):
        with torch.autocast(device_type, dtype=dtype) if dtype is not None else contextlib.nullcontext():
            return fn(*tensors)
    return under_autocast


def _run(entry: "_CacheEntry", tensors: list) -> tuple:
    """The compiled program's outputs; with autocast off where it is on (the trace's casts are in
    the program)."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        with torch.autocast(device_type, enabled=False):
            return entry.function(tensors)
    return entry.function(tensors)


def _has_symbolic_last_dims(source: TracedFunction) -> bool:
    return source.symbolic_last and any(symbolic_last_dim(t, static) for t, static in zip(source.tensors, source.static))


def _layout(t: torch.Tensor):
    """The layout part of the compile key: True when contiguous; else whether the last stride is
    1 (kernels then load a row's columns as one block, other strides are read per call)."""
    if t.is_contiguous():
        return True
    return "last stride 1" if t.stride(-1) == 1 else "any strides"


class _Front:
    """The front cache of one call shape (number of positional arguments, keyword names), written
    for the argument pattern (`_pattern`: which bound values are tensors, constants, or tuples,
    lists and dicts of them) of the shape's first call. A container argument is unpacked by the
    generated code into its leaves, its type and length (a dict's keys) checked on the way: no
    pytree flatten on the hot path.

    `call(args, kwargs)`, the hot path of a repeated call, binds the arguments, finds their
    compiled function and runs it through the C half of autograd's apply
    (`memfuse.runtime.function._function_apply`). It finds the function two ways:
    - the last one it ran (`last`): grad mode and constants compared, the tensors checked in one
      C++ call (`_tensor_guards`), made with plain tensors only;
    - else by the arguments' exact key (what `FusedFunction._exact_key` holds, each argument's part
      led by its type) in `entries`, unwrapping dead functorch wrappers as the Python half of
      apply would.
    It returns MISS, having run nothing, for a key it has no entry for, a call of another pattern
    (a tensor type never equals a constant's, and reading a tensor's attributes off a constant
    fails), any call under a functorch transform and any call with autocast on (the slow path
    keys its state and runs the program with autocast off). `read(args, kwargs)` is the key and
    the tensor arguments alone, for `FusedFunction._remember`."""

    def __init__(self, binding: list, pattern: list):
        self.pattern = pattern
        self.entries: dict = {}          # exact key -> (compiled apply, output rebuild, tensor guards or None)
        self.last = [(None, None, None, None, None)]   # (guards, grad mode, constants, apply, output rebuild)
        namespace: dict = {"grad_enabled": torch.is_grad_enabled, "entries": self.entries, "last": self.last,
                           "MISS": MISS, "transforms_active": torch_private.functorch_transforms_active,
                           "any_autocast": _any_autocast,
                           "unwrap": torch_private.unwrap_if_dead, "STATS": STATS}
        binds = []
        positional = sum(source == "arg" for source, _ in binding)
        if positional:
            binds.append(f"{''.join(f'a{i}, ' for i in range(positional))}= args")
        key, tensors, constants = ["grad_enabled(), any_autocast()"], [], []
        for i, ((source, where), part) in enumerate(zip(binding, self.pattern)):
            v = f"a{where}" if source == "arg" else f"v{i}"
            if source == "kw":
                binds.append(f"{v} = kwargs[{where!r}]")
            elif source == "default":
                namespace[f"default_{i}"] = where
                binds.append(f"{v} = default_{i}")
            for v, is_tensor in _unpacked(v, part, binds, namespace):
                self._read_leaf(v, is_tensor, source, key, tensors, constants)
        key = f"({', '.join(key)})"
        constants = f"({', '.join(constants)})"
        tensors, unwrapped = ", ".join(tensors), ", ".join(f"unwrap({t})" for t in tensors)
        same_constants = f" and {constants} == constants" if constants != "()" else ""
        out = Lines()
        out("def read(args, kwargs):")
        with out.indented():
            out(*binds, f"return {key}, [{tensors}]")
        out()
        out("def call(args, kwargs):")
        with out.indented():
            out(*binds, "guards, grad, constants, apply, rebuild = last[0]",
                f"if grad_enabled() is grad and not any_autocast(){same_constants} and guards.check({tensors})"
                " and not transforms_active():")
            with out.indented():
                out("STATS['cache_hits'] += 1", f"return rebuild(apply({tensors}))")
            out("try:", f"    key = {key}", "    apply, rebuild, guards = entries[key]",
                "except (AttributeError, TypeError, KeyError):", "    return MISS",
                "if transforms_active():", "    return MISS",
                "if guards is not None:", f"    last[0] = guards, key[0], {constants}, apply, rebuild",
                "STATS['cache_hits'] += 1", f"return rebuild(apply({unwrapped}))")
        self.source = out.text()
        exec(compile(self.source, "<memfuse front>", "exec"), namespace)
        self.read, self.call = namespace["read"], namespace["call"]

    @staticmethod
    def _read_leaf(v: str, is_tensor: bool, source: str, key: list, tensors: list, constants: list) -> None:
        """Add the leaf `v` (a local of the generated code) to the key, and to the tensors or the
        constants compared on the last-entry path."""
        if is_tensor:
            key.append(f"type({v}), {v}.shape, {v}.dtype, {v}.device, {v}.requires_grad, "
                       f"{v}.is_contiguous() or {v}.stride()")
            tensors.append(v)
        else:
            key.append(f"type({v}), {v}")
            if source != "default":      # a default is the same in every call
                constants.append(f"type({v}), {v}")


@dataclasses.dataclass(frozen=True)
class _Container:
    """A tuple, list or dict argument in a front's pattern: its type, its dict keys (in order;
    () for a sequence) and which of its items are tensors."""
    kind: type
    keys: tuple
    tensors: tuple


def _pattern(values: list) -> Optional[list]:
    """Per bound value: True for a tensor, False for a constant, a _Container for a tuple, list or
    dict (str keys) of tensors and constants (one level of pytree); None when a
    value is anything else (a deeper pytree, a registered node): the front does not serve it."""
    pattern = []
    for v in values:
        kind = type(v)
        if isinstance(v, LEAF_TYPES):
            pattern.append(isinstance(v, torch.Tensor))
        elif kind in (tuple, list, dict):
            items = list(v.values()) if kind is dict else v
            if not all(isinstance(item, LEAF_TYPES) for item in items) or \
                    (kind is dict and not all(type(k) is str for k in v)):
                return None
            pattern.append(_Container(kind, tuple(v) if kind is dict else (),
                                      tuple(isinstance(item, torch.Tensor) for item in items)))
        else:
            return None
    return pattern


def _unpacked(v: str, part, binds: list, namespace: dict) -> list:
    """[(leaf variable, is tensor)] of the bound value `v`: itself for a leaf; for a container the
    locals the lines added to `binds` unpack it into, after checking its type and length (keys),
    returning MISS where they differ from the pattern's."""
    if not isinstance(part, _Container):
        return [(v, part)]
    leaves = [f"{v}_{j}" for j in range(len(part.tensors))]
    if part.kind is dict:
        namespace[f"keys_{v}"] = part.keys
        binds += [f"if type({v}) is not dict or tuple({v}) != keys_{v}:", "    return MISS"]
        binds.extend(f"{leaf} = {v}[{k!r}]" for leaf, k in zip(leaves, part.keys))
    else:
        binds += [f"if type({v}) is not {part.kind.__name__} or len({v}) != {len(leaves)}:", "    return MISS"]
        if leaves:
            binds.append(f"{', '.join(leaves)}, = {v}")
    return list(zip(leaves, part.tensors))


def autocast_state(device_type: str) -> tuple:
    """(device type, enabled, dtype or None): what a trace on that device type ran under."""
    enabled = torch.is_autocast_enabled(device_type)
    return (device_type, enabled, torch.get_autocast_dtype(device_type) if enabled else None)


def _autocast_now():
    """None while autocast is off (one C call), else its state on the CPU and CUDA."""
    if not _any_autocast():
        return None
    return (autocast_state("cpu"), autocast_state("cuda"))


_any_autocast = torch_private.any_autocast_enabled


def _tensor_guards(tensors: list):
    """One C++ check of these tensors' Python type, dispatch keys, dtype, device, requires_grad,
    sizes and strides (Dynamo's TensorGuards: one C++ call, several times cheaper than reading them
    into a key and looking it up), or None: where torch has no TensorGuards (an
    internal API) or refuses these tensors, and where one is a functorch wrapper (the front then
    unwraps it, as autograd's apply would; a guard made with plain tensors fails on wrappers, whose
    dispatch keys differ)."""
    if TensorGuards is None or any(torch_private.is_functorch_wrapped_tensor(t) for t in tensors):
        return None
    try:
        return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                            dynamic_dims_strides=[list(t.stride()) for t in tensors])
    except (TypeError, RuntimeError):
        return None


TensorGuards = torch_private.TensorGuards


MISS = object()   # what _Front.call returns when it ran nothing
SIZE_SYMBOL = "a size symbol"   # the D part of the key of a tensor whose last dim is traced as a symbol


# -- pytrees: arguments and outputs ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Flat:
    """A call's bound values as the leaves memfuse traces and the tree they came in: `tree` is
    None when every value is a leaf (a tensor or a constant), as in most calls."""
    leaves: list
    tree: Optional[TreeSpec]

    def values(self, leaves: list) -> list:
        """The bound values, with these leaves in place of the call's."""
        return leaves if self.tree is None else tree_unflatten(leaves, self.tree)

    def untraceable(self) -> Optional[int]:
        """The position of the first leaf that is neither a tensor nor a constant, or None."""
        if self.tree is None:
            return None
        return next((i for i, v in enumerate(self.leaves) if not isinstance(v, LEAF_TYPES)), None)


def _flatten(values: list) -> _Flat:
    if all(isinstance(v, LEAF_TYPES) for v in values):
        return _Flat(values, None)
    leaves, tree = tree_flatten(values)
    return _Flat(leaves, tree)


def _leaf_path(tree: Optional[TreeSpec], position: int) -> tuple:
    """(the argument's position, the path inside it, e.g. "[0]" or "['k']") of a call's leaf."""
    if tree is None:
        return position, ""
    arguments = [tree_flatten(value) for value in tree_unflatten(list(range(tree.num_leaves)), tree)]
    argument, (numbers, spec) = next((i, a) for i, a in enumerate(arguments) if position in a[0])
    return argument, key_path(spec, numbers.index(position))


class _MixedDevices(Exception):
    """`_key` found tensor arguments on two devices: `decision` runs the call through torch."""
    def __init__(self, decision: EagerCall):
        super().__init__(str(decision))
        self.decision = decision


class _Slot:
    """A placeholder bound in place of a real argument, to learn where each one goes."""
    def __init__(self, source: str, index):
        self.source, self.index = source, index


@dataclasses.dataclass(frozen=True)
class LayoutVariant:
    """The last part of a compile key whose earlier entries' layout guards a call broke."""
    number: int


class _CacheEntry:
    def __init__(self, function: CompiledFunction, rebuild: Callable, tree: Optional[TreeSpec], captured, plan,
                 input_names=None):
        self.function = function
        self.rebuild = rebuild                 # the program's output tensors -> fn's output (outputs.output_tensors)
        self.tree = tree                       # the arguments' structure, None for a flat call
        self.captured = captured
        self.plan = plan
        self.input_names = input_names or []   # the user's name of each tensor argument, in order
        self.guard_values = None               # tensors -> (guard holds, ...), built at the first check
        self.proven = False                    # a call ran it (FusedFunction._first_run)
        self.retired: Optional[EagerCall] = None   # why its key runs through torch since a first run failed

    def broken_guard(self, tensors: list) -> str | None:
        """The first of the trace's layout guards (memfuse.capture.lower._guards) these tensors break, or None."""
        guards = self.captured.layout_guards
        if not guards:
            return None
        if self.guard_values is None:
            self.guard_values = _guard_function(guards, self.captured)
        for guard, holds in zip(guards, self.guard_values(tensors)):
            if not holds:
                return str(guard)
        return None


def _guard_function(guards: list, captured) -> Callable:
    """tensors -> one bool per guard, reading the sizes and strides the guards name."""
    sources = {**{s: f"t[{i}].shape[{d}]" for s, (i, d) in captured.symbols.items()},
               **{s: f"t[{i}].stride({d})" for s, (i, d) in captured.stride_symbols.items()}}
    symbols = sorted({s for g in guards for s in g.free_symbols}, key=str)
    test = sympy.lambdify(symbols, list(guards), [SIZE_FUNCTIONS, "math"])
    read = eval(f"lambda t: ({', '.join(sources[s] for s in symbols)},)")
    return lambda tensors: test(*read(tensors))
