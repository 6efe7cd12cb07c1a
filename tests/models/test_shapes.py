"""One compiled program serves every batch and sequence size: leading dims are runtime values.
Sizes 0/1 and equal leading sizes are part of the key by design; D and dtypes always are."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import memfuse
from helpers import BLOCKS, forward_backward, rel_error, workload

D = 40


def params(name, dtype=torch.float32, d=D):
    return workload(name, (1, d), dtype).make_params("cpu")


def step_inputs(shape, params, dtype=torch.float32):
    input1 = torch.randn(*shape, dtype=dtype, requires_grad=True)
    input2 = torch.randn(*shape, dtype=dtype, requires_grad=True)
    return [input1, input2, *params], torch.randn(*shape, dtype=dtype)


def check_step(fused, name, shape, ps, dtype=torch.float32, tol=1e-5):
    tensors, grad_output = step_inputs(shape, ps, dtype)
    consts = dict(BLOCKS[name].consts, normalization_axis=len(shape) - 1, dropout_prob=0.0)
    out, grads = forward_backward(fused, tensors, consts, grad_output)
    ref_out, ref_grads = forward_backward(BLOCKS[name].fn, tensors, consts, grad_output)
    assert out.shape == tuple(shape)
    assert rel_error(out, ref_out) <= tol, shape
    for i, (g, r) in enumerate(zip(grads, ref_grads)):
        assert rel_error(g, r) <= tol, (shape, i)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_new_leading_sizes_reuse_the_program(name):
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    ps = params(name)
    for shape in [(2, 3, D), (5, 4, D), (4, 6, D), (3, 2, D)]:
        check_step(fused, name, shape, ps)
    assert memfuse.stats()["compiles"] == 1
    assert memfuse.stats()["cache_hits"] == 3
    assert memfuse.stats()["kernels_generated"] == 2      # one forward, one backward kernel
    entry, = fused.cache.values()
    assert entry.captured.specialized is None


def test_equal_and_unit_leading_sizes_are_their_own_keys():
    name = "layer_norm_block"
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    ps = params(name)
    check_step(fused, name, (2, 3, D), ps)
    check_step(fused, name, (3, 3, D), ps)        # equal sizes share a symbol: M = s0**2
    assert memfuse.stats()["compiles"] == 2
    check_step(fused, name, (4, 4, D), ps)        # ... and that program serves every square
    assert memfuse.stats()["compiles"] == 2 and memfuse.stats()["cache_hits"] == 1
    check_step(fused, name, (1, 7, D), ps)        # size 1 specializes
    assert memfuse.stats()["compiles"] == 3
    check_step(fused, name, (1, 5, D), ps)
    assert memfuse.stats()["compiles"] == 3 and memfuse.stats()["cache_hits"] == 2
    check_step(fused, name, (2, 3, D), ps)        # the first program is still there
    assert memfuse.stats()["compiles"] == 3 and memfuse.stats()["cache_hits"] == 3
    check_step(fused, name, (0, 4, D), ps)        # no rows: empty output, zero parameter grads
    assert memfuse.stats()["compiles"] == 4


def test_rank_two_and_rank_four_inputs():
    name = "rms_norm_block"
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    ps = params(name)
    check_step(fused, name, (6, D), ps)
    check_step(fused, name, (9, D), ps)
    check_step(fused, name, (2, 3, 2, D), ps)
    assert memfuse.stats()["compiles"] == 2


def test_another_d_or_dtype_compiles_again():
    name = "layer_norm_block"
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    check_step(fused, name, (2, 3, D), params(name))
    check_step(fused, name, (2, 3, 24), params(name, d=24))
    assert memfuse.stats()["compiles"] == 2
    check_step(fused, name, (2, 3, D), params(name, torch.float64), torch.float64, tol=1e-12)
    assert memfuse.stats()["compiles"] == 3
    check_step(fused, name, (5, 3, 24), params(name, d=24))
    check_step(fused, name, (5, 3, D), params(name, torch.float64), torch.float64, tol=1e-12)
    assert memfuse.stats()["compiles"] == 3 and memfuse.stats()["cache_hits"] == 2
    assert len(fused.cache) == 3


def key_pattern(lead):
    """The leading-size facts the compile key keeps: 0, 1, and which sizes are equal."""
    firsts = {}
    return tuple(s if s in (0, 1) else ("s", firsts.setdefault(s, len(firsts))) for s in lead)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=1, max_size=5))
def test_any_leading_sizes(leads):
    """Sizes 0 and 1 and repeated sizes included: right results, one compile per key pattern."""
    name = "layer_norm_block"
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    ps = params(name)
    before = memfuse.stats()["compiles"]
    for lead in leads:
        check_step(fused, name, (*lead, D), ps)
    assert memfuse.stats()["compiles"] - before == len({key_pattern(lead) for lead in leads})


def test_non_contiguous_inputs():
    name = "rms_norm_block"
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    ps = params(name)
    check_step(fused, name, (3, 5, D), ps)
    tensors, grad_output = step_inputs((5, 3, D), ps)
    transposed = [t.detach().transpose(0, 1).requires_grad_() if t.dim() == 3 else t for t in tensors]
    assert not transposed[0].is_contiguous()
    consts = dict(BLOCKS[name].consts, dropout_prob=0.0)
    out, grads = forward_backward(fused, transposed, consts, grad_output.transpose(0, 1))
    ref_out, ref_grads = forward_backward(BLOCKS[name].fn, transposed, consts, grad_output.transpose(0, 1))
    assert rel_error(out, ref_out) <= 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel_error(g, r) <= 1e-5
    assert memfuse.stats()["compiles"] == 2          # contiguity is part of the key


def test_a_shape_specialized_program_is_found_again_past_the_front_cache():
    """A trace that guards on sizes (x @ w: x's last dim is w's first) is keyed by its shapes;
    a repeated shape finds its program through the compile key too, not only the front cache."""
    def relu_matmul(x, w):
        return torch.relu(x @ w) * 2
    fused = memfuse.memory_efficient_fusion(relu_matmul)
    w = torch.randn(16, 32)
    for rows in (8, 9, 9, 8):
        fused.exact.clear()
        x = torch.randn(rows, 16)
        torch.testing.assert_close(fused(x, w), relu_matmul(x, w))
    assert memfuse.stats()["compiles"] == 2


def one_dim_pointwise(x, y):
    return (x * y).sin() + torch.atan(x) * y.exp()


def one_dim_reductions(x, w):
    return torch.nn.functional.layer_norm(x, x.shape, w, None) * torch.softmax(x, -1) + x.sum()


@pytest.mark.parametrize("fn", [one_dim_pointwise, one_dim_reductions], ids=["pointwise", "reductions"])
def test_one_dim_inputs(fn):
    """A 1-D [N] tensor is a column vector (COL: its one dim is D): results and gradients match
    eager for every N, but each new N compiles again (D is in the key); a repeated N hits the
    cache. Pointwise ops are fused; reductions over a COL value run through aten, with the
    reason (the kernels reduce FULL [M, D] values)."""
    fused = memfuse.memory_efficient_fusion(fn)
    sizes = [1, 2, 5, 17, 64, 1000]
    for n in sizes + [5, 17]:
        x, y = torch.randn(n, requires_grad=True), torch.randn(n, requires_grad=True)
        out, grads = forward_backward(fused, [x, y], {}, torch.ones(n))
        ref_out, ref_grads = forward_backward(fn, [x, y], {}, torch.ones(n))
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
        for grad, ref in zip(grads, ref_grads):   # (N = 1: layer_norm's gradient is rounding noise x 1/sqrt(eps))
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-4)
    stats = memfuse.stats()
    assert (stats["compiles"], stats["recompiles"], stats["cache_hits"]) == (len(sizes), len(sizes) - 1, 2)
    reasons = {f[2] for entry in fused.cache.values() for f in entry.captured.fallbacks}
    if fn is one_dim_pointwise:
        assert not reasons and stats["extern_calls"] == 0
    else:
        assert reasons == {"reduction over a non-[M, D] tensor or over every dim"}


def embed_and_norm(table, weight, ids, keep):
    """Token ids [B, S] -> rows of `table`, layer-normed, padded positions (keep == 0) zeroed."""
    rows = table[ids]
    normed = torch.nn.functional.layer_norm(rows, rows.shape[-1:], weight)
    return normed * keep.unsqueeze(-1)


# six sequence lengths over three batch sizes, no two sizes equal (equal sizes share a symbol)
BATCH_AND_SEQUENCE = [(2, 5), (3, 6), (4, 7), (2, 9), (3, 11), (4, 13)]


def test_a_new_sequence_length_of_token_ids_is_a_new_symbol_value():
    """Integer inputs [B, S] (token ids, 0/1 masks): S is traced as a size symbol and keyed as a
    leading size, not as D: six sequence lengths and three batch sizes make one program, whose
    outputs and gradients match eager's at each."""
    fused = memfuse.memory_efficient_fusion(embed_and_norm)
    table, weight = torch.randn(50, D, requires_grad=True), torch.randn(D, requires_grad=True)
    for b, s in BATCH_AND_SEQUENCE:
        ids, keep = torch.randint(0, 50, (b, s)), torch.randint(0, 2, (b, s))
        grad_output = torch.randn(b, s, D)
        out, grads = forward_backward(fused, [table, weight], dict(ids=ids, keep=keep), grad_output)
        ref_out, ref_grads = forward_backward(embed_and_norm, [table, weight], dict(ids=ids, keep=keep), grad_output)
        assert rel_error(out, ref_out) <= 1e-5, (b, s)
        for g, r in zip(grads, ref_grads):
            assert rel_error(g, r) <= 1e-5, (b, s)
    stats = memfuse.stats()
    assert (stats["compiles"], stats["recompiles"]) == (1, 0), stats
    entry, = fused.cache.values()
    assert entry.captured.specialized is None


