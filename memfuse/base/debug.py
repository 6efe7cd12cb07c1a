"""Observability switches: counters, the MEMFUSE_LOG topics, MEMFUSE_DUMP_DIR dumps, and what
a recompile changed. docs/debugging.md is the user's guide to all of them.

MEMFUSE_LOG picks what memfuse tells you on stderr, one logger per topic ("memfuse.<topic>"):
    MEMFUSE_LOG=1 (or info)     every topic, one summary line per graph, plan, kernel, miss
    MEMFUSE_LOG=debug (or all)  every topic in full: graph texts, every decision, every cache hit
    MEMFUSE_LOG=plan,recompiles the listed topics only, in full
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

STATS: Counter = Counter()
log = logging.getLogger("memfuse")

# What each counter counts, and where (docs/debugging.md repeats this table); the patterns add
# theirs (register_counter).
COUNTERS = {
    "compiles": "programs compiled (api.FusedFunction._compile), recompiles included",
    "recompiles": "compiles of a function that already had a compiled program (a cache miss on a new key)",
    "cache_hits": "calls that found their compiled program in the cache",
    "front_misses": "calls the front cache (api._Front: generated code binding the arguments, unpacking tuple, "
                    "list and dict arguments, checking the tensors in one C++ call) did not serve: bound, "
                    "flattened and keyed on the slower Python path (first calls, autocast on, deeper pytrees)",
    "kernels_generated": "Triton kernels generated and loaded (runtime.Program, once per compile)",
    "kernels_shared": "of those, kernels whose code an earlier kernel of the process has, up to its value names "
                      "(a model's layers): they launch its function, compiled once (codegen.generate)",
    "kernels_loaded": "kernels whose binary precompile loaded from Triton's cache through memfuse's index, "
                      "without Triton's compile (precompile.BinaryIndex)",
    "kernels_launched": "Triton kernel launches (runtime.Program._launch, every call)",
    "launches_skipped": "kernel launches a compile-only program skipped (Config.compile_only, memfuse.check_compiles)",
    "extern_calls": "extern steps run (matmuls and other aten calls, views)",
    "fallbacks": "ops (capture) and kernel groups (schedule) sent to aten, counted once per compile",
    "graph_fallbacks": "Dynamo graphs the backend could not compile, run through torch instead (once per graph)",
    "first_run_fallbacks": "compiled programs whose first run (forward or backward) failed: their graph or compile key "
                           "runs through torch from then on (driver.fallback.first_run_failed)",
    "eager_calls": "calls that ran the original function or module through torch, op by op, instead of a "
                   "compiled program (api.EagerCall: each reason logged once on the fallbacks topic)",
    "graph_captures": "CUDA-graph instances captured (graphs.GraphedFunction, cuda_graphs=True)",
    "graph_replays": "calls served by replaying captured CUDA graphs (cuda_graphs=True)",
}


def register_counter(name: str, what: str) -> None:
    """A counter of a pattern's (memfuse.patterns), listed by stats() with the core's."""
    COUNTERS[name] = what

# Where compile time goes, in seconds per stage (docs/debugging.md repeats this table). The stages
# but "trace" (a part of "capture") run one after another inside "compile"; under torch.compile,
# Dynamo's and AOTAutograd's own tracing happen before memfuse is called and are not counted.
STAGES = {
    "capture": "AOTAutograd's joint trace, decompositions and the lowering to memfuse's IR (capture.capture; "
               "backend._lower: the lowering only)",
    "trace": "of capture: AOTAutograd's functionalized trace of the function, twice (metadata, then the "
             "joint graph), with symbolic sizes (capture.trace._export)",
    "plan": "the min-cut: what the forward saves, what the backward recomputes (plan.plan)",
    "schedule": "kernel groups, externs, padding, in-place fills (schedule.schedule)",
    "codegen": "Triton source written and its file imported, per kernel (codegen.generate)",
    "buffers": "liveness and storage reuse (buffers.plan_buffers)",
    "program": "each program's Python run function written and compiled (runtime._ProgramWriter.write)",
    "verify": "the IR and buffer-plan verifiers (Config.check only)",
    "precompile": "Triton's compile (or load, warm cache) of every kernel, in parallel threads, on a GPU "
                  "(precompile.precompile)",
    "compile": "whole compiles: every stage above and the bookkeeping between them",
}
SECONDS: Counter = Counter()

TOPICS = ("graphs", "plan", "kernels", "cache", "recompiles", "fallbacks")
_HANDLER_MARK = "_memfuse_handler"

# The fields of one tensor argument's part of the compile key, in the order api.FusedFunction._key
# builds it: ("T", dtype, device, rank, D, size pattern, requires_grad, contiguous, parameter).
TENSOR_KEY_FIELDS = ("tensor", "dtype", "device", "rank", "D (last dim)", "size pattern",
                     "requires_grad", "layout", "nn.Parameter")


def stats() -> dict:
    """Counters since the process started (or the last `reset_stats()`); see COUNTERS."""
    return {k: STATS[k] for k in COUNTERS}


def reset_stats() -> None:
    STATS.clear()
    SECONDS.clear()


def compile_times() -> dict:
    """Seconds spent in each compile stage since the process started (or the last
    `reset_stats()`); see STAGES. The stages but "trace" sum to about "compile"."""
    return {stage: SECONDS[stage] for stage in STAGES}


def timed(stage: str) -> Callable:
    """Decorator: add the wall time of every call of the function to SECONDS[stage]."""
    assert stage in STAGES, stage

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                SECONDS[stage] += time.perf_counter() - start
        return run
    return decorate


def topic_log(topic: str) -> logging.Logger:
    assert topic in TOPICS, topic
    return logging.getLogger(f"memfuse.{topic}")


def configure_logging(spec: Optional[str] = None) -> None:
    """Apply MEMFUSE_LOG (or `spec`, same syntax): called once at import; call again after
    changing the variable. An empty value or 0 turns memfuse's log off."""
    spec = (os.environ.get("MEMFUSE_LOG", "") if spec is None else spec).strip().lower()
    for topic in TOPICS:
        topic_log(topic).setLevel(logging.NOTSET)
    if spec in ("", "0", "off", "false", "no"):
        log.setLevel(logging.NOTSET)
        return
    if spec in ("1", "info", "on", "true", "yes"):
        log.setLevel(logging.INFO)
    elif spec in ("2", "debug", "all"):
        log.setLevel(logging.DEBUG)
    else:
        topics = [t.strip() for t in spec.split(",") if t.strip()]
        unknown = [t for t in topics if t not in TOPICS]
        if unknown:
            raise ValueError(f"memfuse: MEMFUSE_LOG={spec!r}: unknown topic(s) {unknown}; "
                             f"use 1, debug, or a comma-separated list of {', '.join(TOPICS)}")
        log.setLevel(logging.WARNING)
        for topic in topics:
            topic_log(topic).setLevel(logging.DEBUG)
    if not any(getattr(h, _HANDLER_MARK, False) for h in log.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[memfuse] %(message)s"))
        setattr(handler, _HANDLER_MARK, True)
        log.addHandler(handler)


# -- dumps --------------------------------------------------------------------------------------
def dump_dir() -> Optional[Path]:
    folder = os.environ.get("MEMFUSE_DUMP_DIR", "").strip()
    return Path(folder) if folder else None


def dump(name: str, text: str) -> None:
    """Write `text` to $MEMFUSE_DUMP_DIR/name when the switch is set."""
    folder = dump_dir()
    if folder:
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


_dump_numbers: dict = {}


def _next_dump_folder(name: str) -> str:
    """`<name>.<k>`: k counts this process's compiles of functions with that name, so a
    recompile gets its own folder instead of overwriting the first."""
    counter = _dump_numbers.setdefault(name, itertools.count())
    return f"{_safe(name)}.{next(counter)}"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}"


