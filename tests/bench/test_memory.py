"""benchmarks/memory.py (make bench-memory): the doubling-then-bisection search over a fake
`fits`, a mode's search resuming from an earlier command's sizes, errors recorded as a size's
failure, the checkpoint-offload mode, the report, and one tiny run in fresh processes."""
import json
import os
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import memory  # noqa: E402


def fits_up_to(largest: int, calls: list):
    def fits(size):
        calls.append(size)
        return size <= largest
    return fits


def test_search_doubles_then_bisects_to_the_granularity():
    calls = []
    found = memory.search(fits_up_to(1000, calls), start=256, granularity=64, limit=1 << 20)
    assert found.largest == 960 and found.smallest_failed == 1024 and found.complete
    # doubling 256, 512, 1024 (fails); bisection 768, 896, 960
    assert found.tried == (256, 512, 1024, 768, 896, 960) == tuple(calls)


def test_search_where_the_start_fails_or_nothing_fails():
    assert memory.search(fits_up_to(100, []), 256, 64, 4096) == memory.Search(None, 256, (256,), True)
    everything = memory.search(fits_up_to(10**9, []), 256, 64, 4096)
    assert everything.largest == 4096 and everything.smallest_failed is None and everything.complete
    batches = memory.search(fits_up_to(5, []), 1, 1, 4096)
    assert batches.largest == 5 and batches.tried == (1, 2, 4, 8, 6, 5)


def test_search_stops_where_fits_says_the_time_is_spent():
    answers = iter([True, True, None])
    found = memory.search(lambda size: next(answers), 16, 8, 1024)
    assert found == memory.Search(32, None, (16, 32, 64), complete=False)


def _fake_probe(largest_tokens: int, calls: list):
    def probe(run, mode, seq, batch):
        calls.append((batch, seq))
        fits = batch * seq <= largest_tokens
        return {"fits": fits, "seq": seq, "batch": batch, "oom": not fits, "step_s": 1.0,
                "tokens_per_s": float(batch * seq), "peak_bytes": batch * seq * 10**6,
                **({} if fits else {"error": "OutOfMemoryError: CUDA out of memory"})}
    return probe


def _run(deadline=float("inf")):
    return memory.Run(memory.TINY, tiny=True, timeout_s=10, cap_tokens=None, deadline=deadline)


def test_a_mode_search_reuses_the_sizes_an_earlier_command_tried(monkeypatch):
    calls = []
    first = memory.search_mode(_run(deadline=time.monotonic() - 1), memory.Mode("eager"), "seq", 0,
                               probe=_fake_probe(40, calls))
    assert not first["complete"] and calls == []  # past the deadline: no size starts
    partial = memory.search_mode(_run(), memory.Mode("eager"), "seq", 0, probe=_fake_probe(40, calls))
    assert partial["largest"] == 40 and partial["complete"] and partial["at_largest"]["tokens_per_s"] == 40
    calls.clear()
    again = memory.search_mode(_run(), memory.Mode("eager"), "seq", 0, probe=_fake_probe(40, calls),
                               known=partial["probes"])
    assert calls == [] and again["largest"] == 40
    batch = memory.search_mode(_run(), memory.Mode("eager"), "batch", 16, probe=_fake_probe(40, calls))
    assert batch["largest"] == 2 and all(seq == 16 for _, seq in calls)


def test_a_failing_size_records_its_error_and_whether_it_ran_out_of_memory(monkeypatch):
    def raises(error):
        def train_size(*args):
            raise error
        return train_size

    monkeypatch.setattr(memory, "train_size", raises(ValueError("memfuse: memory_budget must be a number")))
    failed = memory.run_one(memory.TINY, memory.Mode.parse("memfuse@12GB"), 16, 1, cuda=False, cap_tokens=None)
    assert failed["fits"] is False and failed["oom"] is False and failed["error"].startswith("ValueError: memfuse")
    monkeypatch.setattr(memory, "train_size", raises(torch.OutOfMemoryError("CUDA out of memory")))
    assert memory.run_one(memory.TINY, memory.Mode("eager"), 16, 1, cuda=False, cap_tokens=None)["oom"] is True
    capped = memory.run_one(memory.TINY, memory.Mode("eager"), 32, 1, cuda=False, cap_tokens=24)
    assert capped["fits"] is False and "tiny cap" in capped["error"]


def test_an_out_of_memory_wrapped_by_a_library_still_counts_as_one():
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        except torch.OutOfMemoryError as error:
            raise RuntimeError("memfuse: the first run failed") from error
    except RuntimeError as wrapped:
        assert memory.is_out_of_memory(wrapped)
    assert not memory.is_out_of_memory(ValueError("memory_budget must be a number"))


