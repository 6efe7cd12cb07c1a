"""benchmarks/loss_head.py: its tiny run (CPU, the Triton interpreter) end to end, a row for every
form x peer with a time or the reason it is missing, small errors against the fp64 reference;
the issue's target line; how explain's text is read."""
import json
import os

import pytest

from benchmarks import loss_head as bench
from benchmarks.loss_head import Row


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_tiny_run(tmp_path, capsys):
    bench.main(["--tiny", "--ignore-fraction", "0.25", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "loss-head-tiny-float32.json").read_text())
    assert result["metadata"]["tiny"] and result["metadata"]["workload"]["ignore_fraction"] == 0.25
    rows = {(r["form"], r["peer"]): r for r in result["rows"]}
    assert list(rows) == [(form, peer) for form in bench.FORMS for peer in bench.PEERS]
    for key, row in rows.items():
        assert row["error"] is None, (key, row["error"])
        if row["missing"]:
            assert row["step_s"] is None, key
            continue
        assert row["step_s"] > 0 and row["first_call_s"] > 0 and row["peak_bytes"] is None, key  # memory n/a on CPU
        assert row["loss_error"] < 1e-5 and row["grad_error"] < 1e-5, (key, row["loss_error"], row["grad_error"])
    for form in bench.FORMS:
        assert rows[form, "eager"]["missing"] is None
        for peer in bench.MEMFUSE_PEERS:
            assert rows[form, peer]["missing"] is None and rows[form, peer]["chunked_loss_head"] is not None
            assert rows[form, peer]["explain"]
        for peer in bench.COMPILE_PEERS:
            assert "--tiny" in rows[form, peer]["missing"]
    assert len(result["targets"]) == len(bench.FORMS) * len(bench.MEMFUSE_PEERS)
    markdown = (tmp_path / "loss-head-tiny-float32.md").read_text()
    assert "TINY RUN" in markdown and markdown.count("| function |") == len(bench.PEERS)
    assert "TINY RUN" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_chunk_mib_and_rows_reach_the_memfuse_peers_only(tmp_path):
    """--chunk-mib and --chunk-rows set memfuse's loss-head chunk (explain says the size it chunked
    with: here the bytes, the fewer), are recorded with the workload and name the result's files
    apart from a default run's."""
    bench.main(["--tiny", "--forms", "function", "--peers", "eager,memfuse,memfuse_backend", "--chunk-mib", "3",
                "--chunk-rows", "100000", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "loss-head-tiny-float32-chunk3mib-rows100000.json").read_text())
    assert result["metadata"]["workload"]["chunk_mib"] == 3
    assert result["metadata"]["workload"]["chunk_rows"] == 100000
    rows = {r["peer"]: r for r in result["rows"]}
    for peer in bench.MEMFUSE_PEERS:
        assert rows[peer]["error"] is None and rows[peer]["chunked_loss_head"], rows[peer]
        assert any("(3 MiB of logits)" in line for line in rows[peer]["explain"]), rows[peer]["explain"]
    assert rows["eager"]["error"] is None and not rows["eager"]["explain"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_a_soft_capped_head_is_chunked_through_its_cap(tmp_path):
    """--soft-cap: both forms soft-cap their logits (as Gemma 2), the reference too; memfuse chunks
    the head through the cap (explain names it) within the fp64 reference's reach; the files say so."""
    bench.main(["--tiny", "--peers", "eager,liger,memfuse,memfuse_backend", "--soft-cap", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "loss-head-tiny-float32-softcap2.json").read_text())
    assert result["metadata"]["workload"]["soft_cap"] == 2.0
    for row in result["rows"]:
        assert row["error"] is None, row
        if row["missing"]:
            continue
        assert row["loss_error"] < 1e-5 and row["grad_error"] < 1e-5, row
        if row["peer"] in bench.MEMFUSE_PEERS:
            assert any("through / 2.0 then tanh then * 2.0" in line for line in row["explain"]), row["explain"]


def _row(peer, ms, mb):
    return Row("function", peer, step_s=ms * 1e-3, peak_bytes=int(mb * bench.MB))


def test_target_line_needs_least_memory_and_time_within_the_ratio():
    rows = [_row("eager", 100, 9000), _row("liger", 50, 2000), _row("torch_compile", 40, 8000),
            _row("memfuse", 44, 2000), _row("memfuse_backend", 45, 1900)]
    met, slow = bench.target_lines(rows)
    assert met.startswith("function memfuse: MET") and "(liger)" in met and "(torch_compile)" in met
    assert slow.startswith("function memfuse_backend: NOT MET") and "1.12x the fastest" in slow


def test_target_line_without_memory_is_not_judged():
    line, = bench.target_lines([Row("module", "eager", step_s=1.0), Row("module", "memfuse", step_s=2.0)])
    assert "not judged" in line and "2.00x" in line


@pytest.mark.parametrize("text, chunked", [
    ("graphs\n  loss head loss: chunked linear + cross-entropy over vocab 101, chunks of 8 rows", True),
    ("  loss head loss: not chunked: the logits are returned", False),
    ("kernels\n  forward: 7 generated kernel(s)", False),
])
def test_explain_text_is_read_for_a_chunked_loss_head(text, chunked):
    found, lines = bench.read_loss_head(text)
    assert found is chunked and lines and all("loss head" in line for line in lines)


@pytest.mark.parametrize("argv, named", [(["--ignore-fraction", "1"], "--ignore-fraction"),
                                          (["--vocab", "0"], "--vocab"), (["--soft-cap", "0"], "--soft-cap")])
def test_bad_arguments_are_named(argv, named, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert named in capsys.readouterr().err
