"""The switches (MEMFUSE_LOG, MEMFUSE_DUMP_DIR, MEMFUSE_STRICT) and the counters of stats()."""
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import memfuse
from benchmarks.lib.workloads import layer_norm_block, smoke_registry
from memfuse.base.debug import COUNTERS, STAGES, configure_logging, describe_key_change, topic_log
from memfuse.ir.graph import Op
from memfuse.runtime.launchers import KernelLaunch
from memfuse.schedule.steps import ExternStep

ROOT = Path(__file__).resolve().parents[2]


def relu_matmul(x, w):
    return torch.relu(x @ w) * 2


def scale_shift(x, w, scale: float = 1.0):
    return (x * w + x) * scale


def layer_norm_inputs():
    return next(w for w in smoke_registry() if w.fn is layer_norm_block).make_inputs("cpu")


def messages(caplog, topic: str) -> list:
    return [r.getMessage() for r in caplog.records if r.name == f"memfuse.{topic}"]


# -- counters ---------------------------------------------------------------------------------------
def test_stats_lists_every_counter():
    assert set(memfuse.stats()) == set(COUNTERS)
    assert all(v == 0 for v in memfuse.stats().values())


def test_compiles_hits_and_kernel_counters(tmp_path):
    inputs = layer_norm_inputs()
    # a cache directory of its own: no kernel an earlier test generated is shared (kernels_shared)
    fused = memfuse.memory_efficient_fusion(layer_norm_block, config=memfuse.Config(cache_dir=tmp_path))
    fused(*inputs.tensors, **inputs.consts).backward(inputs.grad_output)
    assert memfuse.stats() == {**dict.fromkeys(COUNTERS, 0), "compiles": 1, "kernels_generated": 2,
                               "kernels_launched": 2, "front_misses": 1}
    fused(*inputs.tensors, **inputs.consts).backward(inputs.grad_output)
    after = memfuse.stats()
    assert (after["compiles"], after["cache_hits"], after["kernels_launched"]) == (1, 1, 4)
    assert after["front_misses"] == 1, "the repeated call is served by the front"
    assert after["kernels_generated"] == 2           # generated once per compile, not per call
    memfuse.reset_stats()
    assert all(v == 0 for v in memfuse.stats().values())


def test_compile_times_name_every_stage_and_add_up_to_the_compile():
    """compile_times(): seconds per stage; the stages (but trace, a part of capture) run one after
    another inside the compile, so they sum to its time less the bookkeeping between them."""
    assert memfuse.compile_times() == dict.fromkeys(STAGES, 0)
    inputs = layer_norm_inputs()
    fused = memfuse.memory_efficient_fusion(layer_norm_block, config=memfuse.Config(check=True))
    fused(*inputs.tensors, **inputs.consts).backward(inputs.grad_output)
    times = memfuse.compile_times()
    ran = {"capture", "trace", "plan", "schedule", "codegen", "buffers", "program", "verify", "compile"}
    assert all(times[stage] > 0 for stage in ran), times
    assert times["trace"] < times["capture"]
    stages = sum(seconds for stage, seconds in times.items() if stage not in ("trace", "compile"))
    assert 0.9 * times["compile"] <= stages <= times["compile"], times
    fused(*inputs.tensors, **inputs.consts).backward(inputs.grad_output)
    assert memfuse.compile_times() == times, "a cached call compiles nothing"
    memfuse.reset_stats()
    assert memfuse.compile_times() == dict.fromkeys(STAGES, 0)


def test_extern_calls_and_fallbacks_counters():
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(relu_matmul)
    fused(x, w).sum().backward()
    entry = next(iter(fused.cache.values()))
    aten_calls = [s for p in (entry.function.forward, entry.function.backward) for s in p.steps
                  if isinstance(s, ExternStep) and p.graph[s.name].op is Op.EXTERN]
    assert len(aten_calls) >= 3                       # mm forward, two mm backward
    stats = memfuse.stats()
    assert stats["extern_calls"] == len(aten_calls)
    assert stats["fallbacks"] == len(entry.captured.fallbacks)
    assert {target for _, target, _ in entry.captured.fallbacks} >= {"aten.mm.default"}


def test_aten_groups_count_as_fallbacks():
    fused = memfuse.memory_efficient_fusion(scale_shift)
    x, w = torch.randn(4, 0, requires_grad=True), torch.randn(0, requires_grad=True)   # rows of length 0
    out = fused(x, w)
    torch.testing.assert_close(out, scale_shift(x, w))
    stats = memfuse.stats()
    assert (stats["fallbacks"], stats["kernels_generated"], stats["kernels_launched"]) == (2, 0, 0)


