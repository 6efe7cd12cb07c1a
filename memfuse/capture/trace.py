"""capture, the trace: AOTAutograd's joint forward+backward graph of a function, on fake inputs
whose leading dims are size symbols, then lowered (memfuse.capture.lower).

AOTAutograd (`aot_export_joint_simple`) traces on fake tensors whose leading dims are size
symbols and whose last dim is static (but an integer or bool input's: `symbolic_last_dim`), so every constant that depends on the batch or sequence
size stays symbolic (a SYMBOL node) instead of being baked in. What the trace assumed of the
sizes and strides becomes the compile key's specialization and the per-call layout guards.
"""
from __future__ import annotations

import contextlib
import re
from typing import Callable, Sequence

import sympy
import torch
from torch._functorch.aot_autograd import aot_export_joint_simple
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from memfuse.base import torch_private
from memfuse.base.debug import timed
from memfuse.capture.decompositions import decomposition_table
from memfuse.capture.fx_passes import without_unused
from memfuse.capture.lower import Lowering
from memfuse.ir.captured import Captured, MutatedInputError
from memfuse.ir.graph import Graph, Node, Op
from memfuse.ir.patterns import rule, trace_modes

@timed("capture")
def capture(fn: Callable, args: Sequence[torch.Tensor], *, trace_joint: bool,
            static_inputs: Sequence[bool] = (), input_names: Sequence[str] = (),
            symbolic_last: bool = False) -> Captured:
    """Trace `fn(*args)` (tensor args only) and lower it. `static_inputs[i]`: keep all dims of
    input i static (parameters). `input_names`: how messages name the inputs. `symbolic_last`:
    integer inputs' last dims as symbols (`symbolic_last_dim`), else static like any D."""
    shape_env = ShapeEnv()
    # allow_non_fake_inputs: tensors the function closes over become graph constants
    fake_mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    fakes = [_fake_input(fake_mode, t, static=i < len(static_inputs) and static_inputs[i], symbolic_last=symbolic_last)
             for i, t in enumerate(args)]
    _equal_sizes_as_one(fakes)
    with compiling(), trace_modes():
        gm = _export(fn, tuple(fakes), trace_joint)
    symbols, hints = _symbol_sources(fakes)
    # read in place, by their strides; a last stride of 1 is part of the compile key (api._key)
    strided = {i: t.stride(-1) == 1 for i, t in enumerate(args) if not t.is_contiguous()}
    captured = Lowering(gm, symbols, hints, strided).run(num_primals=len(args), trace_joint=trace_joint)
    captured.stride_symbols = _stride_sources(fakes, symbols)
    captured.specialized, captured.layout_guards = _guards(shape_env, symbols, captured.stride_symbols)
    if captured.specialized:
        captured.specialized += _where_sizes_come_from(captured.specialized, fakes, input_names)
    captured.aten_graph = gm
    captured.differentiable_outputs = _differentiable_outputs(captured, fn, fakes)
    return captured

@contextlib.contextmanager
def compiling():
    """`torch.compiler.is_compiling()` answers True while memfuse traces, as it does under
    torch.compile and torch.export (non-strict export sets the same flag): libraries then take
    their trace-friendly paths. HuggingFace's attention-mask code, for one, otherwise branches on
    `mask.all()`, a data-dependent value no trace can follow. TorchScript functions the model
    calls trace as their Python originals, as Dynamo inlines them (`torch_private.
    scripted_functions_as_python`: the TorchScript interpreter cannot run on symbolic sizes)."""
    with torch_private.compiling_flag(), torch_private.scripted_functions_as_python():
        yield


