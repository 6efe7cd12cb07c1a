"""Every odd call gets the right answer or an error that names the argument: never a wrong one."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import memfuse
from memfuse.driver.fallback import StrictModeError

from compare import assert_matches_eager, assert_same, run_both


def add(x, y):
    return x * 2 + y


def layer_norm(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b)


def grads_of(*tensors, requires=True):
    return [t.detach().clone().requires_grad_(requires) for t in tensors]


# -- arguments --------------------------------------------------------------------------------
@pytest.mark.parametrize("args", [(torch.randn(4, 8),), (torch.randn(4, 8),) * 3], ids=["too_few", "too_many"])
def test_wrong_number_of_arguments_names_the_function(args):
    with pytest.raises(TypeError, match=r"memfuse: add\(x, y\)"):
        memfuse.memory_efficient_fusion(add)(*args)


@pytest.mark.compile_fails
@pytest.mark.parametrize("bad", [[1, 2], {"a": 1}, object()], ids=["list", "dict", "object"])
def test_an_argument_the_function_cannot_take_raises_eagers_error(bad, caplog):
    """A container is a pytree, traced until `x * 2 + [1, 2]` fails as in eager; an object memfuse
    cannot trace runs the original, with the reason naming it. Either way eager's error surfaces."""
    x = torch.randn(4, 8)
    with pytest.raises(TypeError) as eager:
        add(x, bad)
    with pytest.raises(TypeError, match=re.escape(str(eager.value))):
        memfuse.memory_efficient_fusion(add)(x, bad)
    if type(bad) is object:
        assert "argument 'y' (position 1) is a object, which memfuse cannot trace" in caplog.text


def test_numpy_array_is_not_taken_for_a_tensor(caplog):
    x, y = torch.randn(4, 8), torch.randn(4, 8).numpy()
    with pytest.warns(DeprecationWarning):      # numpy's, when eager adds an array to a tensor
        out = memfuse.memory_efficient_fusion(add)(x, y)
    torch.testing.assert_close(out, add(x, torch.from_numpy(y)))
    assert "argument 'y' (position 1) is a ndarray" in caplog.text and memfuse.stats()["eager_calls"] == 1


def test_a_constant_where_a_tensor_was_traced_recompiles():
    fused = memfuse.memory_efficient_fusion(add)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(fused(x, y), add(x, y))
    before = memfuse.stats()["compiles"]
    torch.testing.assert_close(fused(x, 2.5), add(x, 2.5))
    torch.testing.assert_close(fused(x, -1.0), add(x, -1.0))
    assert memfuse.stats()["compiles"] == before + 2, "each new constant is its own program"
    torch.testing.assert_close(fused(x, y), add(x, y))
    assert memfuse.stats()["compiles"] == before + 2


def test_keyword_arguments_and_defaults():
    def scaled(x, y, scale=3.0):
        return x * scale + y
    fused = memfuse.memory_efficient_fusion(scaled)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    torch.testing.assert_close(fused(x, y), scaled(x, y))
    torch.testing.assert_close(fused(x, y=y, scale=0.5), scaled(x, y, 0.5))
    with pytest.raises(TypeError, match=r"memfuse: .*scaled\(x, y, scale=3.0\)"):
        fused(x, z=y)


def test_not_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        memfuse.memory_efficient_fusion(3)


@pytest.mark.compile_fails
@pytest.mark.parametrize("returned", [None, 1.0, object()], ids=["None", "float", "object"])
def test_a_function_returning_no_tensor_runs_as_written(returned, caplog):
    fused = memfuse.memory_efficient_fusion(lambda x: returned)
    assert fused(torch.randn(4, 8)) is returned
    assert "returns no tensor" in caplog.text or "returns a object at output" in caplog.text
    assert "return a tensor, or a pytree" in caplog.text     # the way out
    strict = memfuse.memory_efficient_fusion(lambda x: returned, config=memfuse.Config(strict=True))
    with pytest.raises(StrictModeError, match="runs through torch.*strict mode") as raised:
        strict(torch.randn(4, 8))
    assert isinstance(raised.value.__cause__, TypeError)


@pytest.mark.compile_fails
def test_in_place_input_mutation_runs_the_original_with_the_reason(caplog):
    def mutate(x):
        x.mul_(2)
        return x + 1
    x = torch.randn(4, 8)
    out, expected_x = memfuse.memory_efficient_fusion(mutate)(x.clone()), x.clone()
    torch.testing.assert_close(out, mutate(expected_x))
    assert "modifies one of its input tensors in place" in caplog.text and "not x.mul_(2)" in caplog.text
    with pytest.raises(StrictModeError, match="modifies one of its input tensors in place") as raised:
        memfuse.memory_efficient_fusion(mutate, config=memfuse.Config(strict=True))(x)
    assert "in place" in str(raised.value.__cause__)
    torch.testing.assert_close(x, expected_x / 2, msg="the failed strict compile left x as it was")


@pytest.mark.parametrize("fn", [lambda x: x, lambda x: x.view(-1), lambda x: (x * 2, x[:])],
                         ids=["input", "view", "slice"])
