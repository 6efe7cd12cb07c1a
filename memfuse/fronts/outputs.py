"""outputs: what a traced function returns, as the tensors its compiled program returns and a
template that rebuilds the output from them on every call.

An output is a tensor, or a pytree (tuple, list, dict, namedtuple, registered dataclass or node,
such as a HuggingFace ModelOutput) whose leaves are tensors, constants, and *records*: objects of
plain Python classes (with a `__dict__`) whose attributes hold tensors, constants, pytrees and
records again (an object with `__slots__` beside its `__dict__` is no record: `vars` misses the
slots). A HuggingFace model called with `use_cache` on (its default, in training too)
returns one: its KV cache (a DynamicCache holding a list of layers, each holding keys and values).

A record is rebuilt on every call as a new object of its class (`cls.__new__`, no `__init__`
runs) whose attributes hold that call's values, as the call made a new one in eager; an object
reached twice stays one object, and a tensor returned twice one tensor. Kept as they are, by
reference: what a call hands out without making it (modules, classes, functions, devices, enum
members). A size the trace kept symbolic (a cache layer's length counter) is read on every call
off a dim of a returned tensor of that size. Anything else (an object without a `__dict__`, a
size no returned tensor carries) is an UntraceableOutputError: the call runs through torch.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import types
from typing import Any, Callable

import sympy
import torch
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from memfuse.driver.fallback import UntraceableOutputError

CONSTANT_TYPES = (bool, int, float, type(None), str, torch.dtype)
# returned as they are, by reference: a call hands them out, it does not make them
KEPT_TYPES = (torch.nn.Module, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              functools.partial, torch.device, enum.Enum)
SYMBOLIC_TYPES = (torch.SymInt, torch.SymFloat, torch.SymBool)


def output_tensors(out: Any, name: str) -> tuple:
    """(the tensors of fn's output, in order, each once; the function rebuilding the output from
    them). The output holds at least one tensor."""
    if isinstance(out, torch.Tensor):
        return (out,), _first
    if type(out) is tuple and out and all(isinstance(v, torch.Tensor) for v in out) and \
            len({id(v) for v in out}) == len(out):
        return out, tuple
    flattener = _Flattener(name)
    template = flattener.template(out, "")
    if not flattener.tensors:
        raise UntraceableOutputError(f"{name} returns no tensor (a {type(out).__name__}): nothing to compile")
    flattener.resolve_sizes()
    return tuple(flattener.tensors), functools.partial(_build, template)


def _build(template, tensors) -> Any:
    return template.build(tensors, {})


_first = operator.itemgetter(0)


# -- templates: build(tensors, made) -> this part of the output, for one call --------------------
@dataclasses.dataclass(frozen=True)
class _TensorAt:
    index: int

    def build(self, tensors, made: dict):
        return tensors[self.index]


@dataclasses.dataclass(frozen=True)
class _Constant:
    value: Any

    def build(self, tensors, made: dict):
        return self.value


@dataclasses.dataclass(frozen=True)
class _Tree:
    """A pytree node (tuple, list, dict, registered class) and the template of each of its leaves."""
    spec: TreeSpec
    leaves: tuple

    def build(self, tensors, made: dict):
        return tree_unflatten([leaf.build(tensors, made) for leaf in self.leaves], self.spec)


class _Record:
    """An object with attributes, rebuilt as a new object of its class per call (module docstring).
    Made before its attributes, so an attribute that leads back to it finds it (`made`: per call)."""

    def __init__(self, cls: type):
        self.cls = cls
        self.names: tuple = ()
        self.values: tuple = ()

    def build(self, tensors, made: dict):
        key = id(self)
        if key in made:
            return made[key]
        record = made[key] = self.cls.__new__(self.cls)
        record.__dict__.update(zip(self.names, (v.build(tensors, made) for v in self.values)))
        return record


class _Size:
    """A size the trace kept symbolic: its expression over symbols read off returned tensors' dims."""

    def __init__(self, kind: type, expr: sympy.Expr, path: str):
        self.kind, self.expr, self.path = kind, expr, path
        self.read: Callable = None     # tensors -> the value, set by _Flattener.resolve_sizes

    def build(self, tensors, made: dict):
        return self.read(tensors)


