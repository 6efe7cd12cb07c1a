"""Copies nobody asked for: an aten result a kernel reads through its strides is not made
contiguous first (attention's gradients), and a scatter into a fresh fill writes in place instead
of into a clone of it (an embedding's backward, the cross-entropy one-hot; memfuse.schedule.reinplace).
Counted with a dispatch mode around the fused calls; results against eager."""
from collections import Counter

import sympy
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import memfuse
from memfuse.reports.explain import build_report
from memfuse.ir.graph import Constant, Extern, Graph, Kind, Node, Op, Reshape, Value, ValueRef, format_graph
from memfuse.schedule.reinplace import reinplace

aten = torch.ops.aten


class Dispatched(TorchDispatchMode):
    """Counts the aten ops called (at the top level: a program's own calls, not their insides)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def attention(x, w):
    """q, k, v as transposed views: attention's gradients come back in [B, S, H, D] memory."""
    qkv = (x @ w).view(x.shape[0], x.shape[1], 3, 2, 8)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return out.transpose(1, 2).reshape(x.shape[0], x.shape[1], 16) * 2


def test_attention_gradients_are_read_where_they_lie():
    torch.manual_seed(0)
    x, w = torch.randn(2, 5, 16, requires_grad=True), torch.randn(16, 48, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(attention)
    out = fused(x, w)
    grad = torch.randn_like(out)
    with Dispatched() as seen:
        out.backward(grad)
    assert seen.ops[aten.clone.default] == 0     # no .contiguous() copy of the gradients
    got = [x.grad, w.grad]
    x.grad = w.grad = None
    attention(x, w).backward(grad)
    for a, b in zip(got, [x.grad, w.grad]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    backward = fused.compiled_for(x, w).function.backward
    assert ".stride(-1) == 1 else" in backward.source


class Tagger(nn.Module):
    """An embedding (its backward: aten's embedding_dense_backward) and a cross-entropy (its
    backward: the one-hot, a compare of the targets or a scatter of them into a fill)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.out = nn.Linear(8, 11)

    def forward(self, ids):
        logits = self.out(self.embed(ids))
        return F.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1))


def test_embedding_backward_adds_into_a_fill_and_no_scatter_copies_a_fill():
    """The embedding's backward runs as one zero fill and one index_add_ (memfuse.runtime.externs; aten's
    embedding_dense_backward sorts the indices: about 20 CUDA launches; decomposed, it would be an
    index_put with accumulate, CUDA's sort-based kernel, slow on repeated indices); where the
    one-hot is still a scatter, it writes into its fill in place."""
    torch.manual_seed(0)
    eager = Tagger()
    fused = memfuse.memory_efficient_fusion(Tagger())
    fused.load_state_dict(eager.state_dict())
    ids = torch.randint(0, 11, (3, 4))
    fused(ids)                          # compiled here: tracing dispatches the ops it records
    with Dispatched() as seen:
        loss = fused(ids)
        loss.backward()
    assert seen.ops[aten.embedding_dense_backward.default] == 0
    assert seen.ops[aten.index_add_.default] == 1
    assert seen.ops[aten.index_put_.default] == seen.ops[aten.index_put.default] == 0
    assert seen.ops[aten.scatter.value] == seen.ops[aten.scatter.src] == 0
    eager(ids).backward()
    torch.testing.assert_close(loss, eager(ids))
    for p, q in zip(fused.original.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def _embedding_sum(table, ids, weights):
    return (F.embedding(ids, table, padding_idx=2) * weights).sum()


def test_embedding_backward_by_index_add_is_atens_gradient_padding_row_included():
    """Repeated indices, the padding index among them: the padding row's gradient stays 0."""
    torch.manual_seed(0)
    table = torch.randn(7, 5, requires_grad=True)
    ids = torch.tensor([[2, 3, 3, 0], [2, 2, 6, 3]])
    weights = torch.randn(2, 4, 5)
    memfuse.memory_efficient_fusion(_embedding_sum)(table, ids, weights).backward()
    fused_grad, table.grad = table.grad, None
    _embedding_sum(table, ids, weights).backward()
    assert torch.equal(fused_grad[2], torch.zeros(5))
    torch.testing.assert_close(fused_grad, table.grad, rtol=1e-6, atol=1e-6)


def test_embedding_backward_is_atens_own_under_deterministic_algorithms():
    """Atomic adds change the order of the sums from run to run: a user who asked for deterministic
    algorithms gets aten's kernel (and its exact gradient)."""
    torch.manual_seed(0)
    table = torch.randn(7, 5, requires_grad=True)
    ids = torch.tensor([[2, 3, 3, 0], [2, 2, 6, 3]])
    weights = torch.randn(2, 4, 5)
    fused = memfuse.memory_efficient_fusion(_embedding_sum)
    fused(table, ids, weights)          # compiled here: tracing dispatches the ops it records
    try:
        torch.use_deterministic_algorithms(True)
        with Dispatched() as seen:
            fused(table, ids, weights).backward()
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen.ops[aten.embedding_dense_backward.default] == 1 and seen.ops[aten.index_add_.default] == 0
    fused_grad, table.grad = table.grad, None
    _embedding_sum(table, ids, weights).backward()
    assert torch.equal(fused_grad, table.grad)


def test_a_scatter_into_an_input_leaves_the_input_alone():
    def scatter_into(base, index, values):
        return base.index_put((index,), values, accumulate=True) * 2
    base, index, values = torch.randn(6, 4), torch.tensor([0, 2, 2]), torch.randn(3, 4)
    before = base.clone()
    out = memfuse.memory_efficient_fusion(scatter_into)(base, index, values)
    torch.testing.assert_close(out, scatter_into(before, index, values))
    assert torch.equal(base, before)


def _scatter_graph(base_op: str, base_is_output=False, base_read_again=False) -> Graph:
    """base -> index_put(base, [index], values, True), with the base a fill or an input."""
    shape, m = (sympy.Integer(6), sympy.Integer(4)), sympy.Integer(6)
    full = Value(torch.float32, Kind.FULL, shape, m=m, d=4)
    g = Graph()
    for name, value in (("index", Value(torch.int64, Kind.ROW, (sympy.Integer(3),), m=sympy.Integer(3))),
                        ("values", Value(torch.float32, Kind.FULL, (sympy.Integer(3), 4), m=sympy.Integer(3), d=4))):
        g.add(Node(name, Op.INPUT, (), value))
        g.inputs.append(name)
    if base_op == "fill":
        g.add(Node("zero", Op.CONSTANT, (), Value(torch.float32, Kind.SCALAR), Constant(0.0)))
        g.add(Node("base", Op.VIEW, ("zero",), full))
    else:
        g.add(Node("base", Op.INPUT, (), full))
        g.inputs.append("base")
    g.add(Node("put", Op.EXTERN, ("base", "index", "values"), full,
               Extern(aten.index_put.default, (ValueRef("base"), [ValueRef("index")], ValueRef("values"), True), ())))
    outputs = ["put"] + (["base"] if base_is_output else [])
    if base_read_again:
        g.add(Node("twice", Op.ADD, ("base", "put"), full))
        outputs.append("twice")
    g.outputs = outputs
    return g


def test_reinplace_rules():
    graph, records = reinplace(_scatter_graph("fill"))
    assert graph["put"].attr.target is aten.index_put_.default
    assert [r.base for r in records] == ["base"] and "constant written by a kernel" in records[0].reason
    for unsafe in (_scatter_graph("input"), _scatter_graph("fill", base_is_output=True),
                   _scatter_graph("fill", base_read_again=True)):
        graph, records = reinplace(unsafe)
        assert graph is unsafe and records == []
        assert graph["put"].attr.target is aten.index_put.default


def _joint(fn, *args):
    return memfuse.memory_efficient_fusion(fn).compiled_for(*args).captured.joint


def _reading(joint: Graph, op: Op, source: str) -> list:
    return [n for n in joint.nodes.values() if n.op is op and n.inputs[:1] == (source,)]


def three_projections(x, wq, wk, wv):
    """As autocast runs q, k and v projections: each linear casts the same input to bf16."""
    h = x * 2
    return tuple(h.to(torch.bfloat16) @ w.to(torch.bfloat16) for w in (wq, wk, wv))


def test_a_value_cast_for_three_matmuls_is_cast_once():
    x = torch.randn(6, 8, requires_grad=True)
    weights = [torch.randn(8, 4, requires_grad=True) for _ in range(3)]
    joint = _joint(three_projections, x, *weights)
    doubled = next(n.name for n in joint.nodes.values() if n.op is Op.MUL and x.shape[1] == n.value.d)
    assert len(_reading(joint, Op.CAST, doubled)) == 1, format_graph(joint)
    report = build_report(memfuse.memory_efficient_fusion(three_projections).compiled_for(x, *weights), "qkv")
    cast, = _reading(joint, Op.CAST, doubled)
    assert list(report.merged.values()).count(cast.name) == 2 and "merged" in str(report)
    fused = memfuse.memory_efficient_fusion(three_projections)
    outs, expected = fused(x, *weights), three_projections(x, *weights)
    for out, ref in zip(outs, expected):
        assert torch.equal(out, ref)
    grads = torch.autograd.grad(sum(o.float().sum() for o in outs), [x, *weights])
    for grad, ref in zip(grads, torch.autograd.grad(sum(o.float().sum() for o in expected), [x, *weights])):
        assert torch.allclose(grad, ref, rtol=1e-2, atol=1e-2)


def two_attention_layers(x, keep):
    """Each layer builds the additive mask from the same boolean one for its attention call."""
    q = x.unsqueeze(1)
    for _ in range(2):
        q = F.scaled_dot_product_attention(q, q, q, attn_mask=torch.where(keep, 0.0, -1e4)) * 2
    return q


def test_a_mask_each_layer_builds_is_built_once():
    x, keep = torch.randn(2, 6, 8, requires_grad=True), torch.rand(6, 6) > 0.3
    joint = _joint(two_attention_layers, x, keep)
    assert len([n for n in joint.nodes.values() if n.op is Op.WHERE]) == 1, format_graph(joint)
    fused = memfuse.memory_efficient_fusion(two_attention_layers)
    out, ref = fused(x, keep), two_attention_layers(x, keep)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    grad, = torch.autograd.grad(out.sum(), [x])
    expected, = torch.autograd.grad(ref.sum(), [x])
    assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-5)


def test_a_value_recomputed_beside_its_derivative_is_not_merged():
    """GELU's backward recomputes tanh(...) next to the derivative that reads it, in registers:
    merged with the forward's tanh it would be a value one kernel writes for another."""
    def layer(x, w):
        return F.gelu(x @ w, approximate="tanh")

    joint = _joint(layer, torch.randn(4, 8, requires_grad=True), torch.randn(8, 8, requires_grad=True))
    assert len([n for n in joint.nodes.values() if n.op is Op.TANH]) == 2, format_graph(joint)


def attention_probabilities(scores, v):
    """BERT's attention as matmuls: the probabilities [B, H, S, S] go to bmm as [B x H, S, S]."""
    probs = torch.softmax(scores, dim=-1)
    batch, heads, seq, _ = probs.shape
    out = torch.bmm(probs.reshape(batch * heads, seq, seq), v.reshape(batch * heads, seq, -1))
    return out.view(batch, heads, seq, -1) * 2


def test_a_saved_value_reshaped_for_aten_is_an_alias_not_a_copy():
    """The backward reads the saved probabilities as a bmm operand: a reshape of a tensor in
    memory that only aten reads is the runtime's `.reshape` (an alias), not a kernel copying it."""
    scores = torch.randn(2, 3, 5, 5, requires_grad=True)
    v = torch.randn(2, 3, 5, 4, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(attention_probabilities)
    out, ref = fused(scores, v), attention_probabilities(scores, v)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    for grad, expected in zip(torch.autograd.grad((out * out).sum(), [scores, v]),
                              torch.autograd.grad((ref * ref).sum(), [scores, v])):
        assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-5)
    backward = fused.compiled_for(scores, v).function.backward.schedule
    graph = backward.graph
    copies = [o for k in backward.kernels for o in k.outputs
              if graph[o].op is Op.VIEW and graph[graph[o].inputs[0]].op is Op.INPUT]
    assert not copies, [(k.name, k.nodes) for k in backward.kernels]
    reshaped = [n for n, node in graph.nodes.items() if isinstance(node.attr, Reshape)]
    assert reshaped and {n for n, _ in backward.placed} >= set(reshaped)     # explain says why
