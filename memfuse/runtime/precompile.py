"""precompile: build a program's Triton kernels in parallel, before their first launch.

Triton compiles a kernel when it is first launched, one at a time, and sets up its driver (a
small C module, built with the host compiler when Triton's cache is cold) at the first launch
of the process. On a GPU memfuse starts both earlier:
- `start_driver(device)` when a compile begins: the driver is set up in a thread while the
  main thread traces (its C build is a subprocess: it runs beside the trace);
- `precompile(programs, device, config)` when the programs are built: every kernel of the
  forward and the backward program is compiled and loaded in a pool of threads, each through
  Triton's own `JITFunction.warmup` with the argument types the launch will pass, so the first
  launch finds it in Triton's kernel cache. It returns once all are built: nothing races the
  launches. A kernel Triton refuses to compile (`CompilationError`) fails the compile here
  (`KernelCompileError`), before the first run: the graph runs through torch before a forward
  saved anything a backward would need. Any other failure (a set-up, a warm-up API) is logged,
  and the kernel compiles at its first launch, where the first run's guard catches a failure.

With a warm disk cache a kernel skips Triton's `compile` altogether: `BinaryIndex` remembers,
per generated kernel, launch configuration and GPU, where in Triton's cache its binary lies (the
cache hash and the argument specialization), and loads it from there. Triton's own lookup first
hashes its whole installation (`triton_key`: hundreds of MB of libtriton, once per process); the
index keys on the installation's version and file stamps instead. The loaded kernel is handed to
the launch directly (runtime.Launcher.compiled), as is a kernel compiled here.

Without a GPU (Triton's interpreter) `warmup` compiles nothing; `precompile(..., force=True)`
still walks the same path, which is how the CPU tests cover it.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import types
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional

import torch
from triton.compiler.errors import CompilationError

from memfuse.base.config import Config
from memfuse.base.debug import STATS, timed
from memfuse.ir.graph import Op
from memfuse.base.launch import TRITON_VERSION
from memfuse.runtime.launchers import KernelLaunch
from memfuse.codegen.tuning import LaunchConfig

log = logging.getLogger("memfuse.kernels")


class KernelCompileError(RuntimeError):
    """Triton refused to compile a generated kernel (precompile, before the program's first run)."""


MAX_THREADS = 4           # kernels compiled at once (a program pair has 1-6 kernels)
MOCK_INT = 2              # any int32 value: every scalar is do_not_specialize, only its width counts
TRITON_KEY_TIMEOUT_S = 60

_pool: Optional[ThreadPoolExecutor] = None
_launcher_pool: Optional[ThreadPoolExecutor] = None
_driver: dict = {}        # device index -> Future of the driver set-up
_lock = threading.RLock()


def enabled(device: torch.device, config: Config) -> bool:
    return config.precompile and not config.compile_only and device.type == "cuda"


def start_driver(device: torch.device) -> Future:
    """Set up Triton's driver for `device` in a background thread (once per device), and hash
    Triton's installation in another (once per process: `triton_key`, the first part of every
    key Triton's `compile` looks up), so a kernel not in the BinaryIndex finds it done."""
    with _lock:
        future = _driver.get(device.index)
        if future is None:
            future = _driver[device.index] = _executor().submit(_set_up_driver, device)
            if "triton_key" not in _driver:
                _driver["triton_key"] = _executor().submit(_triton_key)
    return future


@timed("precompile")
def precompile(programs: list, device: torch.device, config: Config, *, force: bool = False,
               progress: Optional[Callable[[int, int], None]] = None) -> int:
    """Compile every generated kernel of `programs` (runtime.Program, None skipped) for `device`
    in parallel threads and wait for them, twins (codegen) once for all; returns how many
    binaries were handed to Triton. `progress(done, total)` hears of each binary built
    (base.progress: the compile's progress line)."""
    if not (force or enabled(device, config)):
        return 0
    by_binary: dict = {}           # (function, launch config) -> its launches: twins share one binary
    for program in programs:
        for step in (program.steps if program is not None else []):
            if isinstance(step, KernelLaunch):
                key = (step.kernel.fn, step.launch_config(device, config))
                by_binary.setdefault(key, []).append((program.graph, step))
    if not by_binary:
        return 0
    if device.type == "cuda":
        start_driver(device).result()      # one driver set-up, never two racing ones
    futures = {key: _executor().submit(_warm_up, *launches[0], device, config) for key, launches in by_binary.items()}
    for done, (key, future) in enumerate(futures.items()):
        if progress is not None:
            progress(done, len(futures))
        (_, first), *twins = by_binary[key]
        error = future.exception()
        if isinstance(error, CompilationError):   # its launch would fail alike: the compile fails now
            message = (str(error).strip().splitlines() or [""])[-1]
            raise KernelCompileError(f"memfuse: kernel {first.group.name} does not compile with Triton: "
                                     f"{message}") from error
        if error is not None:
            log.info("memfuse: precompiling %s failed (%s: %s); it compiles at its first launch",
                     first.group.name, type(error).__name__, error)
        elif device.type == "cuda":
            for _, twin in twins:
                twin.launcher.compiled[(device.index, key[1])] = future.result()
    if progress is not None:
        progress(len(futures), len(futures))
    return len(by_binary)


def warmup_arguments(graph, launch: KernelLaunch, device: torch.device, config: Config) -> tuple[list, dict]:
    """The positional and keyword arguments of `launch.kernel.fn.warmup`: a torch dtype where
    the launch passes a tensor (Triton mocks an aligned pointer of that dtype), an int or float
    where it passes a scalar, and the constexprs and warps of the device's launch config."""
    args = []
    for a in launch.kernel.source.args:
        if a.role in ("read", "in_place", "write"):
            args.append(graph[a.value].value.dtype)
        elif a.role == "totals":
            args.append(getattr(torch, a.value))
        elif a.role == "partials":
            args.append(launch.partials_dtypes[Op(a.value)])
        elif a.role == "counter":
            args.append(torch.int32)
        elif a.role == "scalar":
            args.append(1.5 if graph[a.value].value.dtype.is_floating_point else MOCK_INT)
        else:                               # the stream base, strides, rows, tiles per program
            args.append(MOCK_INT)
    chosen = launch.launch_config(device, config)
    return args, {**launch.launcher.keywords(chosen), "num_warps": chosen.num_warps}


def _warm_up(graph, launch: KernelLaunch, device: torch.device, config: Config):
    """The kernel compiled (or loaded) for `launch`'s configuration, handed to its launcher."""
    args, keywords = warmup_arguments(graph, launch, device, config)
    if device.type != "cuda":
        launch.kernel.fn.warmup(*args, grid=(1,), **keywords)   # the interpreter: returns at once
        return None
    chosen = launch.launch_config(device, config)
    index = BinaryIndex(config.cache_dir)
    with torch.cuda.device(device):
        target = str(_current_target())
        compiled = index.load(launch.kernel, chosen, target)
        if compiled is None:
            _triton_installation_hashed()
            with _launcher_built_beside(launch.kernel.fn, device.index):
                compiled = launch.kernel.fn.warmup(*args, grid=(1,), **keywords)
            index.record(launch.kernel, chosen, target, compiled)
        else:
            STATS["kernels_loaded"] += 1
        compiled._init_handles()   # load the binary and build the launcher now, not at the first launch
    launch.launcher.compiled[(device.index, chosen)] = compiled
    return compiled


@contextlib.contextmanager
def _launcher_built_beside(fn, device_index: int):
    """While `fn` compiles for a device, build its launcher in another thread (Triton 3.6).

    Triton 3.6 builds a kernel's launcher, a C module the host compiler builds on a cold cache,
    when the compiled kernel is first loaded: after the compile, on the first call's
    critical path. The module depends only on the kernel's specialization, which the compile
    passes to `fn.ASTSource` (set on the function with its argument binder for the device):
    wrapped for this compile, that call starts the build, and the block waits for it, so the
    load finds the module in Triton's cache. A failed build costs only time: the load builds it."""
    if TRITON_VERSION != (3, 6):
        yield
        return
    fn.device_caches[device_index]          # makes the binder for the device, and sets fn.ASTSource
    make_source, builds = vars(fn).get("ASTSource"), []
    if make_source is None:
        yield
        return

    def source(*args):
        src = make_source(*args)
        builds.append(_launcher_executor().submit(_build_launcher, src))
        return src
    fn.ASTSource = source
    try:
        yield
    finally:
        fn.ASTSource = make_source
        for build in builds:
            if build.exception() is not None:
                log.debug("memfuse: building a launcher early failed: %s", build.exception())


def _build_launcher(src) -> None:
    """Build (into Triton's cache) the launcher of the kernel `src` describes; the metadata are
    what Triton 3.6's launcher reads of a kernel without scratch memory or tensor descriptors."""
    import triton
    metadata = types.SimpleNamespace(tensordesc_meta=None, num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                                     profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
                                     launch_pdl=False)
    triton.runtime.driver.active.launcher_cls(src, metadata)


class BinaryIndex:
    """Where Triton's cache holds each generated kernel's binary, one small JSON file per kernel,
    launch configuration, GPU target and Triton installation (`toolchain`): Triton's cache hash
    and the specialization its launcher is built from (signature, constants, attributes). A
    missing or stale entry (Triton's cache cleared, another Triton) is a miss: the kernel is
    compiled through Triton as usual and the entry rewritten."""

    def __init__(self, cache_dir: Path):
        self.directory = Path(cache_dir) / "binaries"

    def path(self, kernel, launch_config: LaunchConfig, target: str) -> Path:
        variant = json.dumps([launch_config.block_m, launch_config.num_warps, launch_config.num_stages, target,
                              toolchain()])
        digest = hashlib.sha256(variant.encode()).hexdigest()[:16]
        return self.directory / f"{Path(kernel.path).stem}-{digest}.json"

    def load(self, kernel, launch_config: LaunchConfig, target: str):
        """The compiled kernel from Triton's cache, or None (no entry, or Triton's files gone)."""
        from triton.compiler.compiler import ASTSource, CompiledKernel
        from triton.runtime.cache import get_cache_manager
        try:
            entry = json.loads(self.path(kernel, launch_config, target).read_text())
        except (OSError, ValueError):
            return None
        group = get_cache_manager(entry["hash"]).get_group(f"{kernel.fn.__name__[:150]}.json")
        if group is None:
            return None
        source = ASTSource(kernel.fn, entry["signature"], {tuple(k): v for k, v in entry["constants"]},
                           {tuple(k): v for k, v in entry["attrs"]})
        return CompiledKernel(source, group, entry["hash"])

    def record(self, kernel, launch_config: LaunchConfig, target: str, compiled) -> None:
        """Remember where Triton put `compiled` (written atomically; a failed write only costs a
        later compile)."""
        source = compiled.src
        entry = {"hash": compiled.hash, "signature": source.signature,
                 "constants": [[list(k), v] for k, v in source.constants.items()],
                 "attrs": [[list(k), v] for k, v in source.attrs.items()]}
        try:
            text = json.dumps(entry)
        except TypeError:          # a constant JSON cannot hold: not indexed, compiled each process
            return
        path = self.path(kernel, launch_config, target)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except OSError as e:
            log.info("memfuse: could not write %s: %s", path, e)


@functools.cache
def toolchain() -> str:
    """The Triton installation and settings a binary was built by: Triton's version, the size and
    modification time of its compiler library and package files, and the TRITON_* environment.
    Stamps, not contents: hashing the contents is what makes Triton's first compile of a process slow."""
    import triton
    from triton._C import libtriton
    stamps = []
    for path in (libtriton.__file__, triton.__file__, triton.compiler.compiler.__file__):
        stat = os.stat(path)
        stamps.append([path, stat.st_size, stat.st_mtime_ns])
    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("TRITON_"))
    return json.dumps([triton.__version__, stamps, settings])


