"""indexing: advanced indexing by aranges, which only reads a block of its source, made a view.

HuggingFace builds its attention masks by indexing with aranges laid along distinct dims:
`position_ids[batch_arange[:, None, None, None], q_arange[None, None, :, None]]` is
`position_ids[:batch, :q]` seen as [batch, 1, q, 1]. Traced, each is an `aten.index.Tensor` with
index tensors made by `arange` and `unsqueeze`: an extern call a kernel waits for, after the calls
that make its index tensors (aranges, and kernels that write them). Where a mask's graph is split
from the rest (Dynamo breaks it at HuggingFace's packed-sequence check, at FSDP2's hooks), Llama's
took 9 kernels and 8 aten calls a step where Inductor's took a few kernels.

`index_by_aranges(gm)` rewrites such an index into the views it is (slices to each arange's
length, a permute where the aranges' dims are not in order, unsqueezes for the broadcast dims),
which the kernels then read in place. Only what is provably the same: every index an
`arange(0, n)` (plus 0 at most) of an integer dtype, seen through unsqueezes and reshapes as one
non-1 dim; the aranges' dims distinct; each n at most its source dim (aten's bound check could not
fail); under dynamic shapes the aranges end at size symbols, and Dynamo's `x[None, None, :]` leaves
a whole slice in the chain, which is looked through. Anything else stays aten's.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten

ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
INT64_MAX = 2**63 - 1
SHAPE_ONLY = (aten.unsqueeze.default, aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def index_by_aranges(gm: torch.fx.GraphModule) -> bool:
    """Each aten.index of aranges replaced by its views; whether any was (the aranges may be unread)."""
    changed = False
    for node in gm.graph.find_nodes(op="call_function", target=aten.index.Tensor):
        views = _as_views(gm.graph, node)
        if views is not None:
            node.replace_all_uses_with(views)
            gm.graph.erase_node(node)
            changed = True
    return changed


def _as_views(graph: torch.fx.Graph, node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """The views `node` (aten.index.Tensor(x, indices)) is, inserted before it, each with its fake
    value; None where that is not provably the same."""
    source, indices = node.args[0], node.args[1]
    x = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
    if x is None or not indices or len(indices) > x.dim() or None in indices:
        return None
    rank = max(i.meta["val"].dim() for i in indices)
    laid = [_arange_laid(index, rank) for index in indices]     # (length: int or node, its dim among rank)
    if any(a is None for a in laid) or len({dim for _, dim in laid}) != len(laid):
        return None
    if not all(statically_known_true(_size(length) <= x.shape[k]) for k, (length, _) in enumerate(laid)):
        return None
    view = source

    def then(target, *args):
        nonlocal view
        with graph.inserting_before(node):
            made = graph.call_function(target, (view, *args))
        made.meta["val"] = target(view.meta["val"], *(_size(a) for a in args))
        view = made
    for k, (length, _) in enumerate(laid):
        if not statically_known_true(_size(length) == x.shape[k]):
            then(aten.slice.Tensor, k, 0, length)
    dims = [dim for _, dim in laid]
    order = sorted(range(len(dims)), key=dims.__getitem__)
    if order != list(range(len(dims))):
        then(aten.permute.default, order + list(range(len(dims), x.dim())))
    for dim in range(rank):                      # the broadcast dims no arange lies along: size 1
        if dim not in dims:
            then(aten.unsqueeze.default, dim)
    return view


def _arange_laid(index: torch.fx.Node, rank: int) -> Optional[tuple]:
    """(the arange's length as its end argument, the dim it lies along among `rank` broadcast dims)
    of an index that is `arange(0, n)` (+ 0) seen through shape-only views with one non-1 dim."""
    value = index.meta.get("val")
    if value is None or value.dtype in (torch.bool, torch.uint8) or value.is_floating_point():
        return None
    long_dims = [d for d, size in enumerate(value.shape) if not statically_known_true(size == 1)]
    if len(long_dims) != 1:
        return None
    node = index
    while node.op == "call_function" and (node.target in SHAPE_ONLY or _adds_zero(node) or _whole_slice(node)):
        node = node.args[0]
    if node.op != "call_function" or node.target not in ARANGES:
        return None
    start, end, step = _arange_range(node)
    if start != 0 or step != 1 or not statically_known_true(_size(end) == value.shape[long_dims[0]]):
        return None
    return end, rank - value.dim() + long_dims[0]


def _arange_range(node: torch.fx.Node) -> tuple:
    args = node.args
    if node.target is aten.arange.default:
        return 0, args[0], 1
    if node.target is aten.arange.start:
        return args[0], args[1], 1
    return args[0], args[1], args[2] if len(args) > 2 else 1


def _whole_slice(node: torch.fx.Node) -> bool:
    """A slice that keeps its dim whole (Dynamo's `x[None, None, :]` traces a slice to 2**63 - 1)."""
    if node.target is not aten.slice.Tensor or node.kwargs:
        return False
    source, dim, start, end, step = (list(node.args) + [0, 0, None, 1][len(node.args) - 1:])[:5]
    size = source.meta["val"].shape[dim] if isinstance(source, torch.fx.Node) and "val" in source.meta else None
    return start in (None, 0) and step == 1 and size is not None and (
        end is None or (isinstance(end, int) and end >= INT64_MAX) or statically_known_true(_size(end) == size))


def _adds_zero(node: torch.fx.Node) -> bool:
    return node.target in (aten.add.Tensor, aten.add.Scalar) and len(node.args) == 2 and node.args[1] == 0 \
        and not node.kwargs


def _size(length):
    """An argument as a value: an int or list as it is, a node's (a SymInt a graph node holds)."""
    return length.meta["val"] if isinstance(length, torch.fx.Node) else length
