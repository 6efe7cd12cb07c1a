"""Shared test helpers: the seed's blocks as workloads, eager references, error measures."""
from __future__ import annotations

import dataclasses

import torch

import memfuse
from benchmarks.lib import workloads

# The seed's three blocks, with their parameter counts and constants, from the benchmark registry.
BLOCKS = {w.fn.__name__: w for w in workloads.registry() if w.dtype == torch.float32}
assert set(BLOCKS) == {"layer_norm_block", "primitive_layer_norm_block", "rms_norm_block"}, BLOCKS


def workload(name: str, shape, dtype=torch.float32) -> workloads.Workload:
    return dataclasses.replace(BLOCKS[name], shape=tuple(shape), dtype=dtype)


def block_inputs(name: str, shape, dtype=torch.float32, dropout_prob: float = 0.0):
    """(tensors, consts, grad_output) for one block; every tensor requires grad."""
    step = workload(name, shape, dtype).make_inputs("cpu")
    consts = dict(step.consts, dropout_prob=dropout_prob)
    return step.tensors, consts, step.grad_output


def leaves_like(tensors, dtype=None):
    """Fresh leaf copies (optionally cast) that require grad like the originals."""
    return [t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad) for t in tensors]


def forward_backward(fn, tensors, consts, grad_output):
    """Run fn on fresh leaves, backward with grad_output; returns (output, [input grads])."""
    leaves = leaves_like(tensors)
    out = fn(*leaves, **consts)
    out.backward(grad_output.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in fp64 (||a - b|| where b is all zeros or empty)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    actual, expected = actual.double(), expected.double()
    diff, scale = (actual - expected).norm().item(), expected.norm().item()
    return diff / scale if scale > 0 else diff


def counters() -> dict:
    return dict(memfuse.stats())


def delta(before: dict) -> dict:
    after = memfuse.stats()
    return {k: after[k] - before[k] for k in after}
