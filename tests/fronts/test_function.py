"""The user-facing wrapper: constants, keyword arguments, output structure, error messages."""
import re

import pytest
import torch

import memfuse


def scale_shift(x, scale, b=None):
    y = x * scale
    return y if b is None else y + b


def inputs(rows=6, d=24):
    return torch.randn(rows, d, requires_grad=True), torch.randn(d, requires_grad=True)


def grads_of(fn, *args):
    """(output(s), grads of the tensor args that require grad) of fn on fresh leaves."""
    leaves = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args]
    out = fn(*leaves)
    outs = (out,) if isinstance(out, torch.Tensor) else out
    sum(o.double().sum() * (i + 1) for i, o in enumerate(outs) if o.requires_grad).backward()
    return out, [t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def assert_same(actual, expected):
    if expected is None:
        assert actual is None
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        assert type(actual) is type(expected) and len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)


def check(fused, fn, *args):
    out, grads = grads_of(fused, *args)
    ref_out, ref_grads = grads_of(fn, *args)
    assert_same(out, ref_out)
    assert_same(grads, ref_grads)


# -- constants ---------------------------------------------------------------------------------
def test_constants_are_part_of_the_key():
    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(scale_shift)
    check(fused, scale_shift, x, 2.0, b)
    check(fused, scale_shift, x, 3.0, b)
    assert memfuse.stats()["compiles"] == 2
    check(fused, scale_shift, x, 2.0, b)
    assert memfuse.stats()["compiles"] == 2 and memfuse.stats()["cache_hits"] == 1
    check(fused, scale_shift, x, 2, b)             # an int is another constant than a float
    assert memfuse.stats()["compiles"] == 3


def test_constants_steer_python_control_flow():
    def fn(x, mode, eps):
        if mode == "square":
            return x * x + eps
        return x.abs() + eps if eps is not None else x.abs()

    x, _ = inputs()
    fused = memfuse.memory_efficient_fusion(fn)
    for mode, eps in [("square", 0.5), ("abs", 0.25), ("abs", None), ("square", 0.5)]:
        check(fused, fn, x, mode, eps)
    assert memfuse.stats()["compiles"] == 3 and memfuse.stats()["cache_hits"] == 1


def test_a_constant_where_a_tensor_was_traced_compiles_again():
    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(scale_shift)
    check(fused, scale_shift, x, torch.full((24,), 2.0, requires_grad=True), b)
    check(fused, scale_shift, x, 2.0, b)
    assert memfuse.stats()["compiles"] == 2


@pytest.mark.compile_fails
def test_the_front_cache_misses_on_every_key_part():
    """A repeated call is found by its call shape's front (api._Front: the exact key read in one
    go); any change the compile key or the exact key tells apart must miss it and run the program
    compiled for it: dtype, requires_grad, layout, nn.Parameter, a constant's type or value, grad
    mode, a tensor where a constant was, a constant where a tensor was, and (found through the
    compile key, no compile) another leading size."""
    x, b = inputs()

    def run(*args, **kwargs):
        out = fused(*args, **kwargs)
        torch.testing.assert_close(out, scale_shift(*args, **kwargs), rtol=1e-5, atol=1e-6)
        assert out.requires_grad == torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))
        return out

    fused = memfuse.memory_efficient_fusion(scale_shift)
    calls = [((x, 2.0, b), {}), ((x, 2.0), {"b": b}), ((x.double(), 2.0, b.double()), {}),
             ((x.detach(), 2.0, b), {}), ((x.t().contiguous().t(), 2.0, b), {}),
             ((x, 2.0, torch.nn.Parameter(b.detach())), {}), ((x, 2, b), {}), ((x, 3.0, b), {}),
             ((x, torch.full((24,), 2.0), b), {}), ((2.0, x, b), {})]
    for args, kwargs in calls:
        run(*args, **kwargs)
    with torch.no_grad():
        fused(x, 2.0, b)
    compiles = memfuse.stats()["compiles"]
    assert compiles == len(calls) - 1 + 1    # b by keyword binds as the first call; no_grad: one more
    for args, kwargs in calls:               # repeats: front hits, or the lookup's for a tensor
        run(*args, **kwargs)                 # where the front of that call shape reads a constant
    run(torch.randn(7, 24, requires_grad=True), 2.0, b)
    assert memfuse.stats()["compiles"] == compiles
    front = fused.fronts[3]
    # 3 positional arguments, tensor-constant-tensor: 7 calls above, no_grad, the other leading size
    assert front.pattern == [True, False, True] and len(front.entries) == 7 + 1 + 1
    with pytest.raises(TypeError, match="only integer tensors"):   # eager's own error for x * [2.0]
        fused(x, [2.0], b)                   # unhashable: the front passes it on to the lookup


