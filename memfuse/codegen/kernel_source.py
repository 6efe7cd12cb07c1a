"""What the code generator hands on: a kernel's source text and its arguments in launch order."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Arg:
    """One kernel argument, in launch order."""
    name: str                 # parameter name in the kernel
    role: str                 # "read", "in_place", "stride", "write", "scalar", "stream_base", "totals",
    #                           "partials", "counter", "rows", "tiles"
    value: Optional[str] = None   # the graph value it carries (tensor or scalar args)
    dim: Optional[int] = None     # "stride": which dim of the value
    constant: Optional[int] = None   # "stream_base": the int every launch passes


@dataclass
class KernelSource:
    name: str
    source: str
    args: list                                    # Arg, in order (constexprs excluded)
    constexprs: dict                              # D, BLOCK_D (BLOCK_M, NUM_STAGES come with the launch)
    persistent: bool                              # loops over tiles with a fixed grid
    column_sums: dict = field(default_factory=dict)   # reducer op -> [value names] in partial order
    partials_dtypes: dict = field(default_factory=dict)   # reducer op -> dtype of its partials buffer
    totals: dict = field(default_factory=dict)    # dtype -> [column-sum names], the rows of one [n, D] tensor
    bytes_per_row: int = 0                        # bytes moved per row (both directions)
    bytes_per_launch: int = 0                     # bytes moved once a launch: column vectors, scalars, totals
    summary: str = ""                             # what the kernel is, in one line (benchmarks/kernel_sol.py)
    passes: Optional[int] = None                  # looped kernels: walks over each row (one per phase)
    online: tuple = ()                            # looped kernels: the sums of exp carried with their max
    not_online: tuple = ()                        # looped kernels: (sum, why) for the sums of exp that are not
