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
  launches, and a kernel that fails to compile here is compiled (and fails) again at its launch,
  with Triton's error there.

Without a GPU (Triton's interpreter) `warmup` compiles nothing; `precompile(..., force=True)`
still walks the same path, which is how the CPU tests cover it.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from .config import Config
from .ir import Op
from .runtime import KernelLaunch

log = logging.getLogger("memfuse.kernels")
MAX_THREADS = 4           # kernels compiled at once (a program pair has 1-6 kernels)
MOCK_INT = 2              # any int32 value: every scalar is do_not_specialize, only its width counts

_pool: Optional[ThreadPoolExecutor] = None
_driver: dict = {}        # device index -> Future of the driver set-up
_lock = threading.RLock()


def enabled(device: torch.device, config: Config) -> bool:
    return config.precompile and device.type == "cuda"


def start_driver(device: torch.device) -> Future:
    """Set up Triton's driver for `device` in a background thread (once per device)."""
    with _lock:
        future = _driver.get(device.index)
        if future is None:
            future = _driver[device.index] = _executor().submit(_set_up_driver, device)
    return future


def precompile(programs: list, device: torch.device, config: Config, *, force: bool = False) -> int:
    """Compile every generated kernel of `programs` (runtime.Program, None skipped) for `device`
    in parallel threads and wait for them; returns how many kernels were handed to Triton."""
    if not (force or enabled(device, config)):
        return 0
    launches = [(program.graph, step) for program in programs if program is not None
                for step in program.steps if isinstance(step, KernelLaunch)]
    if not launches:
        return 0
    if device.type == "cuda":
        start_driver(device).result()      # one driver set-up, never two racing ones
    futures = [_executor().submit(_warm_up, graph, launch, device, config) for graph, launch in launches]
    for (_, launch), future in zip(launches, futures):
        error = future.exception()
        if error is not None:
            log.info("memfuse: precompiling %s failed (%s: %s); it compiles at its first launch",
                     launch.group.name, type(error).__name__, error)
    return len(launches)


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
        else:                               # strides, rows, tiles per program
            args.append(MOCK_INT)
    chosen = launch.launch_config(device, config)
    return args, {**launch.launcher.keywords(chosen), "num_warps": chosen.num_warps}


def _warm_up(graph, launch: KernelLaunch, device: torch.device, config: Config) -> None:
    args, keywords = warmup_arguments(graph, launch, device, config)
    if device.type != "cuda":
        launch.kernel.fn.warmup(*args, grid=(1,), **keywords)   # the interpreter: returns at once
        return
    with torch.cuda.device(device):
        compiled = launch.kernel.fn.warmup(*args, grid=(1,), **keywords)
        load = getattr(compiled, "_init_handles", None)
        if load is not None:
            load()       # load the binary and build the launcher now, not at the first launch


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
