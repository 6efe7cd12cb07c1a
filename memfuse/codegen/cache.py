"""Content-addressed kernel files: Triton reads source through `inspect`, so each generated
kernel lives in a real `.py` file named by the hash of its text, written once and imported.

Kernels of one structure (the same code up to the names of their values: each layer of a model
has its own copy of the layer's kernels) are told apart from different ones by `structure`."""
from __future__ import annotations

import ast
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


def structure(source: str, name: str) -> str:
    """The module `source` with its kernel `name` renamed `kernel` and the kernel's own names (its
    parameters and the locals it assigns) renamed v0, v1, ... in order of first appearance, comments
    dropped. Two kernels with the same structure compute the same function of their positional
    arguments: only local names differ, and renaming locals changes no meaning. Everything else
    stays as written: literals (a dropout site's seed offset, a scale), attributes (`tl.load`),
    keyword names (`mask=`), the helpers and globals, the names `do_not_specialize` lists (mapped
    with the parameters they name)."""
    tree = ast.parse(source)
    kernel = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)
    parameters = [a.arg for a in kernel.args.args]
    assigned = [node.id for node in ast.walk(kernel) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)]
    renamed = {old: f"v{i}" for i, old in enumerate(dict.fromkeys(parameters + assigned))}
    kernel.name = "kernel"
    for a in kernel.args.args:
        a.arg = renamed[a.arg]
    for node in ast.walk(kernel):
        if isinstance(node, ast.Name) and node.id in renamed:
            node.id = renamed[node.id]
    for decorator in kernel.decorator_list:
        for node in ast.walk(decorator):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in renamed:
                node.value = renamed[node.value]
    return ast.unparse(tree)