def test_outputs_that_alias_inputs_are_copies(fn):
    x = torch.randn(4, 8, requires_grad=True)
    both = assert_matches_eager(fn, [x], expect_kernels=False)
    for out in both.fused:
        assert out.data_ptr() != x.data_ptr()


# -- devices and dtypes -------------------------------------------------------------------------
def test_mixed_devices_name_the_argument():
    """Eager takes a CPU scalar beside GPU tensors: such a call runs through torch, its decision
    naming the argument (tests/driver/test_first_run.py runs one)."""
    decision = memfuse.memory_efficient_fusion(add).compiled_for(torch.randn(4, 8), torch.randn(4, 8, device="meta"))
    assert "argument 'y' (position 1) is on meta, the other tensor arguments on cpu" in decision.reason


@pytest.mark.gpu
def test_mixed_cuda_and_cpu_name_the_argument():
    decision = memfuse.memory_efficient_fusion(add).compiled_for(torch.randn(4, 8, device="cuda"), torch.randn(4, 8))
    assert "argument 'y' (position 1) is on cpu, the other tensor arguments on cuda" in decision.reason


def test_dtypes_that_change_between_calls_recompile():
    fused = memfuse.memory_efficient_fusion(layer_norm)
    for dtype in (torch.float32, torch.bfloat16, torch.float32, torch.float64):
        x, w, b = (torch.randn(3, 16, dtype=dtype), torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype))
        out = fused(x, w, b)
        assert out.dtype == dtype
        assert_same([out], [layer_norm(x, w, b)], scale=2.0)


PROMOTIONS = [   # (first, second): result dtypes and values exactly as eager's
    (torch.int32, torch.float32), (torch.int64, torch.bfloat16), (torch.bool, torch.bfloat16),
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16), (torch.int32, torch.int64),
    (torch.bool, torch.int32), (torch.uint8, torch.int8),
]


def _sample(dtype, shape, generator):
    if dtype == torch.bool:
        return torch.randn(shape, generator=generator) > 0
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=generator) * 3).to(dtype)
    low = 0 if dtype == torch.uint8 else -5
    return torch.randint(low, 6, shape, generator=generator).to(dtype)


@pytest.mark.parametrize("first,second", PROMOTIONS, ids=lambda d: str(d)[6:])
def test_type_promotion_matches_eager(first, second):
    def mixed(a, b):
        return a + b, a * b, a / (b.abs() + 1), torch.where(a > b, a, b), a > b, torch.maximum(a, b)
    generator = torch.Generator().manual_seed(0)
    a, b = _sample(first, (4, 8), generator), _sample(second, (8,), generator)
    both = run_both(mixed, [a, b])
    assert_same(both.fused, both.eager, reference=None)
    assert both.kernels > 0


def test_scalar_comparisons_round_the_scalar_like_eager():
    x = torch.tensor([[0.1, 0.2, 0.30078125, 1 / 3]], dtype=torch.bfloat16).repeat(4, 2)
    fn = lambda x: (x == 0.1, x > 0.2, x <= 0.3, x != 1 / 3, x == torch.tensor(0.1))  # noqa: E731
    both = run_both(fn, [x])
    for got, want in zip(both.fused, both.eager):
        assert torch.equal(got, want)


def test_zero_dim_tensor_arguments():
    x, s = torch.randn(4, 8, requires_grad=True), torch.tensor(1.5, requires_grad=True)
    assert_matches_eager(lambda x, s: (x * s).tanh() + s, [x, s])
    assert_matches_eager(lambda a, b: a * b + 1, [torch.tensor(2.0, requires_grad=True), torch.tensor(3.0)])


def test_tensor_constants_the_function_closes_over():
    weight, offset = torch.randn(8), torch.tensor(0.5)
    x = torch.randn(4, 8, requires_grad=True)
    both = assert_matches_eager(lambda x: (x * weight + offset).relu() * torch.tensor(2.0), [x])
    assert both.fallbacks == [], "a closed-over tensor is a leaf of the graph, not an aten fallback"


# -- shapes ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(0, 16), (2, 0, 16), (1, 16), (1, 1, 16), (1, 5, 16), (5, 1, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_empty_and_size_one_leading_dims(shape):
    x = torch.randn(*shape, requires_grad=True)
    w, b = torch.randn(16, requires_grad=True), torch.randn(16, requires_grad=True)
    both = assert_matches_eager(layer_norm, [x, w, b], expect_kernels=x.numel() > 0)
    if x.numel() == 0:   # weight and bias gradients over no rows are zeros, as in eager
        assert not both.fused_grads[1].any() and not both.fused_grads[2].any()


def test_rows_of_length_one():
    x = torch.randn(6, 1, requires_grad=True)
    assert_matches_eager(lambda x: (x.sigmoid() * x).sum(-1) + x.mean(-1), [x])


def test_rows_of_length_zero():
    x = torch.randn(6, 0, requires_grad=True)
    both = assert_matches_eager(lambda x: (x * 2).sum(-1), [x], expect_kernels=False)
    assert both.fused[0].shape == (6,) and not both.fused[0].any()


