"""benchmarks/budget.py's tiny run (CPU, the Triton interpreter) on one model and two budgets: a
point per budget with no error, fewer planned bytes at the smaller budget, the Markdown table and
the picture."""
import json
import os

import pytest

pytest.importorskip("transformers")

from benchmarks import budget as bench  # noqa: E402

MODEL = "gpt2"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_tiny_budget_run(tmp_path):
    bench.main(["--tiny", "--models", MODEL, "--budgets", "1.0,0.3", "--out", str(tmp_path)])
    result = json.loads(bench.json_path(tmp_path, MODEL, tiny=True).read_text())
    points = {p["budget"]: p for p in result["points"]}
    assert sorted(points) == [0.3, 1.0] and all(p["mode"] == "memfuse_backend" for p in points.values())
    for p in points.values():
        assert p["error"] is None and p["step_s"] > 0 and p["peak_bytes"] is None   # memory n/a on CPU
    assert points[1.0]["planned_bytes"] == points[1.0]["default_planned_bytes"] > 0
    assert points[0.3]["default_planned_bytes"] == points[1.0]["planned_bytes"]
    assert points[0.3]["planned_bytes"] < 0.5 * points[1.0]["planned_bytes"]
    markdown = (tmp_path / "budget-tiny.md").read_text()
    assert markdown.count(f"| {MODEL} |") == 2 and "TINY RUN" in markdown
    assert (tmp_path / f"budget-tiny-{MODEL}.png").exists()