def test_symbolic_token_dims_off_makes_a_sequence_length_a_compile_time_d(caplog, monkeypatch):
    """On by default; MEMFUSE_SYMBOLIC_TOKEN_DIMS=0 (Config.symbolic_token_dims=False) keys an
    integer input's last dim as a D again: a new sequence length is a new program, and says so."""
    monkeypatch.setenv("MEMFUSE_SYMBOLIC_TOKEN_DIMS", "0")
    assert not memfuse.Config().symbolic_token_dims
    fused = memfuse.memory_efficient_fusion(embed_and_norm)
    table, weight = torch.randn(50, D), torch.randn(D)
    with caplog.at_level("INFO", logger="memfuse.recompiles"):
        for b, s in [(2, 5), (3, 7)]:
            fused(table, weight, torch.randint(0, 50, (b, s)), torch.ones(b, s, dtype=torch.bool))
    assert memfuse.stats()["compiles"] == 2
    assert "D (last dim) 5 -> 7" in caplog.text, caplog.text


def test_equal_sizes_of_token_ids_compile_their_own_program_and_say_why(caplog):
    """The rule's minimum: a sequence length equal to the batch size shares its symbol (as equal
    leading sizes do), a program of its own; the recompile log names the argument and its sizes."""
    fused = memfuse.memory_efficient_fusion(embed_and_norm)
    table, weight = torch.randn(50, D), torch.randn(D)
    with caplog.at_level("INFO", logger="memfuse.recompiles"):
        for b, s in [(2, 5), (3, 3), (4, 4), (3, 7)]:
            fused(table, weight, torch.randint(0, 50, (b, s)), torch.ones(b, s, dtype=torch.bool))
    assert memfuse.stats()["compiles"] == 2
    assert "argument 'ids' (position 2): D (last dim) a size symbol" not in caplog.text
    assert "argument 'ids' (position 2): size pattern (-2, -3) -> (-2, -2)" in caplog.text, caplog.text


