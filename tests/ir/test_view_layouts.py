"""Views a program makes by strides (memfuse.ir.views, runtime._ProgramWriter.view): the layout
arithmetic against torch's own views, and programs that use it against eager, also where a
saved-tensors hook hands back other strides."""
from __future__ import annotations

import logging

import pytest
import sympy
import torch
import torch.nn.functional as F

import memfuse
from memfuse.ir.views import Layout, contiguous, reshape_strides, view_layout

aten = torch.ops.aten
S = sympy.Symbol("s0", positive=True, integer=True)
SIZE = 3          # the symbol's value where torch's views are taken


def _concrete(exprs) -> tuple:
    return tuple(int(sympy.sympify(e).subs(S, SIZE)) for e in exprs)


def _source(shape: tuple, order: tuple) -> tuple:
    """A tensor of `shape` laid out with its dims in memory in `order` (outermost first), and its
    Layout over the symbol."""
    sizes = _concrete(shape)
    dense = torch.empty([sizes[d] for d in order])
    tensor = dense.permute([order.index(d) for d in range(len(order))])
    stored = contiguous(tuple(shape[d] for d in order))
    strides = tuple(stored.strides[order.index(d)] for d in range(len(order)))
    return tensor, Layout(tuple(shape), strides)


def _same_reads(strides: tuple, tensor: torch.Tensor) -> bool:
    """Strides that read what `tensor`'s do (dims of size 1 read through no stride)."""
    return all(a == b for a, b, n in zip(_concrete(strides), tensor.stride(), tensor.shape) if n > 1)


RESHAPES = [   # (shape, memory order, new shape, torch can view it)
    ((S, 16, 64), (0, 1, 2), (S * 16, 64), True),
    ((S * 16, 64), (0, 1), (S, 16, 4, 16), True),
    ((S, 4, 16, 16), (0, 2, 1, 3), (S, 4, 16, 16), True),       # the same shape, any layout
    ((S, 16, 4, 16), (0, 1, 2, 3), (S, 16, 64), True),
    ((S, 16, 4, 16), (0, 2, 1, 3), (S, 16, 64), False),         # merges dims apart in memory
    ((S, 4, 16, 16), (0, 2, 1, 3), (S, 4, 256), False),
    ((S, 4, 16, 16), (0, 1, 3, 2), (S * 4, 16, 16), True),      # merges the two outer dims only
    ((S, 1, 8), (0, 1, 2), (S, 8), True),                       # drops a dim of size 1
    ((S, 8), (1, 0), (S, 1, 8, 1), True),                       # adds dims of size 1, transposed
    ((2, 3), (0, 1), (3, 2), True),                             # merge and split, one group
]


@pytest.mark.parametrize("shape, order, new_shape, viewable", RESHAPES)
def test_reshape_strides_are_torchs_or_none(shape, order, new_shape, viewable):
    """Strides of a reshape as torch's view has them (over the symbol, read at one size), or None
    exactly where torch cannot view (its reshape copies)."""
    tensor, source = _source(shape, order)
    strides = reshape_strides(source.shape, source.strides, new_shape)
    assert (strides is not None) == viewable, strides
    if viewable:
        assert _same_reads(strides, tensor.view(_concrete(new_shape)))


VIEWS = [   # (target, args, shape, memory order, traced shape of the view)
    (aten.t.default, (), (S, 8), (1, 0), (8, S)),
    (aten.permute.default, ([0, 2, 1, 3],), (S, 16, 4, 16), (0, 1, 2, 3), (S, 4, 16, 16)),
    (aten.permute.default, ([-1, 0, 1],), (S, 4, 8), (2, 0, 1), (8, S, 4)),
    (aten.unsqueeze.default, (1,), (S, 8), (0, 1), (S, 1, 8)),
    (aten.unsqueeze.default, (-1,), (S, 8), (1, 0), (S, 8, 1)),
    (aten.expand.default, ([2, -1, 8],), (S, 1), (0, 1), (2, S, 8)),
    (aten.narrow.default, (1, 2, 3), (S, 8), (0, 1), (S, 3)),
    (aten.narrow.default, (0, 1, 2), (4, S), (1, 0), (2, S)),
]