def test_a_memfuse_size_run_through_torch_does_not_fit_in_that_mode():
    """memfuse's program failed its first run (an out-of-memory, say) and torch ran the step: the
    size is torch's, not memfuse's; the numbers stay beside the reason."""
    measured = {"fits": True, "tokens_per_s": 10.0, "memfuse": {"compiles": 1, "first_run_fallbacks": 1}}
    judged = memory.judge_through_torch(measured)
    assert judged["fits"] is False and "first_run_fallbacks 1" in judged["error"]
    assert judged["tokens_per_s"] == 10.0
    clean = {"fits": True, "memfuse": {"compiles": 1, "first_run_fallbacks": 0, "eager_calls": 0}}
    assert memory.judge_through_torch(clean) is clean
    assert memory.judge_through_torch({"fits": True, "memfuse": None})["fits"]  # not a memfuse mode


def test_mode_names_carry_budgets():
    assert memory.Mode.parse("memfuse@12GB") == memory.Mode("memfuse", "12GB")
    assert memory.Mode.parse("torch_compile@0.1").name == "torch_compile@0.1"
    assert memory._memfuse_budget("12GB") == "12GB" and memory._memfuse_budget("0.3") == 0.3
    assert memory._memfuse_budget("") is None
    for bad in ("eager@0.5", "sometimes"):
        with pytest.raises(ValueError):
            memory.Mode.parse(bad)


