"""Extern calls a program makes through another implementation of the same result: fewer launches,
or fewer layers on the host.

The runtime binds an extern step's target through `SUBSTITUTES` (docs/architecture.md, Runtime):
where a target is listed, the program calls memfuse's function, which takes the op's arguments
and returns what it returns, falling back to the op itself where the substitute would not give
the same result. Ops a pattern registered with an implementation (memfuse.ir.patterns,
ExternRule.implementation: memfuse's own custom ops) are called as it: a program runs without
autograd, so the dispatcher and the custom op's wrappers only cost time.
"""
from __future__ import annotations

import torch

from memfuse.ir.patterns import rule

aten = torch.ops.aten


def embedding_dense_backward(grad_output: torch.Tensor, indices: torch.Tensor, num_weights: int,
                             padding_idx: int, scale_grad_by_freq: bool) -> torch.Tensor:
    """An embedding's weight gradient as one zero fill and one scatter-add (`index_add_`: atomic
    adds on CUDA), then the padding row zeroed, where aten's CUDA kernel sorts the indices and sums
    each run of duplicates: about 20 launches an embedding (radix-sort passes, scans, segment sums:
    a model's embeddings make a tenth of its step's launches so) against 3. The same sums in another
    order, as torch.compile's decomposition (an accumulating index_put, atomic adds in Triton).
    Aten's own where the order must not change (deterministic algorithms), where counts scale the
    gradient, and below fp32 (atomics would add in bf16 where aten adds in fp32)."""
    if scale_grad_by_freq or grad_output.dtype not in (torch.float32, torch.float64) \
            or torch.are_deterministic_algorithms_enabled():
        return aten.embedding_dense_backward.default(grad_output, indices, num_weights, padding_idx,
                                                     scale_grad_by_freq)
    width = grad_output.shape[-1]
    grad_weight = grad_output.new_zeros((num_weights, width))
    grad_weight.index_add_(0, indices.reshape(-1), grad_output.reshape(-1, width))
    if padding_idx >= 0:           # the padding row gets nothing: its tokens' rows were added above
        grad_weight[padding_idx].zero_()
    return grad_weight


SUBSTITUTES = {
    aten.embedding_dense_backward.default: embedding_dense_backward,
}


def substitute(target):
    """What a program calls for an extern `target`: its substitute, a registered implementation, or
    the target itself. A pattern's wrapper target (one that `calls` an op) is called as it is: it
    calls its op's implementation itself, with the arguments it rewrites."""
    if target in SUBSTITUTES:
        return SUBSTITUTES[target]
    if not isinstance(target, torch._ops.OpOverload):
        return target
    return rule(target).implementation or target