# -- the compile hook -----------------------------------------------------------------------------
# Counters and logging are the ground floor: this module imports no other memfuse module. The
# report layer (explain) registers what it does after a compile here, on `import memfuse`.
_compile_hooks: list = []


def add_compile_hook(hook: Callable[[str, object, Optional[Path]], None]) -> None:
    """Call `hook(name, entry, folder)` after every compile while MEMFUSE_LOG or MEMFUSE_DUMP_DIR
    is on: `entry` holds what the compile recorded (driver.compile.Compiled),
    `folder` is where to dump it (None without MEMFUSE_DUMP_DIR). Adding a hook twice adds it once."""
    if hook not in _compile_hooks:
        _compile_hooks.append(hook)


def _logging_on() -> bool:
    return any(topic_log(t).isEnabledFor(logging.INFO) for t in TOPICS)


def on_compile(name: str, entry) -> Optional[Path]:
    """After a compile: hand the entry to the compile hooks (the report layer logs the graphs, plan
    and kernels, and dumps them when MEMFUSE_DUMP_DIR is set). Returns the dump folder (None
    without dumps). Costs nothing while both switches are off."""
    folder = dump_dir()
    if folder is None and not _logging_on():
        return None
    target = None if folder is None else folder / _next_dump_folder(name)
    for hook in _compile_hooks:
        hook(name, entry, target)
    return target


