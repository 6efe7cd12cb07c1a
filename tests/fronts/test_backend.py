"""torch.compile(model, backend="memfuse"): matches eager over dynamic batch sizes, dropout masks
regenerated from the seed, inference graphs, registration."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import memfuse


class Block(nn.Module):
    def __init__(self, width=32, p=0.0):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.proj = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        h = self.proj(F.gelu(self.fc(self.norm(x))))
        return x + self.drop(h)


def setup_function():
    torch._dynamo.reset()


def test_compile_matches_eager_with_dynamic_batch_sizes():
    torch.manual_seed(0)
    plain = Block()
    model = copy.deepcopy(plain)
    compiled = torch.compile(model, backend="memfuse", dynamic=True)
    memfuse.reset_stats()
    for batch in (2, 3, 5):
        plain.zero_grad()
        model.zero_grad()
        x = torch.randn(batch, 7, 32)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = plain(x1), compiled(x2)
        g = torch.randn_like(y1)
        y1.backward(g)
        y2.backward(g)
        torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-5)
        for (name, p1), p2 in zip(plain.named_parameters(), model.parameters()):
            torch.testing.assert_close(p2.grad, p1.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert memfuse.stats()["compiles"] == 1   # one graph for every batch size


def test_compile_dropout_mask_is_regenerated_in_backward():
    drop = nn.Dropout(0.5)
    compiled = torch.compile(lambda x: drop(x) * 2, backend="memfuse", dynamic=True)
    for rows in (8, 12):
        x = (torch.rand(rows, 16) + 1).requires_grad_()
        y = compiled(x)
        y.backward(torch.ones_like(y))
        assert 0.2 < (y == 0).float().mean() < 0.8
        torch.testing.assert_close(x.grad, y.detach() / x.detach())


def test_compile_inference_graph():
    torch.manual_seed(0)
    block = Block()
    compiled = torch.compile(block, backend="memfuse", dynamic=True)
    with torch.no_grad():
        for batch in (2, 4):
            x = torch.randn(batch, 3, 32)
            torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-5)


def test_compile_under_autocast():
    torch.manual_seed(0)
    plain = Block()
    compiled = torch.compile(copy.deepcopy(plain), backend="memfuse")
    x = torch.randn(4, 5, 32)
    memfuse.reset_stats()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = plain(x), compiled(x)
    assert memfuse.stats()["compiles"] == 1
    assert y1.dtype == y2.dtype
    torch.testing.assert_close(y2, y1, rtol=2e-2, atol=2e-2)
    assert (y2 - plain(x)).abs().max() > 1e-3   # computed in bf16, not silently in fp32


def test_backend_is_registered_and_registration_is_idempotent():
    memfuse.fronts.backend.register()
    memfuse.fronts.backend.register()
    assert "memfuse" in torch._dynamo.list_backends()


def test_backend_found_without_importing_memfuse():
    """Through the torch_dynamo_backends entry point (when installed) or registration on import."""
    code = ("from torch._dynamo.backends.registry import lookup_backend\n"
            "assert lookup_backend('memfuse').__module__ == 'memfuse.fronts.backend'\n")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    try:
        from importlib.metadata import entry_points
        installed = "memfuse" in entry_points(group="torch_dynamo_backends").names
    except Exception:
        installed = False
    if not installed:
        code = "import memfuse\n" + code
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_compile_across_a_graph_break():
    torch.manual_seed(0)
    first, second = nn.LayerNorm(32), nn.Sequential(nn.GELU(), nn.LayerNorm(32))

    def fn(x):
        h = first(x)
        torch._dynamo.graph_break()
        return second(h)

    compiled = torch.compile(fn, backend="memfuse", dynamic=True)
    memfuse.reset_stats()
    x = torch.randn(3, 4, 32)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1, y2 = fn(x1), compiled(x2)
    y1.sum().backward()
    y2.sum().backward()
    assert memfuse.stats()["compiles"] == 2   # one program per side of the break
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-4, atol=1e-5)


def test_fused_module_inside_compile_is_a_graph_break():
    torch.manual_seed(0)
    block = Block()
    fused = memfuse.memory_efficient_fusion(copy.deepcopy(block))
    compiled = torch.compile(lambda x: fused(x.sin()) * 2, backend="memfuse")
    x = torch.randn(3, 32)
    torch.testing.assert_close(compiled(x), block(x.sin()) * 2, rtol=1e-5, atol=1e-5)


def test_compile_reads_tensor_constants_outside_fake_mode():
    """`torch.tensor(...)` in the graph is a real tensor AOTAutograd lifts into the joint graph;
    memfuse reads a 0-d one as a scalar (`.item()`), which AOTAutograd's FakeTensorMode refuses:
    the pipeline runs with that mode unset."""
    def fn(x, w):
        return (x * w + torch.tensor(2) * torch.tensor(0.5)) * torch.tensor([1.0, -2.0, 3.0, 0.5])

    compiled = torch.compile(fn, backend="memfuse")
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, requires_grad=True)
    y = compiled(x, w)
    y.sum().backward()
    assert memfuse.stats()["compiles"] == 1
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    expected = fn(x2, w2)
    expected.sum().backward()
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close((x.grad, w.grad), (x2.grad, w2.grad))


def test_compile_counts_op_fallbacks_as_the_function_wrapper_does():
    def fn(x, w):
        return torch.relu(x @ w) * 2

    x, w = torch.randn(4, 8), torch.randn(8, 8, requires_grad=True)
    memfuse.memory_efficient_fusion(fn)(x, w).sum().backward()
    wrapper = memfuse.stats()["fallbacks"]
    memfuse.reset_stats()
    torch.compile(fn, backend="memfuse")(x, w).sum().backward()
    assert memfuse.stats()["fallbacks"] == wrapper > 0
