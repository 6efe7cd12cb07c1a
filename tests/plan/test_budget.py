"""Config.memory_budget: a smaller budget never keeps more, results and gradients stay eager's at
every budget, dropout masks are regenerated from the seed (never drawn afresh, unlike PyTorch issue
#190758), the torch.compile option, the explain lines, and clear errors for bad values."""
import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

import memfuse
from helpers import BLOCKS, block_inputs, counters, delta, rel_error
from memfuse.capture import capture
from memfuse.base.debug import human_bytes
from memfuse.plan import MAX_MATMUL_CHAIN, Decision, MemoryBudgetError, matmul_chain, plan, predicted_peak

BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
P = 0.3


def mlp(x, w1, b1, w2, b2):
    return (F.layer_norm(F.gelu(x @ w1 + b1) @ w2 + b2, (w2.shape[1],)),)


def dropout_mlp(x, w1, w2):
    """The dropped input is an output too: the test reads the forward's mask from it."""
    dropped = F.dropout(x, P, training=True)
    return F.gelu(dropped @ w1) @ w2, dropped


def column_scale(x):
    return ((x * x.sum(0)).sigmoid(),)    # the column sum is pinned: a reduction over M


def mlp_inputs():
    return [torch.randn(12, 16), torch.randn(16, 32) / 4, torch.randn(32), torch.randn(32, 8) / 4, torch.randn(8)]


def dropout_inputs():
    """The same values at every call (x > 0: a zero of the dropped input means dropped)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(12, 16, generator=generator).abs() + 0.5, torch.randn(16, 32, generator=generator) / 4,
            torch.randn(32, 8, generator=generator) / 4]


def residual_layers(x, *weights):
    """Three pre-norm MLP layers on a residual stream, as a transformer's."""
    for up, down in zip(weights[::2], weights[1::2]):
        x = x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ up) @ down
    return (x,)


def residual_inputs():
    return [torch.randn(12, 16)] + [torch.randn(*shape) / 4 for _ in range(3) for shape in ((16, 32), (32, 16))]


def wide_residual_inputs(tokens=512):
    """Activations ([tokens, 64] each) outweigh the weights: the step's peak is theirs."""
    return [torch.randn(tokens, 16)] + [torch.randn(*shape) / 4 for _ in range(3) for shape in ((16, 64), (64, 16))]


LAYER_NORM_TENSORS, LAYER_NORM_CONSTS, _ = block_inputs("layer_norm_block", (2, 5, 24))


def layer_norm_block(*tensors):
    return (BLOCKS["layer_norm_block"].fn(*tensors, **LAYER_NORM_CONSTS),)


FUNCTIONS = {"mlp": (mlp, mlp_inputs), "dropout_mlp": (dropout_mlp, dropout_inputs),
             "column_scale": (column_scale, lambda: [torch.randn(10, 24)]),
             "residual_layers": (residual_layers, residual_inputs),
             "layer_norm_block": (layer_norm_block, lambda: LAYER_NORM_TENSORS)}


def leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def captured(name):
    fn, make = FUNCTIONS[name]
    return capture(lambda *t: tuple(fn(*t)), leaves(make()), trace_joint=True)


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_a_smaller_budget_never_keeps_more(name):
    joint = captured(name)
    saved = [plan(joint, b).saved_bytes for b in BUDGETS]
    assert saved == sorted(saved, reverse=True), dict(zip(BUDGETS, saved))


@pytest.mark.parametrize("name", ["mlp", "dropout_mlp", "column_scale"])
def test_half_the_budget_keeps_at_most_half(name):
    """Where matmuls or column sums hold the saved bytes, releasing them reaches the target."""
    joint = captured(name)
    default, half = plan(joint).saved_bytes, plan(joint, 0.5)
    assert default > 0 and half.saved_bytes <= default // 2
    assert half.budget.reached_bytes == half.saved_bytes and half.budget.short_of_target is None
    moved = [n for n, (d, reason) in half.decisions.items() if "memory budget 0.5" in reason]
    assert moved and all(half.decisions[n][0] is Decision.RECOMPUTE for n in moved)


def test_budget_recomputes_a_matmul_in_the_backward():
    the_plan = plan(captured("mlp"), 0.1)
    assert the_plan.saved_bytes == 0
    decision, reason = the_plan.decisions["mm"]
    assert decision is Decision.RECOMPUTE and reason.startswith("recomputed for the memory budget 0.1: ")
    assert reason.endswith("matmul") and the_plan.backward["mm"].op.value == "extern"
    assert the_plan.budget.released == {"mm_1": "matmul", "mm": "matmul"}


