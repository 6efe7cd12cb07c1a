"""explain(): the report read from a compiled program's records, the min-cut pictures, and the
picture of one training step's memory."""
import contextlib
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import memfuse
from benchmarks.lib.workloads import SMOKE_SHAPE, layer_norm_block, smoke_registry
from memfuse.buffers import memory_timeline
from memfuse.base.debug import human_bytes
from memfuse.reports.draw import ROLES, SAVED_RING
from memfuse.plan import Decision

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def relu_matmul(x, w):
    """mm is an extern (aten) call; relu's backward needs a mask the planner saves."""
    return torch.relu(x @ w) * 2


def scale_shift(x, w):
    return x * w + x


def layer_norm_inputs():
    return next(w for w in smoke_registry() if w.fn is layer_norm_block).make_inputs("cpu")


def quiet_explain(fn, *args, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        report = memfuse.explain(fn, *args, **kwargs)
    return report, printed.getvalue()


@pytest.fixture(scope="module")
def layer_norm():
    torch.manual_seed(0)
    inputs = layer_norm_inputs()
    report, printed = quiet_explain(layer_norm_block, *inputs.tensors, **inputs.consts)
    return report, printed


@pytest.fixture(scope="module")
def matmul():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 32, requires_grad=True)
    return quiet_explain(relu_matmul, x, w)[0], (x, w)


# -- the LayerNorm block: nothing computed is saved, one kernel each way --------------------------
def test_layer_norm_saves_no_computed_full_value(layer_norm):
    report, _ = layer_norm
    assert [s for s in report.saved if not s.is_input and s.kind == "full"] == []
    assert report.saved_bytes == 0
    assert {s.argument for s in report.saved} <= {"input1", "input2", "weight", "bias1", "bias2"}
    assert report.memfuse_saved.bytes == 0
    # eager autograd keeps the dropout mask and the normalized input, at least one [M, D] each
    rows, d = SMOKE_SHAPE[0] * SMOKE_SHAPE[1], SMOKE_SHAPE[2]
    assert report.eager_saved.bytes >= rows * d * (1 + 4)


def test_layer_norm_one_kernel_each_way(layer_norm):
    report, _ = layer_norm
    forward, backward = report.kernels_of("forward"), report.kernels_of("backward")
    assert len(forward) == 1 and len(backward) == 1
    assert report.fallbacks == [] and all(k.is_kernel for k in report.kernels)
    assert len(backward[0].column_sums) == 3          # dweight, dbias1, dbias2 over M
    assert backward[0].persistent and not forward[0].persistent   # column partials need a fixed grid
    assert forward[0].tile[1] == 32                   # the whole row of D=32 in one tile
    rows, d = SMOKE_SHAPE[0] * SMOKE_SHAPE[1], SMOKE_SHAPE[2]
    assert forward[0].rows == rows and forward[0].d == d
    # reads input1 and input2, writes the output: three fp32 rows of D
    assert forward[0].bytes_per_row == 3 * d * 4
    assert Path(forward[0].path).read_text().startswith("import triton")


def test_layer_norm_decisions(layer_norm):
    report, _ = layer_norm
    assert report.decided(Decision.REGENERATE) == ["rand_like"]
    assert "add" in report.decided(Decision.RECOMPUTE)
    assert report.joint.families["random"] == 1 and report.joint.families["extern"] == 0
    assert report.joint.nodes == sum(report.joint.families.values())


def test_explain_prints_the_report(layer_norm):
    report, printed = layer_norm
    assert printed.strip() == str(report).strip()
    for needle in ("saved for backward", "memfuse_forward_0", "memfuse_backward_0", "regenerate (1)",
                   "eager autograd", "fallbacks", "(none)"):
        assert needle in printed, needle


def test_explain_leaves_counters_and_rng_alone():
    inputs = layer_norm_inputs()
    rng = torch.get_rng_state()
    quiet_explain(layer_norm_block, *inputs.tensors, **inputs.consts)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(v == 0 for v in memfuse.stats().values())


def test_explain_reads_a_fused_functions_cache():
    inputs = layer_norm_inputs()
    fused = memfuse.memory_efficient_fusion(layer_norm_block)
    fused(*inputs.tensors, **inputs.consts)
    report, _ = quiet_explain(fused, *inputs.tensors, **inputs.consts)
    assert len(fused.cache) == 1 and report.entry is next(iter(fused.cache.values()))