def test_checkpoint_offload_packs_each_layers_input_once_and_keeps_the_gradients(monkeypatch):
    """The offload mode's save_on_cpu sees each checkpointed layer's input hidden states and
    nothing the layer saves inside (that is recomputed); the gradients are eager's."""
    import transformers
    packed = []
    real_save_on_cpu = torch.autograd.graph.save_on_cpu

    class CountingSaveOnCpu(real_save_on_cpu):
        def __init__(self, pin_memory=False, device_type="cuda"):
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook
            self.pack_hook = lambda tensor: packed.append(tuple(tensor.shape)) or pack(tensor)

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    config = memory.llama_config(memory.TINY, 16)
    ids = torch.randint(0, memory.TINY.vocab, (1, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    for mode in ("eager", "checkpoint_offload"):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).train()
        memory.wrap(model, memory.Mode(mode), cuda=False)(input_ids=ids, labels=ids).loss.backward()
        grads[mode] = {name: p.grad for name, p in model.named_parameters()}
    assert packed.count((1, 16, memory.TINY.hidden)) == memory.TINY.layers
    assert all(shape != (1, 16, memory.TINY.ffn) for shape in packed)  # the MLP's insides are recomputed
    for name, grad in grads["eager"].items():
        torch.testing.assert_close(grads["checkpoint_offload"][name], grad, rtol=1e-5, atol=1e-6)


def _row(mode, largest, tokens_per_s, failure=None):
    at = {"tokens_per_s": tokens_per_s, "peak_bytes": 5 * 10**9}
    return {"mode": mode, "search": "seq", "seq": None, "largest": largest, "complete": True,
            "at_largest": at if largest else None, "first_failure": failure}


def test_the_report_compares_each_mode_with_the_best_peer():
    rows = [_row("eager", 4096, 1000.0), _row("checkpoint", 8192, 800.0),
            _row("memfuse", 16384, 1200.0), _row("memfuse@12GB", None, 0,
                                                 {"oom": False, "error": "ValueError: memory_budget must be"})]
    assert memory.best_peer(rows)["mode"] == "checkpoint"  # memfuse is no peer
    text = memory.table(rows, "seq")
    assert "| memfuse | 16384 | 1200 | 5.0 | 2.00x | 1.50x | - |" in text
    assert "| memfuse@12GB | none fits | - | - | - | - | ValueError: memory_budget must be |" in text
    assert "Best peer: checkpoint (8192)" in text


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_tiny_run_in_fresh_processes(tmp_path, capsys):
    """Two modes searched in fresh processes against a fake cap of 16 tokens: 16 fits, 32 and
    24 fail; the report and chart are written; a second command skips both modes."""
    args = ["--tiny", "--modes", "eager,checkpoint_offload", "--tiny-cap-tokens", "16", "--chart-seq", "16",
            "--out", str(tmp_path), "--charts", str(tmp_path / "charts")]
    memory.main(args)
    result = json.loads((tmp_path / "memory-tiny.json").read_text())
    for row in result["seq"]:
        assert (row["largest"], row["tried"], row["complete"]) == (16, [16, 32, 24], True), row
        assert row["at_largest"]["tokens_per_s"] > 0 and "tiny cap" in row["first_failure"]["error"]
    assert [point["mode"] for point in result["chart"]] == ["eager", "checkpoint_offload"]
    assert result["metadata"]["tiny"] and result["batch"] == []
    markdown = (tmp_path / "memory-tiny.md").read_text()
    assert "| eager | 16 |" in markdown and "TINY RUN" in markdown
    assert (tmp_path / "charts" / "memory-tiny-seq16.png").exists()
    capsys.readouterr()
    memory.main(args)
    assert capsys.readouterr().out.count("done earlier") == 2


def test_start_and_granularity_from_the_command_replace_the_defaults():
    coarse = memory.Run(memory.MODELS["llama16"], tiny=False, timeout_s=10, cap_tokens=None,
                        deadline=float("inf"), start=8192, granularity=4096)
    assert memory.search_bounds("seq", coarse) == (8192, 4096, memory.SEQ_LIMIT)
    default = memory.Run(memory.MODELS["llama16"], False, 10, None, float("inf"))
    assert memory.search_bounds("seq", default)[:2] == (memory.SEQ_START, memory.SEQ_GRANULARITY)
    assert memory.search_bounds("batch", default)[:2] == (memory.BATCH_START, memory.BATCH_GRANULARITY)


def _running(pid: int) -> bool:
    """Whether `pid` still runs: a killed process that nothing has reaped yet is a zombie (Z)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_size_past_its_timeout_is_killed_with_the_processes_it_started(tmp_path):
    """The size's process and a process it started (as inductor starts compile workers, holding its
    output pipes) are both gone when the timeout answers, not when they end on their own."""
    marker = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {marker}; sleep 60"
    started = time.monotonic()
    assert memory.run_in_own_group(["sh", "-c", script], dict(os.environ), timeout_s=1) is None
    assert time.monotonic() - started < 30
    time.sleep(0.2)
    assert not _running(int(marker.read_text()))
    done = memory.run_in_own_group(["sh", "-c", "echo RESULT {}"], dict(os.environ), timeout_s=30)
    assert done.returncode == 0 and done.stdout.strip() == "RESULT {}"


def test_the_chart_reuses_a_size_either_search_tried(tmp_path):
    calls = []
    run = _run()
    batch = memory.search_mode(run, memory.Mode("eager"), "batch", 16, probe=_fake_probe(40, calls))
    path = memory.mode_path(tmp_path, run.model.name, "batch", memory.Mode("eager"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(batch))
    calls.clear()
    points = memory.chart_points(run, [memory.Mode("eager"), memory.Mode("checkpoint")], 16, tmp_path,
                                 probe=_fake_probe(40, calls))
    assert calls == [(1, 16)]  # checkpoint's only: eager's batch search tried batch 1 x 16
    assert [(p["mode"], p["tokens_per_s"]) for p in points] == [("eager", 16.0), ("checkpoint", 16.0)]


# -- issue 52's recipes and byte budgets ------------------------------------------------------------
def _tiny_llama():
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(memory.llama_config(memory.TINY, 16)).train()


def test_per_layer_is_fuse_layers_and_the_eager_rest_stays_a_mode_of_its_own():
    """memfuse_per_layer is the recipe users get (memfuse.fuse_layers: the rest compiled through the
    backend, its loss head chunked); memfuse_per_layer_eager_rest leaves the rest eager."""
    from memfuse.fronts.module import FusedModule
    for mode, rest_compiled in (("memfuse_per_layer", True), ("memfuse_per_layer_eager_rest", False)):
        model = _tiny_llama()
        wrapped = memory.wrap(model, memory.Mode.parse(mode), cuda=False)
        assert wrapped is model and all(isinstance(layer, FusedModule) for layer in model.model.layers)
        assert (model._compiled_call_impl is not None) is rest_compiled, mode
    assert "memfuse_per_layer_eager_rest" not in memory.MODES


class _Mlp(torch.nn.Module):
    """Three pre-norm MLP layers on a residual stream whose activations outweigh the weights (as
    tests/plan/test_budget.py's residual_layers): a target under the default peak recomputes."""

    def __init__(self):
        super().__init__()
        self.ups = torch.nn.ParameterList(torch.randn(16, 64) / 4 for _ in range(3))
        self.downs = torch.nn.ParameterList(torch.randn(64, 16) / 4 for _ in range(3))

    def forward(self, x):
        for up, down in zip(self.ups, self.downs):
            x = x + torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, x.shape[-1:]) @ up) @ down
        return x.square().mean()


