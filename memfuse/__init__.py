"""memfuse: memory-efficient fusion for PyTorch training code.

    fused = memfuse.memory_efficient_fusion(fn)   # same signature, forward and backward fused
"""
from .api import memory_efficient_fusion
from .config import Config
from .debug import configure_logging, reset_stats, stats
from .draw import draw_plan
from .explain import explain

configure_logging()

__all__ = ["memory_efficient_fusion", "Config", "explain", "draw_plan", "stats", "reset_stats", "configure_logging"]
