"""offload: saved values kept in host memory between the forward and the backward (Plan.offloaded).

The forward copies an offloaded value to pinned host memory on a side stream right after the step
that makes it, and drops its device tensor after its last forward reader: the forward returns the
host tensor in the saved value's place. The backward fetches it back on the same side stream a few
launching steps before its first reader (Config.offload_fetch_ahead), makes the compute stream wait
for the copy right before that reader, and drops the fetched copy after its last reader like any
input. The program text (runtime.program) calls the three functions here under `mf_` names.

Stream rules (CUDA):
- the side stream waits for the compute stream before each copy: the value is written there (the
  forward), and the fetched copy's memory was allocated there and may still be read by queued work
  that freed it (the backward);
- `record_stream(side)` on the offloaded device tensor, so the caching allocator does not hand its
  memory out again before the copy read it; the pinned host block's own event is recorded by torch's
  host allocator for a non-blocking copy;
- one side stream per device, in order: a backward's fetch runs after its forward's copy out.
On a CPU device (tests) the same calls run without streams: the "host" copy is a clone.
"""
from __future__ import annotations

from typing import Optional

import torch

_SIDE_STREAMS: dict = {}   # device -> the side stream its copies run on


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _host_like(value: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor for `value`: in its strides where they are dense (empty_like's
    preserve_format: a plain copy, and the backward reads the layout the forward wrote), else
    contiguous."""
    return torch.empty_like(value, device="cpu", pin_memory=pin)


def offload(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host copy of `value` (made on `device`), started now; the caller drops `value` after its
    last reader."""
    if value.device.type != "cuda":     # a CPU program's, or a host scalar beside a CUDA program's
        return value.clone() if value.device.type == "cpu" else value.to("cpu")
    side = side_stream(device)
    host = _host_like(value, pin=True)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        host.copy_(value, non_blocking=True)
    value.record_stream(side)
    return host


def fetch(host: torch.Tensor, device: torch.device) -> tuple:
    """(a device copy of `host`, the event its copy records, or None where nothing is waited for):
    started now on the side stream; `arrive` before the copy's first reader."""
    if device.type != "cuda" or host.device == device:    # a CPU program, or a hook unpacked it there
        return host.to(device), None
    side = side_stream(device)
    compute = torch.cuda.current_stream(device)
    fetched = torch.empty_like(host, device=device)     # on the compute stream, in host's strides
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        fetched.copy_(host, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(side)
    return fetched, ready


def arrive(ready: Optional["torch.cuda.Event"], device: torch.device) -> None:
    """The compute stream waits for a fetch's copy (nothing to wait for without an event)."""
    if ready is not None:
        torch.cuda.current_stream(device).wait_event(ready)


def settle(device: torch.device) -> None:
    """Wait on the host for the copies out: a saved-tensors hook that packs a host copy may read it
    on the host (torch's `save_on_cpu` copies it), which the side stream may not have written yet.
    Without a hook nothing on the host reads them, and the forward returns without waiting."""
    if device.type == "cuda":
        side_stream(device).synchronize()


def offload_fake(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A compile-only program's offload (fake tensors, no streams): a host tensor of its shape."""
    return torch.empty_like(value, device="cpu")


def fetch_fake(host: torch.Tensor, device: torch.device) -> tuple:
    return torch.empty_like(host, device=device), None
