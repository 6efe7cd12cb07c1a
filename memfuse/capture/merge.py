"""One node for a value computed twice: duplicates that would each be written to memory merged
after lowering."""
from __future__ import annotations

import dataclasses
from typing import Optional

from memfuse.ir.graph import EXTERNAL, FUSIBLE, RANDOM, Extern, Graph, Node, Op, Strided, Value, renamed


def merge_stored_duplicates(graph: Graph) -> tuple:
    """(graph, merged): `graph` with one node for each value that several nodes compute and each
    writes to memory: autocast casts a layer's normalized input once per linear layer that reads
    it (three bf16 copies for q, k and v), and each layer builds the same attention mask for its
    own attention call. A duplicate read only in registers stays: the backward recomputing a forward value next
    to the derivative that reads it is one kernel, not one value written by another (merge_key
    says what counts as the same value). `merged`: each dropped node -> the node kept for it."""
    stored, constant = _stored(graph), _from_constants(graph)
    returned = set(graph.outputs)       # each returned tensor stays a tensor of its own
    names: dict = {}      # dropped duplicate -> the node that computes its value
    first: dict = {}      # merge key -> the first node with it
    merged = Graph(inputs=list(graph.inputs))
    for name, node in graph.nodes.items():
        inputs = tuple(names.get(i, i) for i in node.inputs)
        attr = node.attr
        if isinstance(attr, Extern):
            attr = dataclasses.replace(attr, args=renamed(attr.args, names), kwargs=renamed(attr.kwargs, names))
        mergeable = (name in stored or name in constant) and name not in returned
        key = merge_key(node.op, inputs, node.value, attr) if mergeable else None
        if key is not None and key in first:
            names[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        merged.add(Node(name, node.op, inputs, node.value, attr))
    merged.outputs = list(graph.outputs)
    return merged, names


def merged_name(name, merged: dict):
    """A lowered fx node's value name (or tuple of them, or None) after merge_stored_duplicates."""
    if isinstance(name, tuple):
        return tuple(merged_name(n, merged) for n in name)
    return merged.get(name, name) if isinstance(name, str) else name


def merge_key(op: Op, inputs: tuple, value: Value, attr) -> Optional[tuple]:
    """What makes two nodes compute the same values: op, inputs, result and attribute (a STRIDED
    node's description aside). None for nodes never merged: inputs, random draws (each its own
    stream) and aten calls (memfuse cannot tell which of them are pure)."""
    if op not in FUSIBLE or op in RANDOM:
        return None
    if isinstance(attr, Strided):
        attr = dataclasses.replace(attr, describe="")
    return op, inputs, value, attr


def _from_constants(graph: Graph) -> set:
    """The fusible values computed from constants and sizes alone (a scalar tensor, a fill, an
    iota): every kernel that reads one computes it, so one node serves them all."""
    constant: set = set()
    for name, node in graph.nodes.items():
        if node.op in FUSIBLE and node.op not in RANDOM and node.op is not Op.STRIDED and all(
                graph[i].op in (Op.CONSTANT, Op.SYMBOL) or i in constant for i in node.inputs):
            constant.add(name)
    return constant


def _stored(graph: Graph) -> set:
    """The fusible values that go to memory whatever the schedule: read by an aten call, read in
    place by a strided view, or reshaped (VIEW) into such a value."""
    users = graph.users()
    stored: set = set()
    for name in reversed(graph.nodes):
        for u in users[name]:
            reader = graph[u]
            if reader.op in EXTERNAL or (reader.op is Op.STRIDED and reader.inputs[0] == name) \
                    or (reader.op is Op.VIEW and u in stored):
                stored.add(name)
                break
    return stored

