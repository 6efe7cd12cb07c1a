"""Where one training step's peak memory goes: a CUDA memory snapshot of a `make bench-models`
model in one mode, read at its peak.

    python3 -m benchmarks.peak --model llama --mode memfuse_backend [--out DIR] [--timeline PNG]

The step runs twice first (compiles, warm caches), then once under
`torch.cuda.memory._record_memory_history`. The snapshot's trace is replayed to the moment the
most memory was allocated; the blocks alive then are grouped by where they were allocated (the
innermost frame in memfuse's generated programs, shown with that line's source, else in
transformers or memfuse, else the innermost frame at all) and printed largest first, with the
step's phase (forward or backward) at the peak. The raw snapshot is written as a pickle for
https://pytorch.org/memory_viz. Needs CUDA.

`--timeline PNG` (memfuse modes) also draws memfuse's own account of the same step: the bytes its
programs hold while each kernel or aten call of the forward, then of the backward, runs, saved
activations as their own band, the peak labelled with what is alive then (`memfuse.draw_memory`,
from the buffer plans at the batch's sizes, no CUDA measurement).
"""
from __future__ import annotations

import argparse
import gc
import pickle
import sys
from collections import defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import memfuse
from benchmarks.lib.hf_models import (FAMILIES, GPU_SETTINGS, MODES, WRAPPERS, Setup, Templates, forward_loss, fresh,
                                      make_batch)
from memfuse.runtime.program import Program

MB = 2 ** 20
TOP_GROUPS = 15
TIMELINE_MODES = ("memfuse_whole", "memfuse_backend")   # one memfuse program pair, or one per Dynamo graph


def program_sources() -> dict:
    """The source of every memfuse Program alive, by the file name its `run` was compiled under."""
    sources = {}
    for obj in gc.get_objects():
        if type(obj) is Program:      # (isinstance would call into dead weak proxies)
            for source, run in ((obj.source, obj.run), (obj.source_unhooked, obj.run_unhooked)):
                sources[run.__code__.co_filename] = source.splitlines()
    return sources


def where(frames: list, sources: dict) -> str:
    """The allocation's most telling frame: a generated program's line, else transformers' or
    memfuse's code, else the innermost frame."""
    for frame in frames:
        lines = sources.get(frame["filename"])
        if lines is not None and 0 < frame["line"] <= len(lines):
            return f"memfuse program: {lines[frame['line'] - 1].strip()[:110]}"
    for marker in ("transformers/", "memfuse/"):
        for frame in frames:
            if marker in frame["filename"]:
                short = frame["filename"].split(marker, 1)[1]
                return f"{marker}{short}:{frame['line']} ({frame['name']})"
    python = [f for f in frames if f["filename"].endswith(".py")]
    frame = (python or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
    return f"{frame['filename']}:{frame['line']} ({frame['name']})"


def live_at_peak(trace: list) -> tuple[int, int, dict]:
    """(peak bytes, index of the peak event, {address: alloc event alive then}), replaying allocs and frees."""
    alive, total, peak, peak_at, peak_alive = {}, 0, -1, 0, {}
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, peak_at, peak_alive = total, index, dict(alive)
        elif event["action"] == "free_completed" and event["addr"] in alive:
            total -= alive.pop(event["addr"])["size"]
    return peak, peak_at, peak_alive


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(FAMILIES), default="llama")
    parser.add_argument("--mode", choices=MODES, default="memfuse_backend")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--timeline", type=Path, metavar="PNG",
                        help=f"also draw memfuse's memory timeline of the step ({', '.join(TIMELINE_MODES)})")
    args = parser.parse_args(argv)
    if args.timeline is not None and args.mode not in TIMELINE_MODES:
        parser.error(f"--timeline draws memfuse's programs: --mode must be one of {', '.join(TIMELINE_MODES)}")
    if not torch.cuda.is_available():
        sys.exit("benchmarks.peak needs CUDA: a memory snapshot reads the CUDA caching allocator")
    family = FAMILIES[args.model]
    setup = Setup(torch.device("cuda"), tiny=False, settings=GPU_SETTINGS)
    templates = Templates.build(family, family.size, use_cache=False)
    batch = make_batch(family.size, setup.device)
    model = fresh(templates.dropout, setup.device)
    wrapped = WRAPPERS[args.mode](model, family)
    for _ in range(2):
        forward_loss(wrapped, batch, setup).backward()
    model.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=500_000)
    loss = forward_loss(wrapped, batch, setup)
    torch.cuda.synchronize()
    forward_events = len(torch.cuda.memory._snapshot()["device_traces"][0])
    loss.backward()
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    args.out.mkdir(parents=True, exist_ok=True)
    pickle_path = args.out / f"peak-{args.model}-{args.mode}.pickle"
    pickle_path.write_bytes(pickle.dumps(snapshot))

    trace = snapshot["device_traces"][0]
    peak, peak_at, alive = live_at_peak(trace)
    sources = program_sources()
    groups: dict = defaultdict(lambda: [0, 0])
    for event in alive.values():
        group = groups[where(event.get("frames", []), sources)]
        group[0] += event["size"]
        group[1] += 1
    phase = "forward" if peak_at < forward_events else "backward"
    print(f"{args.model} {args.mode}: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"allocated before the step (model, grads, batch): {base / MB:.0f} MB; allocated during the step "
          f"at its peak: {peak / MB:.0f} MB more, in the {phase} (event {peak_at} of {len(trace)})")
    print(f"{'MB':>8} {'blocks':>6}  allocated at")
    for name, (size, count) in sorted(groups.items(), key=lambda item: -item[1][0])[:TOP_GROUPS]:
        print(f"{size / MB:8.0f} {count:6d}  {name}")
    print(f"snapshot: {pickle_path}")
    if args.timeline is not None:
        with setup.autocast():
            drawing = memfuse.draw_memory(wrapped, **batch, path=args.timeline)
        print(f"timeline: {drawing.path}: {drawing.title}")


if __name__ == "__main__":
    main()
