"""Observability: counters, the MEMFUSE_LOG switch and MEMFUSE_DUMP_DIR dumps."""
from __future__ import annotations

import logging
import os
from collections import Counter
from pathlib import Path

STATS: Counter = Counter()
log = logging.getLogger("memfuse")


def stats() -> dict:
    """Counters since the process started (or the last reset): compiles, cache hits, kernels
    generated and launched, extern calls, groups run through aten."""
    keys = ("compiles", "cache_hits", "kernels_generated", "kernels_launched", "extern_calls", "fallbacks")
    return {k: STATS[k] for k in keys}


def reset_stats() -> None:
    STATS.clear()


def configure_logging() -> None:
    """MEMFUSE_LOG=1 (or info/debug) sends memfuse's log to stderr."""
    level = os.environ.get("MEMFUSE_LOG", "").strip().lower()
    if level in ("", "0", "off", "false"):
        return
    log.setLevel(logging.DEBUG if level == "debug" else logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[memfuse] %(message)s"))
        log.addHandler(handler)


def dump(name: str, text: str) -> None:
    """Write `text` to $MEMFUSE_DUMP_DIR/name when the switch is set."""
    folder = os.environ.get("MEMFUSE_DUMP_DIR")
    if folder:
        path = Path(folder) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
