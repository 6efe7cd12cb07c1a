"""Where one training step's GPU time goes: a `make bench-models` model in several modes, one
step each under torch.profiler, kernels grouped into classes and the largest listed.

    python3 -m benchmarks.profile_step --model gpt2 --modes torch_compile,memfuse_backend [--out DIR]

Each mode trains a fresh copy of the model (bf16 autocast, dropout as in the benchmark); three
steps warm it up, then one step is profiled. Per mode: the step's GPU time (the sum of its kernel
times: the GPU is busy back to back in these steps), that time by class (matmul, attention,
memfuse's Triton kernels, torch.compile's Triton kernels, copies and fills, other aten kernels),
its launches by class, and the --top kernels (default TOP_KERNELS) with the most time, with their
launch counts. Needs CUDA.

    python3 -m benchmarks.profile_step --model bert --origins [--top 40]

--origins profiles one more step per mode with the CPU's ops too and counts every launch by the
op that made it (the innermost op with kernels and ORIGIN_DEPTH - 1 of its parents), modes side
by side, the --top origins whose counts differ most first: where one mode's extra launches
come from (aten's sort-based embedding backward, casts as `.to` calls, the loss head's small ops).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.lib.hf_models import (FAMILIES, GPU_SETTINGS, MODES, WRAPPERS, Setup, Templates, fresh, make_batch,
                                      train_step)
from benchmarks.lib.profiling import WARM_STEPS, kernel_class, profiled_step

TOP_KERNELS = 15
# An origin is the op that launched a kernel and this many ops in all up its stack of CPU ops.
ORIGIN_DEPTH = 3
# torch.profiler files some Triton launches twice, once under a CPU event of this name
PROFILER_DUPLICATE = "Activity Buffer Request"


def launch_origin(stack: list, kernel: str) -> tuple:
    """(origin, kernel label) of one launch: `stack` the CPU ops from the one that launched it
    outwards, `kernel` its name. Triton kernels are one label (their names say their op); an aten
    kernel's is its name up to its template arguments."""
    origin = " < ".join(" ".join(op.split())[:40] for op in stack[:ORIGIN_DEPTH])
    if kernel_class(kernel) in ("memfuse kernels", "torch.compile kernels"):
        return origin, "triton"
    return origin, kernel.split("<")[0].split("(")[0].strip()[:48]


def origin_rows(counts: dict, top: int) -> list:
    """(counts per mode, origin, kernel) for the `top` (origin, kernel) pairs whose counts differ
    most between the modes (`counts`: mode -> Counter), then by the most launches."""
    keys = set().union(*counts.values())
    def spread(key):
        values = [c[key] for c in counts.values()]
        return (-(max(values) - min(values)), -max(values), key)
    return [([c[key] for c in counts.values()], *key) for key in sorted(keys, key=spread)[:top]]


def launches_by_origin(model, batch: dict, setup: Setup) -> Counter:
    """After WARM_STEPS, one step under torch.profiler with the CPU's ops: (origin, kernel label)
    -> launches."""
    for _ in range(WARM_STEPS):
        train_step(model, batch, setup)
    setup.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        train_step(model, batch, setup)
        setup.synchronize()
    counts: Counter = Counter()
    for event in trace.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.kernels \
                or event.name == PROFILER_DUPLICATE:
            continue
        stack, parent = [], event
        while parent is not None and len(stack) < ORIGIN_DEPTH:
            stack.append(parent.name)
            parent = parent.cpu_parent
        for kernel in event.kernels:
            counts[launch_origin(stack, kernel.name)] += 1
    return counts


def origins_report(model: str, counts: dict, top: int) -> str:
    modes = list(counts)
    lines = [f"## {model}: launches of one step by the op that made them",
             "", " | ".join(f"{m}: {sum(c.values())}" for m, c in counts.items()), "",
             "| " + " | ".join(modes) + " | origin (op < parents) | kernel |",
             "| " + " | ".join("---" for _ in modes) + " | --- | --- |"]
    lines += [f"| {' | '.join(map(str, values))} | {origin} | {kernel} |"
              for values, origin, kernel in origin_rows(counts, top)]
    return "\n".join(lines)


def profile_mode(family, templates: Templates, mode: str, setup: Setup, top_kernels: int = TOP_KERNELS) -> dict:
    model = WRAPPERS[mode](fresh(templates.dropout, setup.device), family)
    kernels: dict = defaultdict(lambda: [0.0, 0])
    for name, ms in profiled_step(model, make_batch(family.size, setup.device), setup):
        kernels[name][0] += ms
        kernels[name][1] += 1
    by_class: dict = defaultdict(float)
    launches_by_class: dict = defaultdict(int)
    for name, (ms, launches) in kernels.items():
        by_class[kernel_class(name)] += ms
        launches_by_class[kernel_class(name)] += launches
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top_kernels]
    return {"mode": mode, "gpu_ms": sum(ms for ms, _ in kernels.values()),
            "by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "launches_by_class": dict(launches_by_class),
            "top": [{"kernel": name, "ms": ms, "launches": n, "class": kernel_class(name)} for name, (ms, n) in top]}


def report(model: str, results: list) -> str:
    lines = [f"## {model}: GPU time of one step (ms)"]
    for r in results:
        launches = r.get("launches_by_class", {})
        classes = ", ".join(f"{label} {ms:.1f} ({launches.get(label, '?')} launches)"
                            for label, ms in r["by_class"].items())
        lines += ["", f"### {r['mode']}: {r['gpu_ms']:.1f} ms ({classes})", "",
                  "| ms | launches | class | kernel |", "| --- | --- | --- | --- |"]
        lines += [f"| {t['ms']:.2f} | {t['launches']} | {t['class']} | `{t['kernel'][:110]}` |" for t in r["top"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(FAMILIES), required=True)
    parser.add_argument("--modes", default="torch_compile,memfuse_backend",
                        help=f"comma-separated, from {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, help="directory for profile-MODEL.json and .md")
    parser.add_argument("--top", type=int, default=TOP_KERNELS, help="kernels (origins with --origins) listed per mode")
    parser.add_argument("--origins", action="store_true",
                        help="count launches by the CPU op that made them, modes side by side, instead")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs CUDA: the profile is of GPU kernels")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected some of {', '.join(MODES)}")
    family = FAMILIES[args.model]
    setup = Setup(torch.device("cuda"), tiny=False, settings=GPU_SETTINGS)
    templates = Templates.build(family, family.size, use_cache=False)
    if args.origins:
        counts = {}
        for mode in modes:
            torch._dynamo.reset()
            model = WRAPPERS[mode](fresh(templates.dropout, setup.device), family)
            counts[mode] = launches_by_origin(model, make_batch(family.size, setup.device), setup)
            del model
            torch.cuda.empty_cache()
        text, stem = origins_report(args.model, counts, args.top), f"origins-{args.model}"
        results = {mode: [[*key, n] for key, n in c.most_common()] for mode, c in counts.items()}
    else:
        results = []
        for mode in modes:
            torch._dynamo.reset()
            results.append(profile_mode(family, templates, mode, setup, args.top))
            torch.cuda.empty_cache()
        text, stem = report(args.model, results), f"profile-{args.model}"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{stem}.json").write_text(json.dumps(results, indent=1))
        (args.out / f"{stem}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
