"""The first call's cost: the decomposition table is built once, and the kernel precompile
passes what the launch passes."""
import collections
import functools
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import memfuse
from memfuse.runtime import precompile
from memfuse.capture import decomposition_table
from memfuse.runtime.program import KernelLaunch, Launcher
from memfuse.codegen.tuning import LaunchConfig

from helpers import BLOCKS, block_inputs

ROOT = str(Path(__file__).resolve().parents[2])


def run_python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_torch_compile_by_name_in_a_fresh_process():
    run_python("import torch, memfuse\n"
               "f = torch.compile(lambda x: torch.nn.functional.layer_norm(x, (32,)), backend='memfuse')\n"
               "x = torch.randn(4, 32, requires_grad=True)\n"
               "f(x).sum().backward()\n"
               "assert memfuse.stats()['compiles'] == 1, memfuse.stats()\n")


def test_decomposition_table_is_built_once_and_handed_out_as_a_copy():
    first = decomposition_table()
    first.clear()
    second = decomposition_table()
    assert second and second is not first
    assert torch.ops.aten.native_layer_norm.default in second


def _compiled(name="layer_norm_block"):
    tensors, consts, grad = block_inputs(name, (3, 5, 32), dropout_prob=0.1)
    return memfuse.memory_efficient_fusion(BLOCKS[name].fn), tensors, consts, grad


def _launches(function):
    return [(program.graph, step) for program in (function.forward, function.backward)
            for step in program.steps if isinstance(step, KernelLaunch)]


def test_warmup_arguments_are_what_the_launch_passes(monkeypatch):
    """Same dtype per tensor, same Python type per scalar, same constexprs and warps: Triton's
    kernel cache key of the warm-up is the launch's (pointer alignment aside)."""
    fused, tensors, consts, grad = _compiled()
    launched = {}
    original = Launcher.__call__

    def record(self, programs, args, device, config, aligned):
        launched.setdefault(self.fn, (args, config))
        return original(self, programs, args, device, config, aligned)
    monkeypatch.setattr(Launcher, "__call__", record)
    fused(*tensors, **consts).backward(grad)
    function = fused.compiled_for(*tensors, **consts).function
    launches = _launches(function)
    assert len(launches) >= 2 and len(launched) == len(launches)
    device = torch.device("cpu")
    for graph, launch in launches:
        args, keywords = precompile.warmup_arguments(graph, launch, device, function.forward.config)
        real, config = launched[launch.kernel.fn]
        assert len(args) == len(real)
        for mock, value in zip(args, real):
            if isinstance(value, torch.Tensor):
                assert mock == value.dtype
            else:
                assert type(mock) is type(value), (mock, value)
        assert keywords == {"D": launch.kernel.source.constexprs["D"], "BLOCK_M": config.block_m,
                            "BLOCK_D": launch.kernel.source.constexprs["BLOCK_D"], "NUM_STAGES": config.num_stages,
                            "num_warps": config.num_warps}


def test_precompile_walks_every_kernel_without_a_gpu():
    fused, tensors, consts, grad = _compiled("rms_norm_block")
    function = fused.compiled_for(*tensors, **consts).function
    config = function.forward.config
    device = torch.device("cpu")
    assert precompile.precompile([function.forward, function.backward], device, config) == 0   # CPU: off
    count = precompile.precompile([function.forward, function.backward, None], device, config, force=True)
    assert count == len(_launches(function))
    fused(*tensors, **consts).backward(grad)       # and the program still runs


def test_precompile_builds_one_binary_for_twins(tmp_path, monkeypatch):
    """Layers of one code share their function (codegen): precompile hands each function and launch
    configuration to Triton once, whatever the number of launches."""
    from tests.codegen.test_codegen import four_layer_inputs, four_layers
    tensors = four_layer_inputs()
    fused = memfuse.memory_efficient_fusion(four_layers, config=memfuse.Config(cache_dir=tmp_path))
    fused(*tensors).sum().backward()
    function = fused.compiled_for(*tensors).function
    launches = _launches(function)
    functions = {launch.kernel.fn for _, launch in launches}
    assert len(functions) < len(launches)
    warmed = []
    monkeypatch.setattr(precompile, "_warm_up", lambda graph, launch, *rest: warmed.append(launch.kernel.fn))
    count = precompile.precompile([function.forward, function.backward], torch.device("cpu"),
                                  function.forward.config, force=True)
    assert count == len(warmed) == len(functions) and set(warmed) == functions


