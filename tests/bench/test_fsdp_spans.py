"""benchmarks.fsdp_spans: one forward's FSDP2 hook calls turned into named spans."""
import time

import pytest
import torch

from benchmarks.lib import fsdp_spans
from benchmarks.lib.fsdp_spans import HookCall


def _calls(*events):
    """(module id, hook, started, returned) tuples as HookCalls."""
    return [HookCall(*event) for event in events]


def test_segments_name_bodies_hooks_and_the_spans_between():
    # root pre hook, layer A (pre, post), layer B (pre, post), root post hook
    calls = _calls((10, "pre hook", 1.0, 1.5), (20, "pre hook", 2.0, 2.25), (20, "post hook", 4.0, 4.5),
                   (30, "pre hook", 5.0, 5.5), (30, "post hook", 7.0, 7.25), (10, "post hook", 9.0, 9.5))
    spans = fsdp_spans.segments(calls, step_started=0.5, forward_returned=10.0)
    assert spans == {
        "step start → root pre hook": 0.5,
        "root pre hook": 0.5,
        "root pre hook → layer 1 pre hook": 0.5,
        "layer 1 pre hook": 0.25,
        "layer 1 body": 1.75,
        "layer 1 post hook": 0.5,
        "layer 1 post hook → layer 2 pre hook": 0.5,
        "layer 2 pre hook": 0.5,
        "layer 2 body": 1.5,
        "layer 2 post hook": 0.25,
        "layer 2 post hook → root post hook": 1.75,
        "root post hook": 0.5,
        "root post hook → forward returned": 0.5,
    }
    assert sum(spans.values()) == pytest.approx(10.0 - 0.5)     # the spans tile the forward


def test_segments_of_no_calls_and_without_the_step_bounds():
    assert fsdp_spans.segments([]) == {}
    one = _calls((1, "pre hook", 0.0, 1.0), (1, "post hook", 3.0, 4.0))
    assert fsdp_spans.segments(one) == {"root pre hook": 1.0, "root body": 2.0, "root post hook": 1.0}


def test_recorder_sums_steps_and_takes_a_mean_per_step():
    recorder = fsdp_spans.SpanRecorder()
    module = torch.nn.Linear(1, 1)
    for _ in range(2):
        recorder.begin_step()
        recorder.note(module, "pre hook", time.perf_counter())
        recorder.note(module, "post hook", time.perf_counter())
        recorder.end_step(recorder.calls[-1].returned)
    recorder.note(module, "pre hook", 0.0)                   # off between steps: not noted
    assert recorder.calls[-1].hook == "post hook"
    per_step = recorder.take_ms_per_step()
    assert set(per_step) == {"step start → root pre hook", "root pre hook", "root body",
                             "root post hook", "root post hook → forward returned"}
    assert all(ms >= 0 for ms in per_step.values())
    assert recorder.take_ms_per_step() == {}                   # taken: the sums start again


def test_recording_wraps_fsdp2s_hooks_and_restores_them():
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    before = FSDPState._pre_forward, FSDPState._post_forward
    with fsdp_spans.recording(fsdp_spans.SpanRecorder()):
        assert (FSDPState._pre_forward, FSDPState._post_forward) != before
    assert (FSDPState._pre_forward, FSDPState._post_forward) == before