@timed("trace")
def _export(fn: Callable, fakes: tuple, trace_joint: bool) -> torch.fx.GraphModule:
    """The decomposed aten graph of `fn`. Outputs that alias an input (`return x`, a view of
    x) are returned as copies; a function that mutates an input is refused with the reason."""
    try:
        return without_unused(aot_export_joint_simple(fn, fakes, trace_joint=trace_joint,
                                                       decompositions=decomposition_table()))
    except RuntimeError as e:
        if "does not support input mutations" in str(e):
            raise MutatedInputError("memfuse: the function modifies one of its input tensors in place (x.add_(...), "
                                    "x[...] = ...); memfuse compiles functions that leave their inputs unchanged") from e
        if "does not support outputs that alias inputs" not in str(e):
            raise

    def copying_outputs(*args):
        return tuple(o.clone() for o in fn(*args))
    return without_unused(aot_export_joint_simple(copying_outputs, fakes, trace_joint=trace_joint,
                                                   decompositions=decomposition_table()))


def _differentiable_outputs(captured: "Captured", fn: Callable, fakes: list) -> list:
    """Forward outputs that receive a tangent (the outputs AOTAutograd made tangents for, in
    order): floating values that depend on an input that requires grad, read off the graph.
    Where that count disagrees with the tangents (an output autograd tracks although its value
    is constant, like x ** 0), eager autograd decides, on the fake inputs."""
    if captured.num_tangents == 0:
        return []
    chosen = _dependent_outputs(captured, [t.requires_grad for t in fakes])
    if len(chosen) == captured.num_tangents:
        return chosen
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        outputs = fn(*fakes)     # the no-op hooks keep this run out of any hooks the user set
    chosen = [i for i, o in enumerate(outputs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if len(chosen) != captured.num_tangents:
        raise RuntimeError(f"memfuse: found {len(chosen)} differentiable outputs but the trace has "
                           f"{captured.num_tangents} tangents")
    return chosen


def _dependent_outputs(captured: "Captured", requires_grad: list) -> list:
    graph = captured.joint
    tracked = {name for name, rg in zip(graph.inputs, requires_grad) if rg}
    for name, node in graph.nodes.items():
        if any(i in tracked for i in node.inputs) and not _untracked(graph, node):
            tracked.add(name)
    outputs = graph.outputs[:captured.num_fwd_outputs]
    return [i for i, o in enumerate(outputs) if o in tracked and graph[o].value.is_floating]


def _untracked(graph: Graph, node: Node) -> bool:
    """A value autograd does not track though it reads tracked ones: an output of a registered op
    its rule says so of (memfuse.ir.patterns, ExternRule.untracked: the chunked loss head's
    log-sum-exps and formed gradients)."""
    if node.op is not Op.GETITEM:
        return False
    call = graph[node.inputs[0]]
    untracked = rule(call.attr.target).untracked if call.op is Op.EXTERN else None
    return untracked is not None and node.attr.index in untracked(call.attr)


def symbolic_last_dim(t: torch.Tensor, static: bool = False) -> bool:
    """Whether an input's last dim is traced as a size symbol instead of a compile-time D: true for
    an integer or bool tensor not held static (token ids, labels, positions, 0/1 masks). Its last
    dim counts items (a sequence), not the columns of rows a kernel reads: a new sequence length is a
    new symbol value, not a new compile. A value computed with that dim last is a flat range of rows
    (ir.graph.place): pointwise kernels take it, a reduction over it runs through aten. The compile
    key (fronts.function) keeps such a dim with the leading sizes, by the same rule."""
    return not static and t.dim() >= 1 and not t.dtype.is_floating_point and not t.dtype.is_complex


def _fake_input(mode: FakeTensorMode, t: torch.Tensor, static: bool, symbolic_last: bool = True) -> torch.Tensor:
    symbolic_last = symbolic_last and symbolic_last_dim(t, static)
    dims = [DimDynamic.STATIC if static or (i == t.dim() - 1 and not symbolic_last) else DimDynamic.DYNAMIC
            for i in range(t.dim())]
    return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))