def test_a_budget_never_rebuilds_a_layer_from_the_layer_before():
    """Releasing every matmul would keep only the input and rebuild each layer's output from the one
    before (a chain of six matmuls): the budget stops at chains of MAX_MATMUL_CHAIN and says so."""
    joint = captured("residual_layers")
    the_plan = plan(joint, 0.1)
    rebuilt = {n for n, (decision, _) in the_plan.decisions.items() if decision is Decision.RECOMPUTE}
    assert any(joint.joint[n].op.value == "extern" for n in rebuilt)     # matmuls are recomputed,
    assert matmul_chain(joint.joint, rebuilt) <= MAX_MATMUL_CHAIN      # in chains of two at most
    assert the_plan.budget.refused_chain > MAX_MATMUL_CHAIN
    assert "cuts that keep less were refused" in str(the_plan.budget)


def test_budget_one_is_the_default_plan():
    joint = captured("mlp")
    assert plan(joint, 1.0).budget is None
    assert [s.name for s in plan(joint, 1.0).saved] == [s.name for s in plan(joint).saved]


@pytest.mark.parametrize("name", ["mlp", "column_scale", "layer_norm_block"])
@pytest.mark.parametrize("budget", [1.0, 0.5, 0.1])
def test_results_and_gradients_match_eager_at_every_budget(name, budget):
    fn, make = FUNCTIONS[name]
    matches_eager(fn, memfuse.memory_efficient_fusion(fn, memory_budget=budget), make())


def matches_eager(fn, fused, tensors) -> None:
    """`fused` on fresh leaves of `tensors`: output and every gradient within 1e-5 of `fn`'s."""
    eager_in, fused_in = leaves(tensors), leaves(tensors)
    expected = fn(*eager_in)[0]
    actual = fused(*fused_in)[0]
    grad = torch.randn_like(expected)
    expected.backward(grad)
    actual.backward(grad)
    assert rel_error(actual.detach(), expected.detach()) < 1e-5
    for a, e in zip(fused_in, eager_in):
        assert rel_error(a.grad, e.grad) < 1e-5


def dropout_step(budget, seed=7, fn=dropout_mlp, tensors=None, config=None):
    """(gradients, last output) of one seeded `fn` step (backward through ones) at `budget` (None:
    `config`'s): dropout_mlp's last output is its dropped input."""
    fused = memfuse.memory_efficient_fusion(fn, memory_budget=budget, config=config)
    inputs = leaves(tensors or dropout_inputs())
    torch.manual_seed(seed)
    outputs = fused(*inputs)
    outputs[0].backward(torch.ones_like(outputs[0]))
    return [t.grad for t in inputs], outputs[-1].detach()


def test_dropout_gradients_at_budget_0_1_equal_those_at_1_0():
    """The budget recomputes the matmul of the dropped input in the backward: the mask must be
    the forward's, regenerated from the seed, not a fresh draw."""
    fused = memfuse.memory_efficient_fusion(dropout_mlp, memory_budget=0.1)
    entry = fused.compiled_for(*leaves(dropout_inputs()))
    assert entry.plan.decisions["mm"][0] is Decision.RECOMPUTE
    reference, dropped_reference = dropout_step(1.0)
    grads, dropped = dropout_step(0.1)
    assert torch.equal(dropped, dropped_reference)
    for g, r in zip(grads, reference):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def dropout_residual_layers(x, *weights):
    """residual_layers with each layer's hidden activations dropped: the masks cross the budget's
    recomputed matmuls and its offloaded values."""
    for up, down in zip(weights[::2], weights[1::2]):
        x = x + F.dropout(F.gelu(F.layer_norm(x, x.shape[-1:]) @ up), P, training=True) @ down
    return (x,)


