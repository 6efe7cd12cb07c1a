"""benchmarks/loss_head_kernels.py: its tiny run (CPU, the Triton interpreter) launches every
variant of the loss head's kernels on a chunk, and the accumulation it can run here."""
import json
import math
import os

import pytest

from benchmarks import loss_head_kernels as bench


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_tiny_run(tmp_path, capsys):
    bench.main(["--tiny", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "loss-head-kernels.json").read_text())
    variants = {(r["variant"], r["block"], r["warps"]) for r in result["kernels"]}
    expected = {(v, b, w) for v in ("separate", "fused") for b in bench.BLOCK_SIZES for w in bench.WARPS}
    assert variants == expected | {("clone", None, None)}
    assert all(r["ms"] is None for r in result["kernels"])          # no times on the CPU
    [accumulation] = result["accumulation"]                         # the epilogue is CUDA's alone
    assert accumulation["variant"] == "product then add" and math.isfinite(accumulation["max_error"])
    table = (tmp_path / "loss-head-kernels.md").read_text()
    assert table.count("| [16, 101] |") == len(result["kernels"]) and table.strip() in capsys.readouterr().out


def test_gpu_run_needs_cuda_or_tiny():
    if bench.torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        bench.main([])
