"""The direct launch (runtime.DirectLaunch): on a GPU, an aligned call skips KernelLaunch's
general path and Triton's binder. Here its arguments are checked against the general path's
for the same calls: same grid, same kernel arguments in the same order, same constexprs."""
import contextlib
import dataclasses
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import memfuse
from memfuse.base import launch as launch_module
from memfuse.runtime import program as runtime
from memfuse.runtime.program import DirectLaunch, KernelLaunch, Launcher

from compare import assert_same
from helpers import BLOCKS, block_inputs


def _kernel_launches(name):
    tensors, consts, grad = block_inputs(name, (3, 5, 32), dropout_prob=0.1)
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn)
    fused(*tensors, **consts).backward(grad)
    function = fused.compiled_for(*tensors, **consts).function
    return [step for program in (function.forward, function.backward) for step in program.steps
            if isinstance(step, KernelLaunch)]


def _recording_compiled(calls: list):
    """A compiled kernel whose launcher records what it is called with."""
    return types.SimpleNamespace(run=lambda *args: calls.append(args), function="kernel", packed_metadata="metadata")


def _install_direct(launch, device, calls: list) -> DirectLaunch:
    config, most = launch._grid(device)
    launch.direct[device] = DirectLaunch(launch, device, config, most, _recording_compiled(calls))
    return launch.direct[device]


@pytest.mark.parametrize("name", ["layer_norm_block", "rms_norm_block"])
@pytest.mark.parametrize("rows", [0, 1, 7, 15, 1000, 100000])
def test_direct_launch_passes_what_the_general_path_passes(monkeypatch, name, rows):
    """Same grid, same kernel arguments in the same order (the column sums' buffers as their
    pointers), same constexprs; the launcher gets the grid, the stream and the fixed arguments."""
    general = []

    def record_general(self, programs, args, device, config, aligned):
        general.append((programs, list(args), tuple(self.keywords(config).values())))
    monkeypatch.setattr(Launcher, "__call__", record_general)
    monkeypatch.setattr(runtime, "raw_stream", lambda index: 7)
    cpu = torch.device("cpu")
    for launch in _kernel_launches(name):
        values = tuple(f"value{i}" for i in range(3))
        pointers = tuple(f"pointer{i}" for i in range(3))
        launch._launch(cpu, rows, True, values)
        calls = []
        _install_direct(launch, cpu, calls)
        launch(cpu, rows, pointers, values)
        programs, args, constexprs = general[-1]
        (grid_x, y, z, stream, function, metadata, *hooks), rest = calls[-1][:9], list(calls[-1][9:])
        assert (grid_x, y, z, stream, function, metadata, hooks) == (programs, 1, 1, 7, "kernel", "metadata", [None] * 3)
        expected = list(pointers) + [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args[3:]]
        assert rest == expected + list(constexprs)


def test_a_new_configuration_leaves_the_direct_launch(monkeypatch):
    """Tuning (or an out-of-resources retry) changes the configuration: the next call must not
    launch with the old one. Unaligned inputs (no pointers) never take the direct launch."""
    launch = _kernel_launches("layer_norm_block")[0]
    cuda = torch.device("cuda", 0)
    direct_calls, used = [], []
    config = launch.configs[cuda] = launch._grid(torch.device("cpu"))[0]
    launch.direct[cuda] = DirectLaunch(launch, cuda, config, 4, _recording_compiled(direct_calls))
    monkeypatch.setattr(KernelLaunch, "_launch", lambda self, device, rows, aligned, values: used.append(aligned))
    monkeypatch.setattr(runtime, "raw_stream", lambda index: 7)
    monkeypatch.setattr(DirectLaunch, "column_sum_pointers", lambda self, programs: ())
    launch(cuda, 8, ("pointer",), ("value",))
    launch(cuda, 8, None, ("value",))
    launch.configs[cuda] = dataclasses.replace(config, block_m=config.block_m * 2)
    launch(cuda, 8, ("pointer",), ("value",))
    assert len(direct_calls) == 1 and used == [False, True]


