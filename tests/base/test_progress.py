"""The progress line (memfuse.base.progress): written in place on a terminal, nothing elsewhere."""
import io
import logging

import torch

import memfuse
from memfuse.base.progress import ProgressLine


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_line_appears_and_is_rewritten_in_place():
    stream = FakeTerminal()
    line = ProgressLine("Model", stream)
    line.stage("capture")
    line.kernels(3, 12)
    line.finish(12)
    text = stream.getvalue()
    assert text.startswith("\rmemfuse: compiling Model: capture\rmemfuse: compiling Model: precompile 3/12 kernels")
    assert "\n" not in text[:-1] and text.endswith("\n")    # one line, left behind by the final text
    final = text.split("\r")[-1].rstrip()
    assert final.startswith("memfuse: compiled Model in ") and final.endswith(" s (12 kernels)")


def test_a_shorter_text_blanks_the_longer_one_before_it():
    stream = FakeTerminal()
    line = ProgressLine("M", stream)
    line.stage("a long stage name")
    line.stage("plan")
    last = stream.getvalue().split("\r")[-1]
    assert last.rstrip() == "memfuse: compiling M: plan" and len(last) == len("memfuse: compiling M: a long stage name")
    line.clear()
    assert stream.getvalue().endswith("\r") and stream.getvalue().split("\r")[-2].strip() == ""


def test_nothing_is_written_without_a_terminal_or_when_turned_off(monkeypatch):
    stream = io.StringIO()                        # a file, a pipe, CI
    line = ProgressLine("Model", stream)
    line.stage("capture"), line.finish(3)
    assert stream.getvalue() == ""
    monkeypatch.setenv("MEMFUSE_PROGRESS", "0")
    terminal = FakeTerminal()
    ProgressLine("Model", terminal).finish(3)
    monkeypatch.delenv("MEMFUSE_PROGRESS")
    logger = logging.getLogger("memfuse")
    level = logger.level
    logger.setLevel(logging.ERROR)                # the logger says quiet
    try:
        ProgressLine("Model", terminal).finish(3)
    finally:
        logger.setLevel(level)
    assert terminal.getvalue() == ""


def scaled_tanh(x, y):
    return torch.tanh(x * y) + x


def test_a_compile_reports_its_stages_on_a_terminal(monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)

    fused = memfuse.memory_efficient_fusion(scaled_tanh)
    fused(torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)).sum().backward()
    parts = terminal.getvalue().split("\r")
    stages = [p.rstrip().rsplit(": ", 1)[-1] for p in parts if p.startswith("memfuse: compiling scaled_tanh")]
    assert stages == ["capture", "plan", "schedule", "codegen"], parts
    kernels = memfuse.stats()["kernels_generated"]
    final = parts[-1].rstrip()
    assert final.startswith("memfuse: compiled scaled_tanh in ") and final.endswith(f" ({kernels} kernels)"), parts
