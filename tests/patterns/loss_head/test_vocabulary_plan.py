"""The loss head's vocabulary-major plan (memfuse.patterns.loss_head.op): its steps never write the weight
gradient over logits not yet read, the op by it against eager, where its logits live, and which
plan "auto" picks and says it picked."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import memfuse
from memfuse.patterns.loss_head import op as loss_head
from memfuse.base.config import Config, config_with_options

IGNORE = -100
ITEMSIZES = {1: torch.int8, 2: torch.bfloat16, 4: torch.float32}


def relative(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# -- the steps -------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None, derandomize=True)
@given(tokens=st.integers(1, 3000), hidden=st.integers(1, 600), vocab=st.integers(1, 5000),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), fp32_weight=st.booleans(),
       transient_rows=st.integers(1, 300))
def test_every_write_lands_on_logits_read_already(tokens, hidden, vocab, dtype, fp32_weight, transient_rows):
    """For any sizes: the steps cover the vocabulary once, in order; a stored step's logits lie in
    the storage of the weight gradient's rows not yet written; each write of its rows ends where
    the logits it has read by then end at the latest; the transient holds the other steps. None
    exactly where a vocabulary row's logits take no more bytes than its gradient's row."""
    weight_dtype = torch.float32 if fp32_weight else dtype
    padded = -(-tokens // loss_head.ALIGN) * loss_head.ALIGN
    logits_row, gradient_row = padded * dtype.itemsize, hidden * weight_dtype.itemsize
    plan = loss_head.vocabulary_plan(tokens, hidden, vocab, dtype, weight_dtype, transient_rows * logits_row)
    if logits_row <= gradient_row:
        assert plan is None
        return
    if plan is None:
        assert loss_head._step_rows(vocab, logits_row, gradient_row)[0] < max(loss_head.ALIGN, transient_rows)
        return
    assert plan.tokens == padded and plan.steps[0].logits_at is not None
    assert 0 < plan.forward_rows * logits_row <= vocab * gradient_row      # a forward piece fits the storage
    first = 0
    for step in plan.steps:
        assert step.first == first and step.rows > 0 and sum(step.writes) == step.rows
        if step.logits_at is None:
            assert step.rows <= plan.tail_rows
        else:
            assert first * gradient_row <= step.logits_at
            assert step.logits_at + step.rows * logits_row <= vocab * gradient_row
            done = 0
            for rows in step.writes:
                assert (first + done + rows) * gradient_row <= step.logits_at + done * logits_row
                done += rows
        first += step.rows
    assert first == vocab


def test_the_standalone_head_keeps_about_half_its_logits():
    """8192 tokens, H 4096, vocabulary 128256, bf16: the weight gradient's 1 GB holds 62184 rows of
    logits; the rest are formed again in rounds of about half what is left, the last in the
    transient; a write or two more a round as the space read grows."""
    plan = loss_head.vocabulary_plan(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, 32 * 2**20)
    assert plan.kept_rows == 62184
    rounds = [s.rows for s in plan.steps[1:] if s.logits_at is not None]
    assert rounds[0] == 32032 and all(b < a for a, b in zip(rounds, rounds[1:]))
    assert plan.steps[-1].logits_at is None and plan.steps[-1].rows <= plan.tail_rows == 2048
    assert all(len(s.writes) <= 6 for s in plan.steps)


# -- the op ----------------------------------------------------------------------------------------
def vocabulary_op(x, weight, b, target, reduction="mean", smoothing=0.0, dtype=torch.float32, chunk=None):
    """The op by the vocabulary-major plan, checked to run it (not the rows plan)."""
    chunk = chunk or 4 * x.shape[0] * dtype.itemsize
    choice = loss_head.choose_plan(x.shape[0], x.shape[1], weight.shape[0], dtype, weight.dtype, x.dtype, chunk,
                                   "vocabulary")
    assert choice.vocabulary is not None
    loss, *_ = torch.ops.memfuse.linear_cross_entropy(x, weight, b, target, IGNORE, reduction, smoothing, dtype,
                                                      False, True, chunk, True, "vocabulary")
    return loss, choice.vocabulary


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_rounds_and_tail_match_eager(reduction, smoothing, bias):
    """61 tokens (three of padding), H 16, vocabulary 517 and a transient of 4 rows: the kept rows,
    several rounds in the weight gradient's storage and tail steps in the transient, every fifth
    target ignored; fp32 against fp64 eager."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(61, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(517, 16, generator=generator, dtype=torch.float64, requires_grad=True)
    b = torch.randn(517, generator=generator, dtype=torch.float64, requires_grad=True) if bias else None
    target = torch.randint(0, 517, (61,), generator=generator)
    target[::5] = IGNORE
    ours = [None if t is None else t.detach().float().requires_grad_() for t in (x, weight, b)]
    loss, plan = vocabulary_op(*ours, target, reduction, smoothing)
    assert any(s.logits_at is not None for s in plan.steps[1:]) and plan.steps[-1].logits_at is None
    reference = F.cross_entropy(F.linear(x, weight, b), target, ignore_index=IGNORE, reduction=reduction,
                                label_smoothing=smoothing)
    assert relative(loss, reference) < 1e-6
    (loss * 3.0).backward()
    (reference * 3.0).backward()
    for mine, theirs in zip(ours, (x, weight, b)):
        if theirs is not None:
            assert relative(mine.grad, theirs.grad) < 1e-5


