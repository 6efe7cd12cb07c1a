"""The one compile driver (memfuse.driver.compile): both front doors, memory_efficient_fusion and
torch.compile(backend="memfuse"), compile through `compile_program`, which runs the stages in
order, checks the IR under Config.check, counts and logs each compile once, and returns a record
whose Captured already holds what the front added (nothing patches it afterwards)."""
import dataclasses
import logging

import pytest
import torch
import torch.nn.functional as F

import memfuse
import memfuse.driver.compile as driver
from memfuse.driver.compile import AotGraph, Compiled, Programs, TracedFunction
from memfuse.runtime.program import CompiledFunction


def setup_function():
    torch._dynamo.reset()


def block(x, w):
    return F.layer_norm(x * w, (x.shape[-1],)).sin() * 2


def inputs():
    return torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)


@pytest.fixture
def compiles(monkeypatch):
    """Every Compiled the driver returns, whichever front called it."""
    made = []
    compile_program = driver.compile_program

    def recording(source, config):
        made.append(compile_program(source, config))
        return made[-1]
    monkeypatch.setattr(driver, "compile_program", recording)                  # compile_or_decide's
    monkeypatch.setattr(memfuse.fronts.backend, "compile_program", recording)  # the backend's
    return made


def test_both_fronts_compile_through_the_driver(compiles):
    memfuse.memory_efficient_fusion(block)(*inputs()).sum().backward()
    torch.compile(block, backend="memfuse")(*inputs()).sum().backward()
    assert [type(c.function) for c in compiles] == [CompiledFunction, Programs]
    assert all(isinstance(c, Compiled) and c.function.backward is not None for c in compiles)
    assert memfuse.stats()["compiles"] == 2


def test_an_inference_graph_compiles_through_the_driver_without_a_backward(compiles):
    with torch.no_grad():
        torch.compile(block, backend="memfuse")(*inputs())
    [compiled] = compiles
    assert compiled.function.backward is None and compiled.plan.backward is None


def test_the_sources_are_frozen():
    for kind in (TracedFunction, AotGraph):
        assert dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen


def test_the_graphs_record_holds_the_fronts_additions(compiles):
    """The backend's record and explain read the Captured the driver returned: the aten graph is
    in it, not set on it after the compile."""
    torch.compile(block, backend="memfuse")(*inputs()).sum().backward()
    [compiled] = compiles
    assert compiled.captured.aten_graph is not None
    assert compiled.input_names == ["L['x']", "L['w']"]


class Head(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 64, bias=False)

    def forward(self, h, y):
        return F.cross_entropy(self.lin(h), y)


@pytest.mark.parametrize("front", ["function", "backend"])
def test_the_loss_heads_decision_reaches_explain_from_either_front(front):
    """The loss head is chunked before (torch.compile: in Dynamo's graph) or while (a traced
    function) capture runs; its decision is in the Captured the driver returns, which explain reads."""
    head = Head()
    fused = memfuse.memory_efficient_fusion(head) if front == "function" else torch.compile(head, backend="memfuse")
    report = memfuse.explain(fused, torch.randn(8, 16, requires_grad=True), torch.randint(0, 64, (8,)))
    report = report if front == "function" else report.graphs[0]
    [decision] = report.loss_heads
    assert decision.chunked


@pytest.mark.parametrize("front", ["function", "backend"])
def test_check_verifies_both_sides_in_either_front(front, monkeypatch):
    verified = []
    verify = driver.verify
    monkeypatch.setattr(driver, "verify", lambda graph: verified.append(graph) or verify(graph))
    config = memfuse.Config(check=True)
    if front == "function":
        memfuse.memory_efficient_fusion(block, config=config)(*inputs()).sum().backward()
    else:
        torch.compile(block, backend=lambda gm, args: memfuse.fronts.backend.memfuse_backend(gm, args, config=config))(
            *inputs()).sum().backward()
    assert len(verified) == 2     # the forward and the backward graph, once each


def test_one_log_line_per_compile(caplog):
    caplog.set_level(logging.INFO, logger="memfuse")
    memfuse.memory_efficient_fusion(block)(*inputs()).sum().backward()
    torch.compile(block, backend="memfuse")(*inputs()).sum().backward()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memfuse: compiled ")]
    assert len(lines) == 2
    assert lines[0].startswith("memfuse: compiled block in ") and "bytes beyond the inputs" in lines[0]
    assert " (torch.compile) in " in lines[1]


def relu_matmul(x, w):
    return torch.relu(x) @ w


def test_the_specialized_sizes_line_names_the_function_with_aten_fallbacks_around(logs):
    """The mm runs through aten (a fallback of the capture) and guards on w's first dim: the
    driver's line names the function, not the fallback node."""
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    memfuse.memory_efficient_fusion(relu_matmul).compiled_for(x, w)
    assert memfuse.stats()["fallbacks"] >= 1
    said = [r.getMessage() for r in logs.records if r.name == "memfuse.recompiles"]
    assert any(m.startswith("memfuse: relu_matmul: leading sizes join the compile key") for m in said), said
