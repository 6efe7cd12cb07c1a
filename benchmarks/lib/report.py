"""Turn measured results into the stdout tables, the JSON file and the PNG chart."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Callable

from benchmarks.lib.first_calls import FirstCallResult

MB = 1e6
MISSING = "-"


@dataclasses.dataclass(frozen=True)
class CellResult:
    """One workload x mode of the side-by-side run. Fields are None where not measured."""

    workload: str
    mode: str
    sol_bytes: int
    first_call_s: float | None = None
    step_s: float | None = None  # median wall time of a step (CUDA events)
    steps_per_repeat: int | None = None
    kernel_s: float | None = None  # summed device time of a step's kernels (profiler)
    saved_bytes: int | None = None
    peak_bytes: int | None = None  # above what was alive before the step
    peak_abs_bytes: int | None = None
    step_sol: float | None = None  # SOL time / step_s
    gpu_sol: float | None = None  # SOL time / kernel_s
    vs_baseline: float | None = None  # it/s over torch.compile's it/s on the same workload
    stats: object | None = None  # memfuse.stats() after the cell, when offered
    error: str | None = None

    @property
    def it_s(self) -> float | None:
        return 1.0 / self.step_s if self.step_s else None


@dataclasses.dataclass(frozen=True)
class DynamicResult:
    """The tutorial's dynamic-shape test for one workload x mode."""

    workload: str
    mode: str
    shape_count: int
    first_pass_it_s: float | None = None  # recompiles included; median over the runs
    second_pass_it_s: float | None = None  # every shape seen once already; median over the runs
    error: str | None = None
    ratios: tuple = ()  # first / second pass of each run (a fresh wrapper each), in order: the first
    # run is the tutorial's test as a fresh process sees it (torch.compile's later runs find their
    # recompiled graphs in inductor's on-disk cache)

    @property
    def first_over_second(self) -> float | None:
        """The median run's first pass over its second."""
        if self.ratios:
            return statistics.median(self.ratios)
        return None


@dataclasses.dataclass(frozen=True)
class BenchResults:
    metadata: dict
    unavailable: dict[str, str]
    cells: list[CellResult]
    dynamic: list[DynamicResult]
    first_calls: list[FirstCallResult]


def write_report_files(stem: Path, markdown: str, draw: Callable[[Path], str], charts: Path | None) -> None:
    """A command's report: `stem`.md, the chart `draw` writes to `stem`.png, and the same chart into
    `charts` (docs/img) where given."""
    stem.with_suffix(".md").write_text(markdown)
    print(f"\nwrote {stem.with_suffix('.md')}")
    print(draw(stem.with_suffix(".png")))
    if charts is not None:
        charts.mkdir(parents=True, exist_ok=True)
        print(draw(charts / f"{stem.name}.png"))


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return MISSING if value is None else f"{value * scale:{spec}}{suffix}"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = [headers, ["---"] * len(headers), *rows]
    return "\n".join("| " + " | ".join(line) + " |" for line in lines)


def _cell_row(cell: CellResult) -> list[str]:
    if cell.error:
        return [cell.workload, cell.mode, "error"] + [MISSING] * 6
    return [
        cell.workload,
        cell.mode,
        _fmt(cell.it_s, ".1f"),
        _fmt(cell.vs_baseline, ".2f", suffix="x"),
        _fmt(cell.step_sol, ".0f", 100, "%"),
        _fmt(cell.gpu_sol, ".0f", 100, "%"),
        _fmt(cell.saved_bytes, ".1f", 1 / MB),
        _fmt(cell.peak_bytes, ".1f", 1 / MB),
        _fmt(cell.first_call_s, ".2f"),
    ]


def cells_table(cells: list[CellResult]) -> str:
    headers = ["workload", "mode", "it/s", "vs compile", "step SOL", "GPU SOL", "saved MB", "peak MB", "1st call s"]
    return _table(headers, [_cell_row(c) for c in cells])


def dynamic_table(rows: list[DynamicResult]) -> str:
    headers = ["workload", "mode", "shapes", "1st pass it/s", "2nd pass it/s", "1st/2nd", "first run", "range (runs)"]
    body = [
        [r.workload, r.mode, str(r.shape_count), _fmt(r.first_pass_it_s, ".1f"), _fmt(r.second_pass_it_s, ".1f"),
         _fmt(r.first_over_second, ".2f"), _fmt(r.ratios[0] if r.ratios else None, ".2f"),
         f"{min(r.ratios):.2f}-{max(r.ratios):.2f} ({len(r.ratios)})" if r.ratios else "-"]
        for r in rows
    ]
    return _table(headers, body)


