"""Where a step's host time goes, from torch.profiler Chrome traces with CPU activity (the traces
`benchmarks.distributed --profile ... --trace-dir D` writes as host-trace-*.json): per CPU thread
(the main thread runs the forward and the optimizer, autograd's device thread the backward), its
time busy and, per region, the time its events cover: FSDP2's hooks, Dynamo's frames,
AOTAutograd's forward and backward, Inductor's calls, memfuse's loss head, collectives, the
optimizer. Events of a region nested in one another count once (their intervals merged).

    python -m benchmarks.host_trace D/host-trace-gpt2-fsdp2-torch_compile.json D/host-trace-gpt2-fsdp2-memfuse_backend.json
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

# region -> pattern of the event names it covers (CPU ops and record_function ranges)
REGIONS = {
    "FSDP2 hooks": r"^FSDP::",
    "Dynamo frame": r"^Torch-Compiled Region|^TorchDynamo Cache Lookup",
    "AOT forward": r"^CompiledFunction$",
    "AOT backward": r"CompiledFunctionBackward",
    "Inductor call": r"^## Call CompiledFxGraph",
    "memfuse loss head": r"^memfuse::linear_cross_entropy",
    "collectives": r"^nccl:|^c10d::|^record_param_comms",
    "optimizer": r"^Optimizer\.",
    "kernel launches": r"^cudaLaunchKernel|^cuLaunchKernel",
    "allocations": r"^cudaMalloc|^cudaFree",
    "synchronize": r"Synchronize$",
}


def merged_total(intervals: list) -> float:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    total, end_so_far = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= end_so_far:
            continue
        total += end - max(start, end_so_far)
        end_so_far = end
    return total


def top_level(thread: list) -> list:
    """The events of one thread that no other event of it contains (sorted by start)."""
    outer, end_so_far = [], float("-inf")
    for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end_so_far:
            outer.append(e)
            end_so_far = e["ts"] + e["dur"]
        elif e["ts"] + e["dur"] > end_so_far:      # overlapping, not nested: counted as its own
            outer.append(e)
            end_so_far = e["ts"] + e["dur"]
    return outer


def self_times(thread: list) -> list:
    """(name, count, ms) of one thread's events by the time of their own (less the events they
    contain), the most first."""
    own: dict = {}
    stack: list = []          # [end, name, children's us] of the open events
    def close(entry):
        end, name, start, children = entry
        count, us = own.get(name, (0, 0.0))
        own[name] = (count + 1, us + (end - start) - children)
        if stack:
            stack[-1][3] += end - start
    for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
        while stack and stack[-1][0] <= e["ts"]:
            close(stack.pop())
        stack.append([e["ts"] + e["dur"], e["name"], e["ts"], 0.0])
    while stack:
        close(stack.pop())
    return sorted(((name, count, us / 1e3) for name, (count, us) in own.items()), key=lambda row: -row[2])


def by_name(events: list) -> list:
    """(name, count, ms) of events grouped by name, the most time first."""
    groups: dict = {}
    for e in events:
        count, us = groups.get(e["name"], (0, 0.0))
        groups[e["name"]] = (count + 1, us + e["dur"])
    return sorted(((name, count, us / 1e3) for name, (count, us) in groups.items()), key=lambda row: -row[2])


def cpu_threads(path: Path) -> dict:
    """(pid, tid) -> the CPU events of that thread (complete events with a duration)."""
    events = json.loads(path.read_text())["traceEvents"]
    threads: dict = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"):
            continue
        if "dur" not in e or not isinstance(e.get("tid"), int):    # the profiler's own named rows
            continue
        threads.setdefault((e["pid"], e["tid"]), []).append(e)
    return threads


def thread_summaries(path: Path) -> dict:
    """(pid, tid) of each CPU thread -> {"span", "busy", region: ms}, in ms."""
    threads = cpu_threads(path)
    summaries = {}
    for key, thread in threads.items():
        intervals = [(e["ts"], e["ts"] + e["dur"]) for e in thread]
        summary = {"span": (max(b for _, b in intervals) - min(a for a, _ in intervals)) / 1e3,
                   "busy": merged_total(intervals) / 1e3}
        for region, pattern in REGIONS.items():
            matched = [(e["ts"], e["ts"] + e["dur"]) for e in thread if re.search(pattern, e["name"])]
            summary[region] = merged_total(matched) / 1e3
        summaries[key] = summary
    return summaries


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--min-busy-ms", type=float, default=1.0, help="leave out threads busier than nothing")
    parser.add_argument("--top", type=int, default=0,
                        help="per thread, also the N names with the most time among its outermost events, and "
                             "FSDP2's ranges by name")
    args = parser.parse_args(argv)
    for path in args.traces:
        print(f"== {path.name}")
        threads = cpu_threads(path) if args.top else {}
        for (pid, tid), summary in thread_summaries(path).items():
            if summary["busy"] < args.min_busy_ms:
                continue
            regions = ", ".join(f"{name} {ms:.2f}" for name, ms in summary.items()
                                if name not in ("span", "busy") and ms >= 0.01)
            print(f"  thread {tid}: span {summary['span']:.2f} ms, busy {summary['busy']:.2f} ms; {regions}")
            if args.top:
                for name, count, ms in by_name(top_level(threads[(pid, tid)]))[:args.top]:
                    print(f"      {ms:7.2f} ms {count:5d}x  {name[:100]}")
                for name, count, ms in self_times(threads[(pid, tid)])[:args.top]:
                    print(f"      {ms:7.2f} ms {count:5d}x  (own time) {name[:90]}")
                fsdp = [e for e in threads[(pid, tid)] if re.search(REGIONS["FSDP2 hooks"], e["name"])]
                for name, count, ms in by_name(fsdp):
                    print(f"      {ms:7.2f} ms {count:5d}x  (FSDP2) {name[:90]}")


if __name__ == "__main__":
    main()
