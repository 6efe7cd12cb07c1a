"""Memory budgets side by side: peak memory against step time, memfuse against torch.compile.

    python -m benchmarks.budget [--models bert,gpt2,llama] [--budgets 1.0,0.5,...] [--modes NAME,..]
                                [--tiny] [--timed-steps N] [--out DIR] [--charts DIR]
    python -m benchmarks.budget --report [--tiny] [--out DIR] [--charts DIR]

For each model of benchmarks/lib/hf_models.py (same configs, weights, tokens and training step), each
budget runs twice from fresh copies of the same weights: `torch.compile(model, backend="memfuse",
options={"memory_budget": b})` and `torch.compile(model)` with
`torch._functorch.config.activation_memory_budget = b` around its compile and first step (its
backward compiles at the first `.backward()`). Dynamo is reset between points. Per point: the
median step time, the step's peak and the memory kept for the backward (CUDA only), and for
memfuse the saved bytes its plans chose against the default plans' (any device).
budget-<model>.json is written after every point; then every budget-*.json in --out is merged into
budget.md and one budget-<model>.png per model (peak MB against step ms, a curve per mode, each
point labelled with its budget; --charts DIR (docs/img) draws them there too). Points of an
earlier run of the same model that this run does not repeat stay in its JSON, so a curve can be
measured over several commands.

Without CUDA, or with --tiny, tiny configs run on CPU through the Triton interpreter (memfuse only
unless --modes names torch_compile): a smoke run, not a measurement. docs/results.md says how
to read the picture.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lib import hf_models as models  # noqa: E402  (sets TRITON_INTERPRET for --tiny before triton loads)
from benchmarks.lib import report  # noqa: E402

import torch  # noqa: E402

import memfuse  # noqa: E402
from memfuse.fronts.backend import watch  # noqa: E402
from memfuse.base.debug import human_bytes  # noqa: E402

BUDGETS = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)
MODES = ("memfuse_backend", "torch_compile")
TINY_MODES = ("memfuse_backend",)   # torch.compile builds C++ kernels for minutes on a CPU
# ~280 s per model on an H100: 16 compiles (8 budgets x 2 modes) dominate; few steps each.
GPU_SETTINGS = models.Settings(warmup_steps=2, timed_steps=5)
MB = models.MB
NOTE_CHARS = 400   # of a point's note in the Markdown table (the JSON has it whole)


@dataclasses.dataclass(frozen=True)
class Point:
    """One model x mode x budget. None where not measured (memory on CPU, plans of torch.compile)."""

    model: str
    mode: str
    budget: float
    step_s: float | None = None            # median of the timed steps
    peak_bytes: int | None = None          # a step's peak above the memory allocated at its start
    kept_bytes: int | None = None          # allocated after forward+loss minus before
    planned_bytes: int | None = None       # memfuse: saved bytes beyond the inputs its plans chose
    default_planned_bytes: int | None = None   # memfuse: the same of the default plans (budget 1.0)
    budget_notes: tuple = ()               # memfuse: for each graph short of its target, what the rest is
    error: str | None = None


def wrap(mode: str, model, budget: float):
    if mode == "memfuse_backend":
        return torch.compile(model, backend="memfuse", options={"memory_budget": budget})
    return torch.compile(model)


def compile_context(mode: str, budget: float):
    """torch.compile's budget is a global of functorch's: set around the compile and first step."""
    if mode == "torch_compile":
        return torch._functorch.config.patch(activation_memory_budget=budget)
    return watch()


def measure_point(case: models.Case, mode: str, budget: float) -> Point:
    """First step (compile) under the mode's budget, warm-up, timed steps, then one step's memory."""
    setup, batch = case.setup, case.batch
    model = models.fresh(case.templates.dropout, setup.device)
    wrapped = wrap(mode, model, budget)
    with compile_context(mode, budget) as records:
        models.train_step(wrapped, batch, setup)
    model.zero_grad(set_to_none=False)
    for _ in range(setup.settings.warmup_steps):
        models.train_step(wrapped, batch, setup)
    samples = models.step_seconds(lambda: models.train_step(wrapped, batch, setup), setup.settings.timed_steps, setup)
    peak = kept = None
    if setup.device.type == "cuda":
        peak, kept = models.step_memory(wrapped, batch, setup)
    point = Point(case.family.name, mode, budget, step_s=statistics.median(samples), peak_bytes=peak, kept_bytes=kept)
    return _with_plans(point, records) if mode == "memfuse_backend" else point


def _with_plans(point: Point, records: list) -> Point:
    """The bytes memfuse's plans saved, and the default plans', summed over the graphs it compiled."""
    plans = [r.plan for r in records if r.plan is not None and r.plan.backward is not None]
    budgets = [p.budget for p in plans if p.budget is not None]
    return dataclasses.replace(
        point, planned_bytes=sum(p.saved_bytes for p in plans),
        default_planned_bytes=sum(p.budget.default_bytes if p.budget else p.saved_bytes for p in plans),
        budget_notes=tuple(f"budget not reached ({human_bytes(b.reached_bytes)} of {human_bytes(b.target_bytes)}): "
                           f"{b.short_of_target}" for b in budgets if b.short_of_target))


def run_point(case: models.Case, mode: str, budget: float) -> Point:
    print(f"{case.family.name} {mode} budget {budget:g} ...", flush=True)
    models.isolate(case.setup)
    try:
        point = measure_point(case, mode, budget)
    except Exception as error:  # one failing point must not end the curve
        point = Point(case.family.name, mode, budget, error=models._error_text(error))
    models.isolate(case.setup)
    return point


def run_model(family: models.Family, modes: tuple, budgets: tuple, setup: models.Setup, out: Path) -> Path:
    """Every budget in every mode; the model's JSON is rewritten after each point. Points of an
    earlier run in the same JSON that this run does not repeat are kept: a model's curve may be
    measured in several commands (one mode each, or a few budgets each)."""
    size = family.tiny if setup.tiny else family.size
    templates = models.Templates.build(family, size, setup.use_cache)
    case = models.Case(family, setup, templates, models.make_batch(size, setup.device))
    path = json_path(out, family.name, setup.tiny)
    repeated = {(mode, budget) for mode in modes for budget in budgets}
    earlier = json.loads(path.read_text())["points"] if path.exists() else []
    result = {"metadata": models.metadata(setup), "model": family.name, "size": dataclasses.asdict(size),
              "points": [p for p in earlier if (p["mode"], p["budget"]) not in repeated]}
    for mode in modes:
        for budget in budgets:
            result["points"].append(dataclasses.asdict(run_point(case, mode, budget)))
            path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return path


# -- files and the report -------------------------------------------------------------------------
def json_path(out: Path, model: str, tiny: bool) -> Path:
    return out / f"budget-{'tiny-' if tiny else ''}{model}.json"


def load_results(out: Path, tiny: bool) -> list:
    return [json.loads(p.read_text()) for name in models.FAMILIES
            if (p := json_path(out, name, tiny)).exists()]


def _ms(seconds):
    return report._fmt(seconds, ".1f", 1e3)


def _mb(value):
    return report._fmt(value, ".0f" if value is None or value >= MB else ".3f", 1 / MB)


def render(results: list) -> str:
    """A Markdown table: per model and budget, each mode's step ms, peak MB, kept MB (and memfuse's
    planned saved MB), preceded by each run's device, versions and date."""
    headers = ["model", "budget", "memfuse ms", "memfuse peak MB", "memfuse kept MB", "memfuse planned MB",
               "compile ms", "compile peak MB", "compile kept MB", "note"]
    rows, lines = [], []
    for result in results:
        meta = result["metadata"]
        lines.append(f"- {result['model']}: {meta['device']}, {meta['precision']}, torch {meta['torch']}, "
                     f"triton {meta['triton']}, transformers {meta['transformers']}, {meta['date']}")
        by_key = {(p["mode"], p["budget"]): p for p in result["points"]}
        for budget in sorted({p["budget"] for p in result["points"]}, reverse=True):
            ours, theirs = by_key.get(("memfuse_backend", budget), {}), by_key.get(("torch_compile", budget), {})
            notes = [f"{mode}: {p['error']}" for mode, p in (("memfuse", ours), ("compile", theirs)) if p.get("error")]
            notes += list(ours.get("budget_notes") or ())
            note = " ".join("; ".join(notes).split()).replace("|", "/")[:NOTE_CHARS]
            rows.append([result["model"], f"{budget:g}", _ms(ours.get("step_s")), _mb(ours.get("peak_bytes")),
                         _mb(ours.get("kept_bytes")), _mb(ours.get("planned_bytes")), _ms(theirs.get("step_s")),
                         _mb(theirs.get("peak_bytes")), _mb(theirs.get("kept_bytes")), note])
    return "\n".join(lines) + "\n\n" + report._markdown(headers, rows)