# -- recompiles -----------------------------------------------------------------------------------
def describe_key_change(old_keys, new_key: tuple, arg_name: Callable[[int], str]) -> str:
    """Which parts of the compile key differ between `new_key` and the closest key in `old_keys`
    (the fewest differing parts), e.g. "argument 'x' (position 0): dtype float32 -> float16"."""
    best = None
    for old in old_keys:
        trees = [next((p[1] for p in k[1:] if isinstance(p, tuple) and p[:1] == ("tree",)), None)
                 for k in (old, new_key)]          # how pytree arguments nest the leaves (api._key)
        if trees[0] != trees[1]:                   # then the leaves do not line up: name the structures
            old_tree, new_tree = ("(flat: tensors and constants)" if t is None else " ".join(str(t).split())
                                  for t in trees)
            changes = [f"argument structure {old_tree} -> {new_tree}"]
        else:
            changes = _key_changes(old, new_key, arg_name)
        if best is None or len(changes) < len(best):
            best = changes
    if not best:
        return "no earlier key to compare with"
    return "; ".join(best)


def _key_changes(old: tuple, new: tuple, arg_name: Callable[[int], str]) -> list:
    changes = []
    if old[0] != new[0]:
        needed = {True: "needed", False: "not needed"}
        changes.append(f"gradients {needed[old[0]]} -> {needed[new[0]]} "
                       f"(grad mode, or which inputs require grad)")
    old_args, new_args = _split_key(old), _split_key(new)
    if len(old_args) != len(new_args):
        changes.append(f"number of arguments {len(old_args)} -> {len(new_args)}")
    for position, (a, b) in enumerate(zip(old_args, new_args)):
        if a == b:
            continue
        where = f"argument {arg_name(position)}"
        if a[0] != b[0]:
            what = {"T": "a tensor", "C": "a constant"}
            changes.append(f"{where}: {what[a[0]]} -> {what[b[0]]}")
        elif a[0] == "C":
            field_ = "constant value" if a[1] == b[1] else "constant type"
            changes.append(f"{where}: {field_} {a[2]!r} -> {b[2]!r}")
        else:
            fields = [f"{label} {_short(x)} -> {_short(y)}"
                      for label, x, y in zip(TENSOR_KEY_FIELDS[1:], a[1:], b[1:]) if x != y]
            changes.append(f"{where}: {', '.join(fields)}")
    old_autocast, new_autocast = _autocast_part(old), _autocast_part(new)
    if old_autocast != new_autocast:
        changes.append(f"autocast {_short(old_autocast or 'off')} -> {_short(new_autocast or 'off')}")
    old_shapes, new_shapes = _shapes_part(old), _shapes_part(new)
    if old_shapes != new_shapes and new_shapes is not None:
        changes.append(f"leading sizes {_format_shapes(old_shapes)} -> {_format_shapes(new_shapes)} "
                       f"(this function's trace specializes on them)")
    return changes


def _split_key(key: tuple) -> list:
    return [p for p in key[1:] if isinstance(p, tuple) and p and p[0] in ("T", "C")]


def _autocast_part(key: tuple):
    """The autocast dtype the key's trace ran under, or None."""
    return next((p[1] for p in key[1:] if isinstance(p, tuple) and p and p[0] == "autocast"), None)


def _shapes_part(key: tuple):
    last = key[-1]
    return last if isinstance(last, tuple) and (not last or not isinstance(last[0], str)) else None


def _format_shapes(shapes) -> str:
    return "(none)" if shapes is None else ", ".join(str(list(s)) for s in shapes)


def _short(value) -> str:
    return str(value).replace("torch.", "")
