"""Rewrites of the traced aten graph before it is lowered: values nothing reads dropped, a
permute of a permute composed."""
from __future__ import annotations

import operator

import torch

from memfuse.capture.tables import NOOP_ATEN


def without_unused(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` without the values nothing reads (a pattern's swap, memfuse.patterns, leaves what it
    replaced in the trace). Random draws stay (they advance the generator as in eager), and so
    do checks, but for NOOP_ATEN's checks of a value that only they read (the trace made them)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        checks_the_unused = node.target in NOOP_ATEN and all(
            set(i.users) == {node} for i in node.all_input_nodes)
        if checks_the_unused or (not node.is_impure() and _pure(node.target)):
            gm.graph.erase_node(node)
    return gm


def composed_permutes(gm: torch.fx.GraphModule) -> bool:
    """A permute of a permute becomes one permute of the first one's input, or that input itself
    where the two undo each other: the joint graph transposes a linear's weight for the forward
    and that transpose back for the input's gradient (a call on the host each), and returns the
    weight's gradient as a transpose of a transposed matmul (a copy kernel, where the matmul's
    output has the weight's layout already). A returned pair returns its input then, as a graph
    that returns an input does (export copies a forward output that aliases an input first).
    Whether any changed (their inner permutes may be unread now)."""
    permute = torch.ops.aten.permute.default
    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=permute):
        inner = node.args[0]
        if not isinstance(inner, torch.fx.Node) or inner.target is not permute:
            continue
        rank = len(node.args[1])
        dims = [inner.args[1][d % rank] % rank for d in node.args[1]]
        if dims == list(range(rank)):
            node.replace_all_uses_with(inner.args[0])
        else:
            node.args = (inner.args[0], dims)
        changed = True
    return changed


def _pure(target) -> bool:
    if target is operator.getitem:
        return True
    return (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in target.tags)