def test_dropout_is_bitwise_the_same_at_a_byte_target_and_with_every_saved_value_offloaded():
    """Issue 52: dropout exact at every budget. The same seed gives bitwise the same output and
    gradients at budget 1.0, at a byte target that recomputes and with every saved value offloaded:
    the masks are regenerated from the seed, never drawn again."""
    tensors = wide_residual_inputs(tokens=256)
    default = memfuse.memory_efficient_fusion(dropout_residual_layers).compiled_for(*leaves(tensors))
    target = predicted_peak(default.plan, default.captured.hints) - 64 * 1024
    configs = {"bytes": memfuse.Config(memory_budget=target),
               "offload": memfuse.Config(offload_saved="all", offload_min_bytes=0)}
    plans = {name: memfuse.memory_efficient_fusion(dropout_residual_layers, config=config)
             .compiled_for(*leaves(tensors)).plan for name, config in configs.items()}
    assert any(m.choice == "recompute" for m in plans["bytes"].budget.moves) and plans["offload"].offloaded
    reference_grads, reference = dropout_step(1.0, fn=dropout_residual_layers, tensors=tensors)
    assert not torch.equal(dropout_step(1.0, seed=8, fn=dropout_residual_layers, tensors=tensors)[1], reference)
    for name, config in configs.items():
        grads, out = dropout_step(None, fn=dropout_residual_layers, tensors=tensors, config=config)
        assert torch.equal(out, reference), name
        assert all(torch.equal(g, r) for g, r in zip(grads, reference_grads)), name


def test_dropout_backward_mask_is_the_forwards_at_every_budget():
    """x.grad is zero exactly where the forward dropped x, and equals eager's on the forward's mask."""
    for budget in (1.0, 0.5, 0.1):
        grads, dropped = dropout_step(budget)
        kept = dropped != 0
        assert 0 < kept.float().mean() < 1
        assert torch.equal(grads[0] != 0, kept)
        x, w1, w2 = leaves(dropout_inputs())
        out = F.gelu((x * kept / (1 - P)) @ w1) @ w2
        out.backward(torch.ones_like(out))
        for g, e in zip(grads, (x.grad, w1.grad, w2.grad)):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_backend_option_sets_the_budget():
    torch._dynamo.reset()
    tensors = mlp_inputs()
    compiled = torch.compile(mlp, backend="memfuse", options={"memory_budget": 0.3})
    with memfuse.fronts.backend.watch() as records:
        fused_in, eager_in = leaves(tensors), leaves(tensors)
        actual, expected = compiled(*fused_in)[0], mlp(*eager_in)[0]
    actual.sum().backward()
    expected.sum().backward()
    assert [r.plan.budget.fraction for r in records] == [0.3]
    assert records[0].plan.saved_bytes <= 0.3 * records[0].plan.budget.default_bytes
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    for a, e in zip(fused_in, eager_in):
        torch.testing.assert_close(a.grad, e.grad, rtol=1e-5, atol=1e-5)


def test_backend_refuses_an_unknown_option():
    torch._dynamo.reset()
    compiled = torch.compile(mlp, backend="memfuse", options={"memory_budgt": 0.3})
    with pytest.raises(Exception, match=r"unknown torch.compile option\(s\) \['memory_budgt'\].*memory_budget"):
        compiled(*leaves(mlp_inputs()))


def test_explain_prints_the_budget_and_what_it_moved(capsys):
    report = memfuse.explain(memfuse.memory_efficient_fusion(mlp, memory_budget=0.5), *leaves(mlp_inputs()))
    text = capsys.readouterr().out
    budget = report.budget
    assert budget.fraction == 0.5 and budget.reached_bytes <= budget.target_bytes < budget.default_bytes
    assert f"memory budget 0.5: the default plan saves" in text and "released for recomputation: " in text
    assert "recompute (1): recomputed for the memory budget 0.5: " in text


def test_explain_says_why_a_budget_is_not_reached():
    """A cumsum stays an aten call the budget never releases: what is left is said."""
    def fn(x):
        y = torch.cumsum(x, -1)
        return (y * y,)

    the_plan = plan(capture(fn, [torch.randn(6, 10, requires_grad=True)], trace_joint=True), 0.1)
    assert the_plan.saved_bytes == 6 * 10 * 4
    assert "outputs of aten calls the budget never releases" in the_plan.budget.short_of_target
    assert "budget not reached: the rest are" in str(the_plan.budget)


@pytest.mark.parametrize("value", [0, 0.0, -0.5, 1.5, float("nan"), "0.5", True])
def test_bad_budget_is_a_clear_error(value):
    with pytest.raises(ValueError, match=r"memory_budget must be a number in \(0, 1\]"):
        memfuse.Config(memory_budget=value)
    with pytest.raises(ValueError, match=r"memory_budget must be a number in \(0, 1\]"):
        memfuse.memory_efficient_fusion(mlp, memory_budget=value)


