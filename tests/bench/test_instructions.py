"""benchmarks/instructions.py: memfuse's kernels compiled for sm_90 on a machine without a GPU
(Triton's own ptxas and cuobjdump), their SASS counted and set against the bytes they move."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import memfuse
from benchmarks import instructions
from memfuse.runtime.program import KernelLaunch

ROOT = Path(__file__).resolve().parents[2]


def _launches(fn, *tensors):
    fused = memfuse.memory_efficient_fusion(fn)
    fused(*tensors).sum().backward()
    entry = fused.compiled_for(*tensors)
    return [(program.graph, step) for program in (entry.function.forward, entry.function.backward)
            for step in program.steps if isinstance(step, KernelLaunch)]


def test_its_model_names_are_the_benchmarks():
    """The counter names the models without importing benchmarks.models (which turns the
    interpreter on): the names must stay the benchmark's."""
    from benchmarks.lib.hf_models import FAMILIES
    assert set(instructions.MODEL_NAMES) == set(FAMILIES)


def layer_norm(x, w):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w)


def test_kernels_compile_for_sm90_and_are_judged(tmp_path):
    """A tanh over one-tile rows and a layer norm's backward (column sums: a persistent loop):
    both compile for sm_90 in a process that does not interpret; each gets its instructions a
    tile (the persistent one's loop: fewer than its whole listing) and a bound."""
    x = torch.randn(8, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    launches = _launches(lambda x, w: torch.tanh(x) * 2 + layer_norm(x, w), x, w)
    entries = [instructions.manifest_entry(graph, launch) for graph, launch in launches]
    assert {e["one_tile"] for e in entries} == {True, False}, [(e["name"], e["summary"]) for e in entries]
    manifest = tmp_path / "kernels.manifest.json"
    manifest.write_text(json.dumps(entries))
    subprocess.run([sys.executable, "-m", "benchmarks.instructions", "--compile", str(manifest)], check=True,
                   cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"})
    rows = json.loads(manifest.with_suffix(".rows.json").read_text())
    assert [r["name"] for r in rows] == [e["name"] for e in entries]
    for row, entry in zip(rows, entries):
        assert row["sass"] > 10, row
        assert 16 <= row["registers"] <= 255 and row["spilled"] >= 0, row
        assert 0 < row["warps_per_sm"] <= instructions.SM_WARPS and row["warps_per_sm"] % entry["num_warps"] == 0, row
        assert row["bound"] in ("arithmetic", "memory") and row["per_element"] > 0 and row["memory_ns"] > 0, row
        if entry["persistent"]:
            assert 0 < row["per_tile"] < row["sass"], row
    assert "| `" in instructions.report("tiny", rows)
    assert all(r["compile_s"] > 0 for r in rows)
    assert f"7 kernel launches a step, {len(rows)} functions" in instructions.report("tiny", rows, launches=7)


def test_a_twins_entry_names_the_function_it_launches(tmp_path):
    """A kernel sharing an earlier one's function (codegen's twins) is compiled from that file, under
    that function's name and parameter names."""
    from tests.codegen.test_codegen import four_layer_inputs, four_layers
    tensors = four_layer_inputs()
    fused = memfuse.memory_efficient_fusion(four_layers, config=memfuse.Config(cache_dir=tmp_path))
    fused(*tensors).sum().backward()
    entry = fused.compiled_for(*tensors)
    launches = [(program.graph, step) for program in (entry.function.forward, entry.function.backward)
                for step in program.steps if isinstance(step, KernelLaunch)]
    twins = [(graph, launch) for graph, launch in launches if launch.kernel.twin_of is not None]
    assert twins
    for graph, launch in twins:
        e = instructions.manifest_entry(graph, launch)
        assert e["name"] == launch.kernel.twin_of and f"def {e['name']}(" in Path(e["path"]).read_text()
        assert list(e["signature"]) == launch.kernel.fn.arg_names[:len(e["signature"])]
        assert list(e["signature"]) != [a.name for a in launch.kernel.source.args]
