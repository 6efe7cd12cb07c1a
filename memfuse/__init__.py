"""memfuse: memory-efficient fusion for PyTorch training code.

    fused = memfuse.memory_efficient_fusion(fn)   # same signature, forward and backward fused
    block = memfuse.memory_efficient_fusion(block) # an nn.Module: same parameters and state_dict
    memfuse.fuse_layers(model, model.model.layers) # each layer fused, the rest (head, loss) through the backend
    model = torch.compile(model, backend="memfuse")
    memfuse.check_compiles(model, **batch)        # compile a training step at its real sizes, run nothing
"""
from memfuse import patterns as _patterns  # noqa: F401  (the plug-ins register what the core needs to know)
from memfuse.fronts import backend as _backend
from memfuse.base import debug as _debug
from memfuse.reports import explain as _explain
from memfuse.fronts.wrap import memory_efficient_fusion
from memfuse.fronts.module import FusedModule
from memfuse.fronts.layers import fuse_layers
from memfuse.fronts.check import CompileCheck, check_compiles
from memfuse.base.config import Config
from memfuse.base.debug import compile_times, configure_logging, reset_stats, stats
from memfuse.reports.explain import draw_memory, draw_plan, explain

configure_logging()
_debug.add_compile_hook(_explain.report_compile)   # reports sit above the pipeline: debug calls them back
_backend.register()

__all__ = ["memory_efficient_fusion", "fuse_layers", "FusedModule", "Config", "check_compiles", "CompileCheck", "explain", "draw_plan", "draw_memory", "stats", "compile_times",
           "reset_stats", "configure_logging"]
