"""memory_efficient_fusion(module, in_place=True): the module itself, its calls fused (its
`_compiled_call_impl`, as nn.Module.compile sets it): its class, state_dict keys and submodules
unchanged, outputs and gradients as eager's, its hooks traced with its forward (no call back
into the fused call while tracing); a copy is the plain module, as after nn.Module.compile."""
import copy
import pickle

import pytest
import torch
from torch import nn

import memfuse


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x, scale: float = 1.0):
        return torch.nn.functional.gelu(self.fc(self.norm(x))) * scale


def test_a_module_fused_in_place_matches_eager_and_keeps_its_class():
    torch.manual_seed(0)
    eager = Block()
    eager.register_forward_hook(lambda _module, _args, out: out * 3.0)
    module = copy.deepcopy(eager)
    keys = list(module.state_dict())
    before = memfuse.stats()
    assert memfuse.memory_efficient_fusion(module, in_place=True) is module
    assert type(module) is Block and list(module.state_dict()) == keys
    assert [name for name, _ in module.named_modules()] == ["", "norm", "fc"]
    x = torch.randn(4, 16)
    out = module(x, scale=2.0)
    out.sum().backward()
    expected = eager(x, scale=2.0)
    expected.sum().backward()
    after = memfuse.stats()
    assert after["compiles"] > before["compiles"] and after["eager_calls"] == before["eager_calls"]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(module.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(module(x, scale=2.0), expected)
    assert memfuse.stats()["compiles"] == after["compiles"]          # the second call: the cached program


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))])
def test_a_copy_is_the_plain_module(duplicate):
    """As after nn.Module.compile: nn.Module's __getstate__ leaves `_compiled_call_impl` out, so a
    copy runs its own forward through torch; the original stays fused."""
    module = memfuse.memory_efficient_fusion(Block(), in_place=True)
    x = torch.randn(4, 16)
    module(x)
    twin = duplicate(module)
    assert twin._compiled_call_impl is None and isinstance(module._compiled_call_impl, memfuse.FusedModule)
    torch.testing.assert_close(twin(x), module(x), rtol=1e-5, atol=1e-6)


def test_in_place_needs_a_module():
    with pytest.raises(TypeError, match="in_place"):
        memfuse.memory_efficient_fusion(lambda x: x * 2, in_place=True)
