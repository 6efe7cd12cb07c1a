"""Test setup: the Triton interpreter (without a GPU), a throwaway kernel cache, the IR verifier on.

TRITON_INTERPRET is read when `@triton.jit` decorates a function, so it is set here, before
anything imports triton or memfuse. On a machine with CUDA the kernels run for real.
"""
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
_CACHE_DIR = tempfile.mkdtemp(prefix="memfuse-test-cache-")
os.environ["MEMFUSE_CACHE_DIR"] = _CACHE_DIR          # never write into ~/.cache
os.environ.setdefault("MEMFUSE_CHECK", "1")           # the IR verifier after every stage
for _switch in ("MEMFUSE_LOG", "MEMFUSE_DUMP_DIR", "MEMFUSE_STRICT", "MEMFUSE_SYMBOLIC_TOKEN_DIMS"):
    os.environ.pop(_switch, None)                     # tests turn these on themselves

_ROOT = Path(__file__).resolve().parent.parent
for path in (_ROOT, _ROOT / "tests"):                 # benchmarks.workloads, tests/helpers.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import memfuse  # noqa: E402
from memfuse.base.debug import TOPICS, configure_logging  # noqa: E402

# torch's structured trace log (tlparse) emits DEBUG records that flood failure reports.
logging.getLogger("torch.__trace").setLevel(logging.INFO)


def pytest_report_header(config):
    return f"memfuse: {Path(memfuse.__file__).parent}, kernel cache: {_CACHE_DIR}, " \
           f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "compile_fails: the test makes a compile fail on purpose (the call then "
                                       "runs through torch); elsewhere a failed compile fails the test")


@pytest.fixture(autouse=True)
def _fresh_state(request):
    """Every test starts from counters at zero, no fallback reason told yet and a fixed RNG state.
    A compile that fails runs the original through torch, whose results then match eager: unless
    the test expects it (`compile_fails`), that hides a memfuse error, so it fails the test."""
    memfuse.reset_stats()
    memfuse.driver.fallback.TOLD.clear()
    torch.manual_seed(0)
    yield
    failed = [f"{name}: {reason}" for name, reason in memfuse.driver.fallback.TOLD if reason.startswith("compiling it failed")]
    if failed and "compile_fails" not in request.keywords:
        pytest.fail("a compile failed and the call ran through torch: " + "; ".join(failed), pytrace=False)


# -- the slow tier: `make test-all` runs it, `make test` (what CI runs on two cores) leaves it out -----
# Node-id patterns, each group with why it can wait: every test function of the fast tier still runs
# at least once there (fp32 for the per-op matrices, one model family per mode), so what the slow
# tier adds is a second dtype, a second family, or a run of a whole harness or of a fresh process.
SLOW_TESTS = {
    "a benchmark harness's tiny run (the harness around memfuse; memfuse's paths are tested in the fast tier)": [
        r"bench/test_models\.py::test_tiny_run", r"bench/test_budget\.py::test_tiny_budget_run",
        r"bench/test_loss_head\.py::test_tiny_run", r"bench/test_loss_head_kernels\.py::test_tiny_run",
        r"bench/test_kernel_sol\.py::test_tiny_table", r"runtime/test_launch\.py::test_host_profile",
        r"bench/test_instructions\.py::test_kernels_compile_for_sm90"],
    "a fresh Python process (torch, triton and memfuse imported again: half a minute each)": [
        r"runtime/test_first_call\.py::test_torch_compile_by_name_in_a_fresh_process",
        r"runtime/test_first_call\.py::test_triton_key_comes_from_a_subprocess",
        r"base/test_debug\.py::test_memfuse_log_is_read_at_import",
        r"fronts/test_backend\.py::test_backend_found_without_importing_memfuse",
        r"ir/test_dropout\.py::test_philox_seeds_are_the_same_in_every_process"],
    "two gloo ranks launched by benchmarks/distributed.py (minutes; the one-rank FSDP2 tests stay fast)": [
        r"models/test_distributed\.py::test_(losses|ddp|fsdp2_frees|dropout_follows|table|hf_|cases_are_timed)"],
    "training runs of examples/gpt.py over several steps (test_cli_runs stays fast)": [
        r"models/test_example\.py::test_loss"],
    "the bf16 half of a per-op or per-view matrix whose fp32 half runs every case": [
        r"ir/test_ops\.py::test_(lowered_op|composite)\[.*bfloat16\]",
        r"ir/test_views\.py::test_view_matches_eager_and_fuses\[.*bfloat16\]",
        r"codegen/test_looped_kernel\.py::test_looped_equals_persistent_with_dropout\[bfloat16\]"],
    "a second HuggingFace family or mode of a check that runs once per family and once per mode": [
        r"models/test_hf_models\.py::test_matches_eager_without_dropout\[(gpt2-memfuse_(per_layer|whole)"
        r"|llama-memfuse_(backend|whole|per_layer_backend)|bert-memfuse_(backend|per_layer|per_layer_backend))\]",
        r"patterns/loss_head/test_op\.py::test_huggingface_heads_are_found_and_match_eager\[(gpt2|bert)\]",
        r"models/test_hf_layers\.py::test_layers_compile_and_match_eager\[(gpt2|bert)\]",
        r"capture/test_gather\.py::test_hf_causal_lm_loss_behind_torch_compile_writes_no_vocab_row",
        r"models/test_sequence_lengths\.py::test_a_whole_model_compiles_once_over_sequence_lengths_and_batch_sizes"
        r"\[llama\]"],
    "the model zoo's per-layer style, and Swin wrapped whole (minutes through the interpreter): every family "
    "runs through the backend and wrapped whole in the fast tier; test_hf_models.py runs per layer on three": [
        r"models/test_zoo\.py::test_matches_eager_and_runs_no_graph_through_torch\[(.*-memfuse_per_layer|swin-memfuse_whole)\]"],
    "the before/after kernel identity check: a tiny model compiled and stepped twice, once in a fresh process": [
        r"bench/test_generated_sources\.py::test_record_is_the_same_in_a_fresh_process"],
    "Swin wrapped whole at its GPU size, compile-only (minutes on CI's cores; every other zoo family at its "
    "GPU size, in both styles, runs in the fast tier, about 10 s each)": [
        r"models/test_zoo_real_sizes\.py::test_compiles_at_real_size\[swin-whole\]"],
    "the GPU's flushing arithmetic over every adversarial quotient (IEEE arithmetic stays fast)": [
        r"ir/test_division\.py::test_(row|column)_divisor_within_two_ulps_of_division\[flushing\]"],
}
_SLOW = re.compile("|".join(f"(?:{pattern})" for patterns in SLOW_TESTS.values() for pattern in patterns))


