"""examples/gpt.py trains: memfuse and torch.compile(backend="memfuse") follow eager step by step
with dropout off, and the loss falls with dropout on."""
import importlib.util
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"
spec = importlib.util.spec_from_file_location("gpt_example", EXAMPLE)
gpt = sys.modules["gpt_example"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
spec.loader.exec_module(gpt)


STEPS = 3


@pytest.mark.parametrize("mode,layers", [("memfuse", 2), ("compile", 1)])
def test_loss_curve_matches_eager_without_dropout(mode, layers):
    """memfuse wraps each of 2 blocks; compile takes the whole model (1 block keeps it quick)."""
    import torch._dynamo
    torch._dynamo.reset()
    import memfuse
    expected = gpt.train("eager", steps=STEPS, layers=layers)
    memfuse.reset_stats()
    losses = gpt.train(mode, steps=STEPS, layers=layers)
    assert memfuse.stats()["compiles"] == (layers if mode == "memfuse" else 1)   # memfuse ran them
    assert len(losses) == STEPS
    for step, (got, want) in enumerate(zip(losses, expected)):
        assert abs(got - want) <= 1e-4 * abs(want), (step, losses, expected)


def test_loss_falls_with_dropout():
    losses = gpt.train("memfuse", steps=16, dropout=0.1, lr=1e-2, layers=1)
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < first - 0.05, losses


def test_cli_runs():
    losses = gpt.main(["--mode", "eager", "--steps", "2", "--size", "tiny", "--device", "cpu"])
    assert len(losses) == 2