# -- externs, fallbacks, aten groups ----------------------------------------------------------------
def test_extern_fallbacks_and_not_fused(matmul):
    report, _ = matmul
    targets = {f.node: f.target for f in report.fallbacks}
    assert targets["mm"] == "aten.mm.default"
    assert ("forward", "mm", "aten.mm.default") in {(e.program, e.name, e.target) for e in report.externs}
    assert any(n.node == "relu" and n.input == "mm" and "extern" in n.reason for n in report.not_fused)
    mask = next(s for s in report.saved if s.name == "le")
    assert (mask.kind, mask.dtype, mask.shape, mask.is_input) == ("full", torch.bool, (8, 32), False)
    assert mask.bytes == 8 * 32


def test_aten_group_is_reported():
    fused = memfuse.memory_efficient_fusion(scale_shift)
    x, w = torch.randn(4, 0, requires_grad=True), torch.randn(0, requires_grad=True)   # rows of length 0
    report, printed = quiet_explain(fused, x, w)
    assert report.kernels and not any(k.is_kernel for k in report.kernels)
    assert all("D=0" in k.aten_reason for k in report.kernels)
    assert "group memfuse_forward_0" in printed


def test_inference_has_no_backward():
    x, w = torch.randn(4, 32), torch.randn(32)
    report, printed = quiet_explain(scale_shift, x, w)
    assert report.backward is None and report.saved == [] and report.kernels_of("backward") == []
    assert report.eager_saved.bytes == 0 and "backward  none" in printed


# -- pictures -------------------------------------------------------------------------------------
def test_png_highlights_the_saved_values(layer_norm, tmp_path):
    report, _ = layer_norm
    drawing = report.draw(tmp_path / "plan.png")
    assert (tmp_path / "plan.png").read_bytes().startswith(PNG_MAGIC)
    saved = {s.name for s in report.saved}
    assert drawing.highlighted == saved and set(drawing.saved) == saved
    assert all(drawing.nodes[n].ring == SAVED_RING for n in saved)
    assert drawing.nodes["rand_like"].role == "regenerated"
    assert drawing.nodes["tangents_1"].role == "tangent"
    assert all(a in saved and drawing.nodes[b].role in ("recomputed", "regenerated", "backward")
               for a, b in drawing.cut_edges)


def test_bands_put_the_forward_above_the_backward(layer_norm):
    drawing = layer_norm[0].drawing()
    ys = {band: [n.y for n in drawing.nodes.values() if ROLES[n.role][0] == band]
          for band in ("forward", "both", "backward")}
    assert min(ys["forward"]) > max(ys["both"]) and min(ys["both"]) > max(ys["backward"])
    for a, b in drawing.edges:   # columns are topological generations: data flows left to right
        assert drawing.nodes[a].x < drawing.nodes[b].x


def test_svg_and_dot_mark_a_computed_saved_value(matmul, tmp_path):
    report, (x, w) = matmul
    drawing = memfuse.draw_plan(relu_matmul, x, w, path=tmp_path / "plan.svg")
    svg = (tmp_path / "plan.svg").read_text()
    assert "<svg" in svg and 'id="memfuse_saved"' in svg
    assert "le" in drawing.highlighted and drawing.nodes["le"].role == "forward"
    assert ("le", "where") in drawing.cut_edges
    dot = report.to_dot()
    le_line = next(line for line in dot.splitlines() if line.strip().startswith('"le" ['))
    assert "penwidth=3" in le_line and SAVED_RING in le_line
    mm_line = next(line for line in dot.splitlines() if line.strip().startswith('"mm" ['))
    assert "penwidth" not in mm_line
    assert (tmp_path / "plan.dot") == report.drawing().save(tmp_path / "plan.dot")
    assert (tmp_path / "plan.dot").read_text() == dot


def test_draw_rejects_unknown_formats(layer_norm, tmp_path):
    with pytest.raises(ValueError, match=r"\.png"):
        layer_norm[0].draw(tmp_path / "plan.jpg")


# -- modules and calls that run through torch --------------------------------------------------------
class NormGate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x, cache=None):
        return torch.sigmoid(self.norm(x)) * x