def pytest_collection_modifyitems(config, items):
    """`slow` on the tests SLOW_TESTS names. `gpu`-marked tests (pyproject.toml) need CUDA and real
    kernels, not the interpreter."""
    for item in items:
        if _SLOW.search(item.nodeid):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (and TRITON_INTERPRET unset)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# -- the GPU's arithmetic, modelled in the interpreter (tests/ir/test_math_ops.py, tests/ir/test_division.py) ----
def _flush(a: np.ndarray) -> np.ndarray:
    """fp32 subnormals to zero of the same sign (other dtypes as they are)."""
    if a.dtype != np.float32:
        return a
    return np.where(np.abs(a) < np.finfo(np.float32).tiny, np.copysign(np.float32(0), a), a)


@pytest.fixture
def logs(caplog):
    """Every memfuse topic at DEBUG, captured; the switches restored afterwards."""
    for topic in TOPICS:
        caplog.set_level(logging.DEBUG, logger=f"memfuse.{topic}")
    yield caplog
    configure_logging("0")


@pytest.fixture
def gpu_arithmetic(monkeypatch):
    """The interpreter with the GPU's departures from IEEE arithmetic that a helper must not depend on:
    fp32 division (div.full.f32), exp (ex2.approx) and the libdevice functions (compiled flush-to-zero:
    log, sin, cos, sqrt, floor, ...) flush subnormal operands and results to zero of the same sign, and
    -x is 0 - x (Triton 3.6), +0 for x = -0 or +0. Pessimistic: the H200 measured kept subnormal
    operands of division and log; a helper that passes here depends on neither. Rounding (the
    approximate division, contracted multiply-adds) is not modelled."""
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def flushing(function):
        return lambda self, arg: TensorHandle(_flush(function(_flush(arg.data))), arg.dtype.scalar)

    for name, function in [("exp", np.exp), ("exp2", np.exp2), ("log", np.log), ("log2", np.log2), ("sin", np.sin),
                           ("cos", np.cos), ("sqrt", np.sqrt), ("floor", np.floor), ("ceil", np.ceil)]:
        monkeypatch.setattr(InterpreterBuilder, f"create_{name}", flushing(function))
    monkeypatch.setattr(InterpreterBuilder, "create_fdiv", lambda self, a, b: TensorHandle(
        _flush(np.divide(_flush(a.data), _flush(b.data))), a.dtype.scalar))
    monkeypatch.setattr(InterpreterBuilder, "create_fneg", lambda self, a: TensorHandle(
        np.subtract(np.zeros_like(a.data), a.data), a.dtype.scalar))
