"""The loss head through a model's transform of its logits (loss_head.LogitTransform): Gemma's soft
cap `cap * tanh(logits / cap)`, Cohere's `logits * scale`, Granite's `logits / scale`. The op
against eager's ops on the same logits (fp32: exact to rounding; bf16: the transform bit for bit,
the loss and gradients no further from fp64 than eager's), the pattern found through memfuse's two
ways in (the transformed logits returned too), the near-misses left with their reason, and the
HuggingFace heads that carry one. CPU, Triton's interpreter."""
import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import memfuse
from memfuse.patterns.loss_head import op as loss_head
from memfuse.patterns.loss_head.op import LogitTransform
from tests.patterns.loss_head.test_op import GRADIENTS, IGNORE, as_fp32, head_inputs, relative

SOFT_CAP = (("div", 3.0), ("tanh", None), ("mul", 3.0))
TRANSFORMS = {"soft_cap": SOFT_CAP, "scale": (("mul", 0.0625),), "divided": (("div", 4.0),),
              "scaled_tanh": (("mul", 0.5), ("tanh", None))}


def transformed_loss(x, weight, b, target, steps, reduction="mean", smoothing=0.0):
    """Eager: the linear, the transform's ops in the logits' dtype, the loss in fp32."""
    logits = LogitTransform(steps).apply(F.linear(x, weight, b))
    return F.cross_entropy(logits.float(), target, ignore_index=IGNORE, reduction=reduction,
                           label_smoothing=smoothing)


def op_loss(x, weight, b, target, transform: LogitTransform, reduction="mean", smoothing=0.0, with_gradients=False,
            plan="rows", return_logits=False, dtype=torch.float32, chunk=1024):
    loss, _, logits, *_ = torch.ops.memfuse.linear_cross_entropy(
        x, weight, b, target, IGNORE, reduction, smoothing, dtype, return_logits, with_gradients, chunk, True, plan,
        transform.spec)
    return loss, logits


def written_transformed(logits: torch.Tensor, transform: LogitTransform) -> torch.Tensor:
    """The transformed logits the op's row kernel writes over returned logits [rows, vocab] (vocab a
    multiple of 8) as it reads them for their statistics."""
    rows, vocab = logits.shape
    written = logits.clone()
    target = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    statistics = [torch.empty(rows, device=logits.device) for _ in range(2)]
    loss_head.ROW_STATISTICS[False, transform.constexpr, True](rows, written, written.stride(0), 0, target,
                                                                *statistics, vocab, vocab, IGNORE, 0.0)
    return written


# -- the transform itself ---------------------------------------------------------------------------
STEP = st.one_of(st.tuples(st.sampled_from(["mul", "div"]),
                           st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)),
                 st.just(("tanh", None)))


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(STEP, min_size=1, max_size=4),
       rounded_to=st.sampled_from([None, torch.bfloat16, torch.float16]))
def test_a_transform_survives_its_spec_exactly(steps, rounded_to):
    transform = LogitTransform(tuple(steps), rounded_to)
    assert LogitTransform.parse(transform.spec) == transform
    assert len(transform.constexpr) == 1 + 3 * len(steps)


@pytest.mark.parametrize("spec", ["tanh 3.0", "mul", "exp", "mul 2.0 in float64", "mul 2.0,tanh"])
def test_a_bad_spec_names_the_argument(spec):
    with pytest.raises(ValueError, match="memfuse.linear_cross_entropy: transform"):
        LogitTransform.parse(spec)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_the_kernels_transform_is_eagers_bit_for_bit(dtype, name):
    """Each step rounds to the logits' dtype as eager's op on them does (the interpreter's bf16 cast
    truncates: the kernels round the bits themselves there)."""
    transform = LogitTransform(TRANSFORMS[name], None if dtype == torch.float32 else dtype)
    logits = (torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 8).to(dtype)
    written = written_transformed(logits, transform)
    expected = transform.apply(logits)
    if dtype == torch.float32:      # the interpreter's tanh, rounded once from fp64, and torch's tanhf differ by an ulp
        assert (written - expected).abs().max() <= 4e-7 * expected.abs().max()
    else:
        assert torch.equal(written, expected)