def test_autocast_fp32_weight_holds_twice_the_rows_and_matches_eager():
    """fp32 hidden states and weight under a bf16 head (autocast's master weights): the weight
    gradient's fp32 storage holds bf16 logits of twice as many rows as bf16 storage would; its
    gradient in fp32, the hidden states' in fp32 through the backward's scale, no further from
    fp64 than eager's bf16 head (a margin of 3x, as the rows plan's test)."""
    torch.manual_seed(0)
    x = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(301, 16, requires_grad=True)
    target = torch.randint(0, 301, (64,))
    bf16_weight = loss_head.vocabulary_plan(64, 16, 301, torch.bfloat16, torch.bfloat16, 256)
    loss, plan = vocabulary_op(x, weight, None, target, dtype=torch.bfloat16, chunk=256)
    assert plan.kept_rows >= 2 * bf16_weight.kept_rows - 2 * loss_head.ALIGN
    ours = torch.autograd.grad(loss * 2.0, (x, weight))
    assert [g.dtype for g in ours] == [torch.float32, torch.float32]
    logits = F.linear(x.detach().bfloat16(), weight.detach().bfloat16()).float().requires_grad_()
    (F.cross_entropy(logits, target) * 2.0).backward()
    eager = [(logits.grad.bfloat16() @ weight.detach().bfloat16()).float(),
             (logits.grad.bfloat16().t() @ x.detach().bfloat16()).float()]
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, weight))
    exact = torch.autograd.grad(F.cross_entropy(F.linear(x64, w64), target) * 2.0, (x64, w64))
    for mine, theirs, truth in zip(ours, eager, exact):
        assert relative(mine, truth) <= 3 * relative(theirs, truth) + 1e-6


def test_the_logits_live_in_the_weight_gradient_and_one_small_transient(monkeypatch):
    """The forward's logits, the rows not kept (first, in pieces) and the kept ones, and every stored
    step's are views of the returned weight gradient's storage; the backward's tail steps' of one
    transient buffer of the plan's tail rows: the head allocates no [tokens, vocab] logits."""
    homes = []
    form = loss_head._vocabulary_logits

    def recording(weight, bias, hidden_t, first, rows, out):
        homes.append((first, out.untyped_storage().data_ptr(), out.untyped_storage().nbytes()))
        form(weight, bias, hidden_t, first, rows, out)

    monkeypatch.setattr(loss_head, "_vocabulary_logits", recording)
    torch.manual_seed(0)
    x = torch.randn(40, 8, requires_grad=True)
    weight = torch.randn(400, 8, requires_grad=True)
    target = torch.randint(0, 400, (40,))
    chunk = 6 * 40 * 4
    plan = loss_head.choose_plan(40, 8, 400, torch.float32, torch.float32, torch.float32, chunk, "vocabulary").vocabulary
    *_, weight_gradient, _ = torch.ops.memfuse.linear_cross_entropy(x, weight, None, target, IGNORE, "mean", 0.0,
                                                                    torch.float32, False, True, chunk, True,
                                                                    "vocabulary")
    forward = [*range(plan.kept_rows, 400, plan.forward_rows), plan.steps[0].first]    # the rows not kept first
    assert [first for first, _, _ in homes] == forward + [s.first for s in plan.steps[1:]]
    gradient_storage = weight_gradient.untyped_storage().data_ptr()
    assert {pointer for _, pointer, _ in homes[:len(forward)]} == {gradient_storage}
    backward = homes[len(forward):]
    for step, (_, pointer, nbytes) in zip(plan.steps[1:], backward):
        if step.logits_at is not None:
            assert pointer == gradient_storage
        else:
            assert pointer != gradient_storage and nbytes == plan.tail_rows * plan.tokens * 4
    assert any(s.logits_at is not None for s in plan.steps[1:]) and plan.steps[-1].logits_at is None