def write_chart(result: dict, path: Path) -> str:
    """Peak MB (planned saved MB without CUDA) against step ms, a curve per mode, points labelled
    with their budgets."""
    try:
        import matplotlib
    except ImportError:
        return f"no chart: matplotlib is not installed ({path} not written)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = any(p["peak_bytes"] is not None for p in result["points"])
    field = "peak_bytes" if measured else "planned_bytes"
    figure, axis = plt.subplots(figsize=(6.5, 4.8), constrained_layout=True)
    for index, mode in enumerate(MODES):
        points = sorted((p for p in result["points"] if p["mode"] == mode and p["step_s"] and p[field] is not None),
                        key=lambda p: -p["budget"])
        if not points:
            continue
        xs, ys = [p["step_s"] * 1e3 for p in points], [p[field] / MB for p in points]
        axis.plot(xs, ys, marker="os"[index], color=f"C{index}", label=mode)
        for p, x, y in zip(points, xs, ys):
            axis.annotate(f"{p['budget']:g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    axis.set_xlabel("step ms (fwd+loss+bwd, median)")
    axis.set_ylabel("peak MB above the model's own (one step)" if measured else "memfuse planned saved MB (CPU)")
    meta = result["metadata"]
    axis.set_title(("TINY RUN (CPU): not a performance result\n" if meta["tiny"] else "")
                   + f"{result['model']}: {meta['device']}, torch {meta['torch']}, {meta['date'][:10]}", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


def write_report(out: Path, tiny: bool, charts: Path | None = None) -> None:
    results = load_results(out, tiny)
    if not results:
        sys.exit(f"no {json_path(out, '*', tiny).name} in {out}: run the budgets first")
    stem = out / ("budget-tiny" if tiny else "budget")
    text = render(results)
    print("\n" + text)
    heading = "Memory budgets: memfuse backend against torch.compile's activation_memory_budget"
    stem.with_suffix(".md").write_text(f"## {heading}{' -- TINY RUN, not a result' if tiny else ''}\n\n{text}\n")
    print(f"wrote {stem.with_suffix('.md')}")
    for result in results:
        print(write_chart(result, out / f"{stem.name}-{result['model']}.png"))
        if charts is not None:
            charts.mkdir(parents=True, exist_ok=True)
            print(write_chart(result, charts / f"{stem.name}-{result['model']}.png"))


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(models.FAMILIES)} (default: all)")
    parser.add_argument("--modes", help=f"comma-separated, from {', '.join(MODES)} (default: both; --tiny: memfuse)")
    parser.add_argument("--budgets", help=f"comma-separated fractions in (0, 1] (default {','.join(map(str, BUDGETS))})")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU through the Triton interpreter")
    parser.add_argument("--timed-steps", type=int, help=f"timed steps per point (GPU default {GPU_SETTINGS.timed_steps})")
    parser.add_argument("--report", action="store_true", help="only merge the JSONs in --out into the report")
    parser.add_argument("--out", type=Path, default=models.DEFAULT_OUT, help="output directory")
    parser.add_argument("--charts", type=Path, metavar="DIR",
                        help="also draw the charts into DIR, same undated names (docs/img: the results page's)")
    return parser.parse_args(argv)


def _budgets(text: str | None) -> tuple:
    if not text:
        return BUDGETS
    try:
        budgets = tuple(float(b) for b in text.split(",") if b.strip())
    except ValueError:
        sys.exit(f"--budgets: {text!r} is not a comma-separated list of numbers")
    if not budgets or not all(0 < b <= 1 for b in budgets):
        sys.exit(f"--budgets: each budget must be in (0, 1], got {text!r}")
    return budgets


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.report:
        return write_report(args.out, args.tiny, args.charts)
    tiny = args.tiny or not torch.cuda.is_available()
    import transformers
    transformers.logging.set_verbosity_error()
    families = [models.FAMILIES[n] for n in models._names(args.models, tuple(models.FAMILIES), "models")]
    modes = models._names(args.modes, MODES, "modes") if args.modes else TINY_MODES if tiny else MODES
    settings = models.TINY_SETTINGS if tiny else GPU_SETTINGS
    if args.timed_steps:
        settings = dataclasses.replace(settings, timed_steps=args.timed_steps)
    setup = models.Setup(torch.device("cpu" if tiny else "cuda"), tiny, settings)
    if tiny:
        print(models.TINY_BANNER, flush=True)
    budgets = _budgets(args.budgets)
    args.out.mkdir(parents=True, exist_ok=True)
    for family in families:
        print(f"wrote {run_model(family, modes, budgets, setup, args.out)}", flush=True)
    write_report(args.out, tiny, args.charts)


if __name__ == "__main__":
    main()