# -- the op ----------------------------------------------------------------------------------------
@GRADIENTS
@pytest.mark.parametrize("name", sorted(TRANSFORMS))
@pytest.mark.parametrize("reduction, smoothing, bias", [("mean", 0.0, False), ("sum", 0.1, True)])
def test_op_through_a_transform_matches_eager(with_gradients, plan, name, reduction, smoothing, bias):
    """fp32: loss and gradients (hidden, weight, bias) as eager's, with ignored targets, in chunks of
    6 token rows or the vocabulary-major plan's steps (rounds and the tail)."""
    x, weight, b, target = head_inputs(40, 8, 400, bias=bias)
    x32, w32, b32 = as_fp32(x, weight, b)
    transform = LogitTransform(TRANSFORMS[name])
    chunk = 6 * 400 * 4
    if plan == "vocabulary":
        assert len(loss_head.choose_plan(40, 8, 400, torch.float32, torch.float32, torch.float32, chunk,
                                         plan).vocabulary.steps) > 2
    loss, _ = op_loss(x32, w32, b32, target, transform, reduction, smoothing, with_gradients, plan, chunk=chunk)
    expected = transformed_loss(x, weight, b, target, TRANSFORMS[name], reduction, smoothing)
    assert relative(loss, expected) < 1e-6
    operands = [t for t in (x32, w32, b32) if t is not None]
    ours = torch.autograd.grad(loss, operands)
    theirs = torch.autograd.grad(expected, [t for t in (x, weight, b) if t is not None])
    for mine, truth in zip(ours, theirs):
        assert relative(mine, truth) < 1e-5


def test_a_per_row_loss_through_a_transform_matches_eager():
    x, weight, _, target = head_inputs(40, 16, 37)
    x32, w32 = as_fp32(x, weight)
    loss, _ = op_loss(x32, w32, None, target, LogitTransform(SOFT_CAP), "none")
    expected = transformed_loss(x, weight, None, target, SOFT_CAP, "none")
    upstream = torch.randn(40, dtype=torch.float64)
    assert relative(loss, expected) < 1e-6
    for mine, truth in zip(torch.autograd.grad(loss, (x32, w32), upstream.float()),
                           torch.autograd.grad(expected, (x, weight), upstream)):
        assert relative(mine, truth) < 1e-5


@GRADIENTS
def test_bf16_through_the_soft_cap_no_further_from_fp64_than_eager(with_gradients, plan):
    """bf16 operands, the cap in bf16 (as a HuggingFace model applies it, before the loss's cast):
    the loss as eager's to rounding, the gradients within 3x eager's distance from fp64."""
    x, weight, _, target = head_inputs(64, 32, 50)
    exact = transformed_loss(x, weight, None, target, SOFT_CAP)
    exact_grads = torch.autograd.grad(exact, (x, weight))
    xb, wb = (t.detach().bfloat16().requires_grad_() for t in (x, weight))
    eager = transformed_loss(xb, wb, None, target, SOFT_CAP)
    eager_grads = torch.autograd.grad(eager, (xb, wb))
    ours, _ = op_loss(xb, wb, None, target, LogitTransform(SOFT_CAP, torch.bfloat16), with_gradients=with_gradients,
                      plan=plan, dtype=torch.bfloat16)
    our_grads = torch.autograd.grad(ours, (xb, wb))
    assert abs(ours.double() - exact) <= 3 * abs(eager.double() - exact) + 1e-6
    for mine, theirs, truth in zip(our_grads, eager_grads, exact_grads):
        assert relative(mine, truth) <= 3 * relative(theirs, truth) + 1e-6


@pytest.mark.parametrize("with_gradients", [False, True], ids=["backward_recomputes", "forward_forms"])
def test_returned_logits_are_the_transformed_ones_and_take_their_gradient_back_through_it(with_gradients):
    x, weight, b, target = head_inputs(30, 8, 21, bias=True)
    x32, w32, b32 = as_fp32(x, weight, b)
    loss, logits = op_loss(x32, w32, b32, target, LogitTransform(SOFT_CAP), with_gradients=with_gradients,
                           return_logits=True)
    reference_logits = LogitTransform(SOFT_CAP).apply(F.linear(x, weight, b))
    reference = F.cross_entropy(reference_logits, target, ignore_index=IGNORE)
    assert relative(logits, reference_logits) < 1e-6
    upstream = torch.randn(30, 21, dtype=torch.float64)
    (loss + (logits * upstream.float()).sum()).backward()
    (reference + (reference_logits * upstream).sum()).backward()
    for ours, theirs in zip((x32, w32, b32), (x, weight, b)):
        assert relative(ours.grad, theirs.grad) < 1e-5


# -- found in traced code ----------------------------------------------------------------------------
def soft_capped_head(x, weight, target):
    logits = F.linear(x, weight)
    logits = logits / 3.0
    logits = torch.tanh(logits)
    logits = logits * 3.0
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target, ignore_index=IGNORE)


def soft_capped_head_returning_logits(x, weight, target):
    logits = 3.0 * (F.linear(x, weight) / 3.0).tanh()
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), target, ignore_index=IGNORE), logits


def fp32_scaled_head(x, weight, target):
    return F.cross_entropy(F.linear(x, weight).float().view(-1, weight.shape[0]) * 0.5, target, ignore_index=IGNORE)