def first_call_table(rows: list[FirstCallResult]) -> str:
    headers = ["workload", "mode", "cold 1st call s", "warm 1st call s", "cold process s", "warm process s"]
    body = [
        [r.workload, r.mode, _fmt(r.cold.first_call_s, ".2f"), _fmt(r.warm.first_call_s, ".2f"),
         _fmt(r.cold.process_s, ".2f"), _fmt(r.warm.process_s, ".2f")]
        for r in rows
    ]
    return _table(headers, body)


def problems(results: BenchResults) -> list[str]:
    """Every mode that could not run and every cell that failed, with the reason."""
    lines = [f"unavailable {mode}: {why}" for mode, why in results.unavailable.items()]
    lines += [f"error {c.workload} {c.mode}: {c.error}" for c in results.cells if c.error]
    lines += [f"error dynamic {r.workload} {r.mode}: {r.error}" for r in results.dynamic if r.error]
    for r in results.first_calls:
        lines += [f"error first call ({kind}) {r.workload} {r.mode}: {run.error}"
                  for kind, run in (("cold", r.cold), ("warm", r.warm)) if run.error]
    return lines


def render(results: BenchResults) -> str:
    sections = ["Forward+backward step, side by side", cells_table(results.cells)]
    if results.dynamic:
        sections += ["", "Dynamic shapes (the tutorial's test)", dynamic_table(results.dynamic)]
    if results.first_calls:
        sections += ["", "First call in a fresh process (cold: empty caches; warm: same caches)",
                     first_call_table(results.first_calls)]
    issues = problems(results)
    if issues:
        sections += ["", "Not measured:", *(f"  {line}" for line in issues)]
    return "\n".join(sections)


def _as_json(results: BenchResults) -> dict:
    def with_derived(row, **derived) -> dict:
        return {**dataclasses.asdict(row), **derived}

    return {
        "metadata": results.metadata,
        "unavailable": results.unavailable,
        "cells": [with_derived(c, it_s=c.it_s) for c in results.cells],
        "dynamic": [with_derived(r, first_over_second=r.first_over_second) for r in results.dynamic],
        "first_calls": [dataclasses.asdict(r) for r in results.first_calls],
    }


def write_json(results: BenchResults, path: Path) -> None:
    path.write_text(json.dumps(_as_json(results), indent=2, default=str) + "\n")


def _grouped_bars(axis, cells: list[CellResult], value, ylabel: str) -> None:
    """One group of bars per workload, one bar per mode; missing values leave a gap."""
    workloads = list(dict.fromkeys(c.workload for c in cells))
    modes = list(dict.fromkeys(c.mode for c in cells))
    width = 0.8 / max(len(modes), 1)
    by_key = {(c.workload, c.mode): value(c) for c in cells}
    for index, mode in enumerate(modes):
        heights = [by_key.get((w, mode)) or 0.0 for w in workloads]
        positions = [w + index * width for w in range(len(workloads))]
        axis.bar(positions, heights, width, label=mode)
    axis.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))])
    axis.set_xticklabels([w.replace("[", "\n[") for w in workloads], fontsize=8)
    axis.set_ylabel(ylabel)
    axis.grid(axis="y", alpha=0.3)
    if not any(by_key.values()):
        axis.text(0.5, 0.5, "not measured", transform=axis.transAxes, ha="center", va="center")


def write_chart(results: BenchResults, path: Path) -> None:
    """it/s, step SOL and GPU SOL per workload and mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [c for c in results.cells if not c.error]
    figure, axes = plt.subplots(3, 1, figsize=(12, 12), constrained_layout=True)
    panels = [
        (lambda c: c.it_s, "it/s (fwd+bwd)"),
        (lambda c: c.step_sol and 100 * c.step_sol, "step SOL %"),
        (lambda c: c.gpu_sol and 100 * c.gpu_sol, "GPU SOL %"),
    ]
    for axis, (value, label) in zip(axes, panels):
        _grouped_bars(axis, cells, value, label)
    axes[0].legend(fontsize=8)
    meta = results.metadata
    title = f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}"
    if meta["smoke"]:
        title = "CPU SMOKE RUN (Triton interpreter): not a performance result\n" + title
    figure.suptitle(title)
    figure.savefig(path, dpi=110)
    plt.close(figure)