@pytest.mark.parametrize("make", [
    lambda: torch.randn(8, 4).t(),                        # transposed
    lambda: torch.randn(4, 16)[:, ::2],                   # strided columns
    lambda: torch.randn(8, 8)[1:5],                        # offset rows
    lambda: torch.randn(8).expand(4, 8),                  # stride-0 rows
    lambda: torch.randn(2, 4, 8).permute(1, 0, 2),        # permuted leading dims
], ids=["transposed", "strided", "offset", "expanded", "permuted"])
def test_non_contiguous_inputs(make):
    x = make().requires_grad_()
    y = torch.randn(x.shape, requires_grad=True)
    assert not x.is_contiguous() or x.storage_offset() > 0
    assert_matches_eager(lambda x, y: torch.softmax(x * y, -1) + x, [x, y])


def test_expanded_output_gradient():
    """`out.sum().backward()` hands the backward a stride-0 gradient."""
    fused = memfuse.memory_efficient_fusion(layer_norm)
    x, w, b = grads_of(torch.randn(4, 8), torch.randn(8), torch.randn(8))
    fused(x, w, b).sum().backward()
    xe, we, be = grads_of(x, w, b)
    layer_norm(xe, we, be).sum().backward()
    assert_same([x.grad, w.grad, b.grad], [xe.grad, we.grad, be.grad], scale=2.0)


def test_non_differentiable_outputs_next_to_differentiable_ones():
    x = torch.randn(4, 8, requires_grad=True)
    both = assert_matches_eager(lambda x: (x.tanh(), x > 0, x.argmax(-1), (x > 0).sum(-1)), [x])
    assert [o.requires_grad for o in both.fused] == [True, False, False, False]


def test_inputs_that_need_no_gradient_or_are_unused():
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    assert_matches_eager(lambda x, y, z: x * 2 + z, [x, y, torch.randn(4, 8)])


# -- NaN and inf ------------------------------------------------------------------------------------
SPECIAL = torch.tensor([[1.0, float("nan"), -2.0, 3.0],
                        [float("inf"), 1.0, -float("inf"), 0.0],
                        [-float("inf"), -float("inf"), -float("inf"), -float("inf")],
                        [0.5, -0.5, float("nan"), float("inf")]])

NAN_CASES = {
    "maximum": lambda x: torch.maximum(x, x.flip(0).detach() * 0 + 0.25),
    "minimum": lambda x: torch.minimum(x, torch.zeros_like(x)),
    "relu": torch.relu,
    "clamp": lambda x: x.clamp(-1, 1),
    "row_amax": lambda x: x.amax(-1),
    "row_amin": lambda x: x.amin(-1),
    "col_amax": lambda x: x.amax(0),
    "col_amin": lambda x: x.amin(0),
    "row_sum": lambda x: x.sum(-1),
    "col_sum": lambda x: x.sum(0),
    "max_dim": lambda x: x.max(-1),
    "argmax": lambda x: x.argmax(-1),
    "argmin": lambda x: x.argmin(-1),
    "softmax": lambda x: torch.softmax(x, -1),
    "exp_log": lambda x: torch.log(torch.exp(x)),
    "total": lambda x: x.sum(),
    "total_max": lambda x: x.amax(),
    "prod": lambda x: x.prod(-1),
    "nan_to_num": lambda x: torch.nan_to_num(x),
    "isnan_isinf": lambda x: (x.isnan(), x.isinf(), x.isfinite()),
    "sign_round": lambda x: (x.sign(), x.round(), x.floor(), x.trunc()),
}


@pytest.mark.parametrize("name", list(NAN_CASES))
def test_nan_and_inf_propagate_as_in_eager(name):
    both = run_both(NAN_CASES[name], [SPECIAL.clone()])
    assert_same(both.fused, both.eager)
    assert both.kernels > 0


@pytest.mark.parametrize("name", ["row_amax", "col_amax", "max_dim"])
def test_nan_reductions_in_bf16(name):
    both = run_both(NAN_CASES[name], [SPECIAL.to(torch.bfloat16)])
    assert_same(both.fused, both.eager)


# -- more than 2**31 elements: int64 offsets everywhere ---------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("d", [2 ** 14, 2 ** 15], ids=["persistent", "looped"])
def test_more_than_2_31_elements(d):
    rows = 2 ** 31 // d + 3
    x = torch.randn(rows, d, device="cuda", dtype=torch.float16)
    w = torch.randn(d, device="cuda", dtype=torch.float16)
    fused = memfuse.memory_efficient_fusion(lambda x, w: torch.softmax(x.float(), -1).to(x.dtype) * w)
    out = fused(x, w)
    for start in (0, rows // 2, rows - 4):   # spot-check rows past the 2**31-element mark
        want = torch.softmax(x[start:start + 4].float(), -1).half() * w
        torch.testing.assert_close(out[start:start + 4], want, rtol=1e-3, atol=1e-3)
    del out
    total = memfuse.memory_efficient_fusion(lambda x: (x.float() * 2).sum(0))(x)
    torch.testing.assert_close(total, (x.float() * 2).sum(0), rtol=1e-3, atol=1e-1)
