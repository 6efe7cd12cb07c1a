"""A custom op's backward run as one opaque call, not traced: a plug-in of capture.

A `torch.library.custom_op` is opaque in the forward, but its autograd formula
(`register_autograd`) is Python that AOTAutograd runs, and so traces, into the joint graph. A
formula that reads tensor values (`offs.tolist()` to loop over groups, as HuggingFace's grouped
matmul of mixture-of-experts layers does in transformers <= 5.17) cannot be traced: the trace
fails on a data-dependent value, and the whole graph ran through torch (torch.compile's own
backend fails the same way and breaks the graph there).

While memfuse traces (`opaque_backwards`, a capture trace mode), each such op's formula is
replaced by one call of `memfuse::custom_op_backward`: it takes the forward's tensor arguments
(and its outputs where the op's `setup_context` keeps them) and the output gradients, and returns
the gradients of the arguments that need one. At run time it rebuilds the op's context with the
op's own `setup_context` on those tensors and runs the op's own backward, eagerly: the same
numbers as eager. The trace sees an extern with fake results of the arguments' shapes; the plan
keeps what it reads like any extern's operands.

Every custom op with a Python formula is run so, not only those whose trace would fail: the op is
already a black box to the forward, the formula's trace cannot be tried and undone inside one
AOTAutograd trace (a failed attempt leaves data-dependent symbols in it), and a formula that only
calls torch ops costs one opaque call instead of fused kernels. The ops the pattern registry knows
(memfuse's own, whose backward capture lowers by its rules) keep their formula.
"""
from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Optional

import torch
from torch._library import custom_ops
from torch.utils import _pytree

from memfuse.ir.patterns import RULES, Reads, register_capture, register_extern, register_report


@dataclasses.dataclass(frozen=True)
class OpaqueCall:
    """How one traced call of a custom op runs its backward: the op's formula, its arguments with
    the tensors taken out (`None` in their place), which tensors the call receives (the
    arguments', then the outputs' where `setup_context` keeps them), and which arguments get a
    gradient."""
    op: Any                          # the CustomOpDef
    setup_context: Callable
    backward: Callable
    args: tuple                      # positional arguments, tensors replaced by None
    keyword_only: Optional[dict]     # keyword-only arguments (None: the op has none)
    tensor_positions: tuple          # argument positions of the tensors the call receives
    output_spec: Any                 # pytree spec of the forward's output
    output_dtypes: tuple             # of each output tensor
    passes_outputs: bool             # the outputs are among the tensors the call receives
    needs_input_grad: tuple
    grad_positions: tuple            # argument positions whose gradient the call returns

    def run(self, tensors: list, grads: list) -> list:
        """The op's own setup_context and backward, eagerly, on the real tensors."""
        args = list(self.args)
        for position, tensor in zip(self.tensor_positions, tensors):
            args[position] = tensor
        n_out = len(self.output_dtypes)
        if self.passes_outputs:
            outputs = tensors[len(self.tensor_positions):len(self.tensor_positions) + n_out]
        else:   # setup_context kept none of them: stand-ins with their shapes (their gradients') and no data
            outputs = [torch.empty_like(grad, dtype=dtype, device="meta") for grad, dtype in zip(grads, self.output_dtypes)]
        output = _pytree.tree_unflatten(list(outputs), self.output_spec)
        ctx = _Context(self.needs_input_grad)
        if self.keyword_only is None:
            self.setup_context(ctx=ctx, inputs=tuple(args), output=output)
        else:
            self.setup_context(ctx=ctx, inputs=tuple(args), keyword_only_inputs=dict(self.keyword_only), output=output)
        result = self.backward(ctx, *grads)
        result = result if isinstance(result, (tuple, list)) else (result,)
        return [_as_gradient(result[p] if p < len(result) else None, args[p], tensors) for p in self.grad_positions]