def test_rows_past_int32_take_the_generic_path(monkeypatch):
    """The precompiled (and direct) kernel passes the row count as Triton's i32: 2**31 rows or
    more go to Triton's generic path, which compiles the 64-bit variant."""
    launch = _kernel_launches("layer_norm_block")[0]
    cpu = torch.device("cpu")
    calls = []
    monkeypatch.setattr(Launcher, "__call__", lambda self, programs, args, device, config, direct: calls.append(direct))
    for rows in (2 ** 31 - 1, 2 ** 31):
        launch._launch(cpu, rows, True, tuple(f"value{i}" for i in range(3)))
    assert calls == [True, False]
    general, direct_calls = [], []
    monkeypatch.setattr(KernelLaunch, "_launch", lambda self, device, rows, aligned, values: general.append(aligned))
    monkeypatch.setattr(DirectLaunch, "column_sum_pointers", lambda self, programs: ())
    monkeypatch.setattr(runtime, "raw_stream", lambda index: 7)
    _install_direct(launch, cpu, direct_calls)
    launch(cpu, 2 ** 31 - 1, (), ())
    launch(cpu, 2 ** 31, (), ())
    assert len(direct_calls) == 1 and general == [False]


class CudaLauncher:
    """Triton 3.6's launcher, as far as launch.launcher_call reads it."""
    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid, launch_pdl = "cooperative", "pdl"

    def launch(self, *args):
        pass

    def __call__(self, *args):
        pass


@pytest.mark.parametrize("version, scratch, c_launch", [((3, 6), 0, True), ((3, 6), 64, False), ((3, 9), 0, False)])
def test_launcher_call_skips_the_python_launcher_only_where_checked(monkeypatch, version, scratch, c_launch):
    """Triton 3.6: the C launch, with the arguments CudaLauncher.__call__ puts before the kernel's
    (cooperative grid, PDL, no global or profile scratch, then metadata and three hooks); a kernel
    that needs scratch memory, or another Triton version, calls the launcher as it is."""
    monkeypatch.setattr(launch_module, "TRITON_VERSION", version)
    launcher = CudaLauncher()
    launcher.global_scratch_size = scratch
    compiled = types.SimpleNamespace(run=launcher, function="kernel", packed_metadata="metadata")
    call, leading = launch_module.launcher_call(compiled)
    if c_launch:
        assert call == launcher.launch
        assert leading == ("kernel", "cooperative", "pdl", None, None, "metadata", None, None, None)
    else:
        assert call is launcher and leading == ("kernel", "metadata", None, None, None)


@pytest.mark.parametrize("hooked", [False, True])
def test_programs_pass_pointers_of_what_is_surely_on_the_device(monkeypatch, hooked):
    """The direct launch's arguments are the general path's with raw pointers for memfuse's own
    tensors, the forward's inputs and the backward's tangents. What the forward saved comes back
    as the very tensors it saved unless a saved-tensors hook packed them (it may unpack anything,
    anywhere): then they go to Triton's launcher as tensors, to check; without one, as pointers."""
    calls = []
    original = KernelLaunch.__call__

    def record(self, device, rows, pointers, values):
        calls.append((self.group.name, pointers, values))
        return original(self, device, rows, pointers, values)
    monkeypatch.setattr(KernelLaunch, "__call__", record)
    unpacked = []

    def unpack(t):
        unpacked.append(t.clone())
        return unpacked[-1]
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack) if hooked else contextlib.nullcontext():
        launches = _kernel_launches("layer_norm_block")
    assert {name.split("_")[1] for name, _, _ in calls} == {"forward", "backward"}
    for name, pointers, values in calls:
        assert len(pointers) == len(values)
        for p, v in zip(pointers, values):
            if isinstance(v, torch.Tensor) and not isinstance(p, torch.Tensor):
                assert p == v.data_ptr()
            else:
                assert p is v or p == v
        passed_as_tensors = [p for p in pointers if isinstance(p, torch.Tensor)]
        if "backward" in name and hooked:    # input1, input2, weight, bias1: over what unpack returned
            copies = {u.data_ptr() for u in unpacked}
            assert len(passed_as_tensors) == 4 and {p.data_ptr() for p in passed_as_tensors} == copies
        else:
            assert passed_as_tensors == [], name
    assert len(unpacked) == (4 if hooked else 0) and len(launches) == 2