def _current_target():
    import triton
    return triton.runtime.driver.active.get_current_target()


def _triton_installation_hashed() -> None:
    """Wait for start_driver's `triton_key`: threads that call it before it is cached each hash
    the installation again, side by side."""
    with _lock:
        future = _driver.get("triton_key")
    if future is not None:
        future.result()


def _triton_key() -> None:
    """Have Triton's installation hash (`triton.runtime.cache.triton_key`) ready, computed in a
    subprocess where that works. Hashing the installation in a thread of this process takes about
    twice as long beside the trace as alone: the thread needs the GIL back after every 1 MB
    chunk, and the tracing thread holds it. A subprocess (a fresh Python importing Triton) runs
    free of that, and the value it prints is handed to Triton as Triton hands it to
    its own compile workers: `get_cache_key` then reads it instead of hashing. If the subprocess
    fails, or finds another Triton, or this Triton's `get_cache_key` does not read the function
    by name, the hash is computed here as before."""
    from triton.runtime import cache
    cached = getattr(cache.triton_key, "cache_info", None)
    if cached is None or cached().currsize:     # computed already, or handed in by someone else
        return
    key = _triton_key_of_subprocess() if "triton_key" in cache.get_cache_key.__code__.co_names else None
    if key is None:
        cache.triton_key()
    elif not cache.triton_key.cache_info().currsize:
        cache.triton_key = functools.lru_cache(maxsize=None)(lambda: key)