# -- recompiles: which part of the key changed ------------------------------------------------------
def compile_twice(caplog, first: tuple, second: tuple, fn=scale_shift) -> str:
    """Compile `fn` for two argument lists; what the recompile log line said."""
    fused = memfuse.memory_efficient_fusion(fn)
    fused.compiled_for(*first)
    fused.compiled_for(*second)
    assert memfuse.stats()["recompiles"] == 1 and len(fused.cache) == 2
    said = [m for m in messages(caplog, "recompiles") if "recompile #1" in m]
    assert len(said) == 1
    return said[0]


def x_w(rows=4, d=16, dtype=torch.float32, grad=True, rank=2):
    shape = (rows,) * (rank - 1) + (d,)
    return (torch.randn(shape, dtype=dtype, requires_grad=grad), torch.randn(d, dtype=dtype, requires_grad=grad))


def test_recompile_names_the_dtype(logs):
    said = compile_twice(logs, x_w(), x_w(dtype=torch.float64))
    assert "argument 'x' (position 0): dtype float32 -> float64" in said
    assert "argument 'w' (position 1): dtype float32 -> float64" in said


def test_recompile_names_d(logs):
    assert "D (last dim) 16 -> 32" in compile_twice(logs, x_w(d=16), x_w(d=32))


def test_recompile_names_the_rank(logs):
    assert "argument 'x' (position 0): rank 2 -> 3" in compile_twice(logs, x_w(rank=2), x_w(rank=3))


def test_recompile_names_requires_grad(logs):
    x, w = x_w()
    said = compile_twice(logs, (x, w), (x, w.detach()))
    assert "argument 'w' (position 1): requires_grad True -> False" in said


def test_recompile_names_a_constant(logs):
    x, w = x_w()
    assert "argument 'scale' (position 2): constant value 0.5 -> 2.0" in compile_twice(logs, (x, w, 0.5), (x, w, 2.0))


def test_recompile_names_specialized_leading_sizes(logs):
    # the mm trace guards on w's first dim (== x's last), so leading sizes join the key
    w = torch.randn(16, 32, requires_grad=True)
    first, second = (torch.randn(8, 16, requires_grad=True), w), (torch.randn(9, 16, requires_grad=True), w)
    said = compile_twice(logs, first, second, fn=relu_matmul)
    assert "leading sizes [8, 16], [16, 32] -> [9, 16], [16, 32]" in said
    assert any("leading sizes join the compile key" in m for m in messages(logs, "recompiles"))
    # the guard's size symbol named as the argument and dim it is
    assert any(re.search(r"guards on Eq\((s\d+), 16\) \(\1: w dim 0\)", m) for m in messages(logs, "recompiles")), \
        messages(logs, "recompiles")


def test_new_batch_size_is_a_cache_hit(logs):
    fused = memfuse.memory_efficient_fusion(scale_shift)
    fused.compiled_for(*x_w(rows=4))
    fused.compiled_for(*x_w(rows=7))
    assert (memfuse.stats()["recompiles"], memfuse.stats()["cache_hits"]) == (0, 1)
    cache = messages(logs, "cache")
    assert any("cache miss (first call)" in m for m in cache)
    assert any("cache hit" in m for m in cache)
    assert messages(logs, "recompiles") == []


def test_describe_key_change_picks_the_closest_key():
    base = (True, ("T", torch.float32, "cpu", 2, 16, ("s0",), True, True, False), ("C", float, 0.5))
    far = (False, ("T", torch.float16, "cpu", 3, 8, ("s0", "s1"), False, True, False), ("C", float, 0.5))
    new = (True, ("T", torch.float32, "cpu", 2, 16, ("s0",), True, True, False), ("C", float, 0.7))
    said = describe_key_change([far, base], new, lambda i: f"#{i}")
    assert said == "argument #1: constant value 0.5 -> 0.7"
    no_grad = (False,) + base[1:]
    assert "gradients needed -> not needed" in describe_key_change([base], no_grad, str)


# -- MEMFUSE_LOG -----------------------------------------------------------------------------------
def test_log_topics(logs):
    inputs = layer_norm_inputs()
    memfuse.memory_efficient_fusion(layer_norm_block).compiled_for(*inputs.tensors, **inputs.consts)
    assert any(re.search(r"joint \d+ nodes: \d+ pointwise", m) for m in messages(logs, "graphs"))
    assert any("outputs:" in m for m in messages(logs, "graphs"))            # the full IR at DEBUG
    assert any("saves 0 B beyond the inputs" in m for m in messages(logs, "plan"))
    assert any("regenerate rand_like" in m for m in messages(logs, "plan"))
    kernels = messages(logs, "kernels")
    assert any("memfuse_forward_0" in m and ".py" in m for m in kernels)
    assert any("memfuse_backward_0" in m and "column sums" in m for m in kernels)


