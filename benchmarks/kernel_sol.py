"""Each memfuse kernel of one training step against bandwidth SOL: the bytes it must move at the
launch's sizes over its GPU time, as a fraction of the copy bandwidth measured in the same run.

    python3 -m benchmarks.kernel_sol --model gpt2,llama,bert [--mode memfuse_backend] [--tune] [--out DIR]
    python3 -m benchmarks.kernel_sol --model gpt2 --tiny      # CPU, the Triton interpreter: no times

A `make bench-models` model (bf16 autocast, dropout as in the benchmark) trains in a memfuse mode;
after the warm-up steps one step runs under torch.profiler (benchmarks.profile_step) and inside
memfuse's launch log (memfuse.runtime.launchers.launch_log), which records each launch's M, grid, launch
configuration and must-move bytes: every [M, D], [M] and [D] value the kernel reads or writes,
once (KernelSource.bytes_per_row x M + bytes_per_launch). A looped kernel re-reads its inputs once
a pass, and a kernel with column sums writes and reads back fp32 partials: that traffic is listed
beside the must-move bytes, not counted in them. The profiler's memfuse_* kernels, in the order
they started, are the log's launches in order (one stream). --tune times each kernel below the
target alone at other launch configurations (benchmarks.tune's sweep; alike kernels, a model's
layers, once): whether its configuration is what holds it back, or something the configuration
cannot change. --tiny runs the tiny configs on the CPU
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

from benchmarks.lib.hf_models import (FAMILIES, GPU_SETTINGS, TINY_SETTINGS, WRAPPERS, Setup, Templates, fresh,
                                      make_batch, train_step)
from benchmarks.lib.kernel_timing import best_of, config_text, copy_bandwidth, sweep
from benchmarks.lib.profiling import profiled_step
from memfuse.runtime.launchers import launch_log

MEMFUSE_MODES = ("memfuse_backend", "memfuse_whole", "memfuse_per_layer", "memfuse_per_layer_backend")
KERNEL_PREFIX = "memfuse_"        # the generated kernels' names (codegen: the group's name)
TARGET_MS = 0.5                   # issue 17: every kernel of at least this much GPU time per step ...
TARGET_SOL = 0.8                  # ... reaches this fraction of the copy bandwidth
MB = 1e6


def logged_launches(model, batch: dict, setup: Setup) -> list:
    """One step's memfuse launches as (LaunchRecord, GPU ms), in launch order (ms None on the CPU,
    where the step is the first: the compile's launches are the step's)."""
    if setup.device.type != "cuda":
        with launch_log() as records:
            train_step(model, batch, setup)
        return [(r, None) for r in records]
    records: list = []

    @contextlib.contextmanager
    def logged():
        with launch_log() as launches:
            yield
        records.extend(launches)

    kernels = [(name, ms) for name, ms in profiled_step(model, batch, setup, logged) if name.startswith(KERNEL_PREFIX)]
    names = [r.function for r in records]       # a twin runs as its first kernel's function
    if [name for name, _ in kernels] != names:
        raise RuntimeError(f"kernel_sol: the profile's memfuse kernels ({len(kernels)}) are not the launch log's "
                           f"({len(names)}) in order: the profile's first {kernels[:3]}, the log's first {names[:3]}")
    return [(r, ms) for r, (_, ms) in zip(records, kernels)]


def below_target(record, ms: float, bandwidth: float, min_ms: float = TARGET_MS) -> bool:
    return ms >= min_ms and record.must_move / (ms * 1e-3) < TARGET_SOL * bandwidth


def tune_slow(launches: list, model, batch: dict, setup: Setup, bandwidth: float, min_ms: float = TARGET_MS,
              tiles: list | None = None) -> dict:
    """Each kernel below the target (`min_ms` or more, under TARGET_SOL) timed alone on its
    arguments of one more step (benchmarks.tune: do_bench, L2 flushed), at its own configuration and
    at the best of tune.sweep's: whether a launch configuration is what holds it back. Kernels of
    one structure (a model's layers: the same summary, sizes and configuration) are swept once, at
    the first of them, whose result stands for the others (`"as"`: its name): a sweep compiles
    every configuration it times (`tiles`: only these (rows, warps), see tune.sweep).
    -> {KernelLaunch: {"alone_ms", "best_ms", "best_config"[, "as"]}}; each launch is left as it was."""
    slow = list({r.launch: r for r, ms in launches if below_target(r, ms, bandwidth, min_ms)}.items())
    first_of: dict = {}
    for launch, record in slow:
        first_of.setdefault(structure(record), launch)
    swept = set(first_of.values())
    for launch in swept:
        launch.record = True
    train_step(model, batch, setup)
    setup.synchronize()
    tuned = {}
    for launch in swept:
        launch.record = False
        device = launch.recorded[0]
        own = launch.configs[device]
        own_us = best_of(launch, [own], device)[0][0]
        best_us, best = sweep(launch, device, tiles=tiles)
        launch.configs[device] = own
        tuned[launch] = {"alone_ms": own_us / 1e3, "best_ms": min(best_us, own_us) / 1e3,
                         "best_config": dataclasses.asdict(best if best_us < own_us else own)}
        print(f"  tuned {launch.kernel.source.name}: alone {own_us:.0f} us at {own}, best {best_us:.0f} us at {best}",
              flush=True)
    for launch, record in slow:
        first = first_of[structure(record)]
        if launch is not first:
            tuned[launch] = {**tuned[first], "as": first.kernel.source.name}
    return tuned


def structure(record) -> tuple:
    """What makes two launches' sweeps alike: the kernel's summary, its sizes and configuration."""
    return record.summary, record.rows, record.d, record.config


def as_row(record, ms: float | None, bandwidth: float | None, tuned: dict) -> dict:
    """A launch's JSON row: the record's fields, its time, GB/s and fraction of the copy bandwidth
    (None without times), and what tune_slow found for it."""
    row = {f.name: getattr(record, f.name) for f in dataclasses.fields(record) if f.name != "launch"}
    row["config"] = dataclasses.asdict(record.config)
    rate = record.must_move / (ms * 1e-3) if ms else None
    row.update(ms=ms, gb_s=rate / 1e9 if rate is not None else None,
               sol=rate / bandwidth if rate is not None and bandwidth else None)
    found = tuned.get(record.launch)
    if found is not None:
        row.update(found, best_sol=record.must_move / (found["best_ms"] * 1e-3) / bandwidth)
    return row


def sol_model(model_name: str, mode: str, setup: Setup, bandwidth: float | None, tune: bool,
              tune_ms: float = TARGET_MS, tiles: list | None = None) -> dict:
    family = FAMILIES[model_name]
    size = family.tiny if setup.tiny else family.size
    templates = Templates.build(family, size, use_cache=False)
    torch._dynamo.reset()
    model = WRAPPERS[mode](fresh(templates.dropout, setup.device), family)
    batch = make_batch(size, setup.device)
    launches = logged_launches(model, batch, setup)
    tuned = tune_slow(launches, model, batch, setup, bandwidth, tune_ms, tiles) if tune else {}
    rows = [as_row(r, ms, bandwidth, tuned) for r, ms in launches]
    rows.sort(key=lambda r: -(r["ms"] if r["ms"] is not None else r["must_move"]))
    return {"model": model_name, "mode": mode, "tiny": setup.tiny, "copy_gb_s": bandwidth / 1e9 if bandwidth else None,
            "device": torch.cuda.get_device_name(setup.device) if setup.device.type == "cuda" else "cpu",
            "launches": rows}


def _tuned(row: dict) -> str:
    if "best_ms" not in row:
        return "-"
    found = f"{row['alone_ms']:.3f}, {row['best_ms']:.3f} ({row['best_sol']:.0%}): {config_text(row['best_config'])}"
    return found + (f" (as `{row['as']}`)" if "as" in row else "")


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
                 "| ms | GB/s | SOL | alone ms, best alone ms (SOL): best config | must move MB | partials MB | M | D "
                 "| programs | config | kernel | what |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    else:
        lines = [title, "", f"TINY RUN (CPU, Triton interpreter): no GPU times; {len(launches)} launches", "",
                 "| must move MB | partials MB | M | D | programs | config | kernel | what |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in launches:
        cells = [f"{r['ms']:.3f}", f"{r['gb_s']:.0f}", f"{r['sol']:.0%}", _tuned(r)] if timed else []
        cells += [f"{r['must_move'] / MB:.2f}", f"{r['partials'] / MB:.2f}" if r["partials"] else "-",
                  str(r["rows"]) if r["rows"] is not None else "-", str(r["d"]), str(r["programs"]),
                  config_text(r["config"]), f"`{r['kernel']}` ({Path(r['path']).stem.rsplit('_', 1)[-1][:6]})", r["summary"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help=f"comma-separated, from {', '.join(FAMILIES)}")
    parser.add_argument("--mode", default="memfuse_backend", choices=MEMFUSE_MODES)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU (the interpreter): no GPU times")
    parser.add_argument("--tune", action="store_true",
                        help=f"time each kernel of {TARGET_MS} ms or more under {TARGET_SOL:.0%}% alone at other launch "
                             "configurations (benchmarks.tune's sweep; GPU only)")
    parser.add_argument("--tune-ms", type=float, default=TARGET_MS,
                        help=f"with --tune: the GPU time a step from which a kernel under {TARGET_SOL:.0%}% is tuned")
    parser.add_argument("--tune-tiles", metavar="RxW,..",
                        help="with --tune: only these tiles, rows x warps (e.g. 1x2,2x4,4x8), not the whole sweep")
    parser.add_argument("--out", type=Path, help="directory for kernel-sol-MODEL.json and .md")
    args = parser.parse_args(argv)
    tiles = None
    if args.tune_tiles:
        try:
            tiles = [tuple(int(n) for n in tile.split("x")) for tile in args.tune_tiles.split(",")]
        except ValueError:
            parser.error(f"--tune-tiles: expected rows x warps pairs such as 1x2,2x4, got {args.tune_tiles!r}")
        if any(len(t) != 2 or min(t) < 1 for t in tiles):
            parser.error(f"--tune-tiles: expected rows x warps pairs such as 1x2,2x4, got {args.tune_tiles!r}")
    models = args.model.split(",")
    unknown = [m for m in models if m not in FAMILIES]
    if unknown:
        parser.error(f"--model: unknown {unknown}; expected some of {', '.join(FAMILIES)}")
    if args.tune and args.tiny:
        parser.error("--tune times kernels on the GPU: not with --tiny")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs CUDA for GPU times; --tiny runs the tiny configs on the CPU without them")
    setup = Setup(torch.device("cpu"), tiny=True, settings=TINY_SETTINGS) if args.tiny else \
        Setup(torch.device("cuda"), tiny=False, settings=GPU_SETTINGS)
    bandwidth = None if args.tiny else copy_bandwidth()
    for model_name in models:
        result = sol_model(model_name, args.mode, setup, bandwidth, args.tune, args.tune_ms, tiles)
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