WRAPS = {"memory_efficient_fusion": memfuse.memory_efficient_fusion,
         "backend": lambda fn: torch.compile(fn, backend="memfuse")}


@pytest.mark.parametrize("compile_with", sorted(WRAPS))
@pytest.mark.parametrize("fn, dtype", [(soft_capped_head, torch.bfloat16), (soft_capped_head_returning_logits,
                                                                            torch.bfloat16),
                                       (fp32_scaled_head, torch.bfloat16), (soft_capped_head, torch.float32)],
                         ids=["soft_cap", "soft_cap_returned", "fp32_scale", "soft_cap_fp32"])
def test_a_transformed_head_is_found_and_matches_eager(compile_with, fn, dtype):
    """The loss and gradients as eager's (bf16: within its rounding), the returned logits the
    transformed ones, their gradient back through the transform; explain() names the transform."""
    torch._dynamo.reset()
    x, weight, _, target = head_inputs(40, 16, 37, dtype=dtype)
    x = x.detach().view(2, 20, 16).requires_grad_()
    out = WRAPS[compile_with](fn)(x, weight, target)
    expected = fn(x, weight, target)
    out, expected = (out, expected) if isinstance(out, tuple) else ((out,), (expected,))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert relative(out[0], expected[0]) < tolerance / 10
    upstream = [torch.ones(())] + [torch.randn(t.shape, dtype=t.dtype) for t in expected[1:]]
    ours = torch.autograd.grad(out, (x, weight), upstream)
    theirs = torch.autograd.grad(expected, (x, weight), upstream)
    for mine, truth in zip(ours, theirs):
        assert relative(mine, truth) < tolerance
    if len(out) > 1:
        assert torch.equal(out[1], expected[1]) if dtype != torch.float32 else relative(out[1], expected[1]) < 1e-6
    assert memfuse.stats()["loss_heads_chunked"] == 1
    if compile_with == "memory_efficient_fusion":
        report = str(memfuse.explain(memfuse.memory_efficient_fusion(fn), x, weight, target))
        assert "cross-entropy of the logits through " in report
        assert ("/ 3.0 then tanh then * 3.0" if fn is not fp32_scaled_head else "* 0.5 (in float32)") in report


def soft_capped_z_loss(x, weight, target):
    logits = 3.0 * torch.tanh(F.linear(x, weight) / 3.0)
    return F.cross_entropy(logits, target, ignore_index=IGNORE) + 0.1 * logits.logsumexp(-1).square().mean()


def soft_capped_row_losses_and_z_loss(x, weight, target):
    logits = 3.0 * torch.tanh(F.linear(x, weight) / 3.0)
    row_losses = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
    return (row_losses * torch.linspace(0.5, 1.5, row_losses.shape[0])).sum() + 0.1 * logits.square().mean()


@pytest.mark.parametrize("fn", [soft_capped_z_loss, soft_capped_row_losses_and_z_loss],
                         ids=["formed_gradients", "recomputing_backward"])
def test_transformed_logits_also_read_in_the_graph_take_their_gradient_back_through_it(fn):
    """A z-loss on the capped logits (the backend: the op returns them capped, and their gradient
    goes back through the cap: in the forward-formed head's backward a chunk of 8 rows at a time,
    in the recomputing backward inside its kernel)."""
    torch._dynamo.reset()
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    loss = torch.compile(fn, backend="memfuse", options={"loss_head_chunk_bytes": 8 * 40 * 4})(x, weight, target)
    expected = fn(x, weight, target)
    assert relative(loss, expected) < 1e-6
    for mine, truth in zip(torch.autograd.grad(loss, (x, weight)), torch.autograd.grad(expected, (x, weight))):
        assert relative(mine, truth) < 1e-5
    assert memfuse.stats()["loss_heads_chunked"] == 1


def tensor_scaled_head(x, weight, target):
    return F.cross_entropy(F.linear(x, weight) * weight.new_tensor(0.5), target, ignore_index=IGNORE)


def dtype_changing_head(x, weight, target):
    logits = torch.tanh(F.linear(x, weight) / 3.0).float() * 3.0
    return F.cross_entropy(logits, target, ignore_index=IGNORE)


def raw_and_transformed_head(x, weight, target):
    logits = F.linear(x, weight)
    return F.cross_entropy(torch.tanh(logits), target, ignore_index=IGNORE) + logits.mean()


def fp32_capped_z_loss(x, weight, target):
    logits = torch.tanh(F.linear(x, weight).float() / 3.0) * 3.0
    return F.cross_entropy(logits, target, ignore_index=IGNORE) + 1e-4 * logits.square().mean()