def test_the_backward_takes_the_hook_state_of_its_forward(monkeypatch):
    """Whether the backward takes what the forward saved as raw pointers or as tensors follows
    whether a saved-tensors hook packed them in the forward, not the hooks active when the
    backward runs; a hook that unpacks copies is followed, gradients as eager's."""
    saved_as_tensors = []
    original = KernelLaunch.__call__

    def record(self, device, rows, pointers, values):
        if "backward" in self.group.name:
            saved_as_tensors.append(sum(isinstance(p, torch.Tensor) for p in pointers))
        return original(self, device, rows, pointers, values)
    monkeypatch.setattr(KernelLaunch, "__call__", record)
    tensors, consts, grad = block_inputs("layer_norm_block", (3, 5, 32), dropout_prob=0.0)
    fused = memfuse.memory_efficient_fusion(BLOCKS["layer_norm_block"].fn)
    expected = torch.autograd.grad(BLOCKS["layer_norm_block"].fn(*tensors, **consts), tensors, grad)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t.clone()):
        out = fused(*tensors, **consts)
    assert_same(torch.autograd.grad(out, tensors, grad), expected, what="grads, hooked forward")
    out = fused(*tensors, **consts)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert_same(torch.autograd.grad(out, tensors, grad), expected, what="grads, hooked backward")
    assert saved_as_tensors == [4, 0]


def test_host_profile_cpu_proxy_runs():
    """benchmarks/host_profile.py --stub-launches (the CPU proxy of the host's Python) patches the
    direct launch and the seed draw: it must keep working as they change. In its own process."""
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "benchmarks.host_profile", "--stub-launches", "--steps", "40"],
                            cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "memfuse - floor = " in result.stdout and "philox_draw" in result.stdout, result.stdout[-3000:]


def test_host_profile_times_a_huggingface_layer_on_the_cpu_proxy():
    """host_profile --layer: a wrapped Llama layer called with its model's arguments (the rotary
    tuple included), the floor and eager beside it. In its own process."""
    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "benchmarks.host_profile", "--layer", "llama", "--stub-launches",
                             "--steps", "40"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for line in ("llama layer floor: ", "llama layer eager: ", "llama layer memfuse_backend: ", "memfuse - floor = ",
                 "memfuse_backend - memfuse = ", "Python function calls per step"):
        assert line in result.stdout, result.stdout[-3000:]


def test_host_profile_times_a_whole_model_under_fsdp2_on_the_cpu_proxy():
    """host_profile --model --fsdp2: each mode's whole tiny model on a one-rank FSDP2 group, every
    memfuse program (FusedModules' and the backend's graphs) stubbed: a mode whose programs were
    not all found would run the Triton interpreter and be timed at tenths of a second a step, not
    the milliseconds a stubbed step takes. In its own process."""
    pytest.importorskip("transformers")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "benchmarks.host_profile", "--model", "bert", "--fsdp2",
                             "--stub-launches", "--steps", "20"], cwd=root, env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    times = {}
    for line in result.stdout.splitlines():
        if line.startswith("bert model ") and " under FSDP2: " in line:
            mode, rest = line[len("bert model "):].split(" under FSDP2: ")
            times[mode] = float(rest.split(" us per step")[0])
            assert "0 memfuse compiles while timed" in rest, line
    assert set(times) == {"eager", "memfuse_per_layer", "memfuse_backend", "memfuse_per_layer_backend"}, result.stdout
    assert max(times.values()) < 20 * min(times.values()), times     # nothing interpreted while timed