@pytest.mark.parametrize("guards_available", [True, False])
def test_the_front_runs_its_last_function_on_a_tensor_guard(monkeypatch, guards_available):
    """A repeated call finds the function its call shape ran last by one C++ check of the tensors
    (api._tensor_guards) with grad mode and the constants; any other call goes by its exact key,
    and where torch has no TensorGuards every call does. Either way each call runs its own
    program: consecutive calls that differ in one key part each get theirs."""
    if not guards_available:
        monkeypatch.setattr(memfuse.fronts.function, "TensorGuards", None)
    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(scale_shift)
    variants = [(x, 2.0, b), (x.double(), 2.0, b.double()), (x.detach(), 2.0, b), (x.t().contiguous().t(), 2.0, b),
                (x, 3.0, b), (x, 3, b), (torch.randn(7, 24, requires_grad=True), 3.0, b)]
    for args in variants + variants[::-1] + variants:
        check(fused, scale_shift, *args)
        out = fused(*args)
        assert out.requires_grad == any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    front = fused.fronts[3]
    guards, grad, constants, apply, rebuild = front.last[0]
    assert (guards is not None) == guards_available
    if guards_available:      # the last call's: grad mode on, scale 3.0, the [7, 24] input
        assert grad is True and constants == (float, 3.0) and rebuild(("out",)) == "out"   # a single tensor
        assert guards.check(variants[-1][0], b) and not guards.check(x, b)
    with torch.no_grad():
        assert not fused(x, 3.0, b).requires_grad


def test_no_tensor_guard_for_functorch_wrappers():
    """A guard made with a functorch wrapper would let later wrappers skip the unwrapping."""
    escaped = []
    torch.func.grad(lambda x: escaped.append(x) or x.sum())(torch.randn(3))
    assert memfuse.fronts.function._tensor_guards([escaped[0]]) is None
    assert memfuse.fronts.function._tensor_guards([torch.randn(3)]) is not None


def test_a_repeated_call_skips_the_python_half_of_autograd_apply(monkeypatch):
    """The front of a repeated call runs the compiled function through the C half of
    autograd.Function.apply (runtime._function_apply); only the first call takes the Python
    half. The autograd graph is the same: gradients as eager's, each output's grad_fn memfuse's,
    whose apply (what the engine calls) is memfuse's backward."""
    python_applies = []
    python_apply = torch.autograd.Function.apply.__func__

    def counted(cls, *args, **kwargs):
        python_applies.append(cls)
        return python_apply(cls, *args, **kwargs)
    monkeypatch.setattr(memfuse.runtime.program._MemfuseFunction, "apply", classmethod(counted))
    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(scale_shift)
    for _ in range(3):
        check(fused, scale_shift, x, 2.0, b)
    grad_fn = fused(x, 2.0, b).grad_fn
    assert len(python_applies) == 1 and type(grad_fn).__name__ == "_MemfuseFunctionBackward"
    # the engine calls the node's apply: memfuse's backward itself, not BackwardCFunction.apply's lookup
    assert type(grad_fn).apply is memfuse.runtime.program._MemfuseFunction.backward


@pytest.mark.parametrize("first_call", [True, False])
def test_functorch_transforms_run_the_function_as_written(caplog, first_call):
    """Under vmap or grad, memfuse's kernels would read the transforms' wrappers: the function runs
    op by op, with a logged reason, on a first call and on a call its front has an entry for; in
    strict mode it is an error. A tensor that escaped a transform (a dead wrapper) runs compiled."""
    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(scale_shift)
    if not first_call:
        fused(x, 2.0, b)
    caplog.set_level("INFO", logger="memfuse.fallbacks")
    grad = torch.func.grad(lambda x: fused(x, 2.0, b).sum())(x)
    assert_same(grad, torch.func.grad(lambda x: scale_shift(x, 2.0, b).sum())(x))
    assert_same(torch.func.vmap(lambda x: fused(x, 2.0, b))(x.detach()), scale_shift(x, 2.0, b))
    assert "functorch transform (vmap, grad, jacrev, ...) is active" in caplog.text
    assert memfuse.stats()["compiles"] == (0 if first_call else 1)
    escaped = []
    torch.func.grad(lambda x: escaped.append(x) or x.sum())(x.detach())
    assert torch._C._functorch.is_functorch_wrapped_tensor(escaped[0])
    for _ in range(2):
        assert_same(fused(escaped[0], 2.0, b), scale_shift(escaped[0], 2.0, b))
    assert memfuse.stats()["compiles"] == 1    # a dead wrapper says it requires grad: the key of x
    strict = memfuse.memory_efficient_fusion(scale_shift, config=memfuse.Config(strict=True))
    strict(x, 2.0, b)
    with pytest.raises(NotImplementedError, match=r"functorch transform .*\(strict mode"):
        torch.func.vmap(lambda x: strict(x, 2.0, b))(x.detach())


