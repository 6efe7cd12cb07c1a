"""Whole HuggingFace models side by side: a training step (forward, loss, backward) in six modes.

    python -m benchmarks.models [--models bert,gpt2,llama] [--modes NAME,..] [--tiny] [--use-cache] [--out DIR]
    python -m benchmarks.models --report [--tiny] [--out DIR] [--charts DIR]

BERT (masked LM), GPT-2 and Llama (causal LM) are built from configs with random weights (nothing
is downloaded) and trained on random token ids under bf16 autocast, parameters in fp32, with
`config.use_cache = False` as in training. Each model runs every mode in this process, one after
another, each from a fresh copy of the same weights, and writes models-<model>.json into --out as
soon as it is done; then every models-*.json in --out is merged into models.md and models.png
(--report does only that); --charts DIR (docs/img) draws models.png there too. Besides speed and
memory, each mode trains one step of a dropout-free copy of the model, compared with eager on the
same weights and tokens.

Without CUDA, or with --tiny, tiny configs run on CPU in fp32 through the Triton interpreter: a
smoke run of the harness, not a measurement (models-tiny-*.json, models-tiny.md; torch_compile only
when --modes names it). torch_compile_per_layer (each layer compiled, the rest eager, as torchtitan
compiles its blocks) runs only when --modes names it. docs/results.md says how the columns are measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.lib.hf_models import (ALL_MODES, BASELINE_MODE, DEFAULT_OUT, ERROR_CHARS, FAMILIES,  # noqa: E402
                                      GPU_SETTINGS, MB, MODES, TINY_BANNER, TINY_MODES, TINY_SETTINGS, Setup,
                                      _names, json_path, load_results, metadata, report_stem, run_model)
from benchmarks.lib.report import MISSING, _fmt, _markdown, _table, write_report_files  # noqa: E402


# -- the report -----------------------------------------------------------------------------------
def _mb(value: int | None) -> str:
    return _fmt(value, ".0f", 1 / MB)


def _counter(row: dict, name: str, per_step: bool = False) -> str:
    counters = row["memfuse_per_step" if per_step else "memfuse_compile"]
    if not row["mode"].startswith("memfuse") or not counters or name not in counters:
        return MISSING
    return f"{counters[name]:.0f}" if per_step else str(counters[name])


def _note(row: dict) -> str:
    notes = [row["error"] and f"error: {row['error']}", row["check_error"] and f"check error: {row['check_error']}"]
    text = "; ".join(n for n in notes if n)
    text = " ".join(text.split()).replace("|", "/")
    return text[:ERROR_CHARS] + ("..." if len(text) > ERROR_CHARS else "")


def _table_rows(result: dict, graph_fallbacks: bool) -> list[list[str]]:
    baseline = next((r["it_s"] for r in result["rows"] if r["mode"] == BASELINE_MODE and r["it_s"]), None)
    body = []
    for row in result["rows"]:
        cells = [
            result["model"], row["mode"], _fmt(row["it_s"], ".1f"),
            _fmt(row["it_s"] / baseline if row["it_s"] and baseline else None, ".2f", suffix="x"),
            _mb(row["peak_bytes"]), _mb(row["kept_bytes"]), _fmt(row["first_step_s"], ".1f"),
            _counter(row, "fallbacks"), *([_counter(row, "graph_fallbacks")] if graph_fallbacks else []),
            _counter(row, "extern_calls", per_step=True),
            _fmt(row["loss"], ".4f"), _fmt(row["loss_error"], ".1e"), _fmt(row["grad_error"], ".1e"), _note(row),
        ]
        body.append(cells)
    return body


def _has_counter(results: list[dict], name: str) -> bool:
    return any(name in (row["memfuse_compile"] or {}) for result in results for row in result["rows"])


def render(results: list[dict], markdown: bool) -> str:
    """One table of every model and mode, preceded by each model's device, versions and date."""
    graph_fallbacks = _has_counter(results, "graph_fallbacks")
    headers = ["model", "mode", "it/s", "vs compile", "peak MB", "kept MB", "1st step s", "fallbacks",
               *(["graph fallbacks"] if graph_fallbacks else []), "extern/step", "loss (no dropout)",
               "loss err", "grad err", "note"]
    rows = [cells for result in results for cells in _table_rows(result, graph_fallbacks)]
    lines = []
    for result in results:
        meta, size = result["metadata"], result["size"]
        lines.append(
            f"- {result['model']} ({result['class']}, {result['parameters'] / 1e6:.1f}M parameters, "
            f"batch {size['batch']} x seq {size['seq']}, {meta['precision']}, use_cache={result['use_cache']}): "
            f"{meta['device']}, "
            f"torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, {meta['date']}")
    table = _markdown(headers, rows) if markdown else _table(headers, rows)
    return "\n".join(lines) + "\n\n" + table


