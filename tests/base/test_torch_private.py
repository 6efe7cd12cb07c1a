"""memfuse.base.torch_private: each private torch internal memfuse uses for host speed exists, is
callable and behaves as memfuse assumes on a small tensor. A failure here means torch changed under
memfuse: fix the entry (or take its public fallback) before anything else."""
import threading

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from memfuse.base import torch_private


def test_every_entry_is_torchs_own():
    """On the checked torch versions no entry is a fallback: each is torch's private function."""
    assert torch_private.empty_strided("cpu") is torch._C._dynamo.guards._empty_strided_cpu
    assert torch_private.reinterpret_tensor is torch._C._dynamo.guards._reinterpret_tensor
    assert torch_private.saved_tensors_hooks is torch._C._autograd._top_saved_tensors_default_hooks
    assert torch_private.any_autocast_enabled is torch._C._is_any_autocast_enabled
    assert torch_private.is_functorch_wrapped_tensor is torch._C._functorch.is_functorch_wrapped_tensor
    assert torch_private.TensorGuards is torch._C._dynamo.guards.TensorGuards
    assert torch_private.raw_stream is getattr(torch._C, "_cuda_getCurrentRawStream", None)
    assert torch_private.storage_use_count is torch._C._storage_Use_Count
    assert hasattr(torch.compiler, "_is_compiling_flag")
    for entry in (torch_private.functorch_transforms_active, torch_private.unwrap_if_dead,
                  torch_private.storage_use_count, torch_private.reinterpret_tensor):
        assert callable(entry)


def test_empty_strided_allocates_the_asked_layout():
    assert torch_private.empty_strided("meta") is None     # only cpu and cuda have one
    t = torch_private.empty_strided("cpu")((2, 3, 4), (1, 2, 6), torch.bfloat16)
    assert (t.shape, t.stride(), t.dtype, t.device.type) == ((2, 3, 4), (1, 2, 6), torch.bfloat16, "cpu")


@pytest.mark.parametrize("make", [torch_private.reinterpret_tensor, torch_private.as_strided_at])
def test_reinterpret_tensor_views_the_same_memory(make):
    """The asked sizes, strides and offset (added to the tensor's own), over the same storage; and
    no view for autograd to track where torch's own is used."""
    base = torch.arange(24.0)
    source = base[4:]                                   # storage offset 4
    made = make(source, (2, 3), (1, 2), 5)
    assert (made.shape, made.stride(), made.storage_offset()) == ((2, 3), (1, 2), 9)
    assert made.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert torch.equal(made, base.as_strided((2, 3), (1, 2), 9))
    if make is torch_private.reinterpret_tensor:
        assert not made._is_view()


def test_saved_tensors_hooks_getter():
    assert torch_private.saved_tensors_hooks(False) is None

    def pack(t):
        return t

    def unpack(t):
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        hooks = torch_private.saved_tensors_hooks(False)
        assert hooks is not None and tuple(hooks) == (pack, unpack)
    assert torch_private.saved_tensors_hooks(False) is None


def test_function_apply_c_and_direct_backward():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2
    apply = torch_private.function_apply_c(Double)
    assert apply.__self__ is Double and type(apply).__name__ == "builtin_function_or_method"   # C, not Python
    torch_private.call_backward_directly(Double)
    x = torch.ones(3, requires_grad=True)
    y = apply(x)
    assert torch.equal(y, torch.full((3,), 2.0))
    assert type(y.grad_fn).apply is Double.backward
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_functorch_entries():
    x = torch.ones(3)
    assert torch_private.functorch_transforms_active() is False
    assert torch_private.is_functorch_wrapped_tensor(x) is False
    assert torch_private.unwrap_if_dead(x) is x
    seen = []

    def probe(t):
        seen.append((torch_private.functorch_transforms_active(), torch_private.is_functorch_wrapped_tensor(t)))
        return t * 2
    torch.func.vmap(probe)(torch.ones(2, 3))
    assert seen == [(True, True)]


def test_any_autocast_enabled():
    assert torch_private.any_autocast_enabled() is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch_private.any_autocast_enabled() is True
    assert torch_private.any_autocast_enabled() is False


def test_tensor_guards_check_dtype_and_sizes():
    x, y = torch.ones(2, 3), torch.zeros(4)
    guards = torch_private.TensorGuards(x, y, dynamic_dims_sizes=[list(x.shape), list(y.shape)],
                                        dynamic_dims_strides=[list(x.stride()), list(y.stride())])
    assert guards.check(torch.randn(2, 3), torch.randn(4))
    assert not guards.check(torch.randn(2, 4), torch.randn(4))
    assert not guards.check(torch.randn(2, 3, dtype=torch.float64), torch.randn(4))
    assert not guards.check(torch.randn(3, 2).t(), torch.randn(4))


def test_storage_use_count_counts_holders():
    t = torch.ones(4)
    ref = StorageWeakRef(t.untyped_storage())
    alone = torch_private.storage_use_count(ref.cdata)
    view = t[1:]
    assert torch_private.storage_use_count(ref.cdata) == alone + 1
    del view
    assert torch_private.storage_use_count(ref.cdata) == alone


def test_compiling_flag():
    assert not torch.compiler.is_compiling()
    with torch_private.compiling_flag():
        assert torch.compiler.is_compiling()
    assert not torch.compiler.is_compiling()


@torch.jit.script
def says_where_it_runs(x):
    if torch.jit.is_scripting():
        return x + 1
    return x - 1


def test_scripted_functions_as_python():
    """In the block a TorchScript function runs its Python original (`_torchdynamo_inline`, kept by
    torch.jit.script); outside it, and after it, the interpreter runs it."""
    x = torch.zeros(2)
    interpreted = torch.jit.ScriptFunction.__dict__["__call__"]
    assert torch.equal(says_where_it_runs(x), x + 1)
    with torch_private.scripted_functions_as_python():
        assert torch.equal(says_where_it_runs(x), x - 1)
        with torch_private.scripted_functions_as_python():
            assert torch.equal(says_where_it_runs(x), x - 1)
        assert torch.equal(says_where_it_runs(x), x - 1)
        elsewhere = []        # another thread, in no block: the interpreter
        thread = threading.Thread(target=lambda: elsewhere.append(says_where_it_runs(x)))
        thread.start()
        thread.join()
        assert torch.equal(elsewhere[0], x + 1)
    assert torch.equal(says_where_it_runs(x), x + 1)
    assert torch.jit.ScriptFunction.__dict__["__call__"] is interpreted
