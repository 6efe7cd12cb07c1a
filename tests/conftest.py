"""Test setup: the Triton interpreter (without a GPU), a throwaway kernel cache, the IR verifier on.

TRITON_INTERPRET is read when `@triton.jit` decorates a function, so it is set here, before
anything imports triton or memfuse. On a machine with CUDA the kernels run for real.
"""
import logging
import os
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
for _switch in ("MEMFUSE_LOG", "MEMFUSE_DUMP_DIR", "MEMFUSE_STRICT"):
    os.environ.pop(_switch, None)                     # tests turn these on themselves

_ROOT = Path(__file__).resolve().parent.parent
for path in (_ROOT, _ROOT / "tests"):                 # benchmarks.workloads, tests/helpers.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402

import memfuse  # noqa: E402

# torch's structured trace log (tlparse) emits DEBUG records that flood failure reports.
logging.getLogger("torch.__trace").setLevel(logging.INFO)


def pytest_report_header(config):
    return f"memfuse: {Path(memfuse.__file__).parent}, kernel cache: {_CACHE_DIR}, " \
           f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}"


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts from counters at zero and a fixed RNG state."""
    memfuse.reset_stats()
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(config, items):
    """`gpu`-marked tests (pyproject.toml) need CUDA and real kernels, not the interpreter."""
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (and TRITON_INTERPRET unset)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
