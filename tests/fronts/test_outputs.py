"""Outputs that hold objects (memfuse.fronts.outputs): a KV cache-like record of tensors, rebuilt
as a new object per call, its shared parts shared, its symbolic sizes read per call; objects
memfuse cannot see into still run the call through torch with the reason."""
import pytest
import torch

import memfuse
from memfuse.driver.fallback import StrictModeError


class Layer:
    """Stands for a cache layer: tensors and plain attributes, made by the call."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values
        self.is_initialized = True
        self.device = keys.device


class Cache:
    """Stands for a KV cache: a list of layers, a dict with int keys, a length counter."""

    def __init__(self, layers, length):
        self.layers = layers
        self.is_updated = {0: True, 1: False}
        self.length = length          # a size: symbolic while memfuse traces
        self.owner = self             # an attribute leading back to the object


def attend(x, w):
    k, v = x @ w, (x * 2).tanh()
    out = k.softmax(-1) * v
    return {"out": out, "cache": Cache([Layer(k, v), Layer(k, out)], x.shape[0]), "n": 2}


def test_an_output_holding_objects_with_tensors_compiles_and_is_rebuilt_per_call():
    x, w = torch.randn(6, 8, requires_grad=True), torch.nn.Parameter(torch.randn(8, 8))
    fused = memfuse.memory_efficient_fusion(attend)
    got, want = fused(x, w), attend(x, w)
    assert memfuse.stats()["compiles"] == 1 and memfuse.stats()["eager_calls"] == 0
    cache, expected = got["cache"], want["cache"]
    assert type(cache) is Cache and [type(layer) for layer in cache.layers] == [Layer, Layer]
    assert cache.owner is cache and cache.is_updated == {0: True, 1: False} and got["n"] == 2
    assert cache.layers[0].keys is cache.layers[1].keys      # one tensor returned twice stays one
    assert cache.layers[0].device == x.device and cache.layers[0].is_initialized
    for layer, eager in zip(cache.layers, expected.layers):
        torch.testing.assert_close(layer.keys, eager.keys)
        torch.testing.assert_close(layer.values, eager.values)
    torch.testing.assert_close(got["out"], want["out"])
    (got["out"].sum() + cache.layers[0].keys.square().sum()).backward()
    gx, gw = x.grad, w.grad
    x.grad = w.grad = None
    (want["out"].sum() + expected.layers[0].keys.square().sum()).backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    # the next call (another batch size, the same program) gets a new object, its length read per call
    again = fused(torch.randn(10, 8, requires_grad=True), w)["cache"]
    assert again is not cache and again.layers[0] is not cache.layers[0] and again.owner is again
    assert again.length == 10 and cache.length == 6 and type(again.length) is int
    assert memfuse.stats()["compiles"] == 1


class Slots:
    __slots__ = ("t",)

    def __init__(self, t):
        self.t = t


@pytest.mark.compile_fails
def test_an_object_memfuse_cannot_see_into_runs_the_call_through_torch(caplog):
    fused = memfuse.memory_efficient_fusion(lambda x: {"y": x * 2, "slots": Slots(x + 1)})
    out = fused(torch.randn(4, 8))
    assert isinstance(out["slots"], Slots) and memfuse.stats()["eager_calls"] == 1
    assert "returns a Slots at output['slots']" in caplog.text
    with pytest.raises(StrictModeError, match="returns a Slots"):
        memfuse.memory_efficient_fusion(lambda x: (x * 2, Slots(x)), config=memfuse.Config(strict=True))(
            torch.randn(4, 8))