def _summary_of_a_step(memory_budget):
    import memfuse
    torch.manual_seed(0)
    model = _Mlp()
    wrapped = memfuse.memory_efficient_fusion(model, memory_budget=memory_budget)
    wrapped(torch.randn(256, 16)).backward()
    return memory.plan_summary(wrapped, model)


def test_plan_summary_records_the_predicted_peak_target_and_what_the_budget_moved():
    default = _summary_of_a_step(None)
    assert default["graphs"][0]["target_bytes"] is None and default["recomputed_for_budget"] == 0
    target = default["predicted_peak_bytes"] - 64 * 1024
    budgeted = _summary_of_a_step(target)
    graph, = budgeted["graphs"]
    assert graph["target_bytes"] == target and graph["default_plan_peak_bytes"] == default["predicted_peak_bytes"]
    assert budgeted["predicted_peak_bytes"] <= target and budgeted["recomputed_for_budget"] > 0
    assert memory.plan_summary(_Mlp(), _Mlp()) is None  # nothing fused: no plans


def test_a_target_below_the_least_is_recorded_as_such_not_as_an_out_of_memory(monkeypatch):
    from memfuse.plan import MemoryBudgetError
    with pytest.raises(MemoryBudgetError) as raised:
        _summary_of_a_step("1KB")
    assert raised.value.target_bytes == 1000 and raised.value.least_bytes > 1000

    def train_size(*args):
        try:
            raise raised.value
        except MemoryBudgetError as error:
            raise RuntimeError("a library wrapped it") from error

    monkeypatch.setattr(memory, "train_size", train_size)
    failed = memory.run_one(memory.TINY, memory.Mode.parse("memfuse@1KB"), 16, 1, cuda=False, cap_tokens=None)
    assert failed["fits"] is False and failed["oom"] is False and failed["least_bytes"] == raised.value.least_bytes
    least = raised.value.least_bytes
    assert failed["error"] == f"target below the least: {least / 1e9:.2f} GB ({least} bytes)"
    assert "MemoryBudgetError" in failed["detail"] and memory.below_least(ValueError("other")) is None


def test_the_byte_budget_table_sets_measured_against_target_and_predicted_against_measured():
    fitted = {"fits": True, "batch": 1, "seq": 4096, "peak_bytes": 11 * 10**9, "optimizer_state_bytes": 10**9,
              "plans": {"predicted_peak_bytes": 9 * 10**9, "offloaded": 3, "recomputed_for_budget": 5}}
    below = {"fits": False, "batch": 1, "seq": 8192, "oom": False, "least_bytes": 14 * 10**9,
             "error": "target below the least: 14.0 GB"}
    rows = [{**_row("memfuse@12GB", 4096, 900.0), "probes": [below, fitted]},
            {**_row("memfuse@0.3", 4096, 900.0), "probes": [fitted]}, {**_row("eager", 4096, 1.0), "probes": []}]
    text = memory.budget_table(rows)
    assert "| memfuse@12GB | 1 x 4096 | 12.0 | 9.0 | 11.0 | 1.0 | 0.92 | 0.90 | 3 | 5 |" in text
    assert "| memfuse@12GB | 1 x 8192 | 12.0 | target below the least: 14.0 GB |" in text
    assert "memfuse@0.3" not in text and "eager" not in text  # a fraction is no byte target
    assert memory.target_bytes(memory.Mode.parse("memfuse@1500000000B")) == 1_500_000_000
    assert "Byte budgets" in memory.report("m", {"seq": rows, "batch": []}, [], tiny=False)


def test_memfuse_auto_takes_checkpointings_peak_at_the_chart_size(tmp_path):
    calls = []
    resolved = memory.resolve_auto(_run(), 16, tmp_path, probe=_fake_probe(40, calls))
    assert resolved == memory.Mode("memfuse", "16000000B") and calls == [(1, 16)]  # checkpoint's probe
    assert memory.resolve_auto(_run(), 16, tmp_path, probe=_fake_probe(40, calls)) == resolved  # kept
    assert len(calls) == 1
    assert "needs --chart-seq" in memory.resolve_auto(_run(), None, tmp_path)
    assert "out of memory" in memory.resolve_auto(_run(), 64, tmp_path, probe=_fake_probe(40, []))
    chart = [{"mode": "checkpoint", "fits": True, "seq": 16, "peak_bytes": 16 * 10**6, "tokens_per_s": 100.0},
             {"mode": resolved.name, "fits": True, "seq": 16, "peak_bytes": 15 * 10**6, "tokens_per_s": 150.0}]
    assert "150 tokens/s, 1.50x checkpointing's 100" in memory.versus_checkpoint(chart)
    assert memory.versus_checkpoint(chart[:1]) == ""
