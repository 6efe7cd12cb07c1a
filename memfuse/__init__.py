"""memfuse: memory-efficient fusion for PyTorch training code.

    fused = memfuse.memory_efficient_fusion(fn)   # same signature, forward and backward fused
"""
from .api import memory_efficient_fusion
from .config import Config
from .debug import configure_logging, reset_stats, stats

configure_logging()

__all__ = ["memory_efficient_fusion", "Config", "stats", "reset_stats"]
