"""The decomposition table capture traces with: core ATen plus the composites memfuse wants as
primitives, less the ops whose decomposition is wrong or slower than aten's own kernel."""
from __future__ import annotations

import functools

import torch
from torch._decomp import core_aten_decompositions, get_decompositions
from torch._decomp.decompositions import native_batch_norm_helper

aten = torch.ops.aten


def decomposition_table() -> dict:
    """core ATen plus the composites memfuse wants as primitives (norms, dropout, activations).
    Built once per process (it is not cheap); callers get their own copy of the dict."""
    return dict(_decomposition_table())


@functools.cache
def _decomposition_table() -> dict:
    table = dict(core_aten_decompositions())
    table.update(get_decompositions([
        aten.native_layer_norm, aten.native_layer_norm_backward, aten.native_dropout,
        aten.native_dropout_backward, aten._softmax, aten._softmax_backward_data,
        aten._log_softmax, aten._log_softmax_backward_data, aten.gelu, aten.gelu_backward,
        aten.silu, aten.silu_backward, aten.sigmoid_backward, aten.tanh_backward,
        aten.threshold_backward, aten.rms_norm, aten.elu, aten.leaky_relu, aten.hardtanh,
        aten.linalg_vector_norm,
        # BatchNorm in training: aten's var_mean over N, H, W, then pointwise ops fused with their
        # readers; the backward recomputes the output from the input and statistics it keeps
        aten._native_batch_norm_legit_functional, aten._native_batch_norm_legit.no_stats,
    ]))
    table[aten._native_batch_norm_legit_no_training.default] = _batch_norm_with_running_stats
    # core ATen decomposes CPU flash attention into math that returns the attention weights
    # where the op returns its logsumexp; the (undecomposed) backward then reads the weights as
    # the logsumexp: wrong gradients. torch's comment says inductor must exclude it; so do we.
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    # select's backward is one windowed read (memfuse.ir.views); decomposed, it becomes arange/where
    # over shapes outside the [M, D] space
    table.pop(aten.select_backward.default, None)
    # An embedding's backward stays aten's own kernel. Decomposed, it is an index_put with
    # accumulate, which CUDA runs by sorting the indices and adding each run of duplicates in turn:
    # a table of few rows read by many tokens (a token-type table: 2 rows) becomes a long serial sum.
    table.pop(aten.embedding_dense_backward.default, None)
    return table


def _batch_norm_with_running_stats(input, weight, bias, running_mean, running_var, momentum, eps):
    """BatchNorm in eval mode: pointwise ops over the running statistics, fused with what reads
    them. torch's own decomposition calls `_native_batch_norm_legit`, an op that writes into the
    running statistics, which a functional trace refuses."""
    output, save_mean, save_rstd, _, _ = native_batch_norm_helper(
        input, weight, bias, running_mean, running_var, False, momentum, eps, functional=True)
    return output, save_mean, save_rstd
