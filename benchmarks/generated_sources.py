"""The generated sources of the `make bench-models` models, hashed: a before/after identity check.

    python -m benchmarks.generated_sources --out FILE [--families bert,gpt2,llama] [--styles backend,whole]
                                           [--sizes tiny,bench] [--sources DIR]
    python -m benchmarks.generated_sources --compare A.json B.json [--code-only]

Each family of benchmarks/lib/hf_models.py (dropout off, on the CPU) is compiled in each style: `backend`
(`torch.compile(model, backend="memfuse")`) and `whole` (`memfuse.memory_efficient_fusion(model)`),
at two sizes:
  - tiny (the family's `tiny` Size, fp32): one training step (forward, loss, backward) through
    Triton's interpreter; cases "family/style";
  - bench (its benchmark Size, under CPU bf16 autocast): the same compile with nothing run
    (`compile_only`: memfuse.check_compiles, the step on fake tensors; the interpreter would take
    hours); cases "family/style@bench". At the tiny
    sizes compile_only writes exactly the sources the training step does. The GPU's own kernels
    differ from these (CUDA's autocast rules, matmul padding and plans decided for a GPU), but
    the code that writes them is the same.
Every generated kernel and program source is hashed: the content-addressed kernel files memfuse
writes to MEMFUSE_CACHE_DIR, and the kernels and programs each compile dumps to MEMFUSE_DUMP_DIR
(one folder per compiled graph), both fresh temporary folders per case. --out gets
{"family/style": {relative file: sha256}}; --compare prints every file whose hash differs, is
missing or is new, and exits 1 if there is one.

A comment in a kernel may name a memfuse module (a row-order note names the module that chose
the order), so moving a module changes that text and its content address without changing the
code. The record therefore also keeps, under "_code", the hash of each dumped source without its
comments (ast.unparse of the parsed text): --compare says of each difference whether the code
differs or only its comments, and --compare --code-only compares the code alone (a cache file,
named by the hash of its whole text, is named there by the hash of its code). --sources DIR keeps
the normalized texts, to diff two trees' sources.

Only public memfuse API and environment variables are used, plus the bench models' FAMILIES, build
and make_batch (benchmarks.lib.hf_models; benchmarks.models on a tree before the split), so the same script runs on an older tree: copy it there and run it from
that tree's root (the JSON's "_tree" records which memfuse it imported).

Normalized before hashing, so that one tree gives the same hashes in one process or two: the
run's temporary folder is written <run> in the texts, and a dump folder `<graph>.<k>` (k counts
the process's compiles of that name) is renumbered from k=0 in each case. Dynamo's graph names
(`dynamo_<frame>_<compile>`) need nothing: torch._dynamo.reset() before each case restarts them.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import importlib.util
import itertools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    # Read when @triton.jit decorates, Triton's own helpers included: before anything imports
    # triton. Set only when run, not when imported (a test process on a GPU keeps its setting).
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

import memfuse  # noqa: E402
# The bench models' library since the benchmarks' split; the command that held it on older trees.
_MODELS = importlib.import_module("benchmarks.lib.hf_models" if importlib.util.find_spec("benchmarks.lib")
                                  else "benchmarks.models")
FAMILIES, build, make_batch = _MODELS.FAMILIES, _MODELS.build, _MODELS.make_batch

STYLES = ("backend", "whole")

# Which files of a run are generated sources, by their path relative to the run's folder.
CACHE_KERNELS = "cache/kernels/"
DUMPED = ("kernels/", ".program.py")
SIZES = ("tiny", "bench")


class Compiled(Exception):
    """Raised by `stop_after_compile` once memfuse's backend has compiled a graph: nothing runs."""


def train_step(style: str, model: torch.nn.Module, batch: dict) -> None:
    """One training step (forward, loss, backward) of `model` in `style`."""
    wrapped = {"backend": lambda: torch.compile(model, backend="memfuse"),
               "whole": lambda: memfuse.memory_efficient_fusion(model)}[style]()
    wrapped(**batch).loss.backward()