def test_on_a_gpu_every_twin_launches_the_binary_its_function_was_compiled_to(tmp_path, monkeypatch):
    """The GPU path's hand-over, the GPU stood in for: each function is compiled once (a stand-in
    binary per function here) and every launch of it, twins included, gets that binary for the
    device and launch configuration."""
    from concurrent.futures import Future
    from tests.codegen.test_codegen import four_layer_inputs, four_layers
    tensors = four_layer_inputs()
    fused = memfuse.memory_efficient_fusion(four_layers, config=memfuse.Config(cache_dir=tmp_path))
    fused(*tensors).sum().backward()
    function = fused.compiled_for(*tensors).function
    gpu, chosen = torch.device("cuda", 0), LaunchConfig(2, 4, 1)
    driver = Future()
    driver.set_result(None)
    binaries = {}
    monkeypatch.setattr(precompile, "start_driver", lambda device: driver)
    monkeypatch.setattr(KernelLaunch, "launch_config", lambda launch, device, config: chosen)

    def compiled(graph, launch, device, config):
        binary = binaries[launch.kernel.fn] = object()
        launch.launcher.compiled[(device.index, chosen)] = binary
        return binary
    monkeypatch.setattr(precompile, "_warm_up", compiled)
    precompile.precompile([function.forward, function.backward], gpu, function.forward.config, force=True)
    launches = _launches(function)
    assert len(binaries) < len(launches)
    for _, launch in launches:
        assert launch.launcher.compiled[(0, chosen)] is binaries[launch.kernel.fn]


def test_precompile_is_a_config_switch(monkeypatch):
    monkeypatch.setenv("MEMFUSE_PRECOMPILE", "0")
    assert not memfuse.Config().precompile
    monkeypatch.delenv("MEMFUSE_PRECOMPILE")
    assert memfuse.Config().precompile
    assert not precompile.enabled(torch.device("cpu"), memfuse.Config())
    assert precompile.enabled(torch.device("cuda", 0), memfuse.Config())


class _FakeCompiled:
    """What BinaryIndex reads off a kernel Triton compiled: its cache hash and its source's
    specialization."""
    def __init__(self, fn, hash="ab" * 32):
        from triton.compiler.compiler import ASTSource
        self.hash = hash
        self.src = ASTSource(fn, {"x_ptr": "*fp32", "M": "i32", "D": "constexpr"}, {(2,): 1024},
                             {(0,): [["tt.divisibility", 16]]})


def _index_fakes(monkeypatch, groups: dict):
    """Triton's cache as a dict (hash -> group) and CompiledKernel as a record of its arguments."""
    import triton.compiler.compiler as compiler
    import triton.runtime.cache as cache

    class Manager:
        def __init__(self, key):
            self.key = key

        def get_group(self, filename):
            return groups.get(self.key, {}).get(filename)
    monkeypatch.setattr(cache, "get_cache_manager", Manager)
    monkeypatch.setattr(compiler, "CompiledKernel", lambda src, group, hash: ("loaded", src, group, hash))


def _a_kernel():
    fused, tensors, consts, grad = _compiled()
    return _launches(fused.compiled_for(*tensors, **consts).function)[0][1].kernel


def test_binary_index_loads_what_it_recorded(tmp_path, monkeypatch):
    kernel = _a_kernel()
    name = kernel.fn.__name__
    group = {f"{name}.json": f"/triton/{name}.json", f"{name}.cubin": f"/triton/{name}.cubin"}
    _index_fakes(monkeypatch, {"ab" * 32: {f"{name}.json": group}})
    index = precompile.BinaryIndex(tmp_path)
    config = LaunchConfig(block_m=4, num_warps=8, programs_per_sm=1, num_stages=3)
    assert index.load(kernel, config, "GPUTarget(cuda, 90)") is None        # nothing recorded yet
    recorded = _FakeCompiled(kernel.fn)
    index.record(kernel, config, "GPUTarget(cuda, 90)", recorded)
    tag, source, loaded_group, hash = index.load(kernel, config, "GPUTarget(cuda, 90)")
    assert (tag, loaded_group, hash) == ("loaded", group, recorded.hash)
    assert source.fn is kernel.fn
    assert source.signature == recorded.src.signature
    assert source.constants == recorded.src.constants
    assert source.attrs == recorded.src.attrs


