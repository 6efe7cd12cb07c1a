"""examples/gpt.py trains: memfuse and torch.compile(backend="memfuse") follow eager step by step
with dropout off, and the loss falls with dropout on."""
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt.py"
spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLE)
gpt = sys.modules["gpt_example"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
spec.loader.exec_module(gpt)


@pytest.fixture(scope="module")
def eager_losses():
    return gpt.train("eager", steps=4)


@pytest.mark.parametrize("mode", ["memfuse", "compile"])
def test_loss_curve_matches_eager_without_dropout(mode, eager_losses):
    import torch._dynamo
    torch._dynamo.reset()
    losses = gpt.train(mode, steps=4)
    assert len(losses) == len(eager_losses)
    for step, (got, expected) in enumerate(zip(losses, eager_losses)):
        assert abs(got - expected) <= 1e-4 * abs(expected), (step, losses, eager_losses)


def test_loss_falls_with_dropout():
    losses = gpt.train("memfuse", steps=16, dropout=0.1, lr=1e-2, layers=1)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.05, losses


def test_cli_runs():
    losses = gpt.main(["--mode", "eager", "--steps", "2", "--size", "tiny", "--device", "cpu"])
    assert len(losses) == 2
