"""memfuse.capture.indexing: advanced indexing by aranges made views, exactly where it is provably the same."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import memfuse
from memfuse.capture.indexing import index_by_aranges

INDEX = torch.ops.aten.index.Tensor


def in_order(x):            # HuggingFace's position_ids[batch_idx, q_idx], [batch, 1, q, 1]
    return x[torch.arange(x.shape[0])[:, None, None, None], (torch.arange(6) + 0)[None, None, :, None]]


def out_of_order(x):        # the second arange along the first broadcast dim: a permute
    return x[torch.arange(x.shape[0])[None, :], torch.arange(6)[:, None]]


def shorter(x):             # an arange shorter than its dim: a slice; x's last dim kept whole
    return x[torch.arange(2)[:, None], torch.arange(3)[None, :]]


def with_offset(x):
    return x[torch.arange(1, 3)[:, None], torch.arange(3)[None, :]]


def not_an_arange(x):
    return x[torch.tensor([1, 0])[:, None], torch.arange(3)[None, :]]


def one_dim_twice(x):       # both aranges along one dim: a diagonal, not a block
    return x[torch.arange(3), torch.arange(3)]


def traced(fn, x):
    return make_fx(fn, tracing_mode="fake")(x)


@pytest.mark.parametrize("fn", [in_order, out_of_order, shorter], ids=lambda f: f.__name__)
def test_an_index_of_aranges_becomes_views_with_the_same_values(fn):
    x = torch.randn(4, 7, 5) if fn is shorter else torch.randint(0, 100, (3, 8))
    gm = traced(fn, x)
    assert gm.graph.find_nodes(op="call_function", target=INDEX)
    assert index_by_aranges(gm)
    gm.recompile()
    assert not gm.graph.find_nodes(op="call_function", target=INDEX)
    ours = gm(x)
    assert ours.shape == fn(x).shape and torch.equal(ours, fn(x))
    for node in gm.graph.nodes:          # every node the rewrite made has its fake value
        if node.op == "call_function":
            assert "val" in node.meta, node


@pytest.mark.parametrize("fn", [with_offset, not_an_arange, one_dim_twice], ids=lambda f: f.__name__)
def test_other_indices_stay_aten_indexing(fn):
    x = torch.randn(4, 5)
    gm = traced(fn, x)
    assert not index_by_aranges(gm)
    assert gm.graph.find_nodes(op="call_function", target=INDEX)


def test_an_arange_past_its_dim_stays_aten_and_raises_as_eager():
    def past(x):
        return x[torch.arange(5)[:, None], torch.arange(3)[None, :]]
    x = torch.randn(4, 5)
    gm = traced(past, x)
    assert not index_by_aranges(gm)
    for run in (past, gm):
        with pytest.raises(IndexError):
            run(x)


def hf_mask(position_ids):
    """HuggingFace's sdpa mask of a causal model from position ids (masking_utils, no vmap)."""
    batch, length = 2, position_ids.shape[-1]
    positions = position_ids.expand(batch, -1)
    batch_index = torch.arange(batch)[:, None, None, None]
    q_index = (torch.arange(length) + 0)[None, None, :, None]
    kv_index = (torch.arange(length) + 0)[None, None, None, :]
    return positions[batch_index, kv_index] <= positions[batch_index, q_index]


@pytest.mark.parametrize("compile_with", ["memory_efficient_fusion", "backend"])
def test_a_mask_built_by_indexing_with_aranges_runs_no_aten_index(compile_with):
    """The mask's program reads the position ids in place: no aten.index call is bound in it."""
    from memfuse.fronts.backend import watch
    torch._dynamo.reset()
    position_ids = torch.arange(12)[None, :]
    if compile_with == "backend":
        with watch() as graphs:
            ours = torch.compile(hf_mask, backend="memfuse")(position_ids)
        [graph] = graphs
        program = graph.function.forward
    else:
        fused = memfuse.memory_efficient_fusion(hf_mask)
        ours = fused(position_ids)
        [entry] = [e for e in fused.cache.values() if hasattr(e, "function")]
        program = entry.function.forward
    assert torch.equal(ours, hf_mask(position_ids))
    assert INDEX not in program.run.__globals__.values()


def test_the_gradient_through_an_index_of_aranges_matches_eager():
    """The forward's index becomes views; its backward (aten's index_put of the gradient) still
    gets the aranges it reads."""
    def block(x, w):
        picked = x[torch.arange(4)[:, None], torch.arange(3)[None, :]]
        return (picked * w).tanh()
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    grad = torch.randn(4, 3)
    ours = memfuse.memory_efficient_fusion(block)(x, w)
    theirs = block(x, w)
    assert torch.allclose(ours, theirs, atol=1e-6)
    ours_grads = torch.autograd.grad(ours, (x, w), grad)
    for a, b in zip(ours_grads, torch.autograd.grad(theirs, (x, w), grad)):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_mask_at_every_length_after_dynamo_goes_dynamic():
    """Dynamo's second length compiles with a symbolic one: the aranges end at a size symbol and
    `x[None, None, :]` traces a whole slice; the index is still the views it is."""
    from memfuse.fronts.backend import watch
    torch._dynamo.reset()
    compiled = torch.compile(hf_mask, backend="memfuse")
    with watch() as graphs:
        for length in (12, 20, 7):
            position_ids = torch.arange(length)[None, :]
            assert torch.equal(compiled(position_ids), hf_mask(position_ids))
    assert len(graphs) == 2                                  # static, then dynamic
    for graph in graphs:
        assert INDEX not in graph.function.forward.run.__globals__.values()