def compile_only(style: str, model: torch.nn.Module, batch: dict) -> None:
    """What `train_step` compiles, and nothing run: `memfuse.check_compiles` (the training step on
    fake tensors: every graph, forward and backward, no kernel launched). On a tree without it:
    `whole` through FusedModule.compiled_for; `backend` through a backend that calls memfuse's
    ("memfuse", as Dynamo registered it) and then stops the call (Compiled), so only the call's
    first graph is compiled (each family's step is one graph: `train_step` at the tiny sizes dumps
    one folder)."""
    check_compiles = getattr(memfuse, "check_compiles", None)
    if check_compiles is not None:
        check_compiles(model, **batch, style=style)
        return
    if style == "whole":
        memfuse.memory_efficient_fusion(model).compiled_for(**batch)
        return
    memfuse_backend = torch._dynamo.lookup_backend("memfuse")

    def stop_after_compile(gm, example_inputs):
        memfuse_backend(gm, example_inputs)
        raise Compiled

    try:
        torch.compile(model, backend=stop_after_compile)(**batch)
    except Exception as e:
        if not _caused_by_compiled(e):
            raise


def _caused_by_compiled(error: BaseException | None) -> bool:
    while error is not None:
        if isinstance(error, Compiled):
            return True
        error = error.__cause__ or error.__context__
    return False


# -- one family x style x size --------------------------------------------------------------------
def run(family: str, style: str, size: str) -> dict:
    """{relative file: normalized text} of every source `family` in `style` generates: at its tiny
    size, one training step through the interpreter; at its benchmark size, the same compile under
    bf16 autocast (the benchmark's dtypes, on the CPU's autocast rules), nothing run."""
    torch._dynamo.reset()
    memfuse.reset_stats()
    spec = FAMILIES[family]
    with tempfile.TemporaryDirectory(prefix="memfuse-sources-") as tmp:
        root = Path(tmp)
        saved = {k: os.environ.get(k) for k in ("MEMFUSE_CACHE_DIR", "MEMFUSE_DUMP_DIR")}
        os.environ["MEMFUSE_CACHE_DIR"] = str(root / "cache")
        os.environ["MEMFUSE_DUMP_DIR"] = str(root / "dump")
        try:
            if size == "tiny":
                train_step(style, build(spec, spec.tiny, 0.0), make_batch(spec.tiny, torch.device("cpu")))
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    compile_only(style, build(spec, spec.size, 0.0), make_batch(spec.size, torch.device("cpu")))
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            torch._dynamo.reset()
        return sources(root)


def sources(root: Path) -> dict:
    """The run's generated sources under `root`: the run's folder written <run> in their text, and
    each dump folder `<graph>.<k>` renumbered from k=0 (k counts the process's compiles of a name)."""
    folders = {}
    dump = root / "dump"
    for folder in sorted(dump.iterdir(), key=_dump_order) if dump.exists() else ():
        graph = folder.name.rpartition(".")[0]
        folders[folder.name] = f"{graph}.{sum(f.rpartition('.')[0] == graph for f in folders.values())}"
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("dump/"):
            folder, _, inside = relative[len("dump/"):].partition("/")
            if not (inside.startswith(DUMPED[0]) or inside.endswith(DUMPED[1])):
                continue
            relative = f"dump/{folders[folder]}/{inside}"
        elif not relative.startswith(CACHE_KERNELS) or not relative.endswith(".py"):
            continue
        out[relative] = path.read_text().replace(str(root), "<run>")
    return out


def _dump_order(folder: Path) -> tuple:
    """Dump folders in the order they were written: by graph name, then by compile count k."""
    graph, _, k = folder.name.rpartition(".")
    return graph, int(k)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def code_name(file: str, code_hash: str) -> str:
    """A cache file `<kernel>_<hash of its text>.py` named `<kernel>_<hash of its code>.py`."""
    if not file.startswith(CACHE_KERNELS):
        return file
    return f"{file.rpartition('_')[0]}_{code_hash[:16]}.py"


def code(text: str) -> str:
    """`text` without its comments and layout: the code a source runs."""
    return ast.unparse(ast.parse(text))


