"""The direct launch (runtime.DirectLaunch): on a GPU, an aligned call skips KernelLaunch's
general path and Triton's binder. Here its arguments are checked against the general path's
for the same calls: same grid, same kernel arguments in the same order, same constexprs."""
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import memfuse
from memfuse import runtime
from memfuse.runtime import DirectLaunch, KernelLaunch, Launcher

from helpers import BLOCKS, block_inputs


def _kernel_launches(name):
    tensors, consts, grad = block_inputs(name, (3, 5, 32), dropout_prob=0.1)
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    fused(*tensors, **consts).backward(grad)
    function = fused.compiled_for(*tensors, **consts).function
    return [step for program in (function.forward, function.backward) for step in program.steps
            if isinstance(step, KernelLaunch)]


@pytest.mark.parametrize("name", ["layer_norm_block", "rms_norm_block"])
@pytest.mark.parametrize("rows", [0, 1, 7, 15, 1000, 100000])
def test_direct_launch_passes_what_the_general_path_passes(monkeypatch, name, rows):
    general, direct = [], []

    def record_general(self, programs, args, device, config, aligned):
        general.append((programs, list(args), tuple(self.keywords(config).values())))
    monkeypatch.setattr(Launcher, "__call__", record_general)
    monkeypatch.setattr(runtime, "_raw_stream", lambda index: 7)
    cpu = torch.device("cpu")
    for launch in _kernel_launches(name):
        config, most = launch._grid(cpu)
        values = tuple(f"value{i}" for i in range(3))
        launch._launch(cpu, rows, True, values)

        def record_direct(programs, y, z, stream, function, metadata, *rest):
            assert (y, z, stream, function, metadata, rest[:3]) == (1, 1, 7, "kernel", "metadata", (None,) * 3)
            direct.append(programs)
            direct.append(list(rest[3:]))
        compiled = types.SimpleNamespace(run=record_direct, function="kernel", packed_metadata="metadata")
        DirectLaunch(launch, cpu, config, most, compiled)(rows, values)
        programs, args, constexprs = general[-1]
        assert direct[-2] == programs
        assert direct[-1] == args + list(constexprs)


def test_a_new_configuration_leaves_the_direct_launch(monkeypatch):
    """Tuning (or an out-of-resources retry) changes the configuration: the next call must not
    launch with the old one. Unaligned inputs never take the direct launch."""
    launch = _kernel_launches("layer_norm_block")[0]
    cuda = torch.device("cuda", 0)
    used = []

    class Direct:
        config = launch.configs[cuda] = object()

        def __call__(self, rows, values):
            used.append("direct")
    launch.direct[cuda] = Direct()
    monkeypatch.setattr(KernelLaunch, "_launch", lambda self, *args: used.append("general"))
    launch(cuda, 8, True, ())
    launch(cuda, 8, False, ())
    launch.configs[cuda] = object()
    launch(cuda, 8, True, ())
    assert used == ["direct", "general", "general"]


def test_rows_past_int32_take_the_generic_path(monkeypatch):
    """The precompiled (and direct) kernel passes the row count as Triton's i32: 2**31 rows or
    more go to Triton's generic path, which compiles the 64-bit variant."""
    launch = _kernel_launches("layer_norm_block")[0]
    cpu = torch.device("cpu")
    config, most = launch._grid(cpu)
    calls = []
    monkeypatch.setattr(Launcher, "__call__", lambda self, programs, args, device, config, direct: calls.append(direct))
    for rows in (2 ** 31 - 1, 2 ** 31):
        launch._launch(cpu, rows, True, tuple(f"value{i}" for i in range(3)))
    assert calls == [True, False]
    general = []
    monkeypatch.setattr(KernelLaunch, "_launch", lambda self, device, rows, aligned, values: general.append(aligned))
    compiled = types.SimpleNamespace(run=lambda *args: general.append("direct"), function=None, packed_metadata=None)
    monkeypatch.setattr(runtime, "_raw_stream", lambda index: 7)
    direct = DirectLaunch(launch, cpu, config, most, compiled)
    direct(2 ** 31 - 1, ())
    direct(2 ** 31, ())
    assert general == ["direct", False]


def test_host_profile_cpu_proxy_runs():
    """benchmarks/host_profile.py --stub-launches (the CPU proxy of the host's Python) patches the
    direct launch and the seed draw: it must keep working as they change. In its own process."""
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "benchmarks.host_profile", "--stub-launches", "--steps", "40"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "memfuse - floor = " in result.stdout and "seed_from_philox" in result.stdout, result.stdout[-3000:]
