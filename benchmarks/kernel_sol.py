"""Each memfuse kernel of one training step against bandwidth SOL: the bytes it must move at the
launch's sizes over its GPU time, as a fraction of the copy bandwidth measured in the same run.

    python3 -m benchmarks.kernel_sol --model gpt2,llama,bert [--mode memfuse_backend] [--out DIR]
    python3 -m benchmarks.kernel_sol --model gpt2 --tiny      # CPU, the Triton interpreter: no times

A `make bench-models` model (bf16 autocast, dropout as in the benchmark) trains in a memfuse mode;
after the warm-up steps one step runs under torch.profiler (benchmarks.profile_step) and inside
memfuse's launch log (memfuse.runtime.launch_log), which records each launch's M, grid, launch
configuration and must-move bytes: every [M, D], [M] and [D] value the kernel reads or writes,
once (KernelSource.bytes_per_row x M + bytes_per_launch). A looped kernel re-reads its inputs once
a pass, and a kernel with column sums writes and reads back fp32 partials: that traffic is listed
beside the must-move bytes, not counted in them. The profiler's memfuse_* kernels, in the order
they started, are the log's launches in order (one stream). --tiny runs the tiny configs on the CPU
in fp32: the same table without GPU times (a test of the harness, not a measurement).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.models import FAMILIES, GPU_SETTINGS, TINY_SETTINGS, WRAPPERS, Setup, Templates, fresh, make_batch, \
    train_step
from benchmarks.profile_step import profiled_step
from memfuse.runtime import launch_log

MEMFUSE_MODES = ("memfuse_backend", "memfuse_whole", "memfuse_per_layer")
KERNEL_PREFIX = "memfuse_"        # the generated kernels' names (codegen: the group's name)
TARGET_MS = 0.5                   # issue 17: every kernel of at least this much GPU time per step ...
TARGET_SOL = 0.8                  # ... reaches this fraction of the copy bandwidth
MB = 1e6


def logged_launches(model, batch: dict, setup: Setup) -> list:
    """One step's memfuse launches as dicts (LaunchRecord fields), in launch order, each with its GPU
    time (`ms`) on CUDA. On the CPU the step is the first: the compile's launches are the step's."""
    if setup.device.type != "cuda":
        with launch_log() as records:
            train_step(model, batch, setup)
        return [dict(dataclasses.asdict(r), ms=None) for r in records]
    records: list = []

    @contextlib.contextmanager
    def logged():
        with launch_log() as launches:
            yield
        records.extend(launches)

    kernels = [(name, ms) for name, ms in profiled_step(model, batch, setup, logged) if name.startswith(KERNEL_PREFIX)]
    names = [r.kernel for r in records]
    if [name for name, _ in kernels] != names:
        raise RuntimeError(f"kernel_sol: the profile's memfuse kernels ({len(kernels)}) are not the launch log's "
                           f"({len(names)}) in order: the profile's first {kernels[:3]}, the log's first {names[:3]}")
    return [dict(dataclasses.asdict(r), ms=ms) for r, (_, ms) in zip(records, kernels)]


def copy_bandwidth() -> float:
    """Bytes per second (read + write) of a 1 GiB device-to-device copy, measured now."""
    from benchmarks.long_rows import copy_bandwidth as measured   # (imports triton.testing: CUDA only)
    return measured()


def with_rates(launches: list, bandwidth: float | None) -> list:
    """Each launch with its GB/s and fraction of `bandwidth` (must-move bytes over its time), or
    None for both without times."""
    for launch in launches:
        rate = launch["must_move"] / (launch["ms"] * 1e-3) if launch["ms"] else None
        launch["gb_s"] = rate / 1e9 if rate is not None else None
        launch["sol"] = rate / bandwidth if rate is not None and bandwidth else None
    return launches


def sol_model(model_name: str, mode: str, setup: Setup, bandwidth: float | None) -> dict:
    family = FAMILIES[model_name]
    size = family.tiny if setup.tiny else family.size
    templates = Templates.build(family, size, use_cache=False)
    torch._dynamo.reset()
    model = WRAPPERS[mode](fresh(templates.dropout, setup.device), family)
    launches = with_rates(logged_launches(model, make_batch(size, setup.device), setup), bandwidth)
    launches.sort(key=lambda r: -(r["ms"] if r["ms"] is not None else r["must_move"]))
    return {"model": model_name, "mode": mode, "tiny": setup.tiny, "copy_gb_s": bandwidth / 1e9 if bandwidth else None,
            "device": torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu",
            "launches": launches}


def _config(c: dict) -> str:
    text = f"{c['block_m']}x, {c['num_warps']}w"
    return text + (f", {c['programs_per_sm']}/SM, {c['num_stages']}st" if c["programs_per_sm"] else "")


def report(result: dict) -> str:
    """The Markdown table: one row a launch, the longest first (most bytes first without times)."""
    launches, timed = result["launches"], result["copy_gb_s"] is not None
    title = f"## {result['model']}, {result['mode']}: memfuse kernels against bandwidth SOL"
    if timed:
        total = sum(r["ms"] for r in launches)
        moved = sum(r["must_move"] for r in launches)
        slow = [r for r in launches if r["ms"] >= TARGET_MS and r["sol"] < TARGET_SOL]
        lines = [title, "", f"{result['device']}: copy bandwidth {result['copy_gb_s']:.0f} GB/s (1 GiB copy, this run); "
                 f"{len(launches)} launches, {total:.2f} ms, {moved / MB:.0f} MB must move "
                 f"({moved / (total * 1e-3) / 1e9 / result['copy_gb_s']:.0%} of copy bandwidth overall); "
                 f"{len(slow)} of {TARGET_MS} ms or more below {TARGET_SOL:.0%}", "",
                 "| ms | GB/s | SOL | must move MB | partials MB | M | D | programs | config | kernel | what |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    else:
        lines = [title, "", f"TINY RUN (CPU, Triton interpreter): no GPU times; {len(launches)} launches", "",
                 "| must move MB | partials MB | M | D | programs | config | kernel | what |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in launches:
        cells = [f"{r['ms']:.3f}", f"{r['gb_s']:.0f}", f"{r['sol']:.0%}"] if timed else []
        cells += [f"{r['must_move'] / MB:.2f}", f"{r['partials'] / MB:.2f}" if r["partials"] else "-",
                  str(r["rows"]) if r["rows"] is not None else "-", str(r["d"]), str(r["programs"]),
                  _config(r["config"]), f"`{r['kernel']}` ({Path(r['path']).stem.rsplit('_', 1)[-1][:6]})", r["summary"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help=f"comma-separated, from {', '.join(FAMILIES)}")
    parser.add_argument("--mode", default="memfuse_backend", choices=MEMFUSE_MODES)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (the interpreter): no GPU times")
    parser.add_argument("--out", type=Path, help="directory for kernel-sol-MODEL.json and .md")
    args = parser.parse_args(argv)
    models = args.model.split(",")
    unknown = [m for m in models if m not in FAMILIES]
    if unknown:
        parser.error(f"--model: unknown {unknown}; expected some of {', '.join(FAMILIES)}")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs CUDA for GPU times; --tiny runs the tiny configs on the CPU without them")
    setup = Setup(torch.device("cpu"), tiny=True, settings=TINY_SETTINGS) if args.tiny else \
        Setup(torch.device("cuda"), tiny=False, settings=GPU_SETTINGS)
    bandwidth = None if args.tiny else copy_bandwidth()
    for model_name in models:
        result = sol_model(model_name, args.mode, setup, bandwidth)
        text = report(result)
        print(text + "\n", flush=True)
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            stem = args.out / f"kernel-sol-{'tiny-' if args.tiny else ''}{model_name}"
            stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
            stem.with_suffix(".md").write_text(text + "\n")
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
