"""The gradient of a split fused projection (q/k/v, gate/up) is its parts joined, not zero-padded
parts added (memfuse.capture.rewrite_joins): each backward kernel that joins the parts reads them
through windows over one another, with no ADD op; overlapping parts keep the add. Gradients
against eager."""
import pytest
import torch

from tests.helpers import compiled, forward_backward, rel_error

import memfuse

B, T, H = 2, 8, 32


def selects(x, w, b, wo):
    """Falcon's fused qkv cut by index along a heads dim (select_backward terms)."""
    qkv = (x @ w + b).view(B, T, 3, H)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    return ((q * k).sigmoid() * v @ wo).sum()


def slices(x, w, b, wo):
    """Phi-3's / Falcon's qkv slices along the last dim (slice_backward terms)."""
    qkv = x @ w + b
    q, k, v = qkv[..., :H], qkv[..., H:2 * H], qkv[..., 2 * H:]
    return ((q * k).sigmoid() * v @ wo).sum()


def narrows(x, w, b, wo):
    """GPT-NeoX's per-head view, then slices of its last dim."""
    qkv = (x @ w + b).view(B, T, 4, 3 * H // 4)
    q, k, v = qkv[..., :H // 4], qkv[..., H // 4:H // 2], qkv[..., H // 2:]
    q, k, v = q.reshape(B, T, H), k.reshape(B, T, H), v.reshape(B, T, H)
    return ((q * k).sigmoid() * v @ wo).sum()


def multi_query(x, w, b, wo):
    """Falcon's multi-query cut: every query head, then one key and one value head, each slice
    taking every index of the leading dims (their backward: slice_scatter over the whole dim)."""
    qkv = (x @ w + b).view(x.shape[0], x.shape[1], 6, H // 2)
    q, k, v = qkv[:, :, :4, :], qkv[:, :, 4:5, :], qkv[:, :, 5:, :]
    return ((q * k).sigmoid() * v).sum() + wo.sum()


def overlapping(x, w, b, wo):
    """Two slices that share columns: their gradients add there."""
    qkv = x @ w + b
    first, second = qkv[..., :2 * H], qkv[..., H:]
    return (first.sigmoid() * second).sum() + wo.sum()


def inputs():
    torch.manual_seed(0)
    return [torch.randn(B, T, H), torch.randn(H, 3 * H) / H ** 0.5, torch.randn(3 * H), torch.randn(H, H) / H ** 0.5]


def backward_adds(fn) -> int:
    tensors = [t.requires_grad_() for t in inputs()]
    report = compiled(fn, *tensors).report
    return sum(op == "add" for k in report.kernels_of("backward") for _, op in k.ops)


@pytest.mark.parametrize("fn", [selects, slices, narrows, multi_query])
def test_disjoint_parts_join_without_add(fn):
    assert backward_adds(fn) == 0


def test_overlapping_parts_keep_the_add():
    assert backward_adds(overlapping) == 1


def test_a_whole_dim_scattered_is_its_source():
    """The full leading slices' gradients are the parts themselves: no kernel writes a zero-padded
    part for the join to read again; one kernel joins the parts."""
    tensors = [t.requires_grad_() for t in inputs()]
    joins = [k for k in compiled(multi_query, *tensors).report.kernels_of("backward")
             if any(op == "strided" for _, op in k.ops) and k.rows == B * T * 6]
    assert len(joins) == 1, joins


@pytest.mark.parametrize("fn", [selects, slices, narrows, multi_query, overlapping])
def test_gradients_match_eager(fn):
    tensors, grad = [t.requires_grad_() for t in inputs()], torch.tensor(1.0)
    expected, expected_grads = forward_backward(fn, tensors, {}, grad)
    out, grads = forward_backward(memfuse.memory_efficient_fusion(fn), tensors, {}, grad)
    assert rel_error(out, expected) < 1e-5
    for actual, want in zip(grads, expected_grads):
        assert rel_error(actual, want) < 1e-5
