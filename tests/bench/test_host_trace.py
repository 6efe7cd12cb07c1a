"""benchmarks/host_trace.py: a step's host time by region, from a torch.profiler Chrome trace."""
import json

import torch
from torch.profiler import ProfilerActivity, profile

import memfuse  # noqa: F401  registers backend="memfuse"
from benchmarks import host_trace


def test_merged_intervals_count_overlaps_once():
    assert host_trace.merged_total([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20


def test_outermost_events_and_own_times_by_name():
    events = [{"name": "step", "ts": 0, "dur": 100}, {"name": "mm", "ts": 10, "dur": 30},
              {"name": "launch", "ts": 15, "dur": 5}, {"name": "mm", "ts": 50, "dur": 20},
              {"name": "optimizer", "ts": 120, "dur": 10}]
    assert [e["name"] for e in host_trace.top_level(events)] == ["step", "optimizer"]
    own = {name: (count, ms) for name, count, ms in host_trace.self_times(events)}
    assert own == {"step": (1, 0.05), "mm": (2, 0.045), "launch": (1, 0.005), "optimizer": (1, 0.01)}


def test_a_compiled_step_splits_into_its_regions(tmp_path, capsys):
    """A training step of a function under the memfuse backend, profiled on the CPU: Dynamo's
    frame, AOTAutograd's forward and backward and the optimizer each cover some of the thread's
    busy time, and --top lists the step's outermost events."""
    linear = torch.nn.Linear(16, 16)
    compiled = torch.compile(lambda x: linear(x).relu().sum(), backend="memfuse")
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)
    x = torch.randn(8, 16)
    compiled(x).backward()
    with profile(activities=[ProfilerActivity.CPU]) as trace:
        compiled(x).backward()
        optimizer.step()
    path = tmp_path / "host-trace.json"
    trace.export_chrome_trace(str(path))
    summaries = host_trace.thread_summaries(path)
    busiest = max(summaries.values(), key=lambda s: s["busy"])
    for region in ("Dynamo frame", "AOT forward", "AOT backward", "optimizer"):
        assert 0 < busiest[region] <= busiest["busy"] + 1e-6, region
    host_trace.main([str(path), "--top", "5"])
    printed = capsys.readouterr().out
    assert "CompiledFunctionBackward" in printed and "(own time)" in printed
    assert json.loads(path.read_text())["traceEvents"]