def test_binary_index_misses_on_another_variant_or_a_cleared_triton_cache(tmp_path, monkeypatch):
    kernel = _a_kernel()
    name = kernel.fn.__name__
    groups = {"ab" * 32: {f"{name}.json": {f"{name}.json": "/triton/k.json"}}}
    _index_fakes(monkeypatch, groups)
    index = precompile.BinaryIndex(tmp_path)
    config = LaunchConfig(block_m=4, num_warps=8, programs_per_sm=1, num_stages=3)
    index.record(kernel, config, "GPUTarget(cuda, 90)", _FakeCompiled(kernel.fn))
    assert index.load(kernel, config, "GPUTarget(cuda, 90)") is not None
    assert index.load(kernel, LaunchConfig(4, 4, 1, 3), "GPUTarget(cuda, 90)") is None     # other warps
    assert index.load(kernel, config, "GPUTarget(cuda, 100)") is None                     # other GPU
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")                                   # other settings
    precompile.toolchain.cache_clear()
    try:
        assert index.load(kernel, config, "GPUTarget(cuda, 90)") is None
    finally:
        monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
        precompile.toolchain.cache_clear()
    assert index.load(kernel, config, "GPUTarget(cuda, 90)") is not None
    groups.clear()                                                                        # Triton's cache cleared
    assert index.load(kernel, config, "GPUTarget(cuda, 90)") is None
    index.path(kernel, config, "GPUTarget(cuda, 90)").write_text("{not json")
    assert index.load(kernel, config, "GPUTarget(cuda, 90)") is None


def _uncached_triton_key(monkeypatch):
    """Triton's own `triton_key`, with an empty cache, in place of the process's."""
    from triton.runtime import cache
    original = getattr(cache.triton_key, "__wrapped__", cache.triton_key)
    fresh = functools.lru_cache(maxsize=None)(original)
    monkeypatch.setattr(cache, "triton_key", fresh)
    return cache, original, fresh


def test_triton_key_comes_from_a_subprocess(monkeypatch):
    """The installation hash a fresh process computes is handed to Triton, and it is Triton's own."""
    cache, original, fresh = _uncached_triton_key(monkeypatch)
    precompile._triton_key()
    assert cache.triton_key is not fresh and fresh.cache_info().currsize == 0, "hashed here, not in a subprocess"
    assert cache.triton_key() == original()


@pytest.mark.parametrize("script", [
    "import json; print(json.dumps(['/elsewhere/triton/__init__.py', 'another key']))",   # another Triton
    "raise SystemExit(3)",                                                                   # no output
])
def test_triton_key_is_hashed_here_when_the_subprocess_does_not_answer(monkeypatch, script):
    cache, original, fresh = _uncached_triton_key(monkeypatch)
    monkeypatch.setattr(precompile, "TRITON_KEY_SCRIPT", script)
    precompile._triton_key()
    assert cache.triton_key is fresh and fresh.cache_info().currsize == 1


class _Kernel:
    """What `precompile._launcher_built_beside` touches of a Triton 3.6 JITFunction: making the
    binder for a device sets `self.ASTSource`, which the compile calls with the specialization."""

    def __init__(self):
        self.device_caches = collections.defaultdict(self.create_binder)

    def create_binder(self):
        self.ASTSource = lambda *args: ("source", args[1:])
        return "binder"

    def warmup(self, device_index):
        self.device_caches[device_index]
        return self.ASTSource(self, "signature", "constexprs", "attrs")


@pytest.mark.parametrize("version, built", [((3, 6), True), ((3, 9), False)])
def test_the_launcher_is_built_while_the_kernel_compiles(monkeypatch, version, built):
    """Triton 3.6 builds a kernel's launcher when it loads it; precompile starts that build from
    the specialization the compile hands to ASTSource, and leaves the kernel as it found it."""
    monkeypatch.setattr(precompile, "TRITON_VERSION", version)
    sources = []
    monkeypatch.setattr(precompile, "_build_launcher", sources.append)
    kernel = _Kernel()
    with precompile._launcher_built_beside(kernel, 0):
        source = kernel.warmup(0)
    assert source == ("source", ("signature", "constexprs", "attrs"))
    assert sources == ([source] if built else [])
    assert kernel.warmup(0) == source and len(sources) == (1 if built else 0)     # Triton's own again


def test_launcher_builds_never_wait_behind_the_warm_ups(monkeypatch):
    """More kernels than precompile's threads: every warm-up waits for its launcher's build, so
    the builds must not queue behind the warm-ups for the same threads."""
    monkeypatch.setattr(precompile, "TRITON_VERSION", (3, 6))
    monkeypatch.setattr(precompile, "_build_launcher", lambda src: time.sleep(0.05))

    def warm_up(kernel):
        with precompile._launcher_built_beside(kernel, 0):
            return kernel.warmup(0)
    futures = [precompile._executor().submit(warm_up, _Kernel()) for _ in range(2 * precompile.MAX_THREADS)]
    for future in futures:
        assert future.result(timeout=30)[0] == "source"