# -- which plan ------------------------------------------------------------------------------------
def test_auto_weighs_the_adds_into_the_weight_gradient_against_forming_logits_again():
    """The standalone head (8192 x 4096 -> 128256, bf16): at the default 256 MiB chunk (1024 rows),
    8 chunks' adds into its 1 GB weight gradient cost less than forming 52% of its logits again
    (measured 1.155x): rows. In Liger's memory (64 MiB, 256-row chunks) 32 chunks' adds cost more
    (measured 0.856x): vocabulary-major. make bench-models' heads (16384 tokens, H 768-1024) keep
    under 7% of their logits: rows. Tokens no more than H: nothing kept, rows."""
    chunk = 256 * 2**20
    standalone = loss_head.choose_plan(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, torch.bfloat16, chunk)
    assert standalone.name == "rows" and "1.1" in standalone.reason
    tight = loss_head.choose_plan(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, torch.bfloat16, chunk // 4)
    assert tight.name == "vocabulary" and "MiB less at the head's peak at 0.8" in tight.reason
    for hidden, vocab in ((1024, 32000), (768, 50257), (768, 30522)):
        choice = loss_head.choose_plan(16384, hidden, vocab, torch.bfloat16, torch.bfloat16, torch.bfloat16, chunk)
        assert choice.name == "rows" and "predicted time" in choice.reason
    narrow = loss_head.choose_plan(2048, 4096, 128256, torch.bfloat16, torch.bfloat16, torch.bfloat16, chunk)
    assert narrow.name == "rows" and "keep no logits" in narrow.reason
    asked = loss_head.choose_plan(8192, 4096, 128256, torch.bfloat16, torch.bfloat16, torch.bfloat16, chunk, "rows")
    assert str(asked) == "rows plan: asked for"
    with pytest.raises(ValueError, match="plan 'columns'"):
        loss_head.choose_plan(8, 4, 10, torch.float32, torch.float32, torch.float32, chunk, "columns")


def test_the_plan_is_a_config_option_checked_by_name():
    assert Config(loss_head_plan="rows").loss_head_plan == "rows"
    assert config_with_options(Config(), {"loss_head_plan": "vocabulary"}).loss_head_plan == "vocabulary"
    with pytest.raises(ValueError, match="loss_head_plan must be one of"):
        Config(loss_head_plan="columns")


def linear_head(x, weight, target):
    return F.cross_entropy(F.linear(x, weight), target)


@pytest.mark.parametrize("compile_with", ["memory_efficient_fusion", "backend"])
@pytest.mark.parametrize("plan", ["vocabulary", "rows"])
def test_a_compiled_head_runs_the_configured_plan_and_explain_says_which(compile_with, plan, monkeypatch):
    """Through memfuse's programs (the op's implementation called past the dispatcher): the plan
    asked for runs, the loss and gradients match eager, and explain() names the plan at the traced
    sizes."""
    ran = []
    vocabulary_major = loss_head._vocabulary_major
    monkeypatch.setattr(loss_head, "_vocabulary_major", lambda *a: ran.append(1) or vocabulary_major(*a))
    torch.manual_seed(0)
    x = torch.randn(48, 8, requires_grad=True)
    weight = torch.randn(97, 8, requires_grad=True)
    target = torch.randint(0, 97, (48,))
    config = Config(loss_head_plan=plan)
    if compile_with == "backend":
        torch._dynamo.reset()
        fused = torch.compile(linear_head, backend="memfuse", options={"loss_head_plan": plan})
    else:
        fused = memfuse.memory_efficient_fusion(linear_head, config=config)
    memfuse.reset_stats()
    loss = fused(x, weight, target)
    grads = torch.autograd.grad(loss, (x, weight))
    assert bool(ran) == (plan == "vocabulary")
    assert memfuse.stats()["loss_head_vocabulary_calls"] == (plan == "vocabulary")
    reference = linear_head(x, weight, target)
    assert relative(loss, reference) < 1e-6
    for ours, theirs in zip(grads, torch.autograd.grad(reference, (x, weight))):
        assert relative(ours, theirs) < 1e-5
    if compile_with == "memory_efficient_fusion":
        report = str(memfuse.explain(fused, x, weight, target))
        unless = ", unless the logits are returned" if plan == "vocabulary" else ""
        assert f"at 48 tokens the {plan} plan: asked for (picked per call{unless})" in report
