"""codegen: Triton source for each kernel group, written to the cache and imported."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..debug import timed
from ..ir import Graph
from ..schedule import KernelGroup
from .cache import kernel_path, load_kernel
from .looped_kernel import loop_block_d, write_looped_kernel
from .row_kernel import Arg, KernelSource, dtype_name, write_row_kernel


@dataclass
class CompiledKernel:
    source: KernelSource
    fn: Any                      # the @triton.jit function
    path: str


@timed("codegen")
def generate(graph: Graph, group: KernelGroup, config: Config) -> CompiledKernel:
    if group.space.d is not None and group.space.d > config.max_row_length:
        block_d = loop_block_d(config.max_row_length, config.loop_block_d)
        source = write_looped_kernel(graph, group, block_d, config.seed_from_memory)
    else:
        source = write_row_kernel(graph, group, config.seed_from_memory)
    fn = load_kernel(config.cache_dir, source.name, source.source)
    return CompiledKernel(source, fn, str(kernel_path(config.cache_dir, source.name, source.source)))


__all__ = ["Arg", "CompiledKernel", "KernelSource", "dtype_name", "generate"]
