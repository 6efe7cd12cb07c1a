"""memfuse.explain of a model compiled with torch.compile(backend="memfuse"): one report per
graph memfuse compiled that the call ran (read from the backend's GraphRecords), the graphs run
through torch and why; the same records feed MEMFUSE_DUMP_DIR for backend graphs."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memfuse
from memfuse.reports.explain import ModelReport, Report


class TwoGraphs(nn.Module):
    """A graph break between two normalization blocks: Dynamo hands the backend two graphs."""

    def __init__(self, width=16):
        super().__init__()
        self.first = nn.LayerNorm(width)
        self.second = nn.LayerNorm(width)

    def forward(self, x):
        h = F.gelu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h) * 2


def masked_sum(x):
    """A data-dependent size: memfuse's lowering refuses the graph, which runs through torch."""
    return x[x > 0].sum() + x.sin().sum()


def setup_function():
    torch._dynamo.reset()


def test_one_report_per_graph_the_call_ran(capsys):
    compiled = torch.compile(TwoGraphs(), backend="memfuse")
    report = memfuse.explain(compiled, torch.randn(4, 16))
    assert isinstance(report, ModelReport) and report.name == "TwoGraphs"
    assert [r.name for r in report.graphs] == ["dynamo_0/0", "dynamo_1/0"]
    assert report.through_torch == []
    for graph in report.graphs:
        assert isinstance(graph, Report)
        assert len(graph.kernels_of("forward")) >= 1 and len(graph.kernels_of("backward")) >= 1
        assert graph.drawing().nodes                                  # the min-cut picture reads it too
    arguments = {s.argument for s in report.graphs[0].saved if s.is_input}
    assert any(a is not None and a.startswith("L[") for a in arguments), arguments   # Dynamo's sources
    assert report.compiled_saved.bytes <= report.eager_saved.bytes
    printed = capsys.readouterr().out
    assert 'memfuse.explain: TwoGraphs (torch.compile, backend="memfuse"): the call ran 2 graph(s)' in printed
    assert "memfuse.explain: dynamo_0/0" in printed and "memfuse.explain: dynamo_1/0" in printed
    assert all(v == 0 for v in memfuse.stats().values())              # explain's compiles are not counted


def test_a_cached_model_reports_the_graphs_it_runs():
    compiled = torch.compile(TwoGraphs(), backend="memfuse")
    x = torch.randn(4, 16)
    compiled(x).sum().backward()
    before = memfuse.stats()
    report = memfuse.explain(compiled, x)
    assert [r.name for r in report.graphs] == ["dynamo_0/0", "dynamo_1/0"]
    assert memfuse.stats() == before


def test_graphs_run_through_torch_are_named_with_the_reason(capsys):
    def fn(x):
        h = F.layer_norm(x, (16,))
        torch._dynamo.graph_break()
        return masked_sum(h)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        report = memfuse.explain(torch.compile(fn, backend="memfuse"), torch.randn(4, 16))
    assert [r.name for r in report.graphs] == ["dynamo_0/0"]
    [row] = report.through_torch
    assert row.name == "dynamo_1/0" and row.reason.startswith("NotImplementedError: memfuse: boolean size")
    assert "graphs run through torch (memfuse could not compile them)\n  dynamo_1/0: NotImplementedError" \
        in capsys.readouterr().out


def test_an_inference_call_has_no_backward():
    compiled = torch.compile(TwoGraphs(), backend="memfuse")
    with torch.no_grad():
        report = memfuse.explain(compiled, torch.randn(4, 16))
    assert [r.backward for r in report.graphs] == [None, None]
    assert report.compiled_saved.bytes == 0


def test_a_model_compiled_with_another_backend_is_an_error():
    compiled = torch.compile(TwoGraphs(), backend="eager")
    with pytest.raises(ValueError, match='ran no graph through memfuse\'s backend: compile it with '
                                         r'torch.compile\(..., backend="memfuse"\)'):
        memfuse.explain(compiled, torch.randn(4, 16))


def test_dump_dir_writes_a_folder_per_backend_graph(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFUSE_DUMP_DIR", str(tmp_path))
    compiled = torch.compile(TwoGraphs(), backend="memfuse")
    compiled(torch.randn(4, 16)).sum().backward()
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == ["dynamo_0_0.0", "dynamo_1_0.0"]
    files = {p.relative_to(tmp_path / "dynamo_0_0.0").as_posix() for p in (tmp_path / "dynamo_0_0.0").rglob("*")}
    assert {"joint.ir.txt", "joint.aten.py", "forward.ir.txt", "backward.ir.txt", "explain.txt",
            "forward.program.py", "backward.program.py"} <= files
    assert any(f.startswith("kernels/memfuse_forward_") for f in files)
    assert "memfuse.explain: dynamo_0/0" in (tmp_path / "dynamo_0_0.0" / "explain.txt").read_text()


def test_draw_memory_of_a_compiled_model(tmp_path):
    """Every graph's forward in the order the call ran them, then their backwards in reverse."""
    compiled = torch.compile(TwoGraphs(), backend="memfuse")
    drawing = memfuse.draw_memory(compiled, torch.randn(4, 16, requires_grad=True), path=tmp_path / "memory.svg")
    programs = list(dict.fromkeys(s.program for s in drawing.steps))
    assert programs == ["dynamo_0/0 forward", "dynamo_1/0 forward", "dynamo_1/0 backward", "dynamo_0/0 backward"]
    assert "<svg" in (tmp_path / "memory.svg").read_text() and drawing.title.startswith("memfuse memory: TwoGraphs")