def test_explain_a_module_and_its_wrapper():
    module, x = NormGate(), torch.randn(4, 16, requires_grad=True)
    report, printed = quiet_explain(module, x)
    assert report.name == "NormGate" and len(report.kernels_of("forward")) == 1
    assert {s.argument for s in report.saved if s.is_input} <= {"norm.weight", "norm.bias", "x"}
    assert report.eager_saved.bytes > report.memfuse_saved.bytes and "memfuse.explain: NormGate" in printed
    fused = memfuse.memory_efficient_fusion(module)
    fused(x)
    report, _ = quiet_explain(fused, x)
    (call,) = fused._memfuse_calls.values()
    assert report.entry is next(iter(call.fused.cache.values())), "the wrapper's own program"


def test_explain_a_call_that_runs_through_torch_says_why():
    decision, printed = quiet_explain(NormGate(), torch.randn(4, 16), cache=object())
    assert isinstance(decision, memfuse.driver.fallback.EagerCall)
    assert "runs through torch, not compiled: argument 'cache' is a object" in printed
    assert all(v == 0 for v in memfuse.stats().values())


def test_draw_plan_of_a_call_that_runs_through_torch_says_why():
    with pytest.raises(ValueError, match="no plan to draw: memfuse: NormGate runs through torch"):
        memfuse.draw_plan(NormGate(), torch.randn(4, 16), cache=object())


# -- one training step's memory ------------------------------------------------------------------
def two_layers(x, w1, w2):
    """Two matmuls with GELU between: the forward saves matmul results, the backward recomputes."""
    return F.gelu(F.gelu(x @ w1) @ w2)


def test_draw_memory_of_one_training_step(tmp_path):
    x, w1, w2 = (t.requires_grad_() for t in (torch.randn(10, 8), torch.randn(8, 24) / 3, torch.randn(24, 8) / 3))
    drawing = memfuse.draw_memory(two_layers, x, w1, w2, path=tmp_path / "memory.png")
    assert (tmp_path / "memory.png").read_bytes()[:8] == PNG_MAGIC and drawing.path == tmp_path / "memory.png"
    entry = memfuse.memory_efficient_fusion(two_layers).compiled_for(x, w1, w2)
    programs = (entry.function.forward, entry.function.backward)
    assert [s.program for s in drawing.steps] == [kind for kind, p in zip(("forward", "backward"), programs)
                                                  for _ in p.buffers.steps]
    held = [p.during for program in programs for p in memory_timeline(program.buffers, entry.captured.hints)]
    assert [s.total for s in drawing.steps] == held
    # the saved activations: made by the forward, handed to the backward whole, gone at its end
    forward_end = [s for s in drawing.steps if s.program == "forward"][-1]
    backward_entry = next(s for s in drawing.steps if s.program == "backward")
    assert forward_end.saved == backward_entry.saved == entry.plan.saved_bytes > 0
    assert drawing.steps[0].saved == 0 and drawing.steps[-1].saved < backward_entry.saved
    assert f"peak {human_bytes(drawing.peak.total)} while {drawing.peak.program} {drawing.peak.name}" in drawing.title
    with pytest.raises(ValueError, match=r"\.png"):
        drawing.save(tmp_path / "memory.dot")


def test_draw_memory_of_a_call_that_runs_through_torch_says_why():
    with pytest.raises(ValueError, match="no programs to draw: memfuse: NormGate runs through torch"):
        memfuse.draw_memory(NormGate(), torch.randn(4, 16), cache=object())


def test_twins_say_whose_binary_they_launch(tmp_path):
    from tests.codegen.test_codegen import four_layer_inputs, four_layers
    tensors = four_layer_inputs()
    # a cache directory of its own: every twin's first kernel is one of this compile's
    fused = memfuse.memory_efficient_fusion(four_layers, config=memfuse.Config(cache_dir=tmp_path))
    report, printed = quiet_explain(fused, *tensors)
    twins = [k for k in report.kernels if k.twin_of is not None]
    assert twins
    names = {k.name for k in report.kernels}
    for twin in twins:
        assert twin.twin_of in names and twin.twin_of != twin.name
        assert f"(shared with {twin.twin_of}: the same code over other values, one binary)" in printed
