"""The schedule's graph rewrites around reshapes and casts: reshapes an aten call reads
(`reshapes_for_aten`), returned reshapes of aten results (`returned_reshapes`), casts of column sums
folded into their kernel (`fold_column_casts`)."""
from __future__ import annotations

import torch

from memfuse.ir.graph import EXTERNAL, Graph, Kind, Node, Op, Reshape
from memfuse.schedule.reads import made_by_aten, same_size
from memfuse.schedule.steps import ExternStep, KernelGroup


def reshapes_for_aten(graph: Graph) -> Graph:
    """The graph with each reshape (VIEW) of a tensor already in memory (a program input, an aten
    result, or such a reshape) that an aten call reads marked `Reshape`: the runtime's
    `.reshape`, an alias, where a kernel would copy it. BERT's backward reads each layer's saved
    attention probabilities as a [batch x heads, seq, seq] bmm operand: four 384 MB fp32 copies,
    alive together, otherwise; and each projection's bias gradient sums the rows of the matmul
    operand that attention's gradient already is. Kernels that read one too read it in memory, as
    they would its source. A returned one stays a copy (it would alias the caller's input)."""
    users = graph.users()
    outputs = set(graph.outputs)
    for_aten: set = set()        # VIEW nodes an aten call reads, directly or through such VIEWs
    for name in reversed(graph.nodes):
        node = graph[name]
        if node.op is Op.VIEW and name not in outputs and any(
                graph[u].op in EXTERNAL or u in for_aten for u in users[name]):
            for_aten.add(name)
    marked: set = set()
    for name in graph.nodes:
        node = graph[name]
        source = graph[node.inputs[0]] if node.inputs else None
        if name in for_aten and node.attr is None and node.value.kind is not Kind.TENSOR \
                and source.value.dtype == node.value.dtype \
                and (source.op is Op.INPUT or source.op in EXTERNAL or source.name in marked) \
                and same_size(graph, node):
            marked.add(name)
    if not marked:
        return graph
    rewritten = Graph(inputs=list(graph.inputs), outputs=list(graph.outputs))
    for name, node in graph.nodes.items():
        rewritten.add(Node(name, node.op, node.inputs, node.value, Reshape()) if name in marked else node)
    return rewritten



def returned_reshapes(graph: Graph) -> Graph:
    """The graph with each returned reshape of an aten call's result (through a chain of
    reshapes: `view`, then the `clone` AOTAutograd puts on an output) reading that result itself,
    so that the runtime reshapes it (`runtime_reshape`); the bypassed reshapes nothing else reads
    are dropped."""
    rewired = {}
    for name in set(o for o in graph.outputs if o is not None):
        node, root = graph[name], graph[name]
        while root.op is Op.VIEW and same_size(graph, root):
            root = graph[root.inputs[0]]
        if node.op is Op.VIEW and root.name != node.inputs[0] and root.op is Op.EXTERN \
                and made_by_aten(graph, root.name):
            rewired[name] = Node(name, node.op, (root.name,), node.value, node.attr)
    if not rewired:
        return graph
    nodes = {name: rewired.get(name, node) for name, node in graph.nodes.items()}
    outputs = set(o for o in graph.outputs if o is not None)
    while True:
        read = {i for node in nodes.values() for i in node.inputs}
        dead = [n for n, node in nodes.items() if node.op is Op.VIEW and n not in read and n not in outputs]
        if not dead:
            break
        for n in dead:
            del nodes[n]
    rewritten = Graph(inputs=list(graph.inputs), outputs=list(graph.outputs))
    for node in nodes.values():
        rewritten.add(node)
    return rewritten


# dtypes a kernel's finish rounds a column total through (in fp32 registers, as `cast` does)
FOLDED_CAST_DTYPES = (torch.float32, torch.bfloat16, torch.float16)



def fold_column_casts(graph: Graph, steps: list, placed: list) -> list:
    """The steps without the casts of finished column sums that the kernels finishing those sums
    now apply as they write their totals (KernelGroup.column_casts). Under autocast each bias
    gradient is an fp32 column sum cast to bf16 (the matmul's dtype) and back to fp32 (the
    parameter's): as steps of their own, two `.to` calls a bias, each a launch and its host time.
    A chain is folded while each value has one reader, a cast the runtime would run
    (`runtime_reshape`: a cast, or a reshape, free on a row of the totals), in fp32, bf16 or fp16;
    the last may have any readers."""
    users = graph.users()
    externs = {s.name for s in steps if isinstance(s, ExternStep)}
    folded: set = set()
    for group in steps:
        if not isinstance(group, KernelGroup) or group.aten_reason is not None:
            continue
        for total in group.column_sums:
            chain, value = [], total
            while value not in graph.outputs and len(users[value]) == 1 and \
                    graph[value].value.dtype in FOLDED_CAST_DTYPES:
                reader = graph[users[value][0]]
                if reader.op not in (Op.CAST, Op.VIEW) or reader.name not in externs or \
                        reader.value.dtype not in FOLDED_CAST_DTYPES or not same_size(graph, reader):
                    break
                chain.append(reader.name)
                value = reader.name
            if any(graph[c].op is Op.CAST for c in chain):
                group.column_casts[total] = tuple(chain)
                folded.update(chain)
                casts = " then ".join(str(graph[c].value.dtype).replace("torch.", "") for c in chain
                                      if graph[c].op is Op.CAST)
                placed.append((chain[-1], f"column sum {total} cast to {casts} by {group.name} as it writes its "
                                          f"totals: no `.to` step"))
    return [s for s in steps if not (isinstance(s, ExternStep) and s.name in folded)]
