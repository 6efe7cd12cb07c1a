"""memfuse.patterns.range_indexes: `x[..., [k]]` traced as the slice it reads, against eager."""
import pytest
import torch

from memfuse.patterns.range_indexes import as_slices

from tests.compare import assert_same, run_both
from tests.helpers import compiled


def split_fused_heads(qkv):
    """Falcon's split of its fused projection: [batch, seq, kv heads, queries per kv + 2, head dim],
    the key and value heads picked by list indexes, broadcast over the queries."""
    b, t, _ = qkv.shape
    heads = qkv.view(b, t, 2, 4, 8)
    query, key, value = heads[:, :, :, :-2], heads[:, :, :, [-2]], heads[:, :, :, [-1]]
    key, value = torch.broadcast_to(key, query.shape), torch.broadcast_to(value, query.shape)
    return ((query * key).sin() + value,)


def test_a_list_index_of_one_int_is_read_as_a_slice_both_ways():
    """No aten gather forward and no index_put backward: the key and value heads are slices the
    kernels read in place, and their gradients windowed writes; outputs and gradients as eager's."""
    args = [torch.randn(3, 5, 64, requires_grad=True)]
    both = run_both(split_fused_heads, args)
    assert_same(both.fused, both.eager)
    assert_same(both.fused_grads, both.eager_grads, what="gradient")
    facts = compiled(split_fused_heads, *args)
    externs = facts.externs["forward"] + facts.externs["backward"]
    assert not [t for t in externs if "index" in t], facts.report


@pytest.mark.parametrize("index, expected", [
    ((slice(None), [-2]), (slice(None), slice(4, 5, 1))),
    ((Ellipsis, [0, 2, 4]), (Ellipsis, slice(0, 5, 2))),
    ((None, slice(None), [1, 2]), (None, slice(None), slice(1, 3, 1))),
    ((slice(None), [2, 1]), None),                   # not rising: a reorder
    ((slice(None), [1, 1]), None),                   # a repeat
    ((slice(None), [6]), None),                      # out of range: aten's error, as written
    ((0, [1]), None),                                # an int with the list moves dims: as written
    ((slice(None), [True]), None),                   # a bool mask
    ((slice(None), [1], [2]), None),                 # two lists index together
])
def test_only_a_rising_progression_of_ints_in_a_static_dim_is_a_slice(index, expected):
    """as_slices rewrites only what reads the same elements into the same place."""
    x = torch.randn(3, 6, 7)
    assert as_slices(x, index) == expected
    if expected is not None:
        assert torch.equal(x[expected], x[index])