def test_autocast_state_is_part_of_the_key(caplog):
    """The trace runs under the caller's autocast and holds its casts: a call with autocast off, or
    with another dtype, runs a program of its own (compiled once, found again), and each matches
    eager under the same state. Calls with autocast on take the slow path; the front serves the rest."""
    def project(x, w):
        return torch.relu(x @ w) * 2.0
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(project)
    caplog.set_level("INFO", logger="memfuse.recompiles")
    states = [torch.bfloat16, None, torch.float16, None, torch.bfloat16, torch.float16, None]
    for dtype in states:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out, grads = grads_of(fused, x, w)
            ref_out, ref_grads = grads_of(project, x, w)
        assert out.dtype == ref_out.dtype == (dtype or torch.float32)
        torch.testing.assert_close(out, ref_out, rtol=1e-2, atol=1e-2)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-2, atol=1e-2)
    assert memfuse.stats()["compiles"] == 3
    assert "autocast bfloat16 -> off" in caplog.text and "autocast bfloat16 -> float16" in caplog.text


# -- keyword arguments -------------------------------------------------------------------------
def test_keyword_and_default_arguments():
    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(scale_shift)
    expected = scale_shift(x, 2.0, b)
    assert_same(fused(x, 2.0, b), expected)
    assert_same(fused(x, scale=2.0, b=b), expected)
    assert_same(fused(b=b, scale=2.0, x=x), expected)
    assert memfuse.stats()["compiles"] == 1 and memfuse.stats()["cache_hits"] == 2
    assert_same(fused(x, 2.0), scale_shift(x, 2.0))   # the default b=None: another program
    assert memfuse.stats()["compiles"] == 2


def test_keyword_only_parameters():
    def fn(x, b, *, scale=1.0, shift=None):
        y = x * scale + b
        return y if shift is None else y - shift

    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(fn)
    assert_same(fused(x, b), fn(x, b))
    assert_same(fused(x, b, scale=3.0), fn(x, b, scale=3.0))
    assert_same(fused(x, b, shift=0.5, scale=2.0), fn(x, b, shift=0.5, scale=2.0))
    check(lambda x, b: fused(x, b, scale=3.0), lambda x, b: fn(x, b, scale=3.0), x, b)


def test_var_positional_arguments():
    def fn(x, *biases):
        for b in biases:
            x = x + b
        return x

    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(fn)
    check(fused, fn, x, b, b * 2)
    check(fused, fn, x, b)
    assert memfuse.stats()["compiles"] == 2


# -- outputs -----------------------------------------------------------------------------------
def test_single_tensor_and_tuple_outputs():
    x, b = inputs()
    single = memfuse.memory_efficient_fusion(lambda x, b: x * b)
    one_tuple = memfuse.memory_efficient_fusion(lambda x, b: (x * b,))
    pair = memfuse.memory_efficient_fusion(lambda x, b: (x * b, torch.sigmoid(x) + b))
    out = single(x, b)
    assert isinstance(out, torch.Tensor)
    out = one_tuple(x, b)
    assert isinstance(out, tuple) and len(out) == 1
    out = pair(x, b)
    assert isinstance(out, tuple) and len(out) == 2
    check(pair, lambda x, b: (x * b, torch.sigmoid(x) + b), x, b)   # both outputs' grads flow


def test_non_differentiable_output_next_to_a_differentiable_one():
    def fn(x, b):
        return x + b, (x + b) > 0

    x, b = inputs()
    y, positive = memfuse.memory_efficient_fusion(fn)(x, b)
    assert y.requires_grad and not positive.requires_grad and positive.dtype == torch.bool
    assert torch.equal(positive, (x + b) > 0)
    y.backward(torch.ones_like(y))
    assert torch.equal(x.grad, torch.ones_like(x))
    torch.testing.assert_close(b.grad, torch.full_like(b, x.shape[0]))