def test_fallbacks_are_logged(logs):
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    memfuse.memory_efficient_fusion(relu_matmul).compiled_for(x, w)
    assert any("mm (aten.mm.default) runs through aten" in m for m in messages(logs, "fallbacks"))


def test_configure_logging_levels():
    try:
        configure_logging("plan,recompiles")
        assert topic_log("plan").isEnabledFor(logging.DEBUG)
        assert topic_log("recompiles").isEnabledFor(logging.DEBUG)
        assert not topic_log("kernels").isEnabledFor(logging.INFO)
        configure_logging("1")
        assert topic_log("kernels").isEnabledFor(logging.INFO)
        assert not topic_log("cache").isEnabledFor(logging.DEBUG)   # per-call hits need debug
        configure_logging("debug")
        assert topic_log("cache").isEnabledFor(logging.DEBUG)
        handlers = [h for h in logging.getLogger("memfuse").handlers if getattr(h, "_memfuse_handler", False)]
        assert len(handlers) == 1                                     # configuring twice adds one handler
        with pytest.raises(ValueError, match="unknown topic"):
            configure_logging("plan,kernal")
        configure_logging("0")
        assert not topic_log("plan").isEnabledFor(logging.INFO)
    finally:
        configure_logging("0")


def test_memfuse_log_is_read_at_import():
    code = ("import logging, memfuse; logging.getLogger('memfuse.recompiles').info('said recompile'); "
            "logging.getLogger('memfuse.plan').info('said plan')")
    env = {**os.environ, "MEMFUSE_LOG": "recompiles", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[memfuse] said recompile" in done.stderr and "said plan" not in done.stderr


# -- MEMFUSE_DUMP_DIR ------------------------------------------------------------------------------
def test_dump_dir_writes_graphs_and_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFUSE_DUMP_DIR", str(tmp_path))
    inputs = layer_norm_inputs()
    fused = memfuse.memory_efficient_fusion(layer_norm_block)
    entry = fused.compiled_for(*inputs.tensors, **inputs.consts)
    folders = sorted(p.name for p in tmp_path.iterdir())
    assert folders == ["layer_norm_block.0"]
    dump = tmp_path / folders[0]
    for name in ("joint.ir.txt", "forward.ir.txt", "backward.ir.txt", "joint.aten.py", "explain.txt", "plan.dot",
                 "forward.program.py", "backward.program.py"):
        assert (dump / name).stat().st_size > 0, name
    assert "torch.ops.aten.rand_like.default" in (dump / "joint.aten.py").read_text()
    assert "= rand(seed)" in (dump / "joint.ir.txt").read_text()
    launches = [s for p in (entry.function.forward, entry.function.backward) for s in p.steps
                if isinstance(s, KernelLaunch)]
    assert sorted(p.name for p in (dump / "kernels").iterdir()) == \
        sorted(f"{s.kernel.source.name}.py" for s in launches)
    for step in launches:   # the same text as the content-addressed file in the kernel cache
        assert (dump / "kernels" / f"{step.kernel.source.name}.py").read_text() == Path(step.kernel.path).read_text()
    fused.compiled_for(*[t.double() for t in inputs.tensors], **inputs.consts)      # a recompile
    assert sorted(p.name for p in tmp_path.iterdir()) == ["layer_norm_block.0", "layer_norm_block.1"]


def test_no_dump_without_the_switch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    memfuse.memory_efficient_fusion(scale_shift).compiled_for(*x_w())
    assert list(tmp_path.iterdir()) == []


# -- MEMFUSE_STRICT --------------------------------------------------------------------------------
def test_strict_turns_an_extern_into_an_error_naming_the_op(monkeypatch):
    monkeypatch.setenv("MEMFUSE_STRICT", "1")
    fused = memfuse.memory_efficient_fusion(relu_matmul)
    assert fused.config.strict
    x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"mm \(aten\.mm\.default\) runs through aten.*MEMFUSE_STRICT"):
        fused(x, w)
    assert memfuse.stats()["compiles"] == 0 and fused.cache == {}
    monkeypatch.delenv("MEMFUSE_STRICT")
    torch.testing.assert_close(memfuse.memory_efficient_fusion(relu_matmul)(x, w), relu_matmul(x, w))


def test_strict_turns_an_aten_group_into_an_error():
    fused = memfuse.memory_efficient_fusion(scale_shift, config=memfuse.Config(strict=True))
    with pytest.raises(NotImplementedError, match=r"memfuse_forward_0 \(mul, add, mul\).*D=0"):
        fused(*x_w(d=0))