@pytest.mark.parametrize("target, args, shape, order, traced", VIEWS, ids=lambda v: getattr(v, "__name__", None))
def test_view_layouts_read_what_torchs_views_read(target, args, shape, order, traced):
    """Each view's strides and start, from a source in any memory order, as torch's view has them."""
    tensor, source = _source(shape, order)
    layout = view_layout(target, args, source, traced)
    expected = target(tensor, *args)
    assert _concrete(layout.shape) == tuple(expected.shape)
    assert _same_reads(layout.strides, expected)
    assert int(sympy.sympify(layout.offset).subs(S, SIZE)) == expected.storage_offset()


def heads(x, w):
    """A linear, its output split into heads moved before the sequence, and back (attention's
    views); the transposes and reshapes are extern views of a matmul's result. Sigmoid scores, not
    softmax: a softmax attention is traced as one attention call (patterns/attention_bias.py),
    which would take these views away."""
    b, t, d = x.shape
    h = F.linear(x, w).view(b, t, 2, d // 2).transpose(1, 2)
    scores = (h @ h.transpose(-1, -2)).sigmoid()
    return (scores @ h).transpose(1, 2).reshape(b, t, d).sin()


def _heads_inputs():
    return torch.randn(2, 5, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)


def _eager_grads(fn, tensors, grad_output):
    copies = [t.detach().requires_grad_() for t in tensors]
    out = fn(*copies)
    out.backward(grad_output)
    return out, [c.grad for c in copies]


def test_programs_make_views_of_known_layouts_by_strides():
    """Views of what memfuse allocated, of a matmul's result and of inputs the compile key says are
    contiguous are made by strides (checked against torch's own view: the tests run under
    MEMFUSE_CHECK); a caller's tensor (a saved tensor) under a flag read once.
    Values and gradients as eager's, at two batch sizes."""
    fused = memfuse.memory_efficient_fusion(heads)
    for batch in (3, 4):
        x, w = torch.randn(batch, 5, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True)
        grad_output = torch.randn(batch, 5, 8)
        out = fused(x, w)
        out.backward(grad_output)
        expected, grads = _eager_grads(heads, [x, w], grad_output)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x.grad, grads[0])
        torch.testing.assert_close(w.grad, grads[1])
    entry = next(iter(fused.cache.values()))
    forward, backward = entry.function.forward.source, entry.function.backward.source
    assert "mf_reinterpret(primals_2, (8, 8), (1, 8), 0)" in forward       # the weight's transpose
    assert "mf_check_view(" in forward
    assert "mf_primals_1_contiguous = primals_1.is_contiguous()" in backward
    assert " if mf_primals_1_contiguous else primals_1." in backward


def test_views_of_tensors_a_hook_unpacks_in_other_strides_are_torchs():
    """A saved-tensors hook that unpacks every saved tensor transposed in memory: the flags read
    False, the program's views are torch's (a reshape copies); gradients as eager's."""
    def transposed_copy(t):
        return t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() >= 2 else t

    x, w = _heads_inputs()
    grad_output = torch.randn(2, 5, 8)
    fused = memfuse.memory_efficient_fusion(heads)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, transposed_copy):
        fused(x, w).backward(grad_output)
    assert not transposed_copy(x).is_contiguous()
    _, grads = _eager_grads(heads, [x, w], grad_output)
    torch.testing.assert_close(x.grad, grads[0])
    torch.testing.assert_close(w.grad, grads[1])


def test_a_wrong_layout_is_caught_under_check(monkeypatch, caplog):
    """The check is live: a layout that reads other elements than torch's view fails the run."""
    def transposed(target, args, source, shape):
        layout = view_layout(target, args, source, shape)
        return None if layout is None else Layout(layout.shape, layout.strides[::-1], layout.offset)
    monkeypatch.setattr(memfuse.runtime.program, "view_layout", transposed)
    x, w = _heads_inputs()
    # the first run's failure: the call runs through torch, the reason naming the view
    with caplog.at_level(logging.WARNING, logger="memfuse.fallbacks"):
        memfuse.memory_efficient_fusion(heads)(x, w)
    assert memfuse.stats()["first_run_fallbacks"] == 1
    assert "AssertionError: view permute: made as" in caplog.text