def _equal_sizes_as_one(fakes) -> None:
    """Size symbols of equal value, across all inputs, made one (a replacement, as the trace's own
    Eq(a, b) makes): the compile key (fronts.function) holds the same equality classes of these
    sizes, so the program serves only calls where they are equal again. Without it, sizes that only
    a product relates stay apart: the labels' tokens [b2 * s2] and the logits' rows [b1 * s1] once
    token dims are symbols (Eq(b1*s1, b2*s2) names no single size), and the loss's pick and target
    scatter could not share the logits' [M, D] space. Sizes only: the symbols stay DYNAMIC (not
    duck-shaped), so no stride symbol (duck-shaped by torch) ever takes a size's symbol."""
    first: dict = {}
    for fake in fakes:
        for size in fake.shape:
            if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                same = first.setdefault(size.node.hint, size)
                if same is not size and not bool(size == same):   # the guard records the replacement
                    raise AssertionError(f"memfuse: sizes {size} and {same} of one value differ")


def _symbol_sources(fakes) -> tuple[dict, dict]:
    symbols, hints = {}, {}
    for i, fake in enumerate(fakes):
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt):
                expr = size.node.expr
                if isinstance(expr, sympy.Symbol) and expr not in symbols:
                    symbols[expr] = (i, d)
                    hints[expr] = size.node.hint
    return symbols, hints


def _stride_sources(fakes, sizes: dict) -> dict:
    """symbol -> (input, dim) of the strides that are symbols of their own (a non-contiguous
    input's: a slice's row stride is not D)."""
    strides = {}
    for i, fake in enumerate(fakes):
        for d, stride in enumerate(fake.stride()):
            expr = stride.node.expr if isinstance(stride, torch.SymInt) else None
            if isinstance(expr, sympy.Symbol) and expr not in sizes and expr not in strides:
                strides[expr] = (i, d)
    return strides


def _guards(shape_env: ShapeEnv, sizes: dict, strides: dict) -> tuple:
    """(why leading shapes join the compile key, or None; the layout guards). `s_a == s_b` over
    sizes is implied by the compile key. A guard that reads strides (a contiguity check inside a
    decomposition: Ne(row stride, D)) holds for any batch size of the same layout: the caller
    checks it per call (api) instead of specializing. Any other guard specializes. (The program
    itself reads every stride per call; what the trace assumed of them picks between branches
    that compute the same values, like the layout of a decomposition's output.)"""
    # sizes found equal are one symbol now (the key holds equal sizes equal); a size found to be
    # a constant stays itself, and its guard specializes
    renamed = {s: r for s, r in shape_env.replacements.items() if isinstance(r, sympy.Symbol)}
    specialized, layout = None, []
    for guard in shape_env.guards:
        expr = guard.expr.xreplace(renamed)
        free = expr.free_symbols
        if expr == sympy.true or isinstance(expr, sympy.Eq) and all(
                isinstance(a, sympy.Symbol) and a not in strides for a in expr.args):
            continue
        if free & strides.keys() and free <= sizes.keys() | strides.keys():
            layout.append(expr)
        elif specialized is None:
            specialized = f"the trace guards on {expr}"
    return specialized, layout


def _where_sizes_come_from(guard: str, fakes: list, input_names: Sequence[str]) -> str:
    """" (s3: input_ids dim 1, ...)": the argument and dim each size symbol in a guard's text is
    (read as traced: a guard `Eq(s3, 8)` has since replaced s3 by 8 in the shapes)."""
    named = {}
    for i, fake in enumerate(fakes):
        for d, size in enumerate(fake.shape):
            expr = getattr(size.node, "_expr", None) if isinstance(size, torch.SymInt) else None
            if isinstance(expr, sympy.Symbol) and expr not in named and re.search(rf"\b{expr}\b", guard):
                named[expr] = f"{expr}: {input_names[i] if i < len(input_names) else f'input {i}'} dim {d}"
    return f" ({', '.join(named.values())})" if named else ""