# -- the record and the comparison ----------------------------------------------------------------
def tree() -> dict:
    """Which memfuse this process imported, and its commit where it is a git checkout."""
    package = Path(memfuse.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(package), "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"memfuse": str(package), "commit": commit, "torch": torch.__version__}


def record(families: list, styles: list, sizes: list, keep: Path | None = None) -> dict:
    """{"family/style": {file: sha256}} (the tiny sizes; "family/style@bench" at the benchmark
    sizes), "_code" the same of the sources without comments (cache files named by it: code_name),
    "_tree" which memfuse made them. `keep`: write the normalized sources there too."""
    result = {"_tree": tree(), "_code": {}}
    for size in sizes:
        for family, style in itertools.product(families, styles):
            case = f"{family}/{style}" + ("" if size == "tiny" else f"@{size}")
            texts = run(family, style, size)
            if not any(file.endswith("/forward.program.py") for file in texts):
                raise RuntimeError(f"generated_sources: {case} compiled no program (memfuse ran it through "
                                   f"torch?); MEMFUSE_LOG=1 says why")
            result[case] = {file: sha256(text) for file, text in texts.items()}
            codes = {file: sha256(code(text)) for file, text in texts.items()}
            result["_code"][case] = {code_name(file, codes[file]): codes[file] for file in texts}
            for file, text in texts.items() if keep else ():
                path = keep / case / file
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
            print(f"{case}: {len(texts)} sources", flush=True)
    return result


def compare(a: dict, b: dict, code_only: bool = False) -> list:
    """One line per difference between two records (keys starting with "_" are notes, not compared):
    of the whole texts, saying where only comments differ, or (`code_only`) of the code alone."""
    code_a, code_b = a.get("_code", {}), b.get("_code", {})
    if code_only:
        a, b = code_a, code_b
    lines = []
    for case in sorted(set(a) | set(b)):
        if case.startswith("_"):
            continue
        if case not in a or case not in b:
            lines.append(f"{case}: only in {'B' if case not in a else 'A'}")
            continue
        for file in sorted(set(a[case]) | set(b[case])):
            old, new = a[case].get(file), b[case].get(file)
            if old != new:
                what = "only in B" if old is None else "only in A" if new is None else "differs"
                if what == "differs" and not code_only and file in code_a.get(case, {}):
                    same = code_a[case][file] == code_b.get(case, {}).get(file)
                    what += " in comments only" if same else " in code"
                elif what != "differs" and not code_only and file.startswith(CACHE_KERNELS):
                    what += " (named by its text's hash: --code-only compares its code)"
                lines.append(f"{case}: {file}: {what}")
    return lines


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the record (JSON) here")
    parser.add_argument("--families", default=",".join(FAMILIES), help=f"from {', '.join(FAMILIES)}")
    parser.add_argument("--styles", default=",".join(STYLES), help=f"from {', '.join(STYLES)}")
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"from {', '.join(SIZES)}")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("A", "B"),
                        help="print the differences between two records; exit 1 if any")
    parser.add_argument("--code-only", action="store_true",
                        help="with --compare: compare the dumped sources without their comments")
    parser.add_argument("--sources", type=Path, help="with --out: keep the normalized sources in this folder")
    args = parser.parse_args(argv)
    if not args.compare and not args.out:
        parser.error("give --out FILE or --compare A.json B.json")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        lines = compare(a, b, args.code_only)
        print(f"A: {args.compare[0]} ({a.get('_tree', {}).get('commit')})\n"
              f"B: {args.compare[1]} ({b.get('_tree', {}).get('commit')})")
        compared = a["_code"] if args.code_only else a
        cases = [c for c in compared if not c.startswith("_")]
        what = "sources' code" if args.code_only else "sources"
        print("\n".join(lines) if lines else
              f"identical: {len(cases)} cases, {sum(len(compared[c]) for c in cases)} {what}")
        return 1 if lines else 0
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    styles = [s.strip() for s in args.styles.split(",") if s.strip()]
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for name, offered in ((families, FAMILIES), (styles, STYLES), (sizes, SIZES)):
        unknown = [n for n in name if n not in offered]
        if unknown:
            raise SystemExit(f"unknown {unknown}; choose from {', '.join(offered)}")
    result = record(families, styles, sizes, args.sources)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
