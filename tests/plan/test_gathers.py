"""An aten gather whose result outweighs what it reads (tokens gathered once per expert they are
routed to) is not pinned: the plan keeps its source and indices and gathers again in the backward
(memfuse.plan.expanding_gather), where torch's min-cut keeps the gathered rows."""
import torch

from helpers import compiled, rel_error
from memfuse import memory_efficient_fusion
from tests.plan.test_plan import torch_saved_bytes

TOKENS, HIDDEN, OUT, TOP_K = 8, 32, 16, 2


def routed(hidden, weight, rows):
    """Each token's hidden state gathered TOP_K times (by an integer index, as a router's sort
    gives it) into one matmul."""
    return torch.tanh(hidden[rows] @ weight)


def _inputs():
    torch.manual_seed(0)
    rows = torch.arange(TOKENS * TOP_K).flip(0) // TOP_K
    return torch.randn(TOKENS, HIDDEN, requires_grad=True), torch.randn(HIDDEN, OUT, requires_grad=True), rows


def test_expanding_gather_is_gathered_again_not_saved():
    hidden, weight, rows = _inputs()
    facts = compiled(routed, hidden, weight, rows)
    gathered = [s for s in facts.saved_computed if tuple(s.shape) == (TOKENS * TOP_K, HIDDEN)]
    assert not gathered, facts.report
    assert any("a gather larger than what it reads" in d.reason for d in facts.report.decisions), facts.report
    assert facts.saved_bytes < torch_saved_bytes(routed, [hidden, weight, rows]), facts.report


def test_expanding_gather_gradients_match_eager():
    hidden, weight, rows = _inputs()
    grad = torch.randn(TOKENS * TOP_K, OUT)
    leaves = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
    memory_efficient_fusion(routed)(*leaves, rows).backward(grad)
    expected = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
    routed(*expected, rows).backward(grad)
    for got, want in zip(leaves, expected):
        assert rel_error(got.grad, want.grad) < 1e-5
