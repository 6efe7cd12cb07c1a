"""The progress line: what a long compile is doing, for a user at a terminal.

Compiling a model of many layers takes a while (tracing, planning, generating and building the
kernels); a user at a terminal sees one line on stderr, rewritten in place with `\\r`:

    memfuse: compiling LlamaForCausalLM: precompile 12/40 kernels

and, when the compile is done, the line it leaves behind:

    memfuse: compiled LlamaForCausalLM in 23.4 s (40 kernels)

The driver names its stages once (memfuse.driver.compile); the runtime's kernel precompile reports
its count. The line is written only where it helps: stderr is a terminal (`isatty`), MEMFUSE_PROGRESS
is not 0, and the memfuse logger is not set quieter than warnings (`logging.getLogger("memfuse")
.setLevel(logging.ERROR)` silences it, as it silences the warnings). Elsewhere (a log file, CI, a
notebook's captured stderr) nothing is written.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from typing import Optional, TextIO

OFF_VALUES = ("0", "off", "false", "no")


def progress_enabled(stream: TextIO) -> bool:
    """Whether a progress line goes to `stream` (module docstring)."""
    if os.environ.get("MEMFUSE_PROGRESS", "1").strip().lower() in OFF_VALUES:
        return False
    if logging.getLogger("memfuse").getEffectiveLevel() > logging.WARNING:
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):      # a closed or detached stream
        return False


class ProgressLine:
    """One compile's line. `stage(text)` rewrites it; `kernels(done, total)` shows the precompile's
    count; `finish(kernels)` leaves the final line; `clear()` erases it (a compile that failed: its
    error or fallback says the rest). Writes nothing where `progress_enabled` says no."""

    def __init__(self, name: str, stream: Optional[TextIO] = None):
        self.name = name
        self.stream = sys.stderr if stream is None else stream
        self.enabled = progress_enabled(self.stream)
        self.start = time.perf_counter()
        self.width = 0                  # length of the text on the line now, overwritten by the next

    def stage(self, text: str) -> None:
        self._write(f"memfuse: compiling {self.name}: {text}")

    def kernels(self, done: int, total: int) -> None:
        self.stage(f"precompile {done}/{total} kernels")

    def finish(self, kernels: int) -> None:
        seconds = time.perf_counter() - self.start
        plural = "" if kernels == 1 else "s"
        self._write(f"memfuse: compiled {self.name} in {seconds:.1f} s ({kernels} kernel{plural})", end="\n")

    def clear(self) -> None:
        if self.width:
            self._write("", end="\r")

    def _write(self, text: str, end: str = "") -> None:
        if not self.enabled:
            return
        padding = " " * max(0, self.width - len(text))     # blanks over a longer earlier text
        self.stream.write(f"\r{text}{padding}{end}")
        self.stream.flush()
        self.width = 0 if end else len(text)