class _Context:
    """What an autograd.Function's ctx offers a custom op's setup_context and backward."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.saved_tensors = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        pass

    def mark_dirty(self, *tensors):
        pass

    def set_materialize_grads(self, value: bool):
        self.materialize_grads = value


def _as_gradient(grad, argument: torch.Tensor, received: list) -> torch.Tensor:
    """The gradient as the call's result must be: the argument's shape and dtype, contiguous (the
    fake result: the programs take an extern's result as laid out so), zeros for a formula's None,
    and never the storage of a tensor the call received (a custom op's result may not alias its
    inputs)."""
    like = torch.empty(argument.shape, dtype=argument.dtype, device=argument.device)
    if grad is None:
        return like.zero_()
    aliases = any(grad.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
                  for t in received if t is not None and t.device == grad.device)
    if aliases or grad.dtype != like.dtype or grad.shape != like.shape or not grad.is_contiguous():
        return like.copy_(grad)
    return grad


CALLS: dict = {}          # key -> OpaqueCall, for the process (a compiled program holds its keys)
_keys = itertools.count()


@torch.library.custom_op("memfuse::custom_op_backward", mutates_args=())
def custom_op_backward(key: int, tensors: list[torch.Tensor], grads: list[Optional[torch.Tensor]]) -> list[torch.Tensor]:
    """The gradients of call `key`'s arguments that need one (OpaqueCall.run)."""
    return CALLS[key].run(list(tensors), list(grads))


@custom_op_backward.register_fake
def _(key, tensors, grads):
    call = CALLS[key]
    args = dict(zip(call.tensor_positions, tensors))
    return [torch.empty_like(args[p], memory_format=torch.contiguous_format) for p in call.grad_positions]


# -- the trace mode --------------------------------------------------------------------------------
def _replaced(op) -> bool:
    """A custom op whose formula memfuse runs opaque: it has one, it takes no tensor lists (a
    gradient per list is not one tensor), and no pattern registered the op."""
    schema = op._opoverload._schema
    lists = any(isinstance(a.type, torch.ListType) for a in (*schema.arguments, *schema.returns))
    return op._backward_fn is not None and op._setup_context_fn is not None and not lists \
        and op._opoverload not in RULES


@contextlib.contextmanager
def opaque_backwards():
    """While memfuse traces: every replaced custom op's formula runs as one opaque call."""
    ops = [op for op in list(custom_ops.OPDEFS.values()) if _replaced(op)]
    originals = [(op, op._setup_context_fn, op._backward_fn) for op in ops]
    for op, setup_context, backward in originals:
        op._setup_context_fn = _recording(setup_context)
        op._backward_fn = _opaque(op, setup_context, backward)
    try:
        yield
    finally:
        for op, setup_context, backward in originals:
            op._setup_context_fn, op._backward_fn = setup_context, backward


def _recording(setup_context: Callable) -> Callable:
    """The op's setup_context, which also keeps the call's arguments and output on ctx for the
    opaque backward, and whether it kept a tensor that is not an argument (an output, or one
    computed from it)."""
    def setup(ctx, inputs, output, keyword_only_inputs=None):
        if keyword_only_inputs is None:
            setup_context(ctx=ctx, inputs=inputs, output=output)
        else:
            setup_context(ctx=ctx, inputs=inputs, keyword_only_inputs=keyword_only_inputs, output=output)
        saved = getattr(ctx, "to_save", None) or ()
        kept = [v for v in (*saved, *vars(ctx).values()) if isinstance(v, torch.Tensor)]
        arguments = [a for a in (*inputs, *(keyword_only_inputs or {}).values()) if isinstance(a, torch.Tensor)]
        ctx._memfuse_call = (tuple(inputs), keyword_only_inputs, output,
                             any(all(k is not a for a in arguments) for k in kept))
    return setup


def _opaque(op, setup_context: Callable, backward: Callable) -> Callable:
    def opaque_backward(ctx, *grads):
        inputs, keyword_only, output, keeps_output = ctx._memfuse_call
        constants = [a for a in _pytree.tree_leaves((inputs, keyword_only)) if not isinstance(a, torch.Tensor)]
        if any(isinstance(a, (torch.SymInt, torch.SymFloat, torch.SymBool)) for a in constants):
            return backward(ctx, *grads)     # a size the call takes changes per call: traced as it is
        keeps_output = keeps_output or any(g is None for g in grads)    # no gradient to shape a stand-in
        needs = tuple(ctx.needs_input_grad)
        tensor_positions = tuple(i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor))
        outputs, spec = _pytree.tree_flatten(output)
        key = next(_keys)
        CALLS[key] = OpaqueCall(
            op, setup_context, backward, tuple(None if isinstance(a, torch.Tensor) else a for a in inputs),
            keyword_only, tensor_positions, spec, tuple(o.dtype for o in outputs), keeps_output,
            needs, tuple(i for i in tensor_positions if i < len(needs) and needs[i]))
        received = [inputs[i] for i in tensor_positions] + (list(outputs) if keeps_output else [])
        results = iter(torch.ops.memfuse.custom_op_backward(key, received, list(grads)))
        return tuple(next(results) if i in CALLS[key].grad_positions else None for i in range(len(inputs)))
    return opaque_backward


def _decisions(gm: torch.fx.GraphModule) -> tuple:
    """capture's rewrite hook, which only reports: one line per opaque backward in the graph."""
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.memfuse.custom_op_backward.default]
    return False, [f"{n.name}: the backward of {CALLS[n.args[0]].op._qualname} run as one call "
                   f"(its formula is Python, run eagerly on the saved tensors)" for n in calls]


register_extern(torch.ops.memfuse.custom_op_backward.default, reads=Reads.AS_TRACED,
                reason="a custom op's backward, run as one call (memfuse.patterns.custom_backward)")
register_capture("custom_backwards", trace_mode=opaque_backwards, rewrite=_decisions)
register_report("custom_backwards", "custom ops' backwards run as one call (memfuse.patterns.custom_backward)")
