"""memfuse.check_compiles: a training step compiled on fake tensors, both styles, nothing launched."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import memfuse
from memfuse.driver.fallback import StrictModeError
from memfuse.runtime import launchers

STYLES = ("backend", "whole")


class Block(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class TwoGraphs(nn.Module):
    """Two blocks with a graph break between them: the backend compiles two Dynamo graphs."""

    def __init__(self, width=32):
        super().__init__()
        self.first, self.second = Block(width), Block(width)

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h)


def setup_function():
    torch._dynamo.reset()


@pytest.fixture
def no_launch(monkeypatch):
    """Any kernel launch fails the test."""
    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(launchers.Launcher, "__call__", launched)
    monkeypatch.setattr(launchers.KernelLaunch, "_launch", launched)


@pytest.mark.parametrize("style", STYLES)
def test_a_step_compiles_forward_and_backward_and_launches_nothing(style, no_launch):
    model = Block()
    weight = model.fc.weight
    report = memfuse.check_compiles(model, torch.randn(4, 8, 32), style=style)
    assert len(report.graphs) == 1
    graph = report.graphs[0]
    assert graph.forward_kernels > 0 and graph.backward_kernels > 0
    assert (graph.forward_runs, graph.backward_runs) == (1, 1)
    assert report.backward_covered
    assert report.launches_skipped == graph.forward_kernels + graph.backward_kernels
    assert memfuse.stats()["kernels_launched"] == 0
    # the model's own parameters are back, untouched
    assert model.fc.weight is weight and weight.grad is None and not isinstance(weight, FakeTensor)


def test_every_dynamo_graph_of_a_step_with_a_graph_break_is_compiled(no_launch):
    report = memfuse.check_compiles(TwoGraphs(), torch.randn(4, 8, 32), style="backend")
    assert len(report.graphs) == 2
    assert all(g.backward_runs == 1 for g in report.graphs)


@pytest.mark.parametrize("style", STYLES)
def test_real_sizes_under_bf16_autocast_cost_no_memory(style, no_launch):
    """A step of 256 Mi elements ([4096, 16384, 4] fp32 would take 4 GiB) on a model built under a
    FakeTensorMode: nothing is allocated for real."""
    with FakeTensorMode():
        model = Block(4096)
        x = torch.randn(16384, 4, 4096)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = memfuse.check_compiles(model, x, style=style)
    assert report.backward_covered and len(report.graphs) == 1


@pytest.mark.parametrize("style", STYLES)
def test_a_compile_failure_raises(style, monkeypatch):
    def failing(*args, **kwargs):
        raise ValueError("injected schedule failure")
    monkeypatch.setattr(memfuse.driver.compile, "schedule", failing)
    with pytest.raises((RuntimeError, StrictModeError)) as raised:
        memfuse.check_compiles(Block(), torch.randn(4, 8, 32), style=style)
    assert "injected schedule failure" in str(raised.value)
    assert memfuse.stats()["graph_fallbacks"] == 0 and memfuse.stats()["eager_calls"] == 0


def test_the_programs_launch_as_usual_afterwards():
    model = Block()
    memfuse.check_compiles(model, torch.randn(4, 8, 32), style="whole")
    x = torch.randn(4, 8, 32)
    torch.testing.assert_close(memfuse.memory_efficient_fusion(model)(x), model(x), rtol=1e-5, atol=1e-5)
    assert memfuse.stats()["kernels_launched"] > 0


@pytest.mark.parametrize("style", STYLES)
def test_a_causal_language_model_with_its_chunked_loss_head(style, no_launch):
    """GPT-2 (tiny): its attention mask is built from sizes and looked at once per set of sizes
    (on real values, outside the fake mode), its loss head is memfuse's custom ops, whose backward
    writes in place (fake implementations)."""
    from benchmarks.lib.hf_models import FAMILIES, build
    family = FAMILIES["gpt2"]
    with FakeTensorMode():
        model = build(family, family.tiny, 0.0)
        batch = family.make_batch(family.tiny, torch.device("cpu"))
    report = memfuse.check_compiles(model, **batch, style=style)
    assert report.backward_covered and len(report.graphs) == 1


class ScaledByConstant(nn.Module):
    """A tensor made in forward: a constant of the graph, a real tensor the programs take as input."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x) * torch.tensor([0.5])


@pytest.mark.parametrize("style", STYLES)
def test_a_graph_constant_reaches_the_programs_of_a_model_built_under_fake_mode(style, no_launch):
    with FakeTensorMode() as mode:
        model = ScaledByConstant()
        x = torch.randn(4, 8, 32)
    assert memfuse.check_compiles(model, x, style=style).backward_covered
    assert not mode.allow_non_fake_inputs      # the caller's mode as it was