def test_explain_names_the_dims_that_are_size_symbols():
    """explain() says which dims of which argument a new call may change without a compile."""
    table, weight = torch.randn(50, D), torch.randn(D)
    report = memfuse.explain(embed_and_norm, table, weight, torch.randint(0, 50, (2, 5)), torch.ones(2, 5, dtype=torch.int32))
    assert report.symbolic_sizes == [("table", (0,)), ("ids", (0, 1)), ("keep", (0, 1))], report.symbolic_sizes
    assert "symbols of the program, a new value compiles nothing: table dim 0; ids dims 0, 1; keep dims 0, 1" in str(report)


def test_a_failed_compile_with_symbolic_token_dims_is_compiled_again_with_them_static(monkeypatch):
    """Where the program with integer inputs' last dims as symbols fails to compile (a limit of a
    later stage), the call is compiled again with them static, per shape, and says so; it does not
    run through torch. (The first compile is made to fail here.)"""
    from memfuse.driver.fallback import EagerCall
    from memfuse.fronts import function

    compile_or_decide = function.compile_or_decide

    def failing_with_symbols(source, config):
        if source.symbolic_last:
            return EagerCall(source.name, "a stage failed", "none")
        return compile_or_decide(source, config)

    monkeypatch.setattr(function, "compile_or_decide", failing_with_symbols)
    fused = memfuse.memory_efficient_fusion(embed_and_norm)
    table, weight = torch.randn(50, D), torch.randn(D)
    for b, s in [(2, 5), (2, 5), (3, 6)]:
        ids, keep = torch.randint(0, 50, (b, s)), torch.ones(b, s, dtype=torch.bool)
        torch.testing.assert_close(fused(table, weight, ids, keep), embed_and_norm(table, weight, ids, keep))
    stats = memfuse.stats()
    assert (stats["compiles"], stats["eager_calls"]) == (2, 0), stats    # one per shape
    assert all("compiling them as size symbols failed (a stage failed)" in entry.captured.specialized
               for entry in fused.cache.values())