TRITON_KEY_SCRIPT = ("import json, triton; from triton.runtime.cache import triton_key; "
                     "print(json.dumps([triton.__file__, triton_key()]))")


def _triton_key_of_subprocess() -> Optional[str]:
    """Triton's `triton_key()` as a fresh Python process computes it, if that process imports this
    very Triton; else None."""
    import triton
    package_root = os.path.dirname(os.path.dirname(triton.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p))
    try:
        done = subprocess.run([sys.executable, "-c", TRITON_KEY_SCRIPT], env=env, capture_output=True, text=True,
                              timeout=TRITON_KEY_TIMEOUT_S)
        where, key = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        log.info("memfuse: Triton's installation hash in a subprocess failed (%s: %s); hashing here",
                 type(e).__name__, e)
        return None
    if where != triton.__file__ or not isinstance(key, str):
        log.info("memfuse: the subprocess imported Triton from %s, not %s; hashing here", where, triton.__file__)
        return None
    return key


def _set_up_driver(device: torch.device) -> None:
    import triton
    with torch.cuda.device(device):
        driver = triton.runtime.driver.active
        driver.get_current_target()
        getattr(driver, "utils", None)      # the C module: built (cold cache) or loaded


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="memfuse-precompile")
    return _pool


def _launcher_executor() -> ThreadPoolExecutor:
    """The launcher builds' own threads: a warm-up waits for its launcher's build, so a build
    queued behind the warm-ups in their pool would wait for a thread none of them gives up."""
    global _launcher_pool
    with _lock:
        if _launcher_pool is None:
            _launcher_pool = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="memfuse-launcher")
    return _launcher_pool