def test_inputs_that_need_no_grad_get_none():
    x, b = inputs()
    x = x.detach()
    fused = memfuse.memory_efficient_fusion(lambda x, b: torch.tanh(x * b))
    fused(x, b).sum().backward()
    assert x.grad is None
    torch.testing.assert_close(b.grad, ((1 - torch.tanh(x * b) ** 2) * x).sum(0).detach(), rtol=1e-5, atol=1e-5)


# -- small graphs whose reduction stands alone in its kernel -------------------------------------
@pytest.mark.parametrize("fn", [
    lambda x, b: x + b,                                  # d/db: a column sum of the tangent alone
    lambda x, b: x - x.mean(0) + b,                      # a column mean in the forward
    lambda x, b: x.sum(-1, keepdim=True),                # a row sum alone (b gets no grad)
    lambda x, b: torch.softmax(x * b, -1),
], ids=["bias_add", "column_mean", "row_sum", "softmax"])
# the interpreter evaluates masked-off lanes too (softmax: -inf - -inf there); nothing is stored
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_small_functions_match_eager(fn):
    x, b = inputs(rows=9, d=20)
    check(memfuse.memory_efficient_fusion(fn), fn, x, b)


def test_extern_op_runs_through_aten():
    def fn(x, w, b):
        return torch.sigmoid(torch.mm(x, w)) * b

    x, w, b = torch.randn(6, 8, requires_grad=True), torch.randn(8, 20, requires_grad=True), \
        torch.randn(20, requires_grad=True)
    check(memfuse.memory_efficient_fusion(fn), fn, x, w, b)
    assert memfuse.stats()["extern_calls"] > 0


# -- errors --------------------------------------------------------------------------------------
@pytest.mark.compile_fails
@pytest.mark.parametrize("bad", [[1.0, 2.0], {"scale": 2.0}, (1.0, 2.0)], ids=["list", "dict", "tuple"])
def test_a_container_the_function_cannot_use_raises_eagers_error(bad):
    """A container argument is a pytree of constants; `x * [1.0, 2.0]` fails in the trace as in
    eager: the call runs the original, and its error reaches the caller."""
    x, b = inputs()
    fused = memfuse.memory_efficient_fusion(scale_shift)
    with pytest.raises(TypeError) as eager:
        scale_shift(x, bad, b)
    for call in (lambda: fused(x, bad, b), lambda: fused(x, b=b, scale=bad)):
        with pytest.raises(TypeError, match=re.escape(str(eager.value))):
            call()
    assert memfuse.stats()["compiles"] == 0


def test_other_errors_name_the_problem():
    with pytest.raises(TypeError, match="must be callable"):
        memfuse.memory_efficient_fusion(3)
    fused = memfuse.memory_efficient_fusion(scale_shift)
    with pytest.raises(TypeError, match="no tensor arguments"):
        fused(1.0, 2.0)
    with pytest.raises(TypeError, match="scale_shift"):
        fused(torch.randn(3, 4), 1.0, 2.0, 3.0)             # too many arguments
    with pytest.raises(TypeError, match=r"\*\*kw arguments are not supported"):
        memfuse.memory_efficient_fusion(lambda x, **kw: x * 2)(torch.randn(3, 4), a=1)


def test_libraries_see_a_compile_while_memfuse_traces():
    """HuggingFace's mask code skips its data-dependent `mask.all()` checks when
    `torch.compiler.is_compiling()`: memfuse's trace must say so, as torch.compile's and export's do."""
    def masked_scale(x, mask):
        if not torch.compiler.is_compiling() and bool(mask.all()):   # a branch no trace can follow
            return x * 2.0
        return torch.where(mask, x * 2.0, x)

    fused = memfuse.memory_efficient_fusion(masked_scale)
    x = torch.randn(4, 8, requires_grad=True)
    mask = torch.ones(4, 8, dtype=torch.bool)
    memfuse.reset_stats()
    out = fused(x, mask)
    out.sum().backward()
    assert memfuse.stats()["eager_calls"] == 0 and memfuse.stats()["compiles"] == 1
    assert torch.equal(out, x * 2.0) and torch.equal(x.grad, torch.full_like(x, 2.0))
    assert not torch.compiler.is_compiling()
