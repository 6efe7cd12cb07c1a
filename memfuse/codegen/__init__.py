"""codegen: Triton source for each kernel group, written to the cache and imported.

A kernel whose structure (`cache.structure`), constexprs and argument types match a kernel
generated before in this process (and cache directory) is that kernel's twin: it keeps its own
source (its value names, for dumps and explain) but launches the first one's function, so Triton
compiles, caches and loads one binary for both. A model's layers are such twins.

row_kernel      RowKernelWriter: a kernel whose rows fit in registers; its concerns in
                signature (arguments, bytes moved), strided_reads (access maps), column_sums
looped_kernel   LoopedKernelWriter: rows walked in chunks, pass by pass
emit            expression text; kernel_source: KernelSource and Arg, what codegen hands on
cache, tuning   content-addressed kernel files; launch configurations
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from memfuse.base.config import Config
from memfuse.base.debug import STATS, timed
from memfuse.ir.graph import Graph, Op
from memfuse.schedule.steps import KernelGroup
from memfuse.codegen.cache import kernel_path, load_kernel, structure
from memfuse.codegen.looped_kernel import loop_block_d, write_looped_kernel
from memfuse.codegen.emit import dtype_name
from memfuse.codegen.kernel_source import Arg, KernelSource
from memfuse.codegen.row_kernel import write_row_kernel

_first_of_structure: dict = {}   # twin_key -> the first CompiledKernel of that structure


@dataclass
class CompiledKernel:
    source: KernelSource         # this kernel's own source (its value names)
    fn: Any                      # the @triton.jit function it launches
    path: str                    # the file `fn` was imported from
    twin_of: Optional[str] = None   # the kernel whose function and file it shares (None: its own)

    @property
    def function_name(self) -> str:
        """The name of `fn` in `path`."""
        return self.twin_of or self.source.name


@timed("codegen")
def generate(graph: Graph, group: KernelGroup, config: Config) -> CompiledKernel:
    if group.space.d is not None and group.space.d > config.max_row_length:
        block_d = loop_block_d(config.max_row_length, config.loop_block_d)
        source = write_looped_kernel(graph, group, block_d, config.seed_from_memory)
    else:
        source = write_row_kernel(graph, group, config.seed_from_memory)
    key = twin_key(graph, source, config)
    first = _first_of_structure.get(key)
    if first is not None and first.source.source == source.source:    # the same kernel, generated again
        return CompiledKernel(source, first.fn, first.path)
    if first is not None:
        STATS["kernels_shared"] += 1
        return CompiledKernel(source, first.fn, first.path, twin_of=first.source.name)
    fn = load_kernel(config.cache_dir, source.name, source.source)
    kernel = _first_of_structure[key] = CompiledKernel(source, fn, str(kernel_path(config.cache_dir, source.name,
                                                                                     source.source)))
    return kernel


def twin_key(graph: Graph, source: KernelSource, config: Config) -> tuple:
    """What makes two kernels one binary: the cache directory, the structure of the source, the
    constexprs and the type of every argument (Triton specializes on pointer dtypes and int widths,
    and the binary index and tuning cache are keyed by the kernel's file)."""
    return (str(config.cache_dir), structure(source.source, source.name),
            tuple(sorted(source.constexprs.items())), tuple(_argument_type(graph, source, a) for a in source.args))


def _argument_type(graph: Graph, source: KernelSource, arg: Arg) -> str:
    if arg.role in ("read", "in_place", "write", "scalar"):
        return f"{arg.role}:{graph[arg.value].value.dtype}"
    if arg.role == "partials":
        return f"partials:{source.partials_dtypes[Op(arg.value)]}"
    if arg.role == "totals":
        return f"totals:{arg.value}"      # the dtype's name
    return arg.role                       # the stream base, strides, rows, tiles, the counter: ints


__all__ = ["Arg", "CompiledKernel", "KernelSource", "dtype_name", "generate"]
