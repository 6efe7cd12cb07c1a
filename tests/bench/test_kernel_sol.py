"""memfuse.runtime.program.launch_log (each launch's must-move bytes at its sizes) and the tiny run of
benchmarks/kernel_sol.py (the per-kernel SOL table without GPU times)."""
import contextlib
import io
import json
import math
import os

import pytest
import torch

import memfuse
from memfuse.base.config import Config
from benchmarks.lib.workloads import layer_norm_block, smoke_registry
from memfuse.runtime.program import launch_log


def layer_norm_step(fused, inputs):
    fused(*inputs.tensors, **inputs.consts).backward(inputs.grad_output)


def test_launch_log_bytes_are_explains_at_the_launch_sizes():
    """A record per launch, in order: must-move bytes equal explain's count of every tensor the
    kernel reads and writes; the backward's column sums add fp32 partials on top."""
    inputs = next(w for w in smoke_registry() if w.fn is layer_norm_block).make_inputs("cpu")
    with contextlib.redirect_stdout(io.StringIO()):
        report = memfuse.explain(layer_norm_block, *inputs.tensors, **inputs.consts)
    fused = memfuse.memory_efficient_fusion(layer_norm_block)
    layer_norm_step(fused, inputs)
    with launch_log() as records:
        layer_norm_step(fused, inputs)
    explained = report.kernels_of("forward") + report.kernels_of("backward")
    assert [r.kernel for r in records] == [k.name for k in explained] == ["memfuse_forward_0", "memfuse_backward_0"]
    rows, d = inputs.tensors[0].numel() // inputs.tensors[0].shape[-1], inputs.tensors[0].shape[-1]
    for record, kernel in zip(records, explained):
        assert (record.rows, record.d) == (rows, d)
        assert record.must_move == kernel.bytes, record
    forward, backward = records
    assert forward.partials == 0 and "one tile per program" in forward.summary
    assert "3x sum over M" in backward.summary and "a persistent grid" in backward.summary
    group_size = math.ceil(math.sqrt(backward.programs))
    groups = -(-backward.programs // group_size)
    assert backward.partials == (2 * backward.programs + 2 * groups) * 3 * d * 4   # dweight, dbias1, dbias2
    layer_norm_step(fused, inputs)
    assert len(records) == 2                            # the log is closed


def test_launch_log_is_one_at_a_time():
    with launch_log():
        with pytest.raises(RuntimeError, match="one log at a time"):
            with launch_log():
                pass


def scale_rows(x, w):
    return x * w


def test_looped_kernel_partials_are_read_and_written_per_tile():
    """A looped kernel adds each tile into its program's partials row: two row-traffics a tile."""
    d = 96
    x = torch.randn(8, d, requires_grad=True)
    w = torch.randn(d, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(scale_rows, config=memfuse.Config(max_row_length=32, loop_block_d=32))
    with launch_log() as records:
        fused(x, w).backward(torch.ones(8, d))
    backward = next(r for r in records if r.kernel.startswith("memfuse_backward"))
    assert "looped: 1 pass(es) over each row in chunks of 32" in backward.summary, backward.summary
    tiles = -(-8 // backward.config.block_m)
    group_size = math.ceil(math.sqrt(backward.programs))
    groups = -(-backward.programs // group_size)
    assert backward.partials == (2 * tiles + 2 * groups) * d * 4
    assert backward.must_move == 8 * d * 4 * 3 + 2 * d * 4   # x, grad out, grad x; w, grad w
    torch.testing.assert_close(w.grad, (x * 1).detach().sum(0))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
@pytest.mark.parametrize("mode", ["memfuse_backend", "memfuse_whole"])
def test_tiny_table(tmp_path, capsys, mode):
    pytest.importorskip("transformers")
    from benchmarks import kernel_sol
    from benchmarks.lib.hf_models import FAMILIES
    kernel_sol.main(["--tiny", "--model", "gpt2", "--mode", mode, "--out", str(tmp_path)])
    result = json.loads((tmp_path / "kernel-sol-tiny-gpt2.json").read_text())
    launches = result["launches"]
    assert result["tiny"] and result["copy_gb_s"] is None and len(launches) > 10
    assert all(r["kernel"].startswith("memfuse_") and r["summary"] and r["ms"] is None for r in launches)
    moved = [r["must_move"] for r in launches]
    assert moved == sorted(moved, reverse=True)        # no times: the most bytes first
    size = FAMILIES["gpt2"].tiny
    # the loss head runs chunked (memfuse.patterns.loss_head.op's own kernels) and its returned logits are read in
    # place (GPT-2's odd vocabulary: a view of the op's padded buffer): no generated kernel reads a vocabulary row
    assert not [r for r in launches if r["d"] == size.vocab]
    table = (tmp_path / "kernel-sol-tiny-gpt2.md").read_text()
    assert table.count("| `memfuse_") == len(launches) and "TINY RUN" in table
    assert table.strip() in capsys.readouterr().out


def test_timed_table_rates_and_tuning():
    """The GPU table's arithmetic on a recorded launch given a time: GB/s, the fraction of the copy
    bandwidth, the target count and what --tune found."""
    from benchmarks import kernel_sol
    x, w = torch.randn(64, 32), torch.randn(32)
    fused = memfuse.memory_efficient_fusion(scale_rows)
    with launch_log() as records:
        fused(x, w)
    (record,) = records
    bandwidth, ms = 1e12, 1.0
    tuned = {record.launch: {"alone_ms": 0.9, "best_ms": 0.5, "best_config": {"block_m": 2, "num_warps": 8,
                                                                                "programs_per_sm": 0, "num_stages": 1}}}
    row = kernel_sol.as_row(record, ms, bandwidth, tuned)
    assert row["gb_s"] == pytest.approx(record.must_move / 1e-3 / 1e9) and "launch" not in row
    assert row["sol"] == pytest.approx(record.must_move / 1e-3 / bandwidth)
    assert row["best_sol"] == pytest.approx(2 * row["sol"])
    table = kernel_sol.report({"model": "m", "mode": "memfuse_backend", "copy_gb_s": bandwidth / 1e9, "device": "GPU",
                               "launches": [row]})
    assert f"{row['sol']:.0%} | 0.900, 0.500 ({row['best_sol']:.0%}): 2x, 8w |" in table
    assert "1 of 0.5 ms or more below 80%" in table
    json.dumps(row)


def test_kernels_of_one_structure_are_swept_once():
    """--tune sweeps the first of a model's alike kernels (summary, sizes, configuration) and
    names it in the others' rows; a kernel of another size is its own structure."""
    from benchmarks import kernel_sol
    fused = memfuse.memory_efficient_fusion(scale_rows)
    with launch_log() as records:
        fused(torch.randn(64, 32), torch.randn(32))
        fused(torch.randn(64, 32), torch.randn(32))
        fused(torch.randn(64, 48), torch.randn(48))
    first, again, wider = records
    assert kernel_sol.structure(first) == kernel_sol.structure(again) != kernel_sol.structure(wider)
    found = {"alone_ms": 0.9, "best_ms": 0.5, "best_config": {"block_m": 2, "num_warps": 8, "programs_per_sm": 0,
                                                             "num_stages": 1}}
    row = kernel_sol.as_row(again, 1.0, 1e12, {again.launch: {**found, "as": first.kernel}})
    table = kernel_sol.report({"model": "m", "mode": "memfuse_backend", "copy_gb_s": 1e3, "device": "GPU",
                               "launches": [row]})
    assert f"0.900, 0.500 ({row['best_sol']:.0%}): 2x, 8w (as `{first.kernel}`) |" in table


def test_a_sweep_of_given_tiles_times_only_those(monkeypatch):
    """--tune-tiles: a kernel slow to compile is timed at the tiles named (rows x warps), the
    fastest returned; without them, every candidate tile of its row length."""
    from types import SimpleNamespace

    from benchmarks.lib import kernel_timing as tune
    launch = SimpleNamespace(kernel=SimpleNamespace(source=SimpleNamespace(constexprs={"BLOCK_D": 1024},
                                                                         persistent=False)), configs={})
    timed = []

    def kernel_time(launch):
        config = launch.configs["gpu"]
        timed.append((config.block_m, config.num_warps))
        return 10.0 / (config.block_m * config.num_warps)

    monkeypatch.setattr(tune, "kernel_time", kernel_time)
    us, best = tune.sweep(launch, "gpu", tiles=[(1, 2), (4, 8), (2, 4)])
    assert timed == [(1, 2), (4, 8), (2, 4)] and (best.block_m, best.num_warps, us) == (4, 8, 10.0 / 32)
    timed.clear()
    tune.sweep(launch, "gpu")
    assert len(timed) == len(tune.tile_candidates(1024, 0)) > 3


def test_a_twins_launch_is_recorded_under_the_function_the_profiler_sees(tmp_path):
    """kernel_sol matches a step's profile to its launch log by name: a twin runs its first kernel's
    Triton function, so that is the name its record gives the profiler's row, beside its own."""
    from tests.codegen.test_codegen import four_layer_inputs, four_layers
    tensors = four_layer_inputs()
    fused = memfuse.memory_efficient_fusion(four_layers, config=Config(cache_dir=tmp_path))
    fused(*tensors).sum().backward()
    with launch_log() as records:
        fused(*tensors).sum().backward()
    twins = [r for r in records if r.function != r.kernel]
    assert twins
    own_names = {r.kernel for r in records}
    assert all(r.function in own_names for r in twins), twins          # the first kernel's, launched before