class _Flattener:
    """Walks an output once (at trace time, on fake tensors) into a template and its tensors."""

    def __init__(self, name: str):
        self.name = name
        self.tensors: list = []
        self.tensor_index: dict = {}     # id -> position in self.tensors
        self.records: dict = {}          # id -> _Record
        self.sizes: list = []            # _Size templates, resolved once every tensor is known
        self.held: list = []             # every object walked: ids stay unique while the walk runs

    def template(self, value: Any, path: str):
        if isinstance(value, torch.Tensor):
            index = self.tensor_index.get(id(value))
            if index is None:
                index = self.tensor_index[id(value)] = len(self.tensors)
                self.tensors.append(value)
            return _TensorAt(index)
        if isinstance(value, CONSTANT_TYPES) or isinstance(value, KEPT_TYPES):
            return _Constant(value)
        if isinstance(value, SYMBOLIC_TYPES):
            return self._symbolic(value, path)
        leaves, spec = tree_flatten(value)
        if not spec.is_leaf():
            return _Tree(spec, tuple(self.template(leaf, path + key_path(spec, i)) for i, leaf in enumerate(leaves)))
        if isinstance(value, torch.Size):
            return _Tree(tree_flatten(tuple(value))[1], tuple(self.template(v, f"{path}[{i}]")
                                                              for i, v in enumerate(value)))
        if hasattr(value, "__dict__") and not _slots(type(value)):
            return self._record(value, path)
        raise UntraceableOutputError(f"{self.name} returns a {type(value).__name__} at output{path}")

    def _record(self, value: Any, path: str) -> _Record:
        record = self.records.get(id(value))
        if record is None:
            self.held.append(value)
            record = self.records[id(value)] = _Record(type(value))
            items = list(vars(value).items())
            record.names = tuple(k for k, _ in items)
            record.values = tuple(self.template(v, f"{path}.{k}") for k, v in items)
        return record

    def _symbolic(self, value, path: str):
        constant = value.node.maybe_as_int() if isinstance(value, torch.SymInt) else None
        if constant is not None:
            return _Constant(constant)
        size = _Size({torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)],
                     _replaced(value.node), path)
        self.sizes.append(size)
        return size

    def resolve_sizes(self) -> None:
        """Each symbolic size reads its symbols off a returned tensor's dim that is that symbol."""
        if not self.sizes:
            return
        where: dict = {}
        for i, t in enumerate(self.tensors):
            for d, s in enumerate(t.shape):
                if isinstance(s, torch.SymInt):
                    where.setdefault(_replaced(s.node), (i, d))
        for size in self.sizes:
            symbols = sorted(size.expr.free_symbols, key=str)
            missing = [s for s in symbols if s not in where]
            if missing:
                raise UntraceableOutputError(
                    f"{self.name} returns a size the trace keeps symbolic ({size.expr}) at output{size.path}, and no "
                    f"returned tensor has a dim of size {missing[0]} to read it from")
            value = sympy.lambdify(symbols, size.expr, "math")
            dims = [where[s] for s in symbols]
            kind = size.kind
            size.read = lambda tensors, value=value, dims=dims, kind=kind: \
                kind(value(*(tensors[i].shape[d] for i, d in dims)))


def _slots(cls: type) -> list:
    """The attribute slots a class declares beside its `__dict__` (values vars() does not show)."""
    return [name for c in cls.__mro__ for name in getattr(c, "__slots__", ()) if name not in ("__dict__", "__weakref__")]


def _replaced(node) -> sympy.Expr:
    """A symbolic value's expression with the sizes the trace found equal as one symbol."""
    return node.shape_env.replace(node.expr)


def key_path(tree: TreeSpec, index: int) -> str:
    """The path of leaf `index` in a pytree of this structure, as pytree's keystr writes it."""
    try:
        return keystr(tree_flatten_with_path(tree_unflatten(list(range(tree.num_leaves)), tree))[0][index][0])
    except ValueError:   # a node registered without key paths (flatten_with_keys_fn)
        return f"<leaf {index}>"
