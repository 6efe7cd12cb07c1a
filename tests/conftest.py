"""Test setup: the Triton interpreter, a throwaway kernel cache, the IR verifier on.

TRITON_INTERPRET is read when `@triton.jit` decorates a function, so it is set here, before
anything imports triton or memfuse.
"""
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
_CACHE_DIR = tempfile.mkdtemp(prefix="memfuse-test-cache-")
os.environ["MEMFUSE_CACHE_DIR"] = _CACHE_DIR          # never write into ~/.cache
os.environ.setdefault("MEMFUSE_CHECK", "1")           # verify the IR after every stage

_ROOT = Path(__file__).resolve().parent.parent
for path in (_ROOT, _ROOT / "tests"):                 # benchmarks.workloads, tests/helpers.py
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import pytest  # noqa: E402
import torch  # noqa: E402

import memfuse  # noqa: E402


# torch's structured trace log (tlparse) emits DEBUG records that flood failure reports.
logging.getLogger("torch.__trace").setLevel(logging.INFO)


def pytest_report_header(config):
    return f"memfuse: {Path(memfuse.__file__).parent}, kernel cache: {_CACHE_DIR}, " \
           f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}"


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_state():
    """Every test starts from counters at zero and a fixed RNG state."""
    memfuse.reset_stats()
    torch.manual_seed(0)
    yield