@pytest.mark.parametrize("fn, reason", [
    (fp32_capped_z_loss, "are also read or returned, in float32, not their dtype"),
    (tensor_scaled_head, "its input is not a linear layer's output"),
    (dtype_changing_head, "the logits' transform changes dtype between its steps"),
    (raw_and_transformed_head, "the linear's output is also read besides its transform"),
])
def test_a_near_miss_is_left_with_its_reason_and_matches_eager(fn, reason, caplog):
    torch._dynamo.reset()
    dtype = torch.bfloat16 if fn in (dtype_changing_head, fp32_capped_z_loss) else torch.float32   # half logits
    x, weight, _, target = head_inputs(40, 16, 37, dtype=dtype)
    with caplog.at_level(logging.INFO, logger="memfuse.fallbacks"):
        loss = torch.compile(fn, backend="memfuse")(x, weight, target)
    assert relative(loss, fn(x, weight, target)) < (1e-5 if dtype == torch.float32 else 1e-3)
    assert memfuse.stats()["loss_heads_chunked"] == 0
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


# -- HuggingFace heads with a transform ---------------------------------------------------------------
def _huggingface(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, max_position_embeddings=64)
    if family == "gemma2":
        config = transformers.Gemma2Config(**common, head_dim=16, final_logit_softcapping=5.0,
                                           attn_logit_softcapping=None)
        return transformers.Gemma2ForCausalLM(config), "/ 5.0 then tanh then * 5.0"
    if family == "cohere":
        return transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.25)), "* 0.25"
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=4.0)), "/ 4.0"


@pytest.mark.parametrize("compile_with", ["backend", "memory_efficient_fusion"])
@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_huggingface_heads_with_a_transform_are_found_and_match_eager(family, compile_with, caplog):
    """Gemma 2's soft cap, Cohere's scale, Granite's divisor: under torch.compile(backend="memfuse")
    and with the whole model wrapped, the head is found through the transform, the loss and every
    gradient as eager's, and the returned logits are the model's."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, described = _huggingface(family)
    model.config.use_cache = False
    reference, _ = _huggingface(family)
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(1))
    wrapped = torch.compile(model, backend="memfuse") if compile_with == "backend" else \
        memfuse.memory_efficient_fusion(model)
    with caplog.at_level(logging.INFO, logger="memfuse"):
        out = wrapped(input_ids=ids, labels=ids, use_cache=False)
    expected = reference(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    expected.loss.backward()
    assert memfuse.stats()["loss_heads_chunked"] == 1
    assert any(described in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert relative(out.loss, expected.loss) < 1e-6
    assert relative(out.logits, expected.logits) < 1e-6
    largest = max(p.grad.norm() for p in reference.parameters() if p.grad is not None)
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        if theirs.grad is not None:
            error = (ours.grad - theirs.grad).norm() / max(theirs.grad.norm(), 1e-3 * largest)
            assert error < 1e-4, name


# -- no transform: the logits are the linear's own output, whatever the loss casts them to ------------
def head_returning_autocast_logits(x, weight, target):
    logits = F.linear(x, weight)                 # bfloat16 under autocast
    return F.cross_entropy(logits.float().view(-1, weight.shape[0]), target, ignore_index=IGNORE), logits


def test_logits_cast_only_for_the_loss_are_returned_chunked_by_the_wrapper():
    """Under autocast a model's head returns its logits in bf16 and its loss casts them to fp32 (as
    HuggingFace's causal-LM losses do): no transform step, so the op writes the returned logits in
    their own dtype, and memory_efficient_fusion chunks the head as the backend does."""
    x, weight, _, target = head_inputs(40, 16, 37, dtype=torch.float32)
    x = x.detach().view(2, 20, 16).requires_grad_()
    assert LogitTransform().returns_in(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, logits = memfuse.memory_efficient_fusion(head_returning_autocast_logits)(x, weight, target)
        expected_loss, expected_logits = head_returning_autocast_logits(x, weight, target)
    assert memfuse.stats()["loss_heads_chunked"] == 1
    assert logits.dtype == expected_logits.dtype == torch.bfloat16
    assert relative(loss, expected_loss) < 1e-2 and relative(logits, expected_logits) < 1e-2
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):      # the backend chunks it through the same op
        backend_loss, _ = torch.compile(head_returning_autocast_logits, backend="memfuse")(x, weight, target)
    assert memfuse.stats()["loss_heads_chunked"] == 2 and torch.equal(loss, backend_loss)
    upstream = [torch.ones(()), torch.randn(expected_logits.shape, dtype=torch.bfloat16)]
    ours = torch.autograd.grad((loss, logits), (x, weight), upstream)
    theirs = torch.autograd.grad((expected_loss, expected_logits), (x, weight), upstream)
    for mine, truth in zip(ours, theirs):
        assert relative(mine, truth) < 2e-2
