"""Launch configurations: rows per tile, warps, and programs per SM for persistent kernels.

A choice depends on the row length bucket (BLOCK_D), the element size, whether the kernel is
persistent (it carries column partial sums) and, for a tile of one pass, the bytes its rows move
(the warps that hold them: `warps_for`) — never on M, so it holds for every batch size.
`default_config` is a table measured with benchmarks/tune.py (docs/results); a sweep's results are
cached on disk per device and kernel, and win over the table when present.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int              # rows per tile
    num_warps: int
    programs_per_sm: int      # persistent kernels only: the grid is SMs x this
    num_stages: int = 1       # persistent kernels only: tiles in flight in the pipelined loop


# (BLOCK_D upper bound, persistent) -> elements per tile, warps, programs per SM, pipeline
# stages, measured with benchmarks/tune.py and `benchmarks.kernel_sol --tune`: one row per program
# with few warps for forwards (many small programs hide latency best); 4-8 rows and 8-16 warps, 1-2
# programs per SM for backwards, whose programs also carry the fp32 column partials. For the
# persistent rows of BLOCK_D 1024 and 4096 (a LayerNorm backward with a regenerated dropout and
# column sums, a GELU backward with its bias gradient's column sum), 2 rows and several programs
# an SM with no pipeline beat 4 rows and one program an SM 3 deep: more programs an SM hide
# latency better than a pipeline, which also held one program an SM by its shared memory. Rows
# are tried in order.
TABLE = [
    # block_d <=, persistent, tile elements, warps, programs per SM, stages
    (512, False, 2048, 4, 0, 1),
    (512, True, 4096, 4, 4, 1),
    (1024, False, 1024, 2, 0, 1),
    (1024, True, 2048, 4, 4, 1),
    (2048, False, 2048, 4, 0, 1),
    (2048, True, 8192, 8, 2, 1),
    (4096, False, 4096, 4, 0, 1),
    (4096, True, 8192, 16, 2, 1),
    (1 << 30, False, 1, 16, 0, 1),       # one row per tile
    (1 << 30, True, 1, 16, 1, 1),
]


# A program of one tile holds its rows' values in registers. Past about this many 32-bit words a
# thread, Triton's code takes every register and an SM holds few warps: a backward's rebuild of
# the residual stream (26 [M, 768] values a row, 1 row and 2 warps a program: 255 registers, 8 warps
# an SM) moves a fraction of the memory's bandwidth. Such a kernel gets the warps that bring it
# under this, up to MAX_WARPS; the table's warps are a floor. At 128 it is the backward's first
# kernel of each model of `make bench-models` (the rebuild of what the layers need), and no other.
WORDS_PER_THREAD = 128
MAX_WARPS = 16

# A persistent program walks its tiles one after another: load, compute, store, then the next load.
# The bytes an SM has in flight are about its programs' tiles, and below this many they do not
# cover the memory's latency: a bias gradient (a column sum that only reads [M, 768] bf16, 2 rows
# a tile and 4 programs an SM: 12 KB an SM) moves a fraction of the memory's bandwidth. Such a
# kernel gets the rows (a power of two) that bring its tiles to this; the
# table's rows are a floor, and its warps grow with the tile as a one-pass tile's do.
PERSISTENT_BYTES_PER_SM = 32 * 1024


def default_config(block_d: int, persistent: bool, bytes_per_row: int = 0, d: int = 0) -> LaunchConfig:
    """The table's configuration for rows of `block_d` (`d` columns of them, `bytes_per_row` moved a
    row: a tile of one pass gets the warps its values need, `warps_for`; a persistent tile the rows
    that keep PERSISTENT_BYTES_PER_SM in flight, `rows_in_flight`, and the warps for those)."""
    for bound, is_persistent, tile, warps, per_sm, stages in TABLE:
        if block_d <= bound and persistent == is_persistent:
            block_m = max(1, tile // block_d)
            if persistent:
                block_m = max(block_m, rows_in_flight(bytes_per_row, per_sm))
            if not persistent or block_m * block_d > tile:
                warps = max(warps, warps_for(block_m * bytes_per_row * block_d // max(d, 1)))
            return LaunchConfig(block_m, warps, per_sm, stages)
    raise AssertionError("the table's last rows cover every block_d")


def rows_in_flight(bytes_per_row: int, programs_per_sm: int) -> int:
    """Rows a tile (a power of two) that keep PERSISTENT_BYTES_PER_SM in flight across an SM's
    programs; 1 where the row is unknown (0 bytes)."""
    if bytes_per_row <= 0:
        return 1
    needed = -(-PERSISTENT_BYTES_PER_SM // (bytes_per_row * max(programs_per_sm, 1)))
    rows = 1
    while rows < needed:
        rows *= 2
    return rows


def source_config(source) -> LaunchConfig:
    """default_config for a generated kernel (codegen's KernelSource: its BLOCK_D, D, persistence
    and bytes a row)."""
    return default_config(source.constexprs["BLOCK_D"], source.persistent, source.bytes_per_row,
                          source.constexprs["D"])


def warps_for(tile_bytes: int) -> int:
    """Warps that hold a tile's values (at least 4 bytes each) within WORDS_PER_THREAD a thread: a
    power of two, at most MAX_WARPS."""
    needed = -(-tile_bytes // (4 * 32 * WORDS_PER_THREAD))
    warps = 1
    while warps < min(needed, MAX_WARPS):
        warps *= 2
    return warps


def cpu_config(block_d: int, tile_elements: int) -> LaunchConfig:
    """The interpreter runs programs one by one: fewer, larger tiles are faster there."""
    return LaunchConfig(max(1, tile_elements // block_d), 4, 0)


class TuningCache:
    """`tuning.json` in the cache directory: {device name: {kernel file stem: LaunchConfig}}."""

    def __init__(self, cache_dir: Path):
        self.path = Path(cache_dir) / "tuning.json"
        self._data: Optional[dict] = None

    def _load(self) -> dict:
        if self._data is None:
            try:
                self._data = json.loads(self.path.read_text())
            except (OSError, ValueError):
                self._data = {}
        return self._data

    def get(self, device: str, kernel: str) -> Optional[LaunchConfig]:
        entry = self._load().get(device, {}).get(kernel)
        return LaunchConfig(**entry) if entry else None

    def put(self, device: str, kernel: str, config: LaunchConfig) -> None:
        data = self._load()
        data.setdefault(device, {})[kernel] = asdict(config)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, self.path)