def write_chart(results: list[dict], path: Path) -> str:
    """it/s against peak memory, one subplot per model, one marker per mode (it/s bars where the
    memory was not measured). Returns what was written, or why nothing was."""
    try:
        import matplotlib
    except ImportError:
        return f"no chart: matplotlib is not installed ({path} not written)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, max(len(results), 1), figsize=(5 * max(len(results), 1), 4.5),
                                constrained_layout=True, squeeze=False)
    for axis, result in zip(axes[0], results):
        rows = [r for r in result["rows"] if r["it_s"]]
        if rows and all(r["peak_bytes"] is not None for r in rows):
            for row in rows:
                index = ALL_MODES.index(row["mode"])
                axis.scatter(row["peak_bytes"] / MB, row["it_s"], marker="osD^vP"[index], color=f"C{index}", s=60,
                             label=row["mode"])
            axis.set_xlabel("peak MB above the model's own (one step)")
        else:
            axis.bar([r["mode"].replace("_", "\n") for r in rows], [r["it_s"] for r in rows])
            axis.set_xlabel("memory n/a (CPU)")
        axis.set_ylabel("it/s (fwd+loss+bwd)")
        axis.set_title(result["model"])
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    if results:
        meta = results[0]["metadata"]
        title = f"{meta['device']}  torch {meta['torch']}  triton {meta['triton']}  " \
                f"transformers {meta['transformers']}  {meta['date'][:10]}"
        figure.suptitle(("TINY RUN (CPU, Triton interpreter): not a performance result\n" if meta["tiny"] else "")
                        + title)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


def write_report(out_dir: Path, tiny: bool, charts: Path | None = None) -> None:
    """Merge every model's JSON of this kind in out_dir: stdout, <stem>.md and <stem>.png (and
    charts/<stem>.png when given)."""
    results = load_results(out_dir, tiny)
    if not results:
        sys.exit(f"no {json_path(out_dir, '*', tiny).name} in {out_dir}: run the models first"
                 + ("" if tiny else " (--tiny merges a tiny run's)"))
    stem = report_stem(out_dir, tiny)
    print()
    print(render(results, markdown=False))
    heading = "HuggingFace models: one training step (forward, loss, backward)"
    if tiny:
        heading += " -- TINY RUN on CPU through the Triton interpreter: not a performance result"
    write_report_files(stem, f"## {heading}\n\n{render(results, markdown=True)}\n",
                       lambda path: write_chart(results, path), charts)


# -- the command ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--modes", help=f"comma-separated, from {', '.join(MODES)} (default: all; "
                                           f"--tiny: all but torch_compile)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU through the Triton interpreter")
    parser.add_argument("--use-cache", action="store_true",
                        help="keep transformers' default config.use_cache=True (a step builds a cache it never "
                             "uses; per-layer wrapping cannot take the Cache object)")
    parser.add_argument("--report", action="store_true",
                        help="only merge the JSONs in --out into the report (the GPU runs'; --tiny: the tiny runs')")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    parser.add_argument("--charts", type=Path, metavar="DIR",
                        help="also draw the charts into DIR, same undated names (docs/img: the results page's)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.report:  # the GPU runs' JSONs, wherever they are merged, unless --tiny
        return write_report(args.out, args.tiny, args.charts)
    tiny = args.tiny or not torch.cuda.is_available()
    if tiny and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--tiny runs memfuse through the Triton interpreter: set TRITON_INTERPRET=1 before "
                 "triton loads (python -m benchmarks.models --tiny does)")
    try:
        import transformers
    except ImportError:
        sys.exit("benchmarks.models needs transformers: pip install -e '.[models]'")
    transformers.logging.set_verbosity_error()
    families = [FAMILIES[name] for name in _names(args.models, tuple(FAMILIES), "models")]
    modes = _names(args.modes, ALL_MODES, "modes") if args.modes else TINY_MODES if tiny else MODES
    setup = Setup(torch.device("cpu" if tiny else "cuda"), tiny, TINY_SETTINGS if tiny else GPU_SETTINGS,
                  args.use_cache)
    if tiny:
        print(TINY_BANNER, flush=True)
    else:
        torch.ones(8, 8, device=setup.device) @ torch.ones(8, 8, device=setup.device)  # CUDA and cuBLAS up
    args.out.mkdir(parents=True, exist_ok=True)
    for family in families:
        result = {"metadata": metadata(setup), **run_model(family, modes, setup)}
        path = json_path(args.out, family.name, tiny)
        path.write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(f"wrote {path}", flush=True)
    write_report(args.out, tiny, args.charts)
    if tiny:
        print(TINY_BANNER)


if __name__ == "__main__":
    main()
