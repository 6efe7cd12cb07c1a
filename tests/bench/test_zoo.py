"""benchmarks/zoo.py's machinery without running a model: the families' batches give a loss, the
timing lock excludes, a timing slot pauses the other workers and continues them (also when its
holder dies or overruns), the workers share the run's compile caches, a family past its timeout
gets a JSON saying so, one past the command's budget gets none (the next command reruns it), a
family with a JSON is skipped, a dropout-free family is checked on its timed model's first step,
and the summary's ratios (tests/models/test_zoo.py runs the families themselves)."""
import argparse
import collections
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

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
    defaults = dict(out=tmp_path, jobs=1, timeout=600.0, budget=None, force=False, use_cache=False,
                    families="gpt2,vit", modes="eager", tiny=True, dropout=hf_models.DROPOUT, compile_cache=None)
    return argparse.Namespace(**{**defaults, **fields})


def test_timing_lock_excludes_another_holder(tmp_path):
    path = tmp_path / "lock"
    with zoo.timing_lock(path):
        with open(path) as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]


def _becomes(pid: int, stopped: bool) -> bool:
    deadline = time.monotonic() + 5.0
    while (_state(pid) == "T") != stopped:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def other_worker(tmp_path):
    """A sleeping stand-in for a worker, in a session of its own, registered in tmp_path's run."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    zoo.register_worker(tmp_path, process.pid)
    yield process.pid
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_timing_slot_pauses_the_other_workers_and_continues_them(tmp_path, other_worker):
    zoo.register_worker(tmp_path, os.getpgid(0))  # the holder's own group is never paused
    slot = zoo.TimingSlot(tmp_path, settle_s=0.0)
    with slot.hold():
        assert _becomes(other_worker, stopped=True)
    assert _becomes(other_worker, stopped=False)
    assert slot.report()["slot_holds"] == 1 and slot.report()["workers_paused_most"] == 1
    assert slot.overruns == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_slot_pauses_no_process_but_a_workers(tmp_path):
    """A registration left by a killed command whose id another process took: never paused."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        zoo.register_worker(tmp_path, process.pid)
        (tmp_path / zoo.WORKERS_DIR / str(process.pid)).write_text("1")  # registered: a process started earlier
        assert zoo.registered_workers(tmp_path) == []
        with zoo.TimingSlot(tmp_path, settle_s=0.0).hold():
            time.sleep(0.1)
            assert _state(process.pid) != "T"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_slot_past_its_limit_continues_the_others(tmp_path, other_worker):
    slot = zoo.TimingSlot(tmp_path, settle_s=0.0, limit_s=0.1)
    with slot.hold():
        assert _becomes(other_worker, stopped=True)
        assert _becomes(other_worker, stopped=False)  # the watchdog, while the slot is still held
    assert slot.overruns == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_worker_that_exits_holding_the_slot_leaves_no_one_paused(tmp_path, other_worker):
    """The holder died (crashed, or ended at --timeout) between pausing and continuing."""
    holder = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    zoo.register_worker(tmp_path, holder.pid)
    os.killpg(other_worker, signal.SIGSTOP)
    assert zoo._exited(holder, None) == 0
    zoo.finish_worker(tmp_path, holder)
    assert _becomes(other_worker, stopped=False)
    assert zoo.registered_workers(tmp_path) == [other_worker]
    zoo.clear_workers(tmp_path)  # a new command forgets what an earlier one left
    assert zoo.registered_workers(tmp_path) == []


def test_workers_share_the_run_folders_compile_caches(tmp_path):
    env = zoo.worker_env(_args(tmp_path), tiny=True)
    cache = tmp_path / zoo.CACHE_DIR
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")
    assert env["TRITON_CACHE_DIR"] == str(cache / "triton") and env["MEMFUSE_CACHE_DIR"] == str(cache / "memfuse")
    assert zoo.worker_env(_args(tmp_path, compile_cache=tmp_path / "c"), tiny=True)["TRITON_CACHE_DIR"] == \
        str(tmp_path / "c" / "triton")


def test_a_run_record_is_no_family(tmp_path):
    """zoo-runs.json sits beside the families' JSONs: the report does not read it as one."""
    zoo.runs_path(tmp_path, False).write_text(json.dumps({"runs": []}))
    assert zoo.load_results(tmp_path, tiny=False) == []