@pytest.mark.parametrize("variable, field, value, parsed, bad, bad_message, out_of_range, range_message", [
    ("MEMFUSE_MEMORY_BUDGET", "memory_budget", "0.4", 0.4, "half", "'half' is not a number", "2",
     "memory_budget must be"),
    ("MEMFUSE_LOSS_HEAD_CHUNK_BYTES", "loss_head_chunk_bytes", str(32 * 2**20), 32 * 2**20, "32MiB",
     "'32MiB' is not a whole number", "0", "loss_head_chunk_bytes must be a positive whole number"),
    ("MEMFUSE_LOSS_HEAD_CHUNK_ROWS", "loss_head_chunk_rows", "4096", 4096, "4k", "'4k' is not a whole number", "-1",
     "loss_head_chunk_rows must be a positive whole number"),
])
def test_settings_from_the_environment(monkeypatch, variable, field, value, parsed, bad, bad_message, out_of_range,
                                       range_message):
    """A Config field's environment variable sets it; a value that does not parse, or one out of the
    field's range, is an error naming the variable or the field."""
    monkeypatch.setenv(variable, value)
    assert getattr(memfuse.Config(), field) == parsed
    monkeypatch.setenv(variable, bad)
    with pytest.raises(ValueError, match=f"{variable}={bad_message}"):
        memfuse.Config()
    monkeypatch.setenv(variable, out_of_range)
    with pytest.raises(ValueError, match=range_message):
        memfuse.Config()


def test_loss_head_chunk_defaults():
    assert memfuse.Config().loss_head_chunk_rows is None     # 1024 on one process: memfuse.patterns.loss_head.detect.rows_cap
    assert memfuse.Config().loss_head_chunk_bytes == 256 * 2**20


def randint_mlp(x, w):
    return (F.gelu((x * torch.randint(0, 2, x.shape, dtype=x.dtype)) @ w),)


def test_a_seeded_aten_call_is_never_recomputed():
    """aten.randint draws from torch's generator: the budget recomputes the matmul after it from
    the kept draw, never the draw itself."""
    tensors = [torch.randn(8, 16), torch.randn(16, 32)]
    the_plan = plan(capture(randint_mlp, leaves(tensors), trace_joint=True), 0.1)
    assert the_plan.decisions["randint"][0] is Decision.SAVE and the_plan.decisions["mm"][0] is Decision.RECOMPUTE
    grads = {}
    for budget in (1.0, 0.1):
        inputs = leaves(tensors)
        torch.manual_seed(5)
        memfuse.memory_efficient_fusion(randint_mlp, memory_budget=budget)(*inputs)[0].sum().backward()
        grads[budget] = [t.grad for t in inputs]
    for g, r in zip(grads[0.1], grads[1.0]):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


# -- byte budgets ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value, parsed", [
    ("12GB", 12 * 10**9), ("12GiB", 12 * 2**30), ("800MB", 800 * 10**6), ("1.5GB", 1_500_000_000),
    ("1.5 GiB", 3 * 2**29), ("64kib", 64 * 2**10), (5_000_000, 5_000_000), (0.5, 0.5), (1, 1), (1.0, 1.0)])
def test_budget_in_bytes_parses(value, parsed):
    """A string with a unit is whole bytes (GB decimal, GiB binary); an int above 1 is bytes; a
    number in (0, 1] stays a fraction."""
    config = memfuse.Config(memory_budget=value)
    assert config.memory_budget == parsed and type(config.memory_budget) is type(parsed)
    assert config.memory_fraction == (1.0 if isinstance(value, str) or parsed == 5_000_000 else parsed)


@pytest.mark.parametrize("value", ["12", "12XB", "GB", "-1GB", "0GB", "1B", 2.5, 12e9, -3, [1]])
def test_bad_byte_budget_is_a_clear_error(value):
    with pytest.raises(ValueError, match=r"memory_budget must be .* or a byte target .*\"12GB\".*got "):
        memfuse.Config(memory_budget=value)
    with pytest.raises(ValueError, match=r"memory_budget must be"):
        memfuse.memory_efficient_fusion(mlp, memory_budget=value)


