"""The user-facing wrapper: `memory_efficient_fusion(fn)`, its compile cache and its guards.

A compiled program is keyed by what it was specialized on: grad mode, and per tensor argument
its dtype, device, rank, last dim (D), requires_grad, contiguity and which leading dims are 0,
1 or equal to each other; non-tensor arguments are constants of the graph and part of the key.
Leading sizes are not in the key: a new batch or sequence size reuses the program.
"""
from __future__ import annotations

import functools
import inspect
import logging
import time
from typing import Callable, Optional

import torch

from .capture import capture
from .config import Config
from .debug import STATS, dump
from .ir import format_graph, verify
from .plan import plan
from .runtime import CompiledFunction
from .schedule import schedule

log = logging.getLogger("memfuse")
CONSTANT_TYPES = (bool, int, float, type(None), str, torch.dtype)


def memory_efficient_fusion(fn: Callable, *, config: Optional[Config] = None) -> "FusedFunction":
    """Wrap `fn` (tensors and constants -> tensor or tuple of tensors): same signature, same
    results as eager within float tolerance, forward and backward fused into Triton kernels."""
    if not callable(fn):
        raise TypeError(f"memfuse.memory_efficient_fusion: fn must be callable, got {type(fn).__name__}")
    return FusedFunction(fn, config or Config())


class FusedFunction:
    def __init__(self, fn: Callable, config: Config):
        self.fn = fn
        self.config = config
        self.cache: dict = {}
        self.shape_specialized: set = set()   # keys whose traces guard on the leading sizes
        try:
            self.signature = inspect.signature(fn)
        except (TypeError, ValueError):
            self.signature = None
        self.binds = self.signature is not None and any(
            p.default is not inspect.Parameter.empty or p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD
            for p in self.signature.parameters.values())
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        values = self._bind(args, kwargs)
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if not tensors:
            raise TypeError(f"memfuse: {self._name()} got no tensor arguments; nothing to compile")
        key = self._key(values)
        if key in self.shape_specialized:
            key = key + (tuple(t.shape for t in tensors),)
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self._compile(values, key)
            if compiled.captured.specialized:
                self.shape_specialized.add(key)
                key = key + (tuple(t.shape for t in tensors),)
            self.cache[key] = compiled
        else:
            STATS["cache_hits"] += 1
        outputs = compiled.function(tensors)
        return outputs[0] if compiled.single_output else tuple(outputs)

    # -- binding and the compile key ------------------------------------------------------
    def _name(self) -> str:
        return getattr(self.fn, "__qualname__", type(self.fn).__name__)

    def _bind(self, args, kwargs) -> list:
        if not kwargs and not self.binds and (self.signature is None or len(args) == len(self.signature.parameters)):
            return list(args)
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"memfuse: {self._name()}{self.signature}: {e}") from e
        bound.apply_defaults()
        values = []
        for param, value in bound.arguments.items():
            kind = self.signature.parameters[param].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                values.extend(value)
            elif kind is inspect.Parameter.VAR_KEYWORD:
                raise TypeError(f"memfuse: {self._name()}: **{param} arguments are not supported")
            else:
                values.append(value)
        return values

    def _key(self, values: list) -> tuple:
        grad = torch.is_grad_enabled() and any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)
        sizes: dict = {}
        parts = [grad]
        device = None
        for position, v in enumerate(values):
            if isinstance(v, torch.Tensor):
                if device is None:
                    device = v.device
                elif v.device != device:
                    raise ValueError(f"memfuse: {self._name()}: argument {self._arg_name(position)} is on "
                                     f"{v.device}, expected {device} like the other tensor arguments")
                lead = tuple(s if s in (0, 1) else sizes.setdefault(s, f"s{len(sizes)}") for s in v.shape[:-1])
                last = v.shape[-1] if v.dim() else None
                parts.append(("T", v.dtype, v.device, v.dim(), last, lead, v.requires_grad,
                              v.is_contiguous(), isinstance(v, torch.nn.Parameter)))
            elif isinstance(v, CONSTANT_TYPES):
                parts.append(("C", type(v), v))
            else:
                raise TypeError(f"memfuse: {self._name()}: argument {self._arg_name(position)} is a "
                                f"{type(v).__name__}; expected a tensor or a constant (bool, int, float, str, None)")
        return tuple(parts)

    def _arg_name(self, position: int) -> str:
        if self.signature is not None:
            names = list(self.signature.parameters)
            if position < len(names):
                return f"'{names[position]}' (position {position})"
        return f"at position {position}"

    # -- compiling --------------------------------------------------------------------------
    def _compile(self, values: list, key: tuple) -> "_CacheEntry":
        start = time.perf_counter()
        positions = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
        tensors = [values[i] for i in positions]
        single = []

        def traced(*tensor_args):
            merged = list(values)
            for i, t in zip(positions, tensor_args):
                merged[i] = t
            out = self.fn(*merged)
            single.append(isinstance(out, torch.Tensor))
            outs = (out,) if isinstance(out, torch.Tensor) else out
            if not isinstance(outs, (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in outs):
                got = type(out).__name__ if not isinstance(outs, (tuple, list)) else \
                    f"a {type(out).__name__} holding {', '.join(type(o).__name__ for o in outs)}"
                raise TypeError(f"memfuse: {self._name()} must return a tensor or a tuple/list of tensors, got {got}")
            return tuple(outs)

        grad = key[0]
        static = [isinstance(t, torch.nn.Parameter) for t in tensors]
        captured = capture(traced, tensors, trace_joint=grad, static_inputs=static)
        if captured.specialized:
            log.info("memfuse: %s: leading sizes join the compile key: %s", self._name(), captured.specialized)
        the_plan = plan(captured)
        config = self.config
        if config.check:
            verify(the_plan.forward)
            if the_plan.backward is not None:
                verify(the_plan.backward)
        dump(f"{self._name()}.joint.txt", format_graph(captured.joint))
        dump(f"{self._name()}.forward.txt", format_graph(the_plan.forward))
        if the_plan.backward is not None:
            dump(f"{self._name()}.backward.txt", format_graph(the_plan.backward))
        for name, target, reason in captured.fallbacks:
            message = f"memfuse: {name} ({target}) runs through aten: {reason}"
            if config.strict:
                raise NotImplementedError(message + " (strict mode: MEMFUSE_STRICT=1 / Config.strict)")
            log.info(message)
        function = CompiledFunction(the_plan, captured, config,
                                    lambda graph, kind: schedule(graph, config, kind))
        STATS["compiles"] += 1
        log.info("memfuse: compiled %s in %.3f s: saves %d bytes beyond the inputs", self._name(),
                 time.perf_counter() - start, the_plan.saved_bytes)
        return _CacheEntry(function, single[0] if single else False, captured, the_plan)


class _CacheEntry:
    def __init__(self, function: CompiledFunction, single_output: bool, captured, plan):
        self.function = function
        self.single_output = single_output
        self.captured = captured
        self.plan = plan
