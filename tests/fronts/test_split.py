"""A call whose trace reads a tensor's value (fronts.split): it runs through torch.compile with the
memfuse backend, split at the read, which runs on every call as in eager; strict mode raises."""
import pytest
import torch
import torch._dynamo
from torch import nn
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

import memfuse
from memfuse.driver.fallback import StrictModeError
from memfuse.fronts.split import SplitCall


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.linear(x)).relu() + x


class LayerDrop(nn.Module):
    """transformers' layer drop up to 5.17 (BART, OPT, Whisper, ...): a draw at every training step,
    whatever the probability, compared in Python. Dynamo cannot resume inside the loop: it runs the
    loop's frame in Python and compiles each block's frame on its own, as in OPT's decoder."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.layerdrop = layerdrop

    def forward(self, x):
        for layer in self.layers:
            if self.training and torch.rand([]) < self.layerdrop:
                continue
            x = layer(x)
        return x.square().mean()


def test_a_module_whose_forward_reads_a_random_draw_compiles_split_at_the_read(caplog):
    torch.manual_seed(0)
    plain = LayerDrop(0.0)
    fused = memfuse.memory_efficient_fusion(LayerDrop(0.0))
    fused.load_state_dict(plain.state_dict())
    x = torch.randn(4, 8)
    for _ in range(2):
        loss, want = fused(x), plain(x)
        torch.testing.assert_close(loss, want)
        loss.backward()
        want.backward()
    for p, q in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    stats = memfuse.stats()
    assert stats["eager_calls"] == 0 and stats["split_calls"] == 2, stats
    assert stats["compiles"] >= 1 and stats["graph_fallbacks"] == 0, stats      # the blocks' graphs
    compiles = stats["compiles"]
    fused(x)
    assert memfuse.stats()["compiles"] == compiles, "the next call runs the same graphs"
    assert len(fused._memfuse_calls) == 1, "the split left the module tree as it was: no new call key, no retrace"
    said = [r.getMessage() for r in caplog.records if r.name == "memfuse.fallbacks"]
    assert len(said) == 1 and "LayerDrop runs through torch.compile with the memfuse backend, split where it " \
                              "reads a tensor's value: its trace stopped at test_split.py:" in said[0], said
    assert "(forward): GuardOnDataDependentSymNode: Could not guard on data-dependent expression" in said[0]
    assert isinstance(fused.compiled_for(x), SplitCall)


def branchy(x):
    if x.sum().item() > 0:        # a branch on a tensor's value
        return x * 2
    return x - 1


def test_a_function_branching_on_a_value_takes_the_branch_of_each_call(monkeypatch):
    traces = []
    capture = memfuse.driver.compile.capture
    monkeypatch.setattr(memfuse.driver.compile, "capture", lambda *a, **k: traces.append(1) or capture(*a, **k))
    fused = memfuse.memory_efficient_fusion(branchy)
    for x in (torch.ones(4, 8), -torch.ones(4, 8), torch.ones(4, 8)):
        torch.testing.assert_close(fused(x), branchy(x))
    assert len(traces) == 1, "decided once for the key: memfuse's own trace runs once"
    assert memfuse.stats()["eager_calls"] == 0 and memfuse.stats()["split_calls"] == 3


@pytest.mark.compile_fails
def test_strict_mode_raises_the_read_that_stopped_the_trace():
    strict = memfuse.memory_efficient_fusion(branchy, config=memfuse.Config(strict=True))
    with pytest.raises(StrictModeError, match="GuardOnDataDependentSymNode.*strict mode") as raised:
        strict(torch.ones(4, 8))
    assert isinstance(raised.value.__cause__, GuardOnDataDependentSymNode)
