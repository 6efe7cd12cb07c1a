"""A wrapper shows the wrapped forward's signature (`inspect.signature`), as clients that read it
expect (HuggingFace Trainer keeps only the dataset columns the forward names), and stays a module:
deepcopy, pickle, hooks and the graph break under torch.compile keep working."""
import copy
import inspect
import io
import pickle

import torch
from torch import nn

import memfuse


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, input_ids, labels=None, *, scale=1.0):
        """Projected inputs, scaled."""
        return self.proj(input_ids) * scale


def test_module_wrapper_shows_the_forward_signature():
    plain = Head()
    fused = memfuse.memory_efficient_fusion(plain)
    assert inspect.signature(fused.forward) == inspect.signature(plain.forward)
    assert list(inspect.signature(fused.forward).parameters) == ["input_ids", "labels", "scale"]
    assert fused.forward.__doc__ == plain.forward.__doc__
    x = torch.randn(4, 8)
    torch.testing.assert_close(fused.forward(x, scale=2.0), plain(x, scale=2.0))


def test_function_wrapper_shows_the_function_signature():
    def step(x, weight, *, eps=1e-5):
        return x * weight + eps

    assert inspect.signature(memfuse.memory_efficient_fusion(step)) == inspect.signature(step)


def test_deepcopy_and_pickle_bind_the_copy():
    fused = memfuse.memory_efficient_fusion(Head())
    x = torch.randn(4, 8)
    fused(x)
    assert "forward" in fused.__dict__          # bound on first read, kept on the instance
    clone = copy.deepcopy(fused)
    assert clone.forward.__self__ is clone
    assert clone.proj.weight is not fused.proj.weight
    with torch.no_grad():
        clone.proj.weight.zero_()
    torch.testing.assert_close(clone(x), clone.original(x))
    loaded = pickle.loads(pickle.dumps(fused))
    assert loaded.forward.__self__ is loaded
    assert inspect.signature(loaded.forward) == inspect.signature(Head.forward.__get__(Head()))
    buffer = io.BytesIO()
    torch.save(fused.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer).keys() == Head().state_dict().keys()


def test_hooks_fire_and_an_assigned_forward_wins():
    fused = memfuse.memory_efficient_fusion(Head())
    seen = []
    fused.register_forward_pre_hook(lambda module, args: seen.append("pre"))
    fused.register_forward_hook(lambda module, args, out: seen.append("post"))
    x = torch.randn(4, 8)
    fused(x)
    assert seen == ["pre", "post"]
    inner = fused.forward
    fused.forward = lambda *args, **kwargs: inner(*args, **kwargs) + 1   # as accelerate's autocast wraps it
    torch.testing.assert_close(fused(x), fused.original(x) + 1)


def test_wrapper_inside_torch_compile_stays_a_graph_break():
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    fused = memfuse.memory_efficient_fusion(Head())
    compiled = torch.compile(lambda x: fused(x.sin()) * 2, backend=counting_backend)
    x = torch.randn(3, 8)
    torch.testing.assert_close(compiled(x), fused.original(x.sin()) * 2)
    assert len(graphs) == 2              # the code before the wrapper and after it; memfuse runs it
    assert memfuse.stats()["compiles"] == 1


def test_the_wrapper_class_shows_the_wrapped_class_forward():
    """Trainer reads the class (`find_labels(type(model))`, `can_return_loss`): the wrapper's
    class is made per wrapped class, named after it, its forward with that class's signature."""
    fused = memfuse.memory_efficient_fusion(Head())
    assert isinstance(fused, memfuse.FusedModule)
    assert type(fused).__name__ == "FusedHead"
    assert inspect.signature(type(fused).forward) == inspect.signature(Head.forward)
    assert type(memfuse.memory_efficient_fusion(Head())) is type(fused)
    assert type(copy.deepcopy(fused)) is type(fused)
    assert type(pickle.loads(pickle.dumps(fused))) is type(fused)


def test_a_class_made_from_the_wrapper_class_survives_deepcopy():
    """FSDP2's fully_shard swaps a module's class for one made from it: a copy keeps that class."""
    fused = memfuse.memory_efficient_fusion(Head())
    fused.__class__ = type("ShardedFusedHead", (type(fused),), {})
    clone = copy.deepcopy(fused)
    assert type(clone) is type(fused)
    assert inspect.signature(clone.forward) == inspect.signature(fused.forward)