def test_byte_budget_from_the_environment_and_options(monkeypatch):
    monkeypatch.setenv("MEMFUSE_MEMORY_BUDGET", "12GiB")
    assert memfuse.Config().memory_budget == 12 * 2**30
    monkeypatch.setenv("MEMFUSE_MEMORY_BUDGET", "12 parsecs")
    with pytest.raises(ValueError, match=r"memory_budget must be"):
        memfuse.Config()
    monkeypatch.delenv("MEMFUSE_MEMORY_BUDGET")
    from memfuse.base.config import config_with_options
    assert config_with_options(memfuse.Config(), {"memory_budget": "800MB"}).memory_budget == 800 * 10**6


def matmul_sigmoid(x, w):
    return ((x @ w).sigmoid(),)


def test_predicted_peak_counts_the_inputs_and_the_larger_programs_live_bytes():
    """x [256, 8], w [8, 32] in fp32: the inputs (9216 B) are alive throughout; the forward holds mm
    and the sigmoid it returns and saves (2 x 32 KiB) at once, the backward the saved sigmoid and the
    tangent (2 x 32 KiB) until mul_1 replaces the sigmoid: 9216 + 65536."""
    joint = capture(matmul_sigmoid, leaves([torch.randn(256, 8), torch.randn(8, 32)]), trace_joint=True)
    assert predicted_peak(plan(joint), joint.hints) == 9216 + 2 * 256 * 32 * 4


def test_offloading_and_recomputing_lower_the_predicted_peak():
    joint = capture(residual_layers, leaves(wide_residual_inputs()), trace_joint=True)
    default = plan(joint)
    everything = dataclasses.replace(default, offloaded=tuple(s.name for s in default.saved if not s.is_input))
    assert predicted_peak(everything, joint.hints) < predicted_peak(default, joint.hints)
    assert predicted_peak(plan(joint, 0.3), joint.hints) < predicted_peak(default, joint.hints)


def cumsum_tanh_layers(x):
    """Four layers whose cumsum stays an aten call the budget never releases: recomputing cannot
    lower the peak, offloading the saved cumsums (2 MiB each at [1024, 512]) can."""
    for _ in range(4):
        x = torch.cumsum(torch.tanh(x), -1)
    return (x.sum(),)


def test_a_byte_target_the_default_plan_meets_moves_nothing():
    joint = capture(residual_layers, leaves(wide_residual_inputs()), trace_joint=True)
    default = plan(joint)
    peak = predicted_peak(default, joint.hints)
    the_plan = plan(joint, peak)
    assert [s.name for s in the_plan.saved] == [s.name for s in default.saved] and the_plan.offloaded == ()
    assert the_plan.budget.peak_before == the_plan.budget.peak_after == peak and the_plan.budget.moves == ()


def test_a_byte_target_forces_recompute_and_matches_eager():
    """A target below the default plan's predicted peak: matmul outputs are recomputed (cheaper than
    an offload, and none is large enough to offload), and the step is eager's."""
    tensors = wide_residual_inputs(tokens=256)
    joint = capture(residual_layers, leaves(tensors), trace_joint=True)
    default_peak = predicted_peak(plan(joint), joint.hints)
    target = default_peak - 64 * 1024
    the_plan = plan(joint, target)
    assert predicted_peak(the_plan, joint.hints) == the_plan.budget.peak_after <= target
    assert the_plan.offloaded == () and the_plan.saved_bytes < plan(joint).saved_bytes
    assert any(m.choice == "recompute" for m in the_plan.budget.moves)
    recomputed = [m.name for m in the_plan.budget.moves if m.choice == "recompute"]
    assert all(the_plan.decisions[n][0] is Decision.RECOMPUTE for n in recomputed)
    assert the_plan.decisions[recomputed[0]][1].startswith(f"recomputed for the memory budget {human_bytes(target)}: ")

    fused = memfuse.memory_efficient_fusion(residual_layers, memory_budget=target)
    matches_eager(residual_layers, fused, tensors)
    assert fused.compiled_for(*leaves(tensors)).plan.budget.target_bytes == target


@pytest.mark.parametrize("name, make", [("residual_layers", lambda: wide_residual_inputs(8192)),
                                        ("cumsum_tanh_layers", lambda: [torch.randn(1024, 512)])])
