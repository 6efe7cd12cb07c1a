"""The one writer of generated Python (Triton kernels, programs, the fronts' guard functions):
indented lines, nothing more. No template engine: each writer says its lines in order.

    out = Lines()
    out("def run(x):")
    with out.indented():
        out("return x + 1")
    out.text()        # "def run(x):\n    return x + 1\n"
"""
from __future__ import annotations

import contextlib

INDENT = "    "


class Lines:
    """Lines of Python source at a current depth: `out(text, ...)` adds each at that depth (`out()`
    an empty line),
    `indent()` / `dedent()` or `with indented():` move the depth, `text()` is the source."""

    def __init__(self, depth: int = 0):
        self.lines: list = []
        self.depth = depth

    def __call__(self, *texts: str) -> None:
        for text in texts or ("",):
            self.lines.append(INDENT * self.depth + text if text else "")

    def indent(self) -> None:
        self.depth += 1

    def dedent(self) -> None:
        self.depth -= 1

    @contextlib.contextmanager
    def indented(self):
        self.indent()
        try:
            yield self
        finally:
            self.dedent()

    def extend(self, other: "Lines") -> None:
        """Append `other`'s lines as they are (written at their own depth)."""
        self.lines.extend(other.lines)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"
