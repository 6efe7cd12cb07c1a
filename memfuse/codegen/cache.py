"""Content-addressed kernel files: Triton reads source through `inspect`, so each generated
kernel lives in a real `.py` file named by the hash of its text, written once and imported."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

_modules: dict = {}


def kernel_path(cache_dir: Path, name: str, source: str) -> Path:
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    return Path(cache_dir) / "kernels" / f"{name}_{digest}.py"


def load_kernel(cache_dir: Path, name: str, source: str):
    """The @triton.jit function `name` defined by `source`, imported from its cache file."""
    path = kernel_path(cache_dir, name, source)
    key = str(path)
    if key in _modules:
        return getattr(_modules[key], name)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        os.replace(tmp, path)     # atomic: concurrent processes never see a half-written file
    module_name = f"memfuse_kernels.{path.stem}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    _modules[key] = module
    return getattr(module, name)
