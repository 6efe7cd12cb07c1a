"""Where an FSDP2 forward's host time goes, unprofiled: the time between FSDP2's own forward hooks.

FSDP2 runs a pre-forward and a post-forward hook around each module it shards (each layer, then the
root), outside any compiled graph. `recording()` wraps those two hooks so that each call notes when
it started and returned; `segments()` turns one step's notes into the spans between them, named by
where they start and end:

- `layer 1 body`: from the layer's pre-forward hook returning to its post-forward hook starting,
  what the layer's call costs the host (Dynamo's frame, AOTAutograd's runtime, the program);
- `layer 1 pre hook`, `... post hook`: FSDP2's own work (all-gather, prefetch, reshard);
- `root pre hook → layer 1 pre hook` and the like: the root's code between its layers (embeddings
  before the first, final norm, head and loss after the last).

No profiler runs, so a span holds what it costs the host in a timed step, waits for a full launch
queue included; comparing two modes span by span finds which part of the forward one pays more.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Optional

import torch


@dataclasses.dataclass
class HookCall:
    module: int          # id() of the module the hook ran for
    hook: str            # "pre hook" or "post hook"
    started: float
    returned: float


class SpanRecorder:
    """Hook calls of the steps between begin_step() and end_step(), and their spans' sums."""

    def __init__(self):
        self.calls: list = []
        self.on = False
        self.step_started = 0.0
        self.totals: dict = {}
        self.steps = 0

    def note(self, module, hook: str, started: float) -> None:
        if self.on:
            self.calls.append(HookCall(id(module), hook, started, time.perf_counter()))

    def begin_step(self) -> None:
        self.calls.clear()
        self.on, self.step_started = True, time.perf_counter()

    def end_step(self, forward_returned: float) -> None:
        self.on = False
        for name, seconds in segments(self.calls, self.step_started, forward_returned).items():
            self.totals[name] = self.totals.get(name, 0.0) + seconds
        self.steps += 1

    def take_ms_per_step(self) -> dict:
        """{span: ms a step} over the steps since the last take; empty where no hook ran."""
        per_step = {name: round(s * 1e3 / self.steps, 3) for name, s in self.totals.items()} if self.steps else {}
        self.totals, self.steps = {}, 0
        return per_step


def _wrapped(hook_function, recorder: SpanRecorder, hook: str):
    @torch._dynamo.disable
    def timed(state, module, *args, **kwargs):
        started = time.perf_counter()
        try:
            return hook_function(state, module, *args, **kwargs)
        finally:
            recorder.note(module, hook, started)
    return timed


@contextlib.contextmanager
def recording(recorder: SpanRecorder):
    """FSDP2's forward hooks timed for modules sharded inside the block: the hooks are bound when
    `fully_shard` runs, so the block must hold it (the class's functions are restored after)."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    original = FSDPState._pre_forward, FSDPState._post_forward
    FSDPState._pre_forward = _wrapped(original[0], recorder, "pre hook")
    FSDPState._post_forward = _wrapped(original[1], recorder, "post hook")
    try:
        yield recorder
    finally:
        FSDPState._pre_forward, FSDPState._post_forward = original


def segments(calls: list, step_started: Optional[float] = None, forward_returned: Optional[float] = None) -> dict:
    """{span name: seconds} of one forward's hook calls (in call order), modules named by the order
    in which they first ran in this forward: the first "root" (the root's pre hook runs first), then
    "layer 1", "layer 2", ... (names that match across modes, whatever class wraps a layer): each
    hook call itself, and the span from
    each call's return to the next call's start, named "X body" where a module's pre hook is
    followed by its own post hook, else "from → to". With the step's start and the forward's
    return, the spans before the first and after the last hook call too."""
    order: dict = {}
    for call in calls:
        order.setdefault(call.module, f"layer {len(order)}" if order else "root")
    spans: dict = {}

    def add(name: str, seconds: float) -> None:
        spans[name] = spans.get(name, 0.0) + seconds

    if step_started is not None and calls:
        add(f"step start → {order[calls[0].module]} pre hook", calls[0].started - step_started)
    for i, call in enumerate(calls):
        here = f"{order[call.module]} {call.hook}"
        add(here, call.returned - call.started)
        if i + 1 < len(calls):
            after = calls[i + 1]
            body = call.hook == "pre hook" and after.hook == "post hook" and after.module == call.module
            add(f"{order[call.module]} body" if body else f"{here} → {order[after.module]} {after.hook}",
                after.started - call.returned)
    if forward_returned is not None and calls:
        add(f"{order[calls[-1].module]} {calls[-1].hook} → forward returned", forward_returned - calls[-1].returned)
    return spans
