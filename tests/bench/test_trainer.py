"""benchmarks/trainer.py: its tiny run (CPU, the Triton interpreter, 3 steps) in eager and memfuse
end to end: a row per mode with its speed and loss per step, memfuse's on eager's curve and compiled
(nothing through torch); the JSON and the markdown table, with the peak split by phase, written."""
import json
import os

import pytest

from benchmarks import trainer as bench

pytest.importorskip("transformers")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_tiny_run(tmp_path, capsys):
    bench.main(["--tiny", "--modes", "eager,memfuse", "--steps", "3", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "trainer-tiny.json").read_text())
    assert [r["mode"] for r in rows] == ["eager", "memfuse"]
    for row in rows:
        assert "error" not in row, row
        assert len(row["losses"]) == 3 and row["tokens_per_s"] > 0 and row["tokens_per_step"] == 2 * 32
        assert row["forward_backward_peak_bytes"] == row["optimizer_peak_bytes"] == 0   # no CUDA: no peaks
    eager, fused = rows
    assert fused["memfuse"]["compiles"] >= 1 and fused["memfuse"]["eager_calls"] == 0
    assert max(abs(a - b) for a, b in zip(fused["losses"], eager["losses"])) < 1e-3
    table = (tmp_path / "trainer-tiny.md").read_text()
    assert "forward+backward above state GB" in table and "optimizer step above state GB" in table
    assert table in capsys.readouterr().out