def test_a_family_past_its_timeout_gets_a_json_that_says_so(tmp_path):
    """The worker (a fresh Python importing torch) cannot finish in 0.5 s: it is ended."""
    message = zoo.spawn("gpt2", _args(tmp_path), ("eager", "memfuse_whole"), True, zoo.Budget(0.5, None))
    result = json.loads(zoo.json_path(tmp_path, "gpt2", True).read_text())
    assert "timeout" in message and all(row["error"].startswith("timeout") for row in result["rows"])
    assert "1 crashes" in zoo.summarize([result]).line()  # eager's row is no crash of a compiler
    assert zoo.registered_workers(tmp_path) == []  # unregistered once ended


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


def test_dropout_free_families_share_one_template():
    """A family whose config takes no dropout (Llama) times and checks one model; one with dropout
    (GPT-2) gets a dropout-free copy, unless the run's dropout is 0."""
    llama, gpt2 = ZOO["llama"], ZOO["gpt2"]
    assert hf_models.Templates.build(llama, llama.tiny, use_cache=False).shared
    assert not hf_models.Templates.build(gpt2, gpt2.tiny, use_cache=False).shared
    assert hf_models.Templates.build(gpt2, gpt2.tiny, use_cache=False, dropout=0.0).shared
    assert hf_models.Templates.build(llama, llama.tiny, use_cache=False, dropout=0.3).shared  # any --dropout


@pytest.mark.parametrize("name, checked_on", [("llama", hf_models.CHECKED_ON_FIRST_STEP),
                                              ("gpt2", hf_models.CHECKED_ON_COPY)])
def test_a_dropout_free_family_is_checked_on_its_timed_first_step(name, checked_on, monkeypatch):
    """Llama's check compiles nothing more: no second dropout-free step; GPT-2's runs one."""
    family = ZOO[name]
    setup = hf_models.Setup(torch.device("cpu"), True, hf_models.TINY_SETTINGS)
    case, reference = hf_models.prepare(family, setup)
    copies = []
    original = hf_models.dropout_free_step
    monkeypatch.setattr(hf_models, "dropout_free_step", lambda *a: copies.append(a) or original(*a))
    row = hf_models.run_mode(case, "eager", reference)
    assert row.checked_on == checked_on and len(copies) == (checked_on == hf_models.CHECKED_ON_COPY)
    assert row.error is None and row.check_error is None
    assert row.loss == pytest.approx(reference.loss) and row.grad_error == pytest.approx(0.0, abs=1e-6)
    assert row.compile_cached is None  # eager looks nothing up


def test_compile_cache_lookups_say_whether_every_one_hit(monkeypatch):
    fresh_counters = lambda: collections.defaultdict(collections.Counter)  # noqa: E731  (as torch's)
    setup = hf_models.Setup(torch.device("cuda"), False, hf_models.GPU_SETTINGS)
    monkeypatch.setattr(torch._dynamo.utils, "counters", fresh_counters())
    stats = {"kernels_generated": 10, "kernels_shared": 4, "kernels_loaded": 6}
    torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"] += 2
    lookups, cached = hf_models.compile_cache(stats, setup)
    assert cached is True and lookups["memfuse_binaries_compiled"] == 0
    torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_miss"] += 1
    assert hf_models.compile_cache(stats, setup)[1] is False
    assert hf_models.compile_cache({**stats, "kernels_loaded": 5}, setup)[0]["memfuse_binaries_compiled"] == 1
    monkeypatch.setattr(torch._dynamo.utils, "counters", fresh_counters())
    assert hf_models.compile_cache({}, setup)[1] is None


def test_the_report_says_how_its_timings_and_checks_were_made():
    results = [{"model": "llama", "dropout": 0.1, "timed_model_is_checked": True, "metadata": {"settings": {}},
                "run": {"slot_holds": 4}},
               {"model": "gpt2", "dropout": 0.1, "timed_model_is_checked": False, "metadata": {}, "run": None}]
    text = zoo.how_made(results)
    assert "every other family's process paused" in text and "first step for 1 of 2 families" in text
    assert "dropout: 0.1" in text
    del results[0]["run"]  # a JSON from before the timing slots
    assert "not clean" in zoo.how_made(results)
