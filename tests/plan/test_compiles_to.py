"""What small training blocks compile to, as tinygrad's check_schedule asserts a schedule: kernels per
program, extern calls, and the bytes the forward keeps for the backward, read from memfuse's own
records (helpers.assert_compiles, through memfuse.explain). The expectations follow from what each
block needs, not from a run:

- a row-wise block (pointwise ops and reductions along D) is one kernel over the rows in each
  direction: the backward's reductions over M (weight and bias gradients) finish inside its kernel;
- the backward needs the inputs, which live anyway, and at most per-row statistics (a [M] fp32 value
  or two): every [M, D] intermediate is recomputed from the inputs inside the backward's kernel;
- a random mask is redrawn from its seed in the backward, never saved;
- a matmul is an extern call (one in the forward; grad input and grad weight are two in the backward),
  and its [M, N] output is the one value worth keeping: recomputing it would repeat the matmul.
"""
import pytest
import torch
import torch.nn.functional as F

from helpers import BLOCKS, assert_compiles, block_inputs, compiled

B, T, D, N = 3, 5, 40, 24          # M = 15 rows, D and N not powers of two
M = B * T
FP32 = 4
ROW_STATISTICS = 2 * M * FP32      # e.g. LayerNorm's mean and rstd, one fp32 per row each


def inputs(*shapes, requires_grad=True):
    torch.manual_seed(0)
    return [torch.randn(*shape, requires_grad=requires_grad) for shape in shapes]


def layer_norm_block(x, residual, weight, bias):
    return F.layer_norm(x + residual, (D,), weight, bias)


def dropout_block(x, residual, bias):
    return F.dropout(x + bias, p=0.25, training=True) * residual


def softmax_block(x):
    return torch.softmax(x, dim=-1)


def gelu_mlp(x, weight):
    return F.gelu(x @ weight.t())


def full_size(row) -> bool:
    """A saved value with a D (or N) column per row: an activation, not a statistic."""
    return len(row.shape) >= 2 and row.shape[-1] > 1


def test_a_layer_norm_block_is_one_kernel_each_way_and_keeps_at_most_its_row_statistics():
    args = inputs((B, T, D), (B, T, D), (D,), (D,))
    facts = assert_compiles(layer_norm_block, *args, forward_kernels=1, backward_kernels=1, forward_externs=0,
                            backward_externs=0, aten_groups=0, max_saved_bytes=ROW_STATISTICS)
    assert not [s.name for s in facts.saved_computed if full_size(s)], facts.report
    input_bytes = sum(a.numel() * a.element_size() for a in args)
    assert sum(s.bytes for s in facts.saved) <= input_bytes + ROW_STATISTICS, facts.report
    assert facts.fallbacks == ()


def test_a_dropout_block_saves_no_mask_and_regenerates_it_from_the_seed():
    facts = assert_compiles(dropout_block, *inputs((B, T, D), (B, T, D), (D,)), forward_kernels=1,
                            backward_kernels=1, forward_externs=0, backward_externs=0, aten_groups=0)
    assert facts.regenerated, f"no value is redrawn from the seed:\n{facts.report}"
    assert not [s.name for s in facts.saved_computed if full_size(s) or s.dtype == torch.bool], facts.report
    assert facts.saved_bytes < M * D, "the plan keeps as many bytes as a boolean mask"


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_the_seed_blocks_with_dropout_are_one_kernel_each_way_and_keep_no_mask(name):
    """Bias, dropout, residual add and a norm: row-wise, so the rules above hold with the mask in the middle."""
    tensors, consts, _ = block_inputs(name, (B, T, D), dropout_prob=0.1)
    facts = assert_compiles(BLOCKS[name].fn, *tensors, **consts, forward_kernels=1, backward_kernels=1,
                            forward_externs=0, backward_externs=0, aten_groups=0, max_saved_bytes=ROW_STATISTICS)
    assert facts.regenerated, f"no value is redrawn from the seed:\n{facts.report}"
    assert not [s.name for s in facts.saved_computed if full_size(s)], facts.report


def test_softmax_recomputes_its_output_in_the_backward_instead_of_saving_it():
    facts = assert_compiles(softmax_block, *inputs((B, T, D)), forward_kernels=1, backward_kernels=1,
                            max_saved_bytes=ROW_STATISTICS)
    assert not [s.name for s in facts.saved_computed if full_size(s)], facts.report


def test_a_matmul_is_an_extern_each_way_and_its_output_the_one_value_kept():
    facts = assert_compiles(gelu_mlp, *inputs((B, T, D), (N, D)), forward_kernels=1, backward_kernels=1,
                            forward_externs=1, backward_externs=2, max_saved_bytes=M * N * FP32)
    kept = [s for s in facts.saved_computed if full_size(s)]
    assert len(kept) == 1 and kept[0].bytes == M * N * FP32, facts.report


@pytest.mark.parametrize("block, shapes", [(layer_norm_block, [(B, T, D), (B, T, D), (D,), (D,)]),
                                           (softmax_block, [(B, T, D)])], ids=["layer_norm", "softmax"])
def test_without_gradients_there_is_no_backward_and_nothing_is_saved(block, shapes):
    facts = compiled(block, *inputs(*shapes, requires_grad=False))
    assert (facts.forward_kernels, facts.backward_kernels) == (1, 0), facts.report
    assert facts.saved == () and facts.saved_bytes == 0, facts.report