def test_an_extern_result_goes_to_the_launcher_as_a_tensor(monkeypatch):
    """A value an aten step made inside the program (here a matmul) may view what a saved-tensors
    hook unpacked: the direct launch passes it as a tensor, for Triton's launcher to check."""
    calls = []
    original = KernelLaunch.__call__

    def record(self, device, rows, pointers, values):
        calls.append((self.group.name, pointers))
        return original(self, device, rows, pointers, values)
    monkeypatch.setattr(KernelLaunch, "__call__", record)

    def fn(x, w, b):
        return torch.relu(x @ w + b)
    x, w, b = (torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True),
               torch.randn(32, requires_grad=True))
    memfuse.memory_efficient_fusion(fn)(x, w, b).sum().backward()
    forward = [pointers for name, pointers in calls if "forward" in name]
    assert forward and any(isinstance(p, torch.Tensor) for p in forward[0])


class _RecordingJit:
    """A stand-in @triton.jit function: `fn[grid](...)` records the generic launch and returns a
    compiled kernel whose launcher records the direct ones."""

    def __init__(self):
        self.generic, self.direct = [], []
        self.compiled = types.SimpleNamespace(run=lambda *args: self.direct.append(args), function="kernel",
                                              packed_metadata="metadata")

    def __getitem__(self, grid):
        def launch(*args, **keywords):
            self.generic.append((grid, args, keywords))
            return self.compiled
        return launch


def test_direct_kernel_launches_what_triton_compiled_for_arguments_of_the_same_kind(monkeypatch):
    """memfuse.base.launch.DirectKernel (the loss head's row kernels): the first call with arguments of
    a new kind (an int's width, 1 or a multiple of 16; a tensor's dtype and 16-byte alignment)
    compiles through Triton's own path; the next calls of that kind go straight to its launcher
    with the grid, the stream, the kernel's arguments and its constexprs; a profiler's launch hooks
    and CPU tensors take Triton's path."""
    monkeypatch.setattr(launch_module, "raw_stream", lambda index: 7)
    monkeypatch.setattr(launch_module, "launch_hooks_installed", lambda: False)
    jit = _RecordingJit()
    kernel = launch_module.DirectKernel(jit, {"num_warps": 8}, BLOCK=64)
    first = types.SimpleNamespace(device=torch.device("cuda", 0))
    kernel(5, first, 3000, 0.1)
    kernel(6, first, 3016, 0.2)              # same kinds: 3000 and 3016 are no multiples of 16
    assert jit.generic == [((5,), (first, 3000, 0.1), {"BLOCK": 64, "num_warps": 8})]
    assert jit.direct == [(6, 1, 1, 7, "kernel", "metadata", None, None, None, first, 3016, 0.2, 64)]
    kernel(6, first, 3200, 0.2)              # a multiple of 16: Triton may specialize on it
    kernel(6, first, 1, 0.2)
    kernel(6, first, 2 ** 31, 0.2)           # past int32
    assert [args[1] for _, args, _ in jit.generic[1:]] == [3200, 1, 2 ** 31] and len(jit.direct) == 1
    monkeypatch.setattr(launch_module, "launch_hooks_installed", lambda: True)
    kernel(6, first, 3016, 0.2)
    assert len(jit.generic) == 5 and len(jit.direct) == 1
    monkeypatch.setattr(launch_module, "launch_hooks_installed", lambda: False)
    cpu_tensor = torch.zeros(4)
    kernel(1, cpu_tensor, 3016, 0.2)
    kernel(1, cpu_tensor, 3016, 0.2)
    assert len(jit.generic) == 7 and len(jit.direct) == 1


def test_argument_kind_tells_misaligned_tensors_and_int_classes_apart():
    storage = torch.zeros(16)
    assert launch_module.argument_kind(storage) == (torch.float32, True)
    assert launch_module.argument_kind(storage[1:]) == (torch.float32, False)     # 4 bytes in
    assert launch_module.argument_kind(storage[4:]) == (torch.float32, True)
    assert launch_module.argument_kind(17) == (True, False, False)
    assert launch_module.argument_kind(32) == (True, False, True)
    assert launch_module.argument_kind(1) == (True, True, False)
    assert launch_module.argument_kind(-2 ** 31 - 1) == (False, False, False)
    assert launch_module.argument_kind(True) != launch_module.argument_kind(1)
    assert launch_module.argument_kind(0.5) is float
