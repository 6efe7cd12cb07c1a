"""runtime's kernel launches: `KernelLaunch` runs one generated kernel (its grid, its column sums'
partials and counter, the out-of-resources retry), `Launcher` calls Triton's compiled kernel past
its generic launch path, `DirectLaunch` is the hot path of a call after a kernel's first on a GPU,
and `launch_log()` records launches for benchmarks/kernel_sol.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from pathlib import Path
from typing import Optional

import torch
from triton.runtime.errors import OutOfResources

from memfuse.base.config import Config
from memfuse.base.debug import STATS
from memfuse.base.launch import INT32_MAX, launch_hooks_installed, launcher_call, raw_stream
from memfuse.codegen import CompiledKernel
from memfuse.codegen.tuning import LaunchConfig, TuningCache, cpu_config, source_config
from memfuse.schedule.steps import KernelGroup

log = logging.getLogger("memfuse")

FINISH_GROUPS_MAX = 256   # groups of about sqrt(programs) programs: grids up to 65536 programs
_SM_COUNTS: dict = {}


class KernelLaunch:
    """One generated kernel, with everything a call needs prepared.

    `__call__(device, rows, aligned, values)` takes the kernel's value arguments (inputs,
    scalars, outputs and column totals, in signature order), appends the partial-sum buffers,
    the counter of programs done and the grid scalars, and launches. A kernel with column sums
    finishes them itself (its last program writes the totals): one launch, nothing after it.

    The partials and the counter are per kernel and device, shared by every launch of this
    kernel there (and baked into every CUDA graph that captured it): launches on one stream run
    in order, so each finds the counter at 0 and the partials free. Two launches of the same
    kernel running at once on different streams (one fused function called concurrently from
    two streams) would mix their partials and tickets: unsafe, and not supported."""

    def __init__(self, group: KernelGroup, kernel: CompiledKernel, config: Config):
        self.group = group
        self.kernel = kernel
        self.config = config
        self.persistent = kernel.source.persistent
        self.has_rows = group.space.m is not None
        self.d = kernel.source.constexprs["D"]
        self.reductions = list(kernel.source.column_sums.items())   # (op, [column-sum names])
        self.partials_dtypes = kernel.source.partials_dtypes   # reducer op -> dtype of its partials buffer
        self.launcher = Launcher(kernel)
        self.configs: dict = {}          # device -> LaunchConfig
        self.grids: dict = {}            # device -> (LaunchConfig, most programs)
        self._partials: dict = {}
        self._counters: dict = {}        # device -> [1] int32 programs done, 0 between launches
        self.record = False              # keep the last call's arguments (benchmarks/tune.py)
        self.recorded = None
        self.direct: dict = {}           # device -> DirectLaunch, once compiled there for aligned inputs
        self.checked: set = set()        # devices whose first launch checked its arguments' devices

    def __call__(self, device: torch.device, rows: Optional[int], pointers: Optional[tuple], values: tuple):
        """Launch on `values`, the kernel's value arguments (inputs, scalars, outputs and column
        totals, in signature order). `pointers` is the same with raw device pointers in place of
        the tensors the caller vouches for (memfuse's own, inputs known to be on `device`), or None
        when an input is not 16-byte aligned.

        The hot path, every call after a kernel's first on a GPU: an aligned call on a device where
        the kernel is compiled (`direct`) does the grid arithmetic and calls Triton's launcher. On
        a host-bound step every Python call between the program and the driver shows (DESIGN.md,
        host floor). Inside `launch_log()` every call takes the general path, which records it."""
        direct = self.direct.get(device) if pointers is not None else None
        if direct is None or direct.config is not self.configs.get(device) or self.record or _LAUNCH_LOG is not None \
                or launch_hooks_installed():
            if self.record:
                self.recorded = (device, rows, pointers, values)
            return self._launch(device, rows, pointers is not None, values)
        if rows is None:                 # a kernel over [D] alone
            programs, grid = 1, ()
        elif rows > INT32_MAX:           # the compiled kernel's sizes are 32-bit
            return self._launch(device, rows, False, values)
        elif self.persistent:
            tiles = -(-rows // direct.block_m) or 1
            programs = tiles if tiles < direct.most else direct.most
            grid = (rows, -(-tiles // programs))
        else:
            programs = -(-rows // direct.block_m) or 1
            grid = (rows,)
        column_sums = ()
        if self.reductions:
            column_sums = direct.column_sums.get(programs) or direct.column_sum_pointers(programs)
        direct.call(programs, 1, 1, raw_stream(direct.stream_index), *direct.leading, *pointers, *column_sums, *grid,
                    *direct.constexprs)
        STATS["kernels_launched"] += 1

    def _launch(self, device: torch.device, rows: Optional[int], aligned: bool, values: tuple):
        """The general path: the first call on a device, the interpreter, unaligned inputs, launch
        hooks, a recorded call; a compiled aligned launch on a GPU sets up the direct one. The first
        launch on a device checks that every tensor argument lies there (check_devices)."""
        if device not in self.checked:
            check_devices(self.kernel, device, values)
            self.checked.add(device)
        grid = self.grids.get(device)
        if grid is None or grid[0] is not self.configs.get(device):
            grid = self._grid(device)
        config, most = grid
        if rows is None:
            programs = tiles = 1
        else:
            # at least one tile: with M = 0 the column outputs (a weight grad of zeros) are still written
            tiles = max(1, -(-rows // config.block_m))
            programs = min(tiles, most) if self.persistent else tiles
        args = list(values)
        if self.reductions:
            if programs > FINISH_GROUPS_MAX ** 2:
                raise ValueError(f"memfuse: {self.kernel.source.name}: {programs} programs, more than the column-sum "
                                 f"finish counts ({FINISH_GROUPS_MAX ** 2})")
            args.extend(self.partials(programs, device))
            args.append(self.counter(device))
        if self.has_rows:
            args.append(rows)
            if self.persistent:
                args.append(-(-tiles // programs))
        # the precompiled kernel takes 32-bit sizes (Triton's i32 for small ints): past that, Triton's
        # generic path compiles the 64-bit variant (sizes are leading dims: none exceeds the rows)
        direct = aligned and (rows is None or rows <= INT32_MAX)
        try:
            self.launcher(programs, args, device, config, direct)
        except OutOfResources:
            if config.num_stages == 1:
                raise
            # a deeper pipeline than this kernel's tiles fit in shared memory: run unpipelined, with as
            # many programs an SM as the pipeline had tiles in flight (one program an SM, unpipelined,
            # waits on each load, and leaves most of the memory's bandwidth unused)
            fallback = dataclasses.replace(config, num_stages=1,
                                           programs_per_sm=config.programs_per_sm * config.num_stages)
            log.info("memfuse: %s: %s does not fit, launching with %s", self.kernel.source.name, config, fallback)
            self.configs[device] = fallback
            self.grids.pop(device)
            return self._launch(device, rows, aligned, values)
        STATS["kernels_launched"] += 1
        if _LAUNCH_LOG is not None:
            _LAUNCH_LOG.append(self.launch_record(rows, programs, tiles, config))
        direct_launch = self.direct.get(device)
        if direct and device.type == "cuda" and (direct_launch is None or direct_launch.config is not config):
            compiled = self.launcher.compiled.get((device.index, config))
            if compiled is not None:
                self.direct[device] = DirectLaunch(self, device, config, most, compiled)

    def launch_record(self, rows: Optional[int], programs: int, tiles: int, config: LaunchConfig) -> "LaunchRecord":
        source = self.kernel.source
        return LaunchRecord(source.name, self.kernel.function_name, self.kernel.path, source.summary, rows, self.d,
                            programs, config,
                            (rows or 0) * source.bytes_per_row + source.bytes_per_launch,
                            self.partials_bytes(programs, tiles), self)

    def partials_bytes(self, programs: int, tiles: int) -> int:
        """Bytes of the column sums' partials a launch writes and reads back (finish_column_sums):
        each program writes its row (a looped kernel: each tile adds into it, read and written), the
        groups' last programs read them and write one row per group, the last group reads those."""
        if not self.reductions:
            return 0
        group_size = math.ceil(math.sqrt(programs))
        groups = -(-programs // group_size)
        rows = 2 * (tiles if self.kernel.source.passes is not None else programs) + 2 * groups
        row_bytes = sum(len(names) * self.d * self.partials_dtypes[op].itemsize for op, names in self.reductions)
        return rows * row_bytes

    def _grid(self, device: torch.device) -> tuple:
        config = self.launch_config(device, self.config)
        most = _sm_count(device) * config.programs_per_sm if device.type == "cuda" else self.config.cpu_programs
        self.grids[device] = (config, most)
        return config, most

    def launch_config(self, device: torch.device, config: Config) -> LaunchConfig:
        chosen = self.configs.get(device)
        if chosen is None:
            block_d = self.kernel.source.constexprs["BLOCK_D"]
            if device.type == "cuda":
                name = torch.cuda.get_device_name(device)
                chosen = TuningCache(config.cache_dir).get(name, Path(self.kernel.path).stem) or \
                    source_config(self.kernel.source)
            else:
                chosen = cpu_config(block_d, config.tile_elements)
            self.configs[device] = chosen
        return chosen

    def partials(self, programs: int, device: torch.device) -> list:
        """[programs, n, D] buffers, one per reduction, reused across calls: the launch's last
        program has read them before the next launch on the stream can overwrite them."""
        key = (programs, device)
        buffers = self._partials.get(key)
        if buffers is None:
            buffers = [torch.empty((max(programs, 1), len(names), self.d), device=device,
                                   dtype=self.partials_dtypes[op])
                       for op, names in self.reductions]
            self._partials[key] = buffers
        return buffers

    def counter(self, device: torch.device) -> torch.Tensor:
        """The kernel's int32 ticket counters on `device` (the groups' last, then one per group of
        the finish: codegen.column_sums.finish_column_sums): zeroed once here, then set back to 0 by the
        programs that finish each level (so a CUDA-graph replay also starts from 0)."""
        counter = self._counters.get(device)
        if counter is None:
            counter = self._counters[device] = torch.zeros(1 + FINISH_GROUPS_MAX, dtype=torch.int32, device=device)
        return counter


class KernelDeviceError(ValueError):
    """A kernel argument is a tensor on another device than the one its program launches on."""


# arguments KernelLaunch appends itself (on the launch device), after the value arguments
APPENDED_ROLES = ("partials", "counter", "rows", "tiles")


def check_devices(kernel: CompiledKernel, device: torch.device, values: tuple) -> None:
    """Every tensor among a launch's value arguments lies on `device`: Triton would read a CPU
    tensor's address as a GPU pointer ("cannot be accessed from Triton (cpu tensor?)") and an
    interpreted kernel a GPU tensor's as a host one. Checked at a kernel's first launch on a
    device: a program hands a kernel the same values every call (its inputs, checked by the
    compile key or by autograd, and what it allocates on its device), so one launch proves it."""
    names = [a.name for a in kernel.source.args if a.role not in APPENDED_ROLES]
    for name, value in zip(names, values):
        if isinstance(value, torch.Tensor) and not _same_device(value.device, device):
            raise KernelDeviceError(
                f"memfuse: kernel {kernel.source.name}: argument {name} is a tensor on {value.device}, but the "
                f"program launches on {device}: memfuse chose the wrong device for this value (please report it)")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index == b.index or a.index is None or b.index is None)


class SkippedLaunch(KernelLaunch):
    """A generated kernel that a compile-only program (Config.compile_only) does not launch: the
    kernel is generated and loaded as for a launch, its outputs are allocated by the program (fake
    tensors under FakeTensorMode), and a call only counts itself (`launches_skipped`)."""

    def __call__(self, device: torch.device, rows: Optional[int], pointers: Optional[tuple], values: tuple):
        STATS["launches_skipped"] += 1


@dataclasses.dataclass(frozen=True)
class LaunchRecord:
    """One kernel launch as `launch_log` records it: what the kernel is and what it must move at
    the launch's sizes (benchmarks/kernel_sol.py sets it against the launch's GPU time)."""
    kernel: str               # the kernel's own name (explain's)
    function: str             # the launched Triton function's: what a profiler calls it (a twin's is its first's)
    path: str                 # its generated source (content-addressed: same-named kernels of two graphs differ)
    summary: str              # KernelSource.summary: its walk, reductions, reads, writes, ops
    rows: Optional[int]       # M of this launch (None: a kernel over [D] alone)
    d: int
    programs: int
    config: LaunchConfig
    must_move: int            # bytes: every [M, D], [M] and [D] value read or written once, the totals
    partials: int             # bytes of fp32 column partials written and read back, on top (0: no column sums)
    launch: Optional["KernelLaunch"] = dataclasses.field(default=None, repr=False, compare=False)   # to time it again


_LAUNCH_LOG: Optional[list] = None   # the list launch_log() is filling, else None


@contextlib.contextmanager
def launch_log():
    """Record every memfuse kernel launch in the block, in launch order: `with launch_log() as
    records:` gives a list of LaunchRecord. Launches take the general path meanwhile (more host
    time per launch; the same kernels, configurations and grids on the GPU). Not nestable."""
    global _LAUNCH_LOG
    if _LAUNCH_LOG is not None:
        raise RuntimeError("memfuse: launch_log() is already recording: one log at a time")
    _LAUNCH_LOG = records = []
    try:
        yield records
    finally:
        _LAUNCH_LOG = None


class Launcher:
    """Launches a @triton.jit kernel, skipping Triton's generic launch path once compiled.

    Triton's `kernel[grid](...)` re-binds and re-specializes every argument on each call, as much
    host time as the launch itself. Every scalar of a memfuse kernel is `do_not_specialize`, so
    the only specialization left is the 16-byte alignment of the pointers and the width of the
    ints (i32 below 2**31): memfuse allocates outputs and partials itself, so a call whose inputs
    are all aligned and whose rows fit 32 bits (the caller says so: `direct`) runs the kernel
    compiled for that case directly (precompile hands it over). The interpreter, unaligned inputs,
    2**31 rows or more and any launch hook a profiler installs take the generic path."""

    def __init__(self, kernel: CompiledKernel):
        self.fn = kernel.fn
        self.source = kernel.source
        self.compiled: dict = {}         # (device index, LaunchConfig) -> compiled kernel, aligned inputs, i32 sizes
        self.constexprs: dict = {}       # LaunchConfig -> keyword constexprs, positional constexprs

    def keywords(self, config: LaunchConfig) -> dict:
        """The kernel's constexprs for a launch configuration, in signature order."""
        return {"D": self.source.constexprs["D"], "BLOCK_M": config.block_m,
                "BLOCK_D": self.source.constexprs["BLOCK_D"], "NUM_STAGES": config.num_stages}

    def __call__(self, programs: int, args: list, device: torch.device, config: LaunchConfig, direct: bool) -> None:
        named = self.constexprs.get(config)
        if named is None:
            keywords = self.keywords(config)
            named = self.constexprs[config] = (keywords, tuple(keywords.values()))
        keywords, positional = named
        if device.type != "cuda" or not direct or launch_hooks_installed():
            self.fn[(programs,)](*args, **keywords, num_warps=config.num_warps)
            return
        compiled = self.compiled.get((device.index, config))
        if compiled is None:
            self.compiled[(device.index, config)] = self.fn[(programs,)](*args, **keywords, num_warps=config.num_warps)
            return
        compiled.run(programs, 1, 1, raw_stream(device.index), compiled.function, compiled.packed_metadata,
                     None, None, None, *args, *positional)


class DirectLaunch:
    """What KernelLaunch's hot path needs of its kernel compiled on one GPU: the grid's terms, the
    launcher call and the arguments around the kernel's own, the column sums' buffers as pointers.
    Valid for one LaunchConfig: KernelLaunch drops to its general path when the configuration
    changes (tuning, an out-of-resources retry)."""

    __slots__ = ("kernel_launch", "device", "config", "block_m", "most", "stream_index", "call", "leading",
                 "constexprs", "column_sums")

    def __init__(self, launch: KernelLaunch, device: torch.device, config: LaunchConfig, most: int, compiled):
        self.kernel_launch = launch
        self.device = device
        self.config = config
        self.block_m = config.block_m
        self.most = most
        self.stream_index = device.index      # a CUDA tensor's device always names its index
        self.call, self.leading = launcher_call(compiled)
        self.constexprs = tuple(launch.launcher.keywords(config).values())
        self.column_sums: dict = {}           # programs -> pointers of (partials..., counter)

    def column_sum_pointers(self, programs: int) -> tuple:
        """The column sums' buffers for a grid of `programs`, as pointers (KernelLaunch keeps the
        buffers, per device and grid, for good)."""
        launch = self.kernel_launch
        buffers = (*launch.partials(programs, self.device), launch.counter(self.device))
        pointers = self.column_sums[programs] = tuple(b.data_ptr() for b in buffers)
        return pointers


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
