"""The model zoo side by side: every family's training step in eager, torch.compile and memfuse.

    python -m benchmarks.zoo [--families a,b] [--modes NAME,..] [--tiny] [--jobs N] [--timeout S] [--budget S]
                             [--dropout P] [--compile-cache DIR] [--force] [--out DIR] [--charts DIR]
    python -m benchmarks.zoo --report [--tiny] [--out DIR] [--charts DIR]

The families are benchmarks/lib/zoo.py's (decoders dense and mixture-of-experts, encoders,
encoder-decoders, vision transformers, speech, CNNs; timm's where it is installed), built from
configs with random weights. Each mode runs benchmarks.lib.hf_models' harness (run_mode): the first
step (compile included), warm-up and timed steps, one step's memory, then the check of a
dropout-free step's loss and gradients against eager's; on top, the graph fallbacks and calls run
through torch with their reasons (memfuse's `fallbacks` log, memfuse.stats()).

How the run is made, and why its timings are clean. --jobs worker processes, one fresh process per
family (an OOM or a hang leaves nothing behind; --timeout ends a family's process), compile in
parallel: compiles are most of the cost, the timed steps a small part. A worker's warm-up, timed and
memory steps run in a timing slot (TimingSlot): it takes a file lock and PAUSES every other worker
(SIGSTOP to its process group: the worker, inductor's compile subprocesses, Triton's compiler),
waits GPU_SETTLE_S for their already queued kernels, times, then continues them (SIGCONT). A lock
alone is not enough: the others' compiles (host) and first steps and checks (GPU) ran beside the
timed steps and slowed host-bound modes at random (the first H200 run: models of one architecture
fast in one memfuse mode and slow in the other). A serial measure phase after a parallel warm phase
would time cleanly too, but every compile's tracing (Dynamo's, memfuse's capture and plan) runs
again in it, uncached, for every family one at a time: more than the run's budget. With pausing, the
serial part is only the timed steps themselves. The parent registers a worker
(<out>/zoo-workers/<process group>) under the lock before it runs, and on its exit unregisters it
and continues every worker under the lock (one that died holding a slot left them paused); a slot
held past SLOT_LIMIT_S continues the others and marks its row's timing not exclusive, so one hung
family never stops the zoo. What stays shared: the first step's time (`1st step s`: compile under
the other families' compiles) and the GPU's memory (the paused workers keep theirs).

The workers share on-disk compile caches (--compile-cache, default <out>/zoo-cache): inductor's FX
graph and AOTAutograd caches, Triton's, memfuse's kernels and binary index. A family whose kernels
another family or an earlier command compiled loads them; each row records its first step's cache
lookups (`compile_cache`, `compile_cached`; the table marks `(cached)`), and each command appends
its phases (wall time, timing slots, the parallel rest, per family) to zoo-runs.json, for planning.

One compile per mode where it is honest: a family whose config does not depend on dropout (most
decoders) is checked on its timed model's first step (loss and gradients from zero: what a fresh
dropout-free copy gives); one with dropout compiles a dropout-free copy for the check, unless
--dropout 0, which times every family without dropout (the table then times models without
dropout; `checked_on` in each row, `dropout` in each family's JSON).

A family whose zoo-<family>.json is in --out is skipped unless --force: a run can be split over
commands (--families, --budget) or resumed. Then every family's JSON in --out is merged into zoo.md
(table and summary line) and zoo.png (memfuse's speed ratio against its peak ratio, torch.compile = 1).

Without CUDA, or with --tiny: tiny configs on CPU in fp32 through the Triton interpreter, a smoke
run (zoo-tiny-*.json; torch_compile only when --modes names it).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

STARTED = time.perf_counter()  # this process's start, before torch's import: a worker's wall time

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.lib import hf_models as models  # noqa: E402  (sets TRITON_INTERPRET for --tiny before triton loads)
from benchmarks.lib.report import _fmt, _markdown, _table, write_report_files  # noqa: E402
from benchmarks.lib.zoo import KIND, ZOO  # noqa: E402

MODES = ("eager", "torch_compile", "memfuse_backend", "memfuse_whole")
TINY_MODES = tuple(m for m in MODES if m not in models.COMPILING_MODES)
MEMFUSE_MODES = ("memfuse_backend", "memfuse_whole")  # the summary's and the chart's
PER_LAYER_MODES = ("memfuse_per_layer", "memfuse_per_layer_backend", "torch_compile_per_layer")  # need Family.layers
GPU_SETTINGS = models.Settings(warmup_steps=2, timed_steps=6)  # the zoo's budget: many families, few steps
DEFAULT_JOBS = 4
DEFAULT_TIMEOUT_S = 900  # one family, every mode; a hung family's process is ended then
TARGET_SPEED = 1.0  # issue 50's per-family bar: it/s >= 1.0x torch.compile's ...
TARGET_PEAK = 0.8  # ... at a peak <= 0.8x its peak
REASON_CHARS = 120  # of each fallback reason in the Markdown table (the JSON has them whole)
LOCK_NAME = ".zoo-timing.lock"
WORKERS_DIR = "zoo-workers"  # in --out: an empty file per running worker, named by its process group
CACHE_DIR = "zoo-cache"  # in --out by default: inductor's, Triton's and memfuse's on-disk caches
# A paused worker's kernels already queued on the GPU still run: the slot's holder waits this long,
# longer than a queued step of the zoo's slowest family, before its warm-up steps.
GPU_SETTLE_S = 0.2
# The longest a timing slot keeps the other workers paused: past it (a timed step that hangs, or
# waits on a lock a paused worker holds) they run again and the mode's row says its timing was not
# exclusive, rather than the whole zoo waiting for one family's --timeout.
SLOT_LIMIT_S = 60.0
POLL_S = 0.2  # how often the parent looks whether a worker has exited


# -- files ----------------------------------------------------------------------------------------
def json_path(out_dir: Path, family: str, tiny: bool) -> Path:
    return out_dir / f"zoo-{'tiny-' if tiny else ''}{family}.json"


def report_stem(out_dir: Path, tiny: bool) -> Path:
    return out_dir / ("zoo-tiny" if tiny else "zoo")


def load_results(out_dir: Path, tiny: bool) -> list[dict]:
    """Every family's JSON of this kind in out_dir, in the zoo's order."""
    paths = [json_path(out_dir, name, tiny) for name in ZOO]
    known = [json.loads(p.read_text()) for p in paths if p.exists()]
    # a family measured where timm was installed is listed even where it is not (the report's machine)
    extra = sorted(set(out_dir.glob(f"zoo-{'tiny-' if tiny else ''}*.json")) - set(paths) - {runs_path(out_dir, tiny)})
    extra = [json.loads(p.read_text()) for p in extra if tiny or not p.name.startswith("zoo-tiny-")]
    return known + [result for result in extra if "rows" in result]  # a family's, not a run record's


def runs_path(out_dir: Path, tiny: bool) -> Path:
    """The commands' phase timings (record_run)."""
    return out_dir / f"zoo-{'tiny-' if tiny else ''}runs.json"


