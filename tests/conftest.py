"""Test setup: kernels run through Triton's interpreter on CPU, into a throwaway cache.

The `gpu` marker (registered in pyproject.toml) skips a test when CUDA is absent or the
interpreter is on; on a GPU machine run those with `TRITON_INTERPRET=0 pytest -m gpu tests`.
"""
import os
import tempfile

os.environ.setdefault("TRITON_INTERPRET", "1")          # read when @triton.jit decorates: before imports
os.environ.setdefault("MEMFUSE_CACHE_DIR", tempfile.mkdtemp(prefix="memfuse-tests-"))
os.environ.setdefault("MEMFUSE_CHECK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped on CPU machines)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (and TRITON_INTERPRET unset)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
