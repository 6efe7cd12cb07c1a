"""What the core must know of the loss head's ops, registered in memfuse.ir.patterns' table: how they
read their operands, what a program calls in their place, the backward's in-place twins and when
they may write, the outputs autograd does not track, their reasons, explain's section and the
counters."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from memfuse.base.debug import register_counter
from memfuse.ir.graph import Extern, Graph, Node, ValueRef
from memfuse.ir.patterns import InPlaceChoice, OutputHook, Reads, register_extern, register_report
from memfuse.patterns.loss_head import op
from memfuse.patterns.loss_head.call import OUTPUT, LossHeadCall, schema_arguments
from memfuse.schedule.reinplace import saved_only_here

FORWARD = torch.ops.memfuse.linear_cross_entropy.default
BACKWARD = torch.ops.memfuse.linear_cross_entropy_backward.default
# the backward scaling the weight's and the bias's formed gradients in place; and the hidden states' too
BACKWARD_IN_PLACE = torch.ops.memfuse.linear_cross_entropy_backward_.default
BACKWARD_ALL_IN_PLACE = torch.ops.memfuse.linear_cross_entropy_backward_all_.default


def untracked_outputs(call: Extern) -> frozenset:
    """The outputs autograd does not track though they read tracked values: the log-sum-exps and the
    formed gradients; the logits too where the call returns them without gradient
    (`differentiable_logits` off: memfuse.patterns.loss_head.detect, for a function that returns them)."""
    head = LossHeadCall.of(call.args, call.kwargs)
    untracked = {OUTPUT[name] for name in ("log_sum_exp", "hidden_unit", "weight_unit", "bias_unit")}
    return frozenset(untracked | (set() if head.differentiable_logits else {OUTPUT["logits"]}))


def formed_gradients_scaled(graph: Graph, node: Node, users: dict, outputs: set, replayed: bool
                            ) -> Optional[InPlaceChoice]:
    """The backward's in-place twin where the gradients the forward formed are saved values only this
    call reads: the weight's and the bias's scaled in place; the hidden states' too where it is one,
    in hidden's dtype. Out of place a second [vocab, H] weight gradient would be allocated while the
    first is alive. A program replayed as CUDA graphs keeps its copies: its saved values are static
    buffers a retained graph's next replay reads again, and the op asks autograd whether the graph
    is kept only at the capture."""
    if replayed:
        return None
    named = schema_arguments(BACKWARD, node.attr.args, node.attr.kwargs)
    formed = [named["weight_unit"], named["bias_unit"]]
    if not all(isinstance(f, ValueRef) for f in formed):
        return None
    names = [f.name for f in formed]
    if not all(saved_only_here(graph, node, n, users, outputs) for n in names):
        return None       # computed here, or read by another step: the copies stay
    if not graph[names[0]].value.shape or 0 in graph[names[0]].value.shape:
        return None       # the forward formed none: the backward recomputes them, nothing to scale
    hidden, hidden_unit = named["hidden"], named["hidden_unit"]
    if (isinstance(hidden, ValueRef) and isinstance(hidden_unit, ValueRef)
            and saved_only_here(graph, node, hidden_unit.name, users, outputs)
            and graph[hidden_unit.name].value.dtype == graph[hidden.name].value.dtype):
        return InPlaceChoice(BACKWARD_ALL_IN_PLACE, ", ".join([hidden_unit.name, *names]),
                             "the gradients the forward formed (the hidden states' in their dtype) are saved values "
                             "only it reads: scaled in place (copies where a backward keeps its graph), no second "
                             "weight or hidden states' gradient")
    return InPlaceChoice(BACKWARD_IN_PLACE, ", ".join(names),
                         "the gradients the forward formed are saved values only it reads: scaled in place (copies "
                         "where a backward keeps its graph), no second weight gradient")


def returned_logits_hook(returns: list) -> OutputHook:
    """The output hook that gives each returned head's logits their backward (op.LogitsReturn)."""
    return OutputHook(sum(r.hidden[0] == "output" for r in returns), functools.partial(_attach, tuple(returns)))


def _attach(returns: tuple, results: list, outputs, inputs) -> None:
    attached = op.attach_returned_logits(outputs, inputs, list(returns), len(results))
    for returned in returns:
        for position in returned.positions:
            results[position] = attached[position]


register_extern(FORWARD, reads=Reads.ANY_STRIDES, implementation=op.linear_cross_entropy_impl,
                untracked=untracked_outputs,
                reason="the chunked loss head (memfuse.patterns.loss_head.op): its matmuls and kernels, a chunk of "
                       "tokens at a time")
register_extern(BACKWARD, reads=Reads.ANY_STRIDES, implementation=op.linear_cross_entropy_backward_impl,
                in_place=formed_gradients_scaled,
                reason="the chunked loss head's backward (memfuse.patterns.loss_head.op)")
register_extern(BACKWARD_IN_PLACE, implementation=op.linear_cross_entropy_backward_in_place_impl)
# its hidden states' gradient aliases a saved value only the call reads: the program's own memory
register_extern(BACKWARD_ALL_IN_PLACE, implementation=op.linear_cross_entropy_backward_all_in_place_impl,
                own_aliases=(0,))
register_report("loss_heads", "loss heads (cross_entropy of a linear layer's output)")
register_counter("loss_heads_chunked", "cross-entropies of a linear's output computed chunked, logits never whole "
                                       "(memfuse.patterns.loss_head.detect)")
register_counter("loss_head_vocabulary_calls", "calls of the chunked loss head that ran the vocabulary-major plan "
                                               "(memfuse.patterns.loss_head.op.choose_plan), every call")