# -- one family, in a worker process --------------------------------------------------------------
class FallbackReasons(logging.Handler):
    """What memfuse's `fallbacks` topic says while a mode runs: each graph or call it ran through
    torch, with the reason (driver/fallback.py's graph_fallback and say_once)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.reasons.append(record.getMessage())

    @contextlib.contextmanager
    def recording(self):
        from memfuse.driver import fallback

        fallback.TOLD.clear()  # say_once tells once per process: each mode hears every reason
        logger = logging.getLogger("memfuse.fallbacks")
        logger.addHandler(self)
        try:
            yield self.reasons
        finally:
            logger.removeHandler(self)


@contextlib.contextmanager
def timing_lock(path: Path):
    """Held while a worker times, and while the parent registers or unregisters a worker."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _start_time(pid: int) -> str | None:
    """When the process started (clock ticks after boot, /proc/<pid>/stat's 22nd field; None: gone):
    with its id, it names one process, never a later one that reused the id."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def register_worker(out_dir: Path, pgid: int) -> None:
    (out_dir / WORKERS_DIR).mkdir(parents=True, exist_ok=True)
    (out_dir / WORKERS_DIR / str(pgid)).write_text(_start_time(pgid) or "")


def unregister_worker(out_dir: Path, pgid: int) -> None:
    (out_dir / WORKERS_DIR / str(pgid)).unlink(missing_ok=True)


def clear_workers(out_dir: Path) -> None:
    """Forget the workers an earlier command left registered (its parent was killed: they died with
    it, _die_with_parent)."""
    folder = out_dir / WORKERS_DIR
    for path in folder.iterdir() if folder.is_dir() else ():
        path.unlink(missing_ok=True)


def registered_workers(out_dir: Path) -> list[int]:
    """The process groups of the running workers (each worker runs in a session of its own, with
    its compile subprocesses): each registered group whose leader is the process registered, so a
    stale registration (a killed command's) never names a process that reused its id."""
    folder = out_dir / WORKERS_DIR
    files = sorted(p for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []
    return [int(p.name) for p in files if p.read_text() and p.read_text() == _start_time(int(p.name))]


def signal_groups(pgids: list[int], signum: int) -> list[int]:
    """Send `signum` to each process group; the groups it reached (one that has exited is skipped)."""
    reached = []
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signum)
            reached.append(pgid)
    return reached


class TimingSlot:
    """One worker's timed steps with nothing else running on the host or the GPU: the slot takes
    the timing lock, pauses every other registered worker's process group (SIGSTOP: their compiles,
    compile subprocesses and GPU work stop where they are), waits GPU_SETTLE_S for their queued
    kernels, and on leaving continues them (SIGCONT). Counts what it cost, for the family's JSON."""

    def __init__(self, out_dir: Path, settle_s: float = GPU_SETTLE_S, limit_s: float = SLOT_LIMIT_S):
        self.out_dir, self.settle_s, self.limit_s = out_dir, settle_s, limit_s
        self.held_s = 0.0  # the others paused: the run's serial part
        self.holds = 0
        self.overruns = 0  # holds that passed limit_s: the others ran again before the hold ended
        self.paused_most = 0  # the most workers one hold paused

    @contextlib.contextmanager
    def hold(self):
        with timing_lock(self.out_dir / LOCK_NAME):
            own = os.getpgid(0)
            others = [g for g in registered_workers(self.out_dir) if g != own]
            paused = signal_groups(others, signal.SIGSTOP)
            watchdog = threading.Timer(self.limit_s, self._overrun, (paused,))
            watchdog.daemon = True
            start = time.perf_counter()
            watchdog.start()
            try:
                if paused:
                    time.sleep(self.settle_s)
                yield
            finally:
                watchdog.cancel()
                signal_groups(paused, signal.SIGCONT)
                self.held_s += time.perf_counter() - start
                self.holds += 1
                self.paused_most = max(self.paused_most, len(paused))

    def _overrun(self, paused: list[int]) -> None:
        self.overruns += 1
        signal_groups(paused, signal.SIGCONT)
        print(f"zoo: a timing slot held past {self.limit_s:.0f} s: the other workers run again, this mode's "
              f"timing is not exclusive", file=sys.stderr, flush=True)

    def report(self) -> dict:
        return {"slot_s": self.held_s, "slot_holds": self.holds, "slot_overruns": self.overruns,
                "workers_paused_most": self.paused_most}


def run_family(name: str, modes: tuple[str, ...], setup: models.Setup, slot: TimingSlot) -> dict:
    """Every mode of one family on the same weights and batch; the family's JSON."""
    family = ZOO[name]
    case, reference = models.prepare(family, setup)
    rows = []
    for mode in modes:
        if mode in PER_LAYER_MODES and not family.layer_paths:
            continue  # a model without a list of layers (timm's) has no per-layer mode
        recorder, overruns = FallbackReasons(), slot.overruns
        with recorder.recording() as reasons:
            row = models.run_mode(case, mode, reference)
        rows.append({**models.row_json(row), "fallback_reasons": reasons,
                     "timing_exclusive": slot.overruns == overruns})
    return {"metadata": models.metadata(setup), "kind": KIND[name], **models.describe(case),
            "layers": list(family.layer_paths), "rows": rows}


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """Killed when the command that started this worker dies (Linux): a command ended from outside
    leaves no worker on the GPU (the worker runs in a session of its own, for its timeout)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def worker(args: argparse.Namespace) -> None:
    _die_with_parent()
    import transformers

    transformers.logging.set_verbosity_error()
    tiny = args.tiny
    slot = TimingSlot(args.out)
    setup = models.Setup(torch.device("cpu" if tiny else "cuda"), tiny,
                         models.TINY_SETTINGS if tiny else GPU_SETTINGS, use_cache=args.use_cache,
                         dropout=args.dropout, exclusive=slot.hold)
    if not tiny:
        torch.ones(8, 8, device=setup.device) @ torch.ones(8, 8, device=setup.device)  # CUDA and cuBLAS up
    result = run_family(args.worker, _modes(args, tiny), setup, slot)
    rows = result["rows"]
    result["run"] = {"wall_s": time.perf_counter() - STARTED, **slot.report(), "jobs": args.jobs,
                     "first_steps_s": sum(r["first_step_s"] or 0.0 for r in rows),
                     "checks_s": sum(r["check_s"] or 0.0 for r in rows),
                     "compiles_cached": sum(r["compile_cached"] is True for r in rows),
                     "compiles_cold": sum(r["compile_cached"] is False for r in rows),
                     "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}
    path = json_path(args.out, args.worker, tiny)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path}", flush=True)


# -- the parent: workers, timeouts ----------------------------------------------------------------
def _failed_result(name: str, modes: tuple[str, ...], tiny: bool, error: str) -> dict:
    """A family whose worker died or timed out: every mode's row carries the error."""
    family = ZOO[name]
    return {"metadata": {"tiny": tiny, "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                         "device": "?", "torch": torch.__version__, "triton": None, "transformers": None,
                         "precision": "fp32" if tiny else "bf16 autocast, fp32 parameters"},
            "kind": KIND[name], "model": name, "class": family.model_class,
            "size": dataclasses.asdict(family.tiny if tiny else family.size), "parameters": None,
            "layers": list(family.layer_paths), "run": None,
            "rows": [{"mode": m, "error": error, "check_error": None, "it_s": None, "peak_bytes": None,
                      "kept_bytes": None, "first_step_s": None, "memfuse_compile": None, "memfuse_per_step": None,
                      "loss": None, "loss_error": None, "grad_error": None, "fallback_reasons": []} for m in modes]}


def _tail(path: Path, lines: int = 3) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " / ".join(text[-lines:])


@dataclasses.dataclass(frozen=True)
class Budget:
    """The command's time: --timeout for each family, --budget for the whole command (None: none)."""

    family_s: float
    command_s: float | None
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def left(self) -> float | None:
        return None if self.command_s is None else self.command_s - (time.perf_counter() - self.start)


def spawn(name: str, args: argparse.Namespace, modes: tuple[str, ...], tiny: bool, budget: Budget) -> str:
    """One family in a fresh process, its output in <out>/zoo-logs/<family>.log; ended after
    --timeout (its JSON then says so), or when --budget runs out (no JSON: the next command reruns it)."""
    left = budget.left()
    if left is not None and left <= 0:
        return f"{name}: not started, --budget spent (the next command runs it)"
    timeout = budget.family_s if left is None else min(budget.family_s, left)
    logs = args.out / "zoo-logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{'tiny-' if tiny else ''}{name}.log"
    command = [sys.executable, "-m", "benchmarks.zoo", "--worker", name, "--modes", ",".join(modes),
               "--out", str(args.out), "--jobs", str(args.jobs), "--dropout", repr(args.dropout),
               *(["--tiny"] if tiny else []), *(["--use-cache"] if args.use_cache else [])]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        process = start_worker(command, log, args, tiny)
        try:
            rc = _exited(process, timeout)
            if rc is None:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the worker and its compile workers
                _exited(process, None)
        except BaseException:  # interrupted (Ctrl-C): the worker does not outlive the command
            signal_groups([process.pid], signal.SIGKILL)
            raise
        finally:
            finish_worker(args.out, process)
    path = json_path(args.out, name, tiny)
    if rc is None and timeout < budget.family_s:
        return f"{name}: ended unfinished when --budget ran out (the next command reruns it)"
    if rc is None:
        error = f"timeout: the family's process ran past --timeout {args.timeout:.0f} s and was ended"
    elif rc != 0 or not path.exists():
        error = f"the family's process exited with {rc}: {_tail(log_path)}"
    else:
        return f"{name}: done in {time.perf_counter() - start:.0f} s"
    path.write_text(json.dumps(_failed_result(name, modes, tiny, error), indent=2) + "\n")
    return f"{name}: {error} (log {log_path})"


def worker_env(args: argparse.Namespace, tiny: bool) -> dict:
    """A worker's environment: the run's compile caches (a family that compiles what another or an
    earlier command compiled loads it), and its share of the cores for inductor's compile workers."""
    cache = args.compile_cache or args.out / CACHE_DIR
    env = {**os.environ, "TORCHINDUCTOR_COMPILE_THREADS": str(max(1, (os.cpu_count() or 1) // args.jobs)),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "MEMFUSE_CACHE_DIR": str(cache / "memfuse")}
    if tiny:
        env["TRITON_INTERPRET"] = "1"
    return env


def start_worker(command: list[str], log, args: argparse.Namespace, tiny: bool) -> subprocess.Popen:
    """The worker in a session of its own, registered (its process group paused by every other
    worker's timing slot) before it runs beside a timed step: started under the timing lock."""
    with timing_lock(args.out / LOCK_NAME):
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=worker_env(args, tiny),
                                   cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
        register_worker(args.out, process.pid)
    return process


def _exited(process: subprocess.Popen, timeout: float | None) -> int | None:
    """The worker's exit status once it has exited (None: still running after `timeout`), left
    unreaped: until finish_worker reaps it its process id names no other process."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        flags = os.WEXITED | os.WNOWAIT | (0 if deadline is None else os.WNOHANG)
        info = os.waitid(os.P_PID, process.pid, flags)
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if time.monotonic() >= deadline:
            return None
        time.sleep(POLL_S)


def finish_worker(out_dir: Path, process: subprocess.Popen) -> None:
    """Unregister an exited worker and continue the others: one that died holding a timing slot
    (crashed, or ended at --timeout) left them paused. Under the timing lock, so that no live
    slot's pause is undone; then reap it."""
    with timing_lock(out_dir / LOCK_NAME):
        unregister_worker(out_dir, process.pid)
        signal_groups(registered_workers(out_dir), signal.SIGCONT)
    process.wait()


def run_all(args: argparse.Namespace, tiny: bool) -> None:
    names = models._names(args.families, tuple(ZOO), "families")
    modes = _modes(args, tiny)
    todo = [n for n in names if args.force or not json_path(args.out, n, tiny).exists()]
    skipped = [n for n in names if n not in todo]
    if skipped:
        print(f"skipped (their JSON is in {args.out}; --force reruns): {', '.join(skipped)}", flush=True)
    print(f"{len(todo)} families x {', '.join(modes)}; {args.jobs} at a time", flush=True)
    clear_workers(args.out)
    budget = Budget(args.timeout, args.budget)
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for message in pool.map(lambda name: spawn(name, args, modes, tiny, budget), todo):
            print(message, flush=True)
    if todo:
        print(record_run(args, todo, time.perf_counter() - budget.start, tiny), flush=True)


def record_run(args: argparse.Namespace, families: list[str], wall_s: float, tiny: bool) -> str:
    """Append this command's phases to runs_path() (cost planning): its wall time, the serial
    part (timing slots: every other worker paused) and the parallel rest (compiles, checks), each
    family's own (its JSON's `run`)."""
    runs = {}
    for name in families:
        path = json_path(args.out, name, tiny)
        runs[name] = json.loads(path.read_text()).get("run") if path.exists() else None
    slot_s = sum(run["slot_s"] for run in runs.values() if run)
    entry = {"date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "jobs": args.jobs,
             "dropout": args.dropout, "cache_dir": str(args.compile_cache or args.out / CACHE_DIR), "wall_s": wall_s,
             "timing_slots_s": slot_s, "parallel_s": wall_s - slot_s, "families": runs}
    path = runs_path(args.out, tiny)
    history = json.loads(path.read_text()) if path.exists() else {"runs": []}
    history["runs"].append(entry)
    path.write_text(json.dumps(history, indent=2) + "\n")
    return (f"{len(families)} families in {wall_s:.0f} s, {slot_s:.0f} s of it timing with the others paused; "
            f"wrote {path}")


def _modes(args: argparse.Namespace, tiny: bool) -> tuple[str, ...]:
    if args.modes:
        return models._names(args.modes, models.ALL_MODES, "modes")
    return TINY_MODES if tiny else MODES


# -- the report -----------------------------------------------------------------------------------
def _rows(result: dict) -> dict[str, dict]:
    return {row["mode"]: row for row in result["rows"]}


def _ratio(row: dict, baseline: dict | None, field: str) -> float | None:
    if not baseline or not row.get(field) or not baseline.get(field):
        return None
    return row[field] / baseline[field]


def _counter(row: dict, name: str) -> int | None:
    counters = row.get("memfuse_compile") or {}
    return counters.get(name) if row["mode"].startswith("memfuse") else None


def _crashed(row: dict) -> bool:
    return bool(row.get("error") or row.get("check_error"))


def _short(text: str, limit: int) -> str:
    text = " ".join(str(text).split()).replace("|", "/")
    return text[:limit] + ("..." if len(text) > limit else "")


def _note(row: dict) -> str:
    parts = [row.get("error") and f"error: {row['error']}", row.get("check_error") and f"check: {row['check_error']}",
             row.get("timing_exclusive") is False and f"timing not exclusive (a slot past {SLOT_LIMIT_S:.0f} s)"]
    parts += [f"fallback: {_short(reason, REASON_CHARS)}" for reason in dict.fromkeys(row.get("fallback_reasons") or [])]
    return _short("; ".join(p for p in parts if p), models.ERROR_CHARS + 2 * REASON_CHARS)


def _first_step(row: dict) -> str:
    """The first step's seconds, marked where every compile-cache lookup hit (an earlier family or
    command compiled it)."""
    text = _fmt(row.get("first_step_s"), ".1f")
    return f"{text} (cached)" if row.get("compile_cached") else text


def table(results: list[dict], markdown: bool) -> str:
    headers = ["family", "kind", "mode", "it/s", "speed vs compile", "peak MB", "peak vs compile", "kept MB",
               "1st step s", "graph fallbacks", "eager calls", "loss (no dropout)", "loss err", "grad err",
               "compile's grad err", "note"]
    body = []
    for result in results:
        rows = _rows(result)
        baseline = rows.get(models.BASELINE_MODE)
        for row in result["rows"]:
            body.append([
                result["model"], result["kind"], row["mode"], _fmt(row.get("it_s"), ".1f"),
                _fmt(_ratio(row, baseline, "it_s"), ".2f", suffix="x"),
                _fmt(row.get("peak_bytes"), ".0f", 1 / models.MB),
                _fmt(_ratio(row, baseline, "peak_bytes"), ".2f", suffix="x"),
                _fmt(row.get("kept_bytes"), ".0f", 1 / models.MB), _first_step(row),
                _fmt(_counter(row, "graph_fallbacks"), ".0f"), _fmt(_counter(row, "eager_calls"), ".0f"),
                _fmt(row.get("loss"), ".4f"), _fmt(row.get("loss_error"), ".1e"), _fmt(row.get("grad_error"), ".1e"),
                _fmt((baseline or {}).get("grad_error") if row["mode"] in MEMFUSE_MODES else None, ".1e"),
                _note(row)])
    return _markdown(headers, body) if markdown else _table(headers, body)


@dataclasses.dataclass(frozen=True)
class Summary:
    families: int
    crashes: int  # rows of a compiling mode (not eager) whose speed part or check raised
    fallbacks: int  # memfuse rows with a graph fallback or a call run through torch
    speed_ratio: dict  # mode -> median it/s over torch.compile's
    peak_ratio: dict  # mode -> median peak over torch.compile's
    meeting: dict  # mode -> families at >= TARGET_SPEED and <= TARGET_PEAK
    measured: dict  # mode -> families with both ratios

    def line(self) -> str:
        parts = [f"{self.families} families", f"{self.crashes} crashes", f"{self.fallbacks} memfuse rows with fallbacks"]
        for mode in MEMFUSE_MODES:
            parts.append(f"{mode}: median {_fmt(self.speed_ratio.get(mode), '.2f', suffix='x')} speed, "
                         f"{_fmt(self.peak_ratio.get(mode), '.2f', suffix='x')} peak vs torch.compile, "
                         f"{self.meeting.get(mode, 0)}/{self.measured.get(mode, 0)} families at >= "
                         f"{TARGET_SPEED:.1f}x speed and <= {TARGET_PEAK:.1f}x peak")
        return "; ".join(parts)


def summarize(results: list[dict]) -> Summary:
    crashes = fallbacks = 0
    speed, peak, meeting = {m: [] for m in MEMFUSE_MODES}, {m: [] for m in MEMFUSE_MODES}, {m: 0 for m in MEMFUSE_MODES}
    for result in results:
        rows = _rows(result)
        baseline = rows.get(models.BASELINE_MODE)
        for row in result["rows"]:
            crashes += row["mode"] != "eager" and _crashed(row)
            fallbacks += bool(_counter(row, "graph_fallbacks") or _counter(row, "eager_calls"))
        for mode in MEMFUSE_MODES:
            row = rows.get(mode)
            if row is None:
                continue
            s, p = _ratio(row, baseline, "it_s"), _ratio(row, baseline, "peak_bytes")
            if s is not None:
                speed[mode].append(s)
            if s is not None and p is not None:
                peak[mode].append(p)
                meeting[mode] += s >= TARGET_SPEED and p <= TARGET_PEAK
    median = lambda values: statistics.median(values) if values else None  # noqa: E731
    return Summary(len(results), crashes, fallbacks, {m: median(v) for m, v in speed.items()},
                   {m: median(v) for m, v in peak.items()}, meeting, {m: len(peak[m]) for m in MEMFUSE_MODES})


def write_chart(results: list[dict], path: Path) -> str:
    """Each family's memfuse speed ratio against its peak ratio (torch.compile = 1, 1), per mode;
    the target's corner shaded. Returns what was written, or why nothing was."""
    try:
        import matplotlib
    except ImportError:
        return f"no chart: matplotlib is not installed ({path} not written)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(10, 7), constrained_layout=True)
    points = 0
    for index, mode in enumerate(MEMFUSE_MODES):
        for result in results:
            rows = _rows(result)
            row, baseline = rows.get(mode), rows.get(models.BASELINE_MODE)
            s, p = (_ratio(row, baseline, "it_s"), _ratio(row, baseline, "peak_bytes")) if row else (None, None)
            if s is None or p is None:
                continue
            axis.scatter(p, s, marker="os"[index], color=f"C{index}", s=45, label=mode if points == 0 or
                         mode not in axis.get_legend_handles_labels()[1] else None)
            axis.annotate(result["model"], (p, s), fontsize=7, xytext=(3, 3), textcoords="offset points")
            points += 1
    axis.axhline(TARGET_SPEED, color="gray", lw=0.8)
    axis.axvline(TARGET_PEAK, color="gray", lw=0.8, ls="--")
    axis.axvline(1.0, color="gray", lw=0.8)
    axis.set_xlabel("peak memory vs torch.compile (one step; lower is better)")
    axis.set_ylabel("it/s vs torch.compile (higher is better)")
    axis.grid(alpha=0.3)
    if points:
        axis.legend()
        left, right = axis.get_xlim()
        axis.fill_between([left, TARGET_PEAK], TARGET_SPEED, axis.get_ylim()[1], color="C2", alpha=0.08)
    else:
        axis.text(0.5, 0.5, "no ratios: torch_compile's or the peaks were not measured", ha="center",
                  transform=axis.transAxes)
    if results:
        meta = results[0]["metadata"]
        title = f"model zoo: {meta['device']}  torch {meta['torch']}  transformers {meta['transformers']}  " \
                f"{str(meta['date'])[:10]}"
        axis.set_title(("TINY RUN (CPU, Triton interpreter): not a performance result\n" if meta["tiny"] else "")
                       + title + "\n" + "\n".join(summarize(results).line().split("; ")), fontsize=8)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"wrote {path}"


def how_made(results: list[dict]) -> str:
    """What the table's timings and checks mean for these results (the module's docstring says why)."""
    dropouts = sorted({r.get("dropout") for r in results if r.get("dropout") is not None})
    on_first = [r["model"] for r in results if r.get("timed_model_is_checked")]
    settings = results[0]["metadata"].get("settings") or {}
    # a JSON from before the timing slots has no `run`: its timed steps held a lock, others ran beside them
    paused = all("run" in r for r in results)
    how = ("one family at a time, every other family's process paused" if paused else
           "one family at a time under a lock, OTHER FAMILIES COMPILING BESIDE THEM (not clean)")
    return (f"Timed steps ({settings.get('warmup_steps', '?')} warm-up, {settings.get('timed_steps', '?')} timed): "
            f"{how}; `1st step s`: wrap and compile beside the other families' compiles, `(cached)` where every compile-cache lookup hit. "
            f"Timed models' dropout: {', '.join(f'{d:g}' for d in dropouts) or '?'}. Loss and gradients: a "
            f"dropout-free step against eager's, the timed model's own first step for {len(on_first)} of "
            f"{len(results)} families (no dropout), a dropout-free copy's for the others.")


def write_report(out_dir: Path, tiny: bool, charts: Path | None = None) -> None:
    """Merge every family's JSON of this kind in out_dir: stdout, <stem>.md and <stem>.png."""
    results = load_results(out_dir, tiny)
    if not results:
        sys.exit(f"no {json_path(out_dir, '*', tiny).name} in {out_dir}: run the zoo first")
    stem = report_stem(out_dir, tiny)
    summary = summarize(results).line()
    print()
    print(table(results, markdown=False))
    print(f"\nsummary: {summary}")
    meta = results[0]["metadata"]
    heading = "Model zoo: one training step (forward, loss, backward) per family and mode"
    if tiny:
        heading += " -- TINY RUN on CPU through the Triton interpreter: not a performance result"
    lines = [f"## {heading}", "",
             f"{meta['device']}, torch {meta['torch']}, triton {meta.get('triton')}, transformers "
             f"{meta.get('transformers')}, {meta['precision']}, {meta['date']}", "", how_made(results), "",
             f"**Summary**: {summary}", "", table(results, markdown=True), ""]
    write_report_files(stem, "\n".join(lines), lambda path: write_chart(results, path), charts)


# -- the command ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", help=f"comma-separated, from {', '.join(ZOO)} (default: all)")
    parser.add_argument("--modes", help=f"comma-separated, from {', '.join(models.ALL_MODES)} (default: "
                                           f"{', '.join(MODES)}; --tiny: all but torch_compile)")
    parser.add_argument("--tiny", action="store_true", help="tiny configs on CPU through the Triton interpreter")
    parser.add_argument("--use-cache", action="store_true",
                        help="keep transformers' default config.use_cache=True, as a user's model has it (the "
                             "model returns its KV cache; default: off, as in training); its JSONs have the same names: give another --out")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, help=f"families at once (default {DEFAULT_JOBS})")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds a family's process may run (default {DEFAULT_TIMEOUT_S})")
    parser.add_argument("--budget", type=float, metavar="SECONDS",
                        help="the whole command's time: no family starts after it, a running one is ended "
                             "at it and left for the next command (default: no limit)")
    parser.add_argument("--dropout", type=float, default=models.DROPOUT,
                        help=f"the timed models' dropout (default {models.DROPOUT}); 0: every family's timed "
                             f"model is the checked one, one compile per mode (families without dropout "
                             f"are checked on their timed model at any value)")
    parser.add_argument("--compile-cache", type=Path, metavar="DIR",
                        help=f"the compile caches the workers share (inductor's, Triton's, memfuse's; "
                             f"default --out/{CACHE_DIR}): a command that reruns families loads what "
                             f"an earlier one compiled")
    parser.add_argument("--force", action="store_true", help="rerun families whose JSON is already in --out")
    parser.add_argument("--report", action="store_true", help="only merge the JSONs in --out into the report")
    parser.add_argument("--out", type=Path, default=models.DEFAULT_OUT,
                        help=f"output directory (default {models.DEFAULT_OUT})")
    parser.add_argument("--charts", type=Path, metavar="DIR", help="also draw the chart into DIR (docs/img)")
    parser.add_argument("--worker", metavar="FAMILY", help=argparse.SUPPRESS)  # one family, in this process
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out = args.out.resolve()
    args.compile_cache = args.compile_cache and args.compile_cache.resolve()
    if args.report:
        return write_report(args.out, args.tiny, args.charts)
    tiny = args.tiny or not torch.cuda.is_available()
    args.tiny = tiny
    args.out.mkdir(parents=True, exist_ok=True)
    if args.worker:
        return worker(args)
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("benchmarks.zoo needs transformers: pip install -e '.[models]'")
    if tiny:
        print(models.TINY_BANNER, flush=True)
    run_all(args, tiny)
    write_report(args.out, tiny, args.charts)
    if tiny:
        print(models.TINY_BANNER)


if __name__ == "__main__":
    main()
