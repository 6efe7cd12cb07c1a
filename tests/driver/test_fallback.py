"""torch.compile(backend="memfuse") takes every graph Dynamo hands it: a graph memfuse cannot
compile, wherever the failure happens (AOTAutograd's trace, the partition that builds both
programs, the inference compiler), runs through torch with eager's results and gradients, is
logged once and counted; in strict mode it is an error chained to the failure."""
import logging

import pytest
import torch

import memfuse
import memfuse.driver.compile
import memfuse.fronts.backend

aten = torch.ops.aten


def setup_function():
    torch._dynamo.reset()


def fallback_messages(caplog) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "memfuse.fallbacks" and "runs through torch" in r.getMessage()]


def masked_sum(x, w):
    """A data-dependent size (the number of positive elements): memfuse's lowering has no
    argument to read it from and refuses the graph."""
    return (x * w)[x > 0].sum() * 2 + (x * w).sin().sum()


def block(x, w):
    return torch.nn.functional.layer_norm(x * w, (x.shape[-1],)).sin() * 2


def inputs():
    x = torch.randn(3, 8)
    x[0, 0] = 1.0                       # at least one positive element
    return x, torch.randn(8)


def assert_matches_eager(fn, compiled, x, w):
    """Outputs and gradients of `compiled` equal eager's, for inputs that require grad."""
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    expected, got = fn(x1, w1), compiled(x2, w2)
    expected.sum().backward()
    got.sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close((x2.grad, w2.grad), (x1.grad, w1.grad))


def test_a_graph_the_lowering_rejects_runs_through_torch(logs):
    x, w = inputs()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(masked_sum, backend="memfuse")
        assert_matches_eager(masked_sum, compiled, x, w)
        assert_matches_eager(masked_sum, compiled, -x.abs() + 0.5, w)   # another count, same graph
    assert memfuse.stats()["graph_fallbacks"] == 1
    assert memfuse.stats()["compiles"] == 0
    [message] = fallback_messages(logs)
    assert "graph dynamo_0/0 runs through torch (eager)" in message
    assert "NotImplementedError: memfuse: boolean size expression" in message
    assert "memfuse/capture/lower.py" in message and "(lower_symbol)" in message
    assert "MEMFUSE_STRICT=1" in message
    record = next(r for r in logs.records if r.name == "memfuse.fallbacks")
    assert record.levelno == logging.WARNING and record.exc_info is not None   # the traceback at DEBUG


def test_strict_mode_raises_the_failure_chained(monkeypatch):
    monkeypatch.setenv("MEMFUSE_STRICT", "1")
    compiled = torch.compile(masked_sum, backend="memfuse")
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True), \
            pytest.raises(torch._dynamo.exc.BackendCompilerFailed) as info:
        compiled(*inputs())
    error = info.value.inner_exception
    assert isinstance(error, RuntimeError)
    assert "could not compile graph dynamo_0/0: NotImplementedError" in str(error)
    assert "strict mode (MEMFUSE_STRICT=1 / Config.strict)" in str(error)
    assert isinstance(error.__cause__, NotImplementedError)
    assert memfuse.stats()["graph_fallbacks"] == 0


def test_a_failure_building_the_backward_program_is_caught_before_the_forward_runs(monkeypatch, logs):
    """AOTAutograd compiles the backward lazily, but memfuse's partition builds both programs up
    front: a failure there falls back at the first call, before any memfuse forward ran."""
    schedule = memfuse.driver.compile.schedule

    def failing(graph, config, kind):
        if kind == "backward":
            raise RuntimeError("injected: the backward schedule failed")
        return schedule(graph, config, kind)
    monkeypatch.setattr(memfuse.driver.compile, "schedule", failing)
    compiled = torch.compile(block, backend="memfuse")
    x, w = inputs()
    compiled(x, w.requires_grad_())
    assert memfuse.stats()["graph_fallbacks"] == 1       # before any backward
    assert "RuntimeError: injected: the backward schedule failed" in fallback_messages(logs)[0]
    assert_matches_eager(block, compiled, *inputs())
    assert memfuse.stats()["compiles"] == 0


def test_a_failure_in_the_inference_compiler_runs_through_torch(monkeypatch, logs):
    def failing(captured, *budget):
        raise ValueError("injected: the plan failed")
    monkeypatch.setattr(memfuse.driver.compile, "plan", failing)
    compiled = torch.compile(block, backend="memfuse")
    x, w = inputs()
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, w), block(x, w))
    assert memfuse.stats()["graph_fallbacks"] == 1
    assert "ValueError: injected: the plan failed" in fallback_messages(logs)[0]
    assert "memfuse/driver/compile.py" in fallback_messages(logs)[0]


def test_a_failure_in_aotautograds_trace_runs_through_torch(monkeypatch, logs):
    """Before memfuse's partition: a decomposition memfuse hands AOTAutograd fails."""
    def failing_sin(x):
        raise TypeError("injected: the decomposition failed")
    table = memfuse.fronts.backend.decomposition_table()
    monkeypatch.setattr(memfuse.fronts.backend, "decomposition_table", lambda: {**table, aten.sin.default: failing_sin})
    compiled = torch.compile(block, backend="memfuse")
    assert_matches_eager(block, compiled, *inputs())
    assert memfuse.stats()["graph_fallbacks"] == 1
    assert "TypeError: injected: the decomposition failed" in fallback_messages(logs)[0]


def test_each_graph_falls_back_on_its_own():
    """A graph break: the first graph compiles, the second runs through torch."""
    def fn(x, w):
        h = block(x, w)
        torch._dynamo.graph_break()
        return masked_sum(h, w)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        compiled = torch.compile(fn, backend="memfuse")
        assert_matches_eager(fn, compiled, *inputs())
    assert memfuse.stats()["compiles"] == 1
    assert memfuse.stats()["graph_fallbacks"] == 1
