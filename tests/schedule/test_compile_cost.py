"""Compile cost that grows with the graph: checks that count the expensive calls (never the wall
time) the scheduler makes per node, so a big model's compile stays in seconds."""
import pytest
import sympy
import torch

from memfuse.ir.graph import Graph, Kind, Node, Op, Value
from memfuse.schedule import reads

S = sympy.Symbol("s0", positive=True, integer=True)


def _view_of(source_shape: tuple, view_shape: tuple) -> tuple:
    graph = Graph()
    graph.add(Node("x", Op.INPUT, (), Value(torch.float32, Kind.TENSOR, source_shape)))
    graph.add(Node("v", Op.VIEW, ("x",), Value(torch.float32, Kind.TENSOR, view_shape)))
    return graph, graph["v"]


def _no_simplify(*args, **kwargs):
    raise AssertionError("sympy.simplify called")


@pytest.mark.parametrize("source, view, expected", [
    ((4, 6), (24,), True),          # static sizes: integers compared
    ((4, 6), (25,), False),
    ((S, 4, 6), (S, 24), True),     # the same symbols, static rest: products equal in form
    ((2 * S, 3), (S, 6), True),
])
def test_same_size_needs_no_simplify_where_the_products_match_in_form(monkeypatch, source, view, expected):
    monkeypatch.setattr(reads.sympy, "simplify", _no_simplify)
    assert reads.same_size(*_view_of(source, view)) is expected


def test_same_size_still_decides_products_that_differ_in_form():
    assert reads.same_size(*_view_of((S + 1, S - 1), (S * S - 1,)))
    assert not reads.same_size(*_view_of((S + 1, S), (S * S,)))
