"""benchmarks/zoo.py's machinery without running a model: the families' batches give a loss, the
timing lock excludes, a family past its timeout gets a JSON saying so, one past the command's
budget gets none (the next command reruns it), a family with a JSON is skipped, and the summary's
ratios (tests/models/test_zoo.py runs the families themselves)."""
import argparse
import fcntl
import json

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import zoo  # noqa: E402
from benchmarks.lib import hf_models  # noqa: E402
from benchmarks.lib.zoo import KINDS, ZOO  # noqa: E402


def test_the_zoo_covers_every_kind_with_24_transformers_families():
    transformers_families = [f for f in ZOO.values() if f.construct is None]
    assert len(transformers_families) >= 24
    assert {"dense decoder", "moe decoder", "encoder", "encoder-decoder", "vision transformer", "speech",
            "cnn"} <= set(KINDS)
    for family in ZOO.values():
        assert family.tiny.layers <= 2 and family.tiny.hidden <= 64, family.name
        assert family.tiny.seq <= 16 or family.inputs is not None, family.name  # speech: samples
        assert family.tiny.image <= 64, family.name
    # benchmarks.models' families are the zoo's, unchanged
    assert all(ZOO[name] is hf_models.FAMILIES[name] for name in hf_models.FAMILIES)


def _args(tmp_path, **fields) -> argparse.Namespace:
    return argparse.Namespace(out=tmp_path, jobs=1, timeout=600.0, budget=None, force=False, use_cache=False,
                              families="gpt2,vit", modes="eager", tiny=True, **fields)


def test_timing_lock_excludes_another_holder(tmp_path):
    path = tmp_path / "lock"
    with zoo.timing_lock(path):
        with open(path) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released


def test_a_family_past_its_timeout_gets_a_json_that_says_so(tmp_path):
    """The worker (a fresh Python importing torch) cannot finish in 0.5 s: it is ended."""
    message = zoo.spawn("gpt2", _args(tmp_path), ("eager", "memfuse_whole"), True, zoo.Budget(0.5, None))
    result = json.loads(zoo.json_path(tmp_path, "gpt2", True).read_text())
    assert "timeout" in message and all(row["error"].startswith("timeout") for row in result["rows"])
    assert "1 crashes" in zoo.summarize([result]).line()  # eager's row is no crash of a compiler


def test_a_family_past_the_budget_is_left_for_the_next_command(tmp_path):
    message = zoo.spawn("gpt2", _args(tmp_path), ("eager",), True, zoo.Budget(600.0, 0.5))
    assert "reruns it" in message and not zoo.json_path(tmp_path, "gpt2", True).exists()
    message = zoo.spawn("gpt2", _args(tmp_path), ("eager",), True, zoo.Budget(600.0, 0.0))
    assert "not started" in message


def test_families_with_a_json_are_skipped_unless_forced(tmp_path, monkeypatch):
    zoo.json_path(tmp_path, "gpt2", True).write_text("{}")
    spawned = []
    monkeypatch.setattr(zoo, "spawn", lambda name, *rest: spawned.append(name) or name)
    zoo.run_all(_args(tmp_path), tiny=True)
    assert spawned == ["vit"]
    spawned.clear()
    args = _args(tmp_path)
    args.force = True
    zoo.run_all(args, tiny=True)
    assert spawned == ["gpt2", "vit"]


def _row(mode, it_s, peak, **fields):
    return {"mode": mode, "it_s": it_s, "peak_bytes": peak, "kept_bytes": None, "first_step_s": 1.0,
            "error": None, "check_error": None, "memfuse_compile": {"graph_fallbacks": 0, "eager_calls": 0},
            "loss": 1.0, "loss_error": 0.0, "grad_error": 0.0, "fallback_reasons": [], **fields}


def test_summary_ratios_against_torch_compile():
    fast = {"model": "a", "kind": "encoder", "rows": [
        _row("torch_compile", 10.0, 100), _row("memfuse_backend", 12.0, 50), _row("memfuse_whole", 9.0, 50)]}
    slow = {"model": "b", "kind": "cnn", "rows": [
        _row("torch_compile", 10.0, 100), _row("memfuse_whole", None, None, error="RuntimeError: x"),
        _row("memfuse_backend", 10.0, 90, memfuse_compile={"graph_fallbacks": 2, "eager_calls": 0},
             fallback_reasons=["memfuse: graph dynamo_0/0 runs through torch (eager), not memfuse: GraphError"])]}
    summary = zoo.summarize([fast, slow])
    assert (summary.crashes, summary.fallbacks) == (1, 1)
    assert summary.speed_ratio["memfuse_backend"] == pytest.approx(1.1)
    assert summary.peak_ratio["memfuse_backend"] == pytest.approx(0.7)
    assert summary.meeting == {"memfuse_backend": 1, "memfuse_whole": 0}
    text = zoo.table([fast, slow], markdown=True)
    assert "| 1.20x |" in text and "| 0.50x |" in text and "GraphError" in text and "RuntimeError: x" in text


def test_a_family_batch_reaches_a_loss():
    """One tiny family of each batch builder: its call returns `.loss` (eager, CPU)."""
    picks = {family.inputs: family for family in reversed(list(ZOO.values())) if family.construct is None}
    for family in picks.values():
        model = hf_models.build(family, family.tiny, 0.0)
        loss = model(**family.make_batch(family.tiny, torch.device("cpu"))).loss
        assert loss.ndim == 0 and torch.isfinite(loss), family.name
