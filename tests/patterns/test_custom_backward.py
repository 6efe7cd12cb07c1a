"""A custom op's Python backward runs as one opaque call while memfuse traces
(memfuse.patterns.custom_backward): a mixture-of-experts block whose grouped matmul's backward
loops over `offs.tolist()` (transformers 5.17's grouped_mm_fallback) compiles whole, in both fronts,
with eager's gradients, and keeps no more than torch's min-cut partitioner does for the same graph.
A custom op takes a transposed weight as the view eager hands it (Reads.AS_TRACED), not a copy."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function
from torch._functorch.partitioners import min_cut_rematerialization_partition

import memfuse
from memfuse.patterns.custom_backward import opaque_backwards
from tests.helpers import compiled, rel_error

TOKENS, HIDDEN, FFN, EXPERTS, TOP_K = 8, 16, 24, 4, 2


@torch.library.custom_op("memfuse_tests::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows [offs[i-1], offs[i]) of x times w[i]: a loop over the groups' ends, read as numbers."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for i, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[i]
        start = end
    return out


@grouped_mm.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2])


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _backward(ctx, grad):
    """The same loop: no trace can follow it (a guard on each group's end)."""
    x, w = ctx.saved_tensors
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for i, end in enumerate(ctx.offs.tolist()):
        grad_x[start:end] = grad[start:end] @ w[i].T
        grad_w[i] = x[start:end].T @ grad[start:end]
        start = end
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def moe_block(hidden, router, gate_up, down):
    """A sparse mixture-of-experts block as HuggingFace's grouped path writes it: softmax routing,
    top-k, tokens sorted by expert, two grouped matmuls, the weighted outputs put back in order and
    summed over the k choices. The expert weights are stored [experts, out, in] and transposed for
    the call, as HuggingFace's are."""
    probs = torch.softmax(hidden @ router.T, dim=-1)
    weights, experts = torch.topk(probs, TOP_K, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    expert_ids, order = torch.sort(experts.reshape(-1))
    rows = hidden[order // TOP_K]
    counts = (expert_ids[:, None] == torch.arange(EXPERTS)).sum(0)
    offs = torch.cumsum(counts, dim=0)
    gate, up = grouped_mm(rows, gate_up.transpose(1, 2), offs).chunk(2, dim=-1)
    out = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs) * weights.reshape(-1)[order, None]
    restore = torch.empty_like(order)
    restore[order] = torch.arange(order.shape[0])
    return out[restore].view(-1, TOP_K, HIDDEN).sum(dim=1)


def _inputs(tokens=TOKENS):
    torch.manual_seed(0)
    return [torch.randn(tokens, HIDDEN, requires_grad=True),
            torch.randn(EXPERTS, HIDDEN, requires_grad=True),
            (torch.randn(EXPERTS, 2 * FFN, HIDDEN) / 4).requires_grad_(),
            (torch.randn(EXPERTS, HIDDEN, FFN) / 4).requires_grad_()]


def _run(fn, inputs):
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(torch.ones_like(out))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("front", ["function", "backend"])
def test_data_dependent_backward_compiles_with_eager_gradients(front):
    memfuse.reset_stats()
    fn = memfuse.memory_efficient_fusion(moe_block) if front == "function" else \
        torch.compile(moe_block, backend="memfuse", fullgraph=True, dynamic=True)
    for tokens in (TOKENS, TOKENS + 5):     # the second count runs the program traced at the first
        inputs = _inputs(tokens)
        out, grads = _run(fn, inputs)
        expected, expected_grads = _run(moe_block, inputs)
        assert rel_error(out, expected) < 1e-5
        for grad, want in zip(grads, expected_grads):
            assert rel_error(grad, want) < 1e-5
    assert memfuse.stats()["graph_fallbacks"] == 0, "the block ran through torch"


def _torch_min_cut_saved_bytes(fn, inputs) -> int:
    """Bytes torch's min-cut partitioner saves for `fn` beyond its inputs (the same joint graph:
    the custom op's backward opaque, as memfuse traces it; torch cannot trace the loop either)."""
    saved = []

    def forward_compiler(gm, _):
        placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        saved.extend(o for o in dict.fromkeys(outputs[1:]) if o not in placeholders
                     and isinstance(o.meta.get("val"), torch.Tensor))
        return gm

    compiled_fn = aot_function(fn, fw_compiler=forward_compiler, bw_compiler=lambda gm, _: gm,
                               partition_fn=functools.partial(min_cut_rematerialization_partition,
                                                              compiler="inductor"))
    with opaque_backwards():
        compiled_fn(*inputs)
    return sum(o.meta["val"].numel() * o.meta["val"].element_size() for o in saved)


def test_saves_no_more_than_torch_min_cut():
    inputs = _inputs()
    facts = compiled(moe_block, *inputs)
    assert any(target.startswith("memfuse.custom_op_backward") for target in facts.externs["backward"])
    assert facts.saved_bytes <= _torch_min_cut_saved_bytes(moe_block, inputs), facts.report


def test_custom_op_reads_transposed_weights_in_place():
    """The experts' weights, transposed for the custom op, reach it as aten views: no kernel of
    either program reads them (a kernel that did would copy a whole stack of expert weights)."""
    inputs = _inputs()
    facts = compiled(moe_block, *inputs)
    joint = facts.report.entry.captured.joint
    weights = set(joint.inputs[2:4])
    copies = [k.name for k in facts.report.kernels if k.is_kernel and weights & set(k.inputs)]
    assert not copies, facts.report
