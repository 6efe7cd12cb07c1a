"""benchmarks/models.py's tiny run (CPU, fp32, the Triton interpreter) on one model: a row per
mode with no error, the dropout-free check against eager, the JSON's metadata and the merged
report (Markdown and PNG)."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import models as bench  # noqa: E402

MODEL = "gpt2"
MODES = ("eager", "memfuse_backend", "memfuse_per_layer")  # memfuse_whole: see tests/models/test_hf_models.py


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_tiny_run(tmp_path, capsys):
    bench.main(["--tiny", "--models", MODEL, "--modes", ",".join(MODES), "--out", str(tmp_path)])
    result = json.loads(bench.json_path(tmp_path, MODEL, tiny=True).read_text())
    assert result["metadata"]["tiny"] and result["metadata"]["transformers"]
    assert result["use_cache"] is False and result["attention"] == "sdpa"
    rows = {row["mode"]: row for row in result["rows"]}
    assert tuple(rows) == MODES
    for mode, row in rows.items():
        assert row["error"] is None and row["check_error"] is None, (mode, row["error"], row["check_error"])
        assert row["it_s"] > 0 and row["first_step_s"] > 0
        assert row["peak_bytes"] is None and row["kept_bytes"] is None  # n/a on CPU
        assert row["loss_error"] <= 1e-5 and row["grad_error"] <= 1e-4, (mode, row["loss_error"], row["grad_error"])
    assert rows["memfuse_backend"]["memfuse_compile"]["compiles"] >= 1
    assert rows["memfuse_per_layer"]["memfuse_compile"]["compiles"] == result["size"]["layers"]
    assert rows["memfuse_per_layer"]["memfuse_per_step"]["compiles"] == 0  # no recompile after the first step
    markdown = bench.report_stem(tmp_path, tiny=True).with_suffix(".md").read_text()
    assert markdown.count(f"| {MODEL} |") == len(MODES) and "TINY RUN" in markdown
    assert bench.report_stem(tmp_path, tiny=True).with_suffix(".png").exists()
    assert "TINY RUN" in capsys.readouterr().out


def test_peak_replay_finds_the_blocks_alive_at_the_peak():
    """benchmarks.peak replays a snapshot's trace: the peak and what was alive then, by frame."""
    from benchmarks.peak import live_at_peak, where
    program = [{"filename": "<memfuse program 1>", "line": 2, "name": "run"}]
    library = [{"filename": "/x/transformers/models/llama.py", "line": 7, "name": "forward"}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": program},
             {"action": "alloc", "addr": 2, "size": 50, "frames": library},
             {"action": "free_completed", "addr": 1, "size": 100},
             {"action": "alloc", "addr": 3, "size": 60, "frames": library}]
    peak, at, alive = live_at_peak(trace)
    assert (peak, at, sorted(alive)) == (150, 1, [1, 2])
    sources = {"<memfuse program 1>": ["def run(mf_inputs):", "    buf = mf_empty((4,), (1,), f32)"]}
    assert where(program, sources) == "memfuse program: buf = mf_empty((4,), (1,), f32)"
    assert where(library, sources) == "transformers/models/llama.py:7 (forward)"


def test_gradients_of_layers_compiled_in_place_keep_the_plain_names():
    """torch_compile_per_layer puts each layer in torch.compile's wrapper, which names its parameters
    through `_orig_mod`: the gradients are still keyed as the plain model's (the check against eager
    compares them by name; no compile happens here, nothing is called)."""
    from benchmarks.lib import hf_models as bench
    family = bench.FAMILIES[MODEL]
    plain = bench.build(family, family.tiny, 0.0, use_cache=False)
    names = [name for name, _ in plain.named_parameters()]
    wrapped = bench.WRAPPERS["torch_compile_per_layer"](bench.build(family, family.tiny, 0.0, use_cache=False), family)
    assert any("_orig_mod" in name for name, _ in wrapped.named_parameters())
    for p in wrapped.parameters():
        p.grad = torch.ones_like(p)
    assert list(bench.gradients(wrapped)) == names