def test_the_predicted_peak_is_monotone_in_the_target(name, make):
    fn = {"residual_layers": residual_layers, "cumsum_tanh_layers": cumsum_tanh_layers}[name]
    joint = capture(fn, leaves(make()), trace_joint=True)
    default_peak = predicted_peak(plan(joint), joint.hints)
    peaks = []
    for target in range(default_peak, 0, -default_peak // 8):
        try:
            peaks.append(predicted_peak(plan(joint, target), joint.hints))
        except MemoryBudgetError:
            break
        assert peaks[-1] <= target
    assert len(peaks) > 2 and peaks == sorted(peaks, reverse=True) and peaks[-1] < default_peak, peaks


def test_a_target_that_needs_offload_sets_plan_offloaded():
    joint = capture(cumsum_tanh_layers, leaves([torch.randn(1024, 512)]), trace_joint=True)
    default = plan(joint)
    the_plan = plan(joint, predicted_peak(default, joint.hints) - 1)
    assert the_plan.offloaded == ("cumsum",)        # read last by the backward: its copies hide best
    assert [s.name for s in the_plan.saved] == [s.name for s in default.saved]
    decision, reason = the_plan.decisions["cumsum"]
    assert decision is Decision.SAVE and reason.startswith("offloaded for the memory budget ")
    assert plan(joint, predicted_peak(the_plan, joint.hints) - 1).offloaded == ("cumsum", "cumsum_1")


def test_a_target_below_the_least_is_a_clear_error():
    joint = capture(cumsum_tanh_layers, leaves([torch.randn(1024, 512)]), trace_joint=True)
    """Nothing here is recomputable (cumsums stay aten calls): the least is every cumsum offloaded."""
    default = plan(joint)
    everything = dataclasses.replace(default, offloaded=tuple(s.name for s in default.saved if not s.is_input))
    least = predicted_peak(everything, joint.hints)
    with pytest.raises(MemoryBudgetError, match=rf"memory_budget 5.0 MiB \(5242880 bytes\) is below the least "
                                                rf"this step can need: a predicted peak of {human_bytes(least)} "
                                                rf"\({least} bytes\)") as raised:
        plan(joint, 5 * 2**20)
    assert (raised.value.target_bytes, raised.value.least_bytes) == (5 * 2**20, least)
    assert plan(joint, least).budget.peak_after == least


@pytest.mark.parametrize("strict", [False, True])
def test_a_target_below_the_least_reaches_the_caller_not_torch(monkeypatch, strict):
    """A user error, not a compile failure: raised as it is by memory_efficient_fusion and by the
    torch.compile backend, never run through torch (which would ignore the budget)."""
    monkeypatch.setenv("MEMFUSE_STRICT", "1" if strict else "0")
    x = leaves([torch.randn(1024, 512)])
    with pytest.raises(MemoryBudgetError, match="is below the least this step can need"):
        memfuse.memory_efficient_fusion(cumsum_tanh_layers, memory_budget="5MiB")(*x)
    torch._dynamo.reset()
    before = counters()
    compiled = torch.compile(cumsum_tanh_layers, backend="memfuse", options={"memory_budget": "5MiB"})
    with pytest.raises(Exception, match="is below the least this step can need") as caught:
        compiled(*x)
    assert isinstance(getattr(caught.value, "inner_exception", caught.value), MemoryBudgetError)   # Dynamo's wrapper
    assert delta(before)["graph_fallbacks"] == 0


def test_explain_prints_a_byte_budgets_target_peaks_and_moves(capsys):
    """The target, the predicted peak before and after, and a line per moved value: its choice, its
    bytes and the reason."""
    tensors = [torch.randn(1024, 512)]
    joint = capture(cumsum_tanh_layers, leaves(tensors), trace_joint=True)
    target = predicted_peak(plan(joint), joint.hints) - 1
    report = memfuse.explain(memfuse.memory_efficient_fusion(cumsum_tanh_layers, memory_budget=target),
                             *leaves(tensors))
    text = capsys.readouterr().out
    budget = report.budget
    assert budget.target_bytes == target and budget.peak_after <= target < budget.peak_before
    assert (f"memory budget {human_bytes(target)} ({target} bytes) for the step's predicted peak: the default "
            f"plan's {human_bytes(budget.peak_before)}, this plan's {human_bytes(budget.peak_after)}") in text
    assert re.search(r"\n    cumsum  offload     2\.0 MiB  to pinned host memory: \d+ us each way over the host link",
                     text), text
    assert report.entry.plan.offloaded == ("cumsum",)
