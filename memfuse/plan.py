"""plan: decide what the forward saves and what the backward recomputes, by a min-cut.

Each forward-computable node n is split into (n, IN) -> (n, OUT) with capacity = the bytes of
saving n. Data edges are infinite. The primal inputs and the nodes that cannot be recomputed
(extern calls, reductions over M) hang from the source; every forward node a backward node reads hangs to the sink. The cheapest cut
is the cheapest set of values to keep alive; the forward computes its own outputs regardless. The primal inputs cost one byte: they are alive
anyway, and the byte only breaks ties towards fewer tensors. Random values are recomputable
for free: their only input, the seed, is a Python int kept on the side, so a dropout mask is
regenerated in the backward and never saved.

Three rules for whole models (a language-model head and its cross-entropy):
- Index ops on integer targets (the one-hot, the `ne(ignore_index)` masks, where over them)
  are recomputed from the targets: fused ones like any pointwise op; an extern one (a scatter
  that stays an aten call) when it expands its integer inputs at least INDEX_EXPANSION-fold.
- Views cost nothing: a VIEW node, or an aten view run as an extern (a permute of a weight for
  mm), is never saved (infinite capacity) and is rebuilt from its base in the backward, so
  saving x and x.t() costs x's bytes once, and a tie between a value and its reshape keeps the
  value (no copy written to be saved).
- A value behind an exact upcast (a bf16 matmul output cast to fp32 for the loss) is saved in
  the narrow dtype and the cast recomputed: the cut is the cheaper of the two by construction,
  and the plan says so. A downcast is never moved across: the narrow value does not give the
  wide one back.
Row statistics: where the backward would recompute a chain of row reductions one from another
(norms in a row along a residual stream it rebuilds), those reductions are kept too ([rows] values
each), so the rebuild is pointwise (MAX_ROW_REDUCTION_CHAIN).
Ties go to values already in memory (an extern's result, a forward output) over values a
kernel would write only to be saved (WRITE_TIE).

A memory budget below 1 (Config.memory_budget) releases pins one at a time, cheapest first (index
ops, reductions over M, then matmuls), re-cutting until the cut keeps at most that fraction of the
default cut's bytes; `Plan.budget` records what it did and every value it moved says so.
"""
from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field

import networkx as nx
import sympy
import torch
from networkx.algorithms.flow import boykov_kolmogorov

from memfuse.ir.captured import Captured
from memfuse.base.config import is_byte_budget
from memfuse.base.debug import human_bytes, timed
from memfuse.ir.graph import LEAF, REDUCTION, Graph, Kind, Matmul, Node, Op, Reduce, value_bytes

INFINITE = float("inf")
FREE_LEAVES = {Op.SEED, Op.CONSTANT, Op.SYMBOL}   # available to both graphs at no cost
INPUT_COST = 1
# An extern index op (computed from integer inputs only) is recomputed in the backward when its
# result holds at least this many times the bytes of those inputs (a one-hot [tokens, vocab]
# from [tokens] targets); one that does not (a flip, a count) is kept: recomputing it would cost
# an aten launch to spare few bytes.
INDEX_EXPANSION = 2
# aten gathers: an extern one whose result outweighs what it reads is not pinned (expanding_gather).
GATHER_ATEN = {torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default, torch.ops.aten.gather.default}
# A value a kernel would write only to be saved costs this much more than the same bytes already
# in memory (an extern's result, a forward output): a tie keeps what nothing has to write.
WRITE_TIE = 1


SOURCE, SINK = "source", "sink"


class Side(enum.Enum):
    IN = "in"
    OUT = "out"


class Decision(enum.Enum):
    SAVE = "save"
    RECOMPUTE = "recompute"
    REGENERATE = "regenerate"      # a random value, redrawn in the backward from the seed
    FORWARD = "forward"            # computed in the forward only


@dataclass(frozen=True)
class SavedValue:
    name: str
    bytes: int
    is_input: bool
    reason: str


@dataclass
class Plan:
    forward: Graph                 # inputs: primals, [seed]; outputs: user outputs, then saved
    backward: Graph | None         # inputs: saved, [seed], tangents; outputs: one grad per primal
    num_fwd_outputs: int
    saved: list = field(default_factory=list)        # SavedValue, in forward-output order
    decisions: dict = field(default_factory=dict)    # node name -> (Decision, reason)
    budget: Budget | None = None   # what Config.memory_budget < 1 changed; None at 1.0
    offloaded: tuple = ()          # names of saved values kept in host memory (memfuse.runtime.offload)

    @property
    def saved_bytes(self) -> int:
        """Bytes kept alive for the backward beyond the inputs (hinted sizes)."""
        return sum(s.bytes for s in self.saved if not s.is_input)


# `Plan.offloaded`: the saved values (names as in Plan.saved, forward-output order) the forward copies
# to pinned host memory and the backward fetches back ahead of its first reader (the runtime's);
# set only under a byte budget whose target needs it.


# -- the predicted peak ----------------------------------------------------------------------------
def predicted_peak(plan: Plan, hints: dict) -> int:
    """The most bytes this step holds on the device at once, as this program sees it (size symbols
    at their hints): the forward's inputs (parameters, batch: the caller's, alive throughout) plus the
    larger of the forward's and the backward's own live bytes (`_live_peak`). Counted: each value an
    aten call makes or reads and each value a program returns, from the step that makes it to its
    last reader; the saved values from their producer to the forward's end and in the backward from
    its start to their last reader; an offloaded one (Plan.offloaded) in the forward only to its last
    forward reader and in the backward only from its first reader; the tangents; the gradients to the
    backward's end. Left out: a fused kernel's intermediates (registers) and the schedule's exact
    grouping, optimizer state, gradients accumulated from earlier steps, the forward's returned
    outputs while the backward runs, other graphs of a split model, what an extern allocates inside
    itself (a chunked loss head's chunk), the allocator's rounding and cached blocks."""
    forward_inputs = [n for n in plan.forward.inputs if plan.forward[n].op is not Op.SEED]
    sizes = {name: value_bytes(node.value, hints) for graph in (plan.forward, plan.backward) if graph is not None
             for name, node in graph.nodes.items()}
    saved = [s.name for s in plan.saved if not s.is_input]
    return _peak(plan.forward, plan.backward, forward_inputs, saved, set(plan.offloaded), sizes)


def _peak(forward: Graph, backward: Graph | None, forward_inputs: list, saved: list, offloaded: set,
          sizes: dict) -> int:
    """predicted_peak's sum, from the two programs and each value's bytes (`sizes`)."""
    inputs = sum(sizes[n] for n in forward_inputs)
    peak = _live_peak(forward, sizes, counted_inputs=(), late=set(), held_to_end=set(forward.outputs) - offloaded)
    if backward is not None:
        tangents = [n for n in backward.inputs if n not in forward.outputs and backward[n].op is not Op.SEED]
        peak = max(peak, _live_peak(backward, sizes, counted_inputs=saved + tangents, late=offloaded,
                                    held_to_end=set(backward.outputs)))
    return inputs + peak


def _live_peak(graph: Graph, sizes: dict, counted_inputs, late: set, held_to_end: set) -> int:
    """The most bytes of `graph`'s materialized values alive at once, walking its nodes in order:
    a value lives from the node that makes it (an input in `counted_inputs`: from the start, or from
    its first reader where `late`) to its last reader (a view's readers are its base's), or to the end
    when `held_to_end`. Materialized: what an aten call makes or reads, what the graph returns."""
    order = {name: k for k, name in enumerate(graph.nodes)}
    base: dict = {}
    for name, node in graph.nodes.items():
        base[name] = base[node.inputs[0]] if is_view(node) and node.inputs else name
    held = {base[o] for o in held_to_end if o in base}
    counted = set(counted_inputs)
    materialized = {base[o] for o in graph.outputs if o in base} | counted
    first, last = {}, {}
    for name, node in graph.nodes.items():
        if node.op in (Op.EXTERN, Op.GETITEM) and not is_view(node):
            materialized.add(name)
            materialized.update(base[i] for i in node.inputs)
        for i in node.inputs:
            first.setdefault(base[i], order[name])
            last[base[i]] = order[name]
    end = len(order)
    change = [0] * (end + 2)
    for name in materialized:
        node = graph[name]
        if node.op in LEAF and name not in counted or node.value.dtype is None:
            continue      # the caller's (primals, saved inputs), a seed, a constant, a tuple
        start = first.get(name, end) if name in late else 0 if node.op in LEAF else order[name]
        stop = end if name in held else max(last.get(name, order[name]), start)
        change[start] += sizes[name]
        change[stop + 1] -= sizes[name]
    peak = live = 0
    for delta in change:
        live += delta
        peak = max(peak, live)
    return peak


def is_view(node: Node) -> bool:
    """A VIEW node, or an aten view (permute, expand, view, ...) run as an extern: nothing to
    recompute, and saving it keeps its base."""
    return node.op is Op.VIEW or node.op is Op.EXTERN and getattr(node.attr.target, "is_view", False)


def is_exact_upcast(node: Node, joint: Graph) -> bool:
    """A cast to a wider floating dtype (bf16 -> fp32): the narrow value gives it back exactly."""
    if node.op is not Op.CAST:
        return False
    source = joint[node.inputs[0]].value.dtype
    target = node.value.dtype
    return source is not None and target is not None and target.is_floating_point and \
        (source == torch.bool or source.is_floating_point and target.itemsize > source.itemsize)


def index_inputs(joint: Graph) -> dict:
    """Nodes computed from integer inputs only (targets, labels; constants aside) -> the names of
    those inputs. A random value, a float input or a seeded extern (randint) below a node keeps
    it out, and so does having no integer input at all (an arange is a constant)."""
    sources, found = {}, {}
    for name, node in joint.nodes.items():
        if node.op is Op.INPUT:
            if node.value.dtype is not None and not node.value.is_floating:
                sources[name] = frozenset([name])
            continue
        if node.op in (Op.CONSTANT, Op.SYMBOL):
            sources[name] = frozenset()
            continue
        seeded = node.op is Op.EXTERN and torch.Tag.nondeterministic_seeded in getattr(node.attr.target, "tags", ())
        if node.op in (Op.SEED, Op.RAND) or seeded or any(i not in sources for i in node.inputs):
            continue
        sources[name] = frozenset().union(*(sources[i] for i in node.inputs))
        if sources[name]:
            found[name] = sources[name]
    return found


def expanding_gather(node: Node, joint: Graph | None, hints: dict) -> bool:
    """An aten gather (`x[idx]`, index_select, gather) whose result holds more bytes than all it
    reads: a mixture-of-experts layer's tokens gathered once per expert they are routed to (top-k
    times its hidden states). Not pinned: the min-cut keeps it or its source and indices, whichever
    costs fewer bytes, and the backward gathers again (one aten launch, bytes it reads and writes)."""
    if joint is None or node.op is not Op.EXTERN or node.attr.target not in GATHER_ATEN:
        return False
    read = sum(value_bytes(joint[i].value, hints) for i in set(node.inputs))
    return value_bytes(node.value, hints) > read


def pinned_reason(node: Node, index_bytes: dict, hints: dict, joint: Graph | None = None) -> str | None:
    """Why `node` cannot be recomputed in the backward (it hangs from the source), or None."""
    if node.op in (Op.EXTERN, Op.GETITEM):
        if is_view(node) or expanding_gather(node, joint, hints):
            return None
        if node.op is Op.EXTERN and node.name in index_bytes and node.value.dtype is not None and \
                value_bytes(node.value, hints) >= INDEX_EXPANSION * max(index_bytes[node.name], 1):
            return None
        return "an extern call"
    if node.op in REDUCTION and isinstance(node.attr, Reduce) and node.attr.axis is Kind.COL:
        return "a reduction over M"   # recomputing it costs a whole extra pass
    if node.op is Op.STRIDED and node.attr.summed:
        return "a sum over leading dims"   # recomputing it re-reads every row it adds up
    return None


@timed("plan")
def plan(captured: Captured, memory_budget: float | int = 1.0) -> Plan:
    """The default plan (the byte-cheapest cut); under a fraction `memory_budget` < 1 one that keeps
    at most that fraction of its saved bytes where recomputing more can get there (`_within_budget`);
    under a byte budget (an int above 1: Config.memory_budget parsed) one whose predicted peak is at
    most that many bytes, recomputing and offloading (`_within_peak`; MemoryBudgetError where none can)."""
    joint = captured.joint
    if captured.num_tangents == 0 and len(joint.outputs) == captured.num_fwd_outputs:
        return plan_inference(captured)
    n_fwd = captured.num_fwd_outputs
    fwd_outputs, grads = joint.outputs[:n_fwd], joint.outputs[n_fwd:]
    primals = joint.inputs[:captured.num_primals]
    tangents = joint.inputs[len(joint.inputs) - captured.num_tangents:]

    backward_only = _descendants(joint, tangents)
    backward_needed = _ancestors(joint, [g for g in grads if g is not None])
    index_ops = index_inputs(joint)
    index_bytes = {n: sum(value_bytes(joint[i].value, captured.hints) for i in srcs) for n, srcs in index_ops.items()}
    flow, pins = _flow_graph(captured, backward_only, backward_needed, grads, index_bytes)
    default_cut = _cut(flow)
    cut, budget, offloaded = default_cut, None, frozenset()
    if is_byte_budget(memory_budget):
        cut, offloaded, budget = _within_peak(flow, pins, default_cut, memory_budget, captured, index_bytes,
                                              backward_only)
    elif memory_budget < 1:
        cut, budget = _within_budget(flow, pins, default_cut, memory_budget, captured, index_bytes,
                                     backward_only)

    grad_names = [g for g in grads if g is not None]
    statistics = row_statistics(joint, cut, grad_names, backward_only)
    default_statistics = statistics if cut == default_cut else \
        row_statistics(joint, default_cut, grad_names, backward_only)
    cut, default_cut = cut | frozenset(statistics), default_cut | frozenset(default_statistics)
    saved_names = [n for n in joint.nodes if n in cut]
    forward = _subgraph(joint, inputs=primals + (["seed"] if captured.has_seed else []),
                        outputs=list(fwd_outputs) + saved_names)
    backward = _backward(joint, captured, saved_names, tangents, grads)
    default_backward = backward if cut == default_cut else \
        _backward(joint, captured, [n for n in joint.nodes if n in default_cut], tangents, grads)
    context = _Context(joint, joint.users(), backward, index_bytes, captured.hints, budget,
                       frozenset(default_backward.nodes) - set(default_backward.inputs), statistics)
    saved = [SavedValue(n, value_bytes(joint[n].value, captured.hints), joint[n].op is Op.INPUT,
                        _save_reason(joint[n], context))
             for n in saved_names]
    decisions = _decisions(joint, forward, backward, saved, backward_only, context)
    return Plan(forward, backward, n_fwd, saved, decisions, budget, tuple(n for n in saved_names if n in offloaded))


def _backward(joint: Graph, captured: Captured, saved_names: list, tangents: list, grads: list) -> Graph:
    inputs = saved_names + (["seed"] if captured.has_seed else []) + tangents
    return _recomputed_where_read(_subgraph(joint, inputs=inputs, outputs=list(grads)), tangents)


def _recomputed_where_read(backward: Graph, tangents: list) -> Graph:
    """The backward's nodes in the order autograd would run them: those the tangents reach keep
    the joint graph's order, and each recomputation of the forward comes right before its first
    reader, not at the program's start (where the joint graph has it), so that a layer's
    recomputed values are not all alive at once while the layers after it run their backwards.
    The steps follow this order (schedule._order)."""
    reached = _descendants(backward, tangents)
    order: dict = {name: None for name in backward.inputs}
    for root in [n for n in backward.nodes if n in reached] + list(backward.nodes):
        stack = [(root, False)]      # depth first, inputs before their reader, without recursion
        while stack:
            name, inputs_done = stack.pop()
            if name in order:
                continue
            if inputs_done:
                order[name] = None
                continue
            stack.append((name, True))
            stack.extend((i, False) for i in reversed(backward[name].inputs) if i not in order)
    return Graph({name: backward[name] for name in order}, backward.inputs, backward.outputs)


def plan_inference(captured: Captured) -> Plan:
    """Forward only (no_grad, or nothing needs a gradient): nothing is saved."""
    joint = captured.joint
    n_fwd = captured.num_fwd_outputs
    inputs = joint.inputs[:captured.num_primals] + (["seed"] if captured.has_seed else [])
    forward = _subgraph(joint, inputs=inputs, outputs=list(joint.outputs[:n_fwd]))
    decisions = {n: (Decision.FORWARD, "forward only") for n in forward.nodes}
    return Plan(forward, None, n_fwd, [], decisions)


def _flow_graph(captured, backward_only, backward_needed, grads, index_bytes) -> tuple:
    """(flow network, pins): the min-cut network whose cut is the values the backward receives, and
    the computed nodes tied to the source (name -> why: `pinned_reason`). Forward-needed nodes are
    not tied to the source: the forward computes them anyway, and the backward may compute them again."""
    joint = captured.joint
    users = joint.users()
    fwd_outputs = set(joint.outputs[:captured.num_fwd_outputs])
    flow, pins = nx.DiGraph(), {}
    flow.add_node(SOURCE)
    flow.add_node(SINK)
    for name, node in joint.nodes.items():
        if name in backward_only or node.op in FREE_LEAVES:
            continue
        if name not in backward_needed:
            continue   # the backward never reads it, directly or through recomputation
        inside, outside = (name, Side.IN), (name, Side.OUT)
        capacity = _capacity(node, captured.hints)
        if node.op not in (Op.INPUT, Op.EXTERN, Op.GETITEM) and name not in fwd_outputs:
            capacity += WRITE_TIE
        flow.add_edge(inside, outside, capacity=capacity)
        pinned = None if node.op is Op.INPUT else pinned_reason(node, index_bytes, captured.hints, joint)
        if node.op is Op.INPUT or pinned is not None:
            flow.add_edge(SOURCE, inside, capacity=INFINITE)
        if pinned is not None:
            pins[name] = pinned
        for inp in node.inputs:
            if (inp, Side.OUT) in flow:
                flow.add_edge((inp, Side.OUT), inside, capacity=INFINITE)
        if any(u in backward_only for u in users[name]) or name in grads:
            flow.add_edge(outside, SINK, capacity=INFINITE)
    return flow, pins


def _cut(flow: nx.DiGraph, flow_func=None) -> frozenset:
    """The values the cheapest cut of `flow` keeps for the backward (networkx's default max-flow
    algorithm unless `flow_func` names another)."""
    if not nx.has_path(flow, SOURCE, SINK):
        return frozenset()
    _, (reachable, _) = nx.minimum_cut(flow, SOURCE, SINK, flow_func=flow_func)
    return frozenset(key[0] for key in reachable if key != SOURCE and key[1] is Side.IN
                     and (key[0], Side.OUT) not in reachable)


# -- the memory budget -------------------------------------------------------------------------
# The default cut is already the byte-cheapest one the pins allow: every fused value whose
# recomputation keeps fewer bytes is recomputed. A budget below 1 releases pins, cheapest tier
# first: index ops that stay aten calls ("pointwise"), reductions over M and sums over leading dims
# ("reduction"), then matmuls ("matmul"). Other externs (attention, embedding, a seeded randint)
# are never released: recomputing a seeded one would draw new random numbers.
BUDGET_TIERS = ("pointwise", "reduction", "matmul")
# FLOPs a matmul does in the time it takes to move one byte (the machine balance of current
# data-centre GPUs in bf16): a matmul's recompute cost in bytes-moved equivalents.
MATMUL_FLOPS_PER_BYTE = 300
# An extern recomputed in the backward is one more aten launch: its host time is the time such a
# GPU moves this many bytes. Between equally cheap matmuls per byte, the larger goes first.
EXTERN_LAUNCH_BYTES = 16_000_000
# The max-flow algorithm of the budget's re-cuts: Boykov-Kolmogorov cuts these graphs 2-3x faster
# than networkx's default.
BUDGET_FLOW = boykov_kolmogorov
# The longest chain of matmuls a budget's backward may rebuild one from another's output. Two is a
# layer's attention projection and the MLP matmul that reads it; past that the chain runs through
# the residual stream into the layers before, so the backward rebuilds every earlier layer to get
# the last one's input and holds their products until their own backwards run; a budget that allows a longer chain
# costs both time and peak against one that keeps more. A cut with a longer chain is never chosen, even where it keeps fewer bytes.
MAX_MATMUL_CHAIN = 2
# The longest chain of row reductions the backward recomputes one from another's result: one
# normalization (its mean, then its variance). A longer chain runs through several norms in a row
# (a post-norm residual stream rebuilt from saved matmul outputs: each LayerNorm's row sums wait on
# the one before, a serial chain of kernels far below bandwidth); the
# reductions on it are kept ([rows] values each: `row_statistics`), so that the rebuild is pointwise.
MAX_ROW_REDUCTION_CHAIN = 2


@dataclass(frozen=True)
class Budget:
    """What Config.memory_budget changed: the fraction, the default plan's saved bytes, the target,
    the bytes the plan reached, the pins it released (name -> tier, in order), and why it stopped
    short of the target (None when it reached it)."""
    fraction: float
    default_bytes: int
    target_bytes: int
    reached_bytes: int
    released: dict
    short_of_target: str | None = None
    refused_chain: int = 0     # the longest matmul chain of the refused cuts that keep fewer bytes

    @property
    def label(self) -> str:
        return f"{self.fraction:g}"

    def __str__(self) -> str:
        head = (f"memory budget {self.fraction:g}: the default plan saves {human_bytes(self.default_bytes)}, "
                f"target {human_bytes(self.target_bytes)}, reached {human_bytes(self.reached_bytes)}")
        tiers = Counter(self.released.values())
        released = ", ".join(f"{tiers[t]} {t}" for t in BUDGET_TIERS if tiers[t])
        head += f" (released for recomputation: {released})" if released else ""
        head += f"; budget not reached: {self.short_of_target}" if self.short_of_target else ""
        if self.refused_chain:
            head += (f"; cuts that keep less were refused: their backward rebuilds chains of up to "
                     f"{self.refused_chain} matmuls, each from the one before (at most {MAX_MATMUL_CHAIN})")
        return head


def budget_tier(node: Node, index_bytes: dict) -> str | None:
    """Which BUDGET_TIERS tier may release this pinned node for recomputation; None: never."""
    if node.op is Op.EXTERN and isinstance(node.attr, Matmul):
        return "matmul"
    if node.op is Op.EXTERN and node.name in index_bytes:
        return "pointwise"
    if node.op in REDUCTION or node.op is Op.STRIDED:
        return "reduction"
    return None


def recompute_cost(node: Node, joint: Graph, hints: dict) -> float:
    """What computing `node` once more in the backward costs, in bytes moved: a fused op or an
    index op reads its inputs and writes its result; a matmul does 2·M·N·K FLOPs
    (MATMUL_FLOPS_PER_BYTE to the byte). An extern costs a launch more (EXTERN_LAUNCH_BYTES)."""
    launch = EXTERN_LAUNCH_BYTES if node.op is Op.EXTERN else 0
    if node.op is Op.EXTERN and isinstance(node.attr, Matmul):
        addmm = node.attr.target is torch.ops.aten.addmm.default     # addmm(bias, a, b)
        operand = node.attr.args[1] if addmm else node.attr.args[0]
        k = sympy.sympify(joint[operand.name].value.shape[-1]).subs(hints)
        elements = value_bytes(node.value, hints) // max(node.value.dtype.itemsize, 1)
        return launch + 2 * elements * int(k) / MATMUL_FLOPS_PER_BYTE
    return launch + value_bytes(node.value, hints) + sum(value_bytes(joint[i].value, hints) for i in node.inputs)


def _within_budget(flow, pins, default_cut, fraction, captured, index_bytes, backward_only) -> tuple:
    """(cut, Budget): the cuts of `_released_cuts` until one keeps at most `fraction` of the default
    cut's bytes. The sequence of cuts does not depend on `fraction`, only where it stops: a smaller
    budget never keeps more. Short of the target, the sequence's cheapest cut."""
    joint, hints = captured.joint, captured.hints
    grads = [g for g in joint.outputs[captured.num_fwd_outputs:] if g is not None]
    default_bytes = _saved_bytes(default_cut, joint, hints)
    target = int(fraction * default_bytes)
    refused: list = []
    cuts = _released_cuts(flow, pins, default_cut, joint, hints, index_bytes, grads, backward_only, refused)
    best = (default_bytes, default_cut, {})
    while best[0] > target:
        step = next(cuts, None)
        if step is None:
            break
        best = step
    reached, cut, released = best
    short = None if reached <= target else _short_of_target(cut, pins, index_bytes, joint, hints)
    refused_chain = max((chain for kept, chain in refused if kept < reached), default=0)
    return cut, Budget(fraction, default_bytes, target, reached, released, short, refused_chain)


def _released_cuts(flow, pins, default_cut, joint, hints, index_bytes, grads, backward_only, refused: list):
    """(saved bytes, cut, released pins) of each cut, keeping fewer bytes than the one before, that
    releasing pins one at a time, re-cutting after each, reaches. Each time the pin released is, among
    those a saved value hangs from (`_held_bytes`), of the cheapest tier, and within it the cheapest to
    recompute per byte of saved values hanging from it. A cut whose backward rebuilds a chain of more
    than MAX_MATMUL_CHAIN matmuls is never yielded: appended to `refused` (its bytes, its chain)."""
    position = {name: i for i, name in enumerate(joint.nodes)}
    cut, released, best = default_cut, {}, _saved_bytes(default_cut, joint, hints)
    while True:
        held = {n: b for n, b in _held_bytes(cut, pins, joint, hints).items()
                if budget_tier(joint[n], index_bytes) is not None}
        if not held:
            return
        name = min(held, key=lambda n: (BUDGET_TIERS.index(budget_tier(joint[n], index_bytes)),
                                        recompute_cost(joint[n], joint, hints) / max(held[n], 1), position[n]))
        flow.remove_edge(SOURCE, (name, Side.IN))
        del pins[name]
        released[name] = budget_tier(joint[name], index_bytes)
        cut = _cut(flow, BUDGET_FLOW)
        kept = _saved_bytes(cut, joint, hints)
        if kept >= best:
            continue
        chain = matmul_chain(joint, _recomputed(joint, cut, grads, backward_only))
        if chain > MAX_MATMUL_CHAIN:
            refused.append((kept, chain))
        else:
            best = kept
            yield kept, cut, dict(released)


# -- a byte budget ---------------------------------------------------------------------------------
# A byte target (Config.memory_budget "12GB") is one for the predicted peak (predicted_peak). From the
# default cut the planner moves saved values, one step at a time, to recompute (the next cut of the
# pin-release sequence above, `_released_cuts`) or to offload (a saved value copied to pinned host
# memory in the forward and fetched back ahead of its backward reader), the one that costs less
# time per byte it frees, until the predicted peak is at most the target. The cost model, in seconds:
# the device's memory bandwidth (a matmul's FLOPs count MATMUL_FLOPS_PER_BYTE to the byte, as in
# recompute_cost) and the host link, which an offloaded value crosses twice.
HBM_BYTES_PER_SECOND = 4e12
HOST_LINK_BYTES_PER_SECOND = 25e9
# Values smaller than this are never offloaded: each copy is one more launch, one more pinned host
# block and one more event to wait on, for little memory.
MIN_OFFLOAD_BYTES = 2**20


class MemoryBudgetError(ValueError):
    """A byte budget below the least this step can need: the caller's to change (a larger budget, a
    smaller batch or sequence), never a reason to run through torch (memfuse.driver.fallback). The
    target and that least travel as numbers too (a benchmark records them without reading the text)."""

    def __init__(self, message: str, target_bytes: int | None = None, least_bytes: int | None = None):
        super().__init__(message)
        self.target_bytes, self.least_bytes = target_bytes, least_bytes


@dataclass(frozen=True)
class Move:
    """A value a byte budget moved from the default plan: its choice ("keep", "recompute",
    "offload"), its bytes and why."""
    name: str
    choice: str
    bytes: int
    reason: str


@dataclass(frozen=True)
class PeakBudget:
    """What a byte budget changed (Plan.budget, in Budget's place): the target, the predicted peak of
    the default plan and of this one, the pins released for recomputation (name -> tier, as
    Budget's) and each moved value."""
    target_bytes: int
    peak_before: int
    peak_after: int
    released: dict
    moves: tuple = ()

    @property
    def label(self) -> str:
        return human_bytes(self.target_bytes)

    def move(self, name: str) -> Move | None:
        return next((m for m in self.moves if m.name == name), None)

    def __str__(self) -> str:
        lines = [f"memory budget {self.label} ({self.target_bytes} bytes) for the step's predicted peak: "
                 f"the default plan's {human_bytes(self.peak_before)}, this plan's {human_bytes(self.peak_after)}"]
        if not self.moves:
            lines[0] += " (the default plan fits: nothing moved)"
        width = max([len(m.name) for m in self.moves] + [4])
        lines += [f"  {m.name:<{width}}  {m.choice:<9} {human_bytes(m.bytes):>9}  {m.reason}" for m in self.moves]
        return "\n".join(lines)


def _seconds(seconds: float) -> str:
    """A cost model's estimate, as the reasons print it."""
    return f"{seconds * 1e6:.0f} us"


@dataclass
class _Step:
    """The byte budget's search state: the cut, the saved values offloaded, the two programs of the
    cut (the times an offload's copies can hide behind) and their predicted peak."""
    cut: frozenset
    offloaded: frozenset
    forward: Graph
    backward: Graph
    peak: int


class _PeakSearch:
    """The byte budget's search (`_within_peak`): the step state of a cut and offloaded set, and the
    time costs of each move."""

    def __init__(self, captured: Captured, backward_only: set):
        self.captured, self.joint, self.hints = captured, captured.joint, captured.hints
        joint = self.joint
        self.n_fwd = captured.num_fwd_outputs
        self.grads = [g for g in joint.outputs[self.n_fwd:] if g is not None]
        self.primals = joint.inputs[:captured.num_primals]
        self.tangents = joint.inputs[len(joint.inputs) - captured.num_tangents:]
        self.backward_only = backward_only
        self.sizes = {name: value_bytes(node.value, self.hints) for name, node in joint.nodes.items()}
        self.fwd_outputs = set(joint.outputs[:self.n_fwd])
        self._recompute_seconds: dict = {}
        self._cost: dict = {}         # node -> recompute_cost, each read many times over the search

    def step(self, cut: frozenset, offloaded: frozenset) -> _Step:
        joint, captured = self.joint, self.captured
        full = cut | frozenset(row_statistics(joint, cut, self.grads, self.backward_only))
        saved_names = [n for n in joint.nodes if n in full]
        forward = _subgraph(joint, inputs=self.primals + (["seed"] if captured.has_seed else []),
                            outputs=list(joint.outputs[:self.n_fwd]) + saved_names)
        backward = _backward(joint, captured, saved_names, self.tangents, list(joint.outputs[self.n_fwd:]))
        computed = [n for n in saved_names if joint[n].op is not Op.INPUT]
        peak = _peak(forward, backward, self.primals, computed, set(offloaded), self.sizes)
        return _Step(cut, offloaded, forward, backward, peak)

    def on_device(self, cut, offloaded) -> int:
        return sum(self.sizes[n] for n in cut if self.joint[n].op is not Op.INPUT and n not in offloaded)

    def recompute_seconds(self, cut) -> float:
        """The time the backward of `cut` spends recomputing the forward (recompute_cost, views free)."""
        if cut not in self._recompute_seconds:
            recomputed = _recomputed(self.joint, cut, self.grads, self.backward_only)
            self._recompute_seconds[cut] = sum(self.cost(n) for n in recomputed
                                               if not is_view(self.joint[n])) / HBM_BYTES_PER_SECOND
        return self._recompute_seconds[cut]

    def compute_seconds(self, name: str) -> float:
        """An aten call's device time, what an offload's copies hide behind; a fused node's counts
        nothing (a conservative estimate: the copy may hide behind less than it does)."""
        node = self.joint[name]
        if node.op is not Op.EXTERN or is_view(node):
            return 0.0
        return (self.cost(name) - EXTERN_LAUNCH_BYTES) / HBM_BYTES_PER_SECOND

    def cost(self, name: str) -> float:
        if name not in self._cost:
            self._cost[name] = recompute_cost(self.joint[name], self.joint, self.hints)
        return self._cost[name]

    def offload_candidates(self, state: _Step) -> dict:
        """Saved value -> (seconds its copies do not hide, transfer seconds each way): the values of
        at least MIN_OFFLOAD_BYTES the forward makes for the backward alone (not an input, not a
        forward output the caller holds anyway), not yet offloaded."""
        forward_order = list(state.forward.nodes)
        after, total = {}, 0.0
        for name in reversed(forward_order):
            after[name] = total
            total += self.compute_seconds(name)
        first, total = {}, 0.0
        for name, node in state.backward.nodes.items():
            for i in node.inputs:
                first.setdefault(i, total)
            total += self.compute_seconds(name)
        found = {}
        for name in state.cut:
            node = self.joint[name]
            if node.op is Op.INPUT or name in self.fwd_outputs or name in state.offloaded or \
                    node.value.dtype is None or self.sizes[name] < MIN_OFFLOAD_BYTES:
                continue
            transfer = self.sizes[name] / HOST_LINK_BYTES_PER_SECOND
            hidden_out, hidden_back = after.get(name, 0.0), first.get(name, 0.0)
            found[name] = (max(0.0, transfer - hidden_out) + max(0.0, transfer - hidden_back), transfer)
        return found


def _within_peak(flow, pins, default_cut, target: int, captured, index_bytes, backward_only) -> tuple:
    """(cut, offloaded names, PeakBudget): from the default cut, one move at a time, the cheaper in
    time per byte it frees on the device: the next cut of `_released_cuts` (recompute) or the saved
    value whose offload costs least per byte (`_PeakSearch.offload_candidates`), until the predicted
    peak is at most `target`. The moves do not depend on the target, only where they stop: a smaller
    target never predicts a higher peak. Past the last move, a MemoryBudgetError naming the least."""
    search = _PeakSearch(captured, backward_only)
    joint, hints = captured.joint, captured.hints
    cuts = _released_cuts(flow, pins, default_cut, joint, hints, index_bytes, search.grads, backward_only, [])
    state = search.step(default_cut, frozenset())
    before, least, released, moves = state.peak, state.peak, {}, {}
    pending = next(cuts, None)
    while state.peak > target:
        candidates = search.offload_candidates(state)
        offload = min(candidates, key=lambda n: (candidates[n][0] / search.sizes[n], -search.sizes[n], n),
                      default=None)
        offload_rate = candidates[offload][0] / search.sizes[offload] if offload else INFINITE
        recompute_rate, recompute_seconds, freed = INFINITE, 0.0, 0
        if pending is not None:
            kept_offloaded = state.offloaded & pending[1]
            freed = search.on_device(state.cut, state.offloaded) - search.on_device(pending[1], kept_offloaded)
            recompute_seconds = max(0.0, search.recompute_seconds(pending[1]) - search.recompute_seconds(state.cut))
            recompute_rate = recompute_seconds / freed if freed > 0 else INFINITE
        if pending is None and offload is None:
            raise MemoryBudgetError(
                f"memfuse: memory_budget {human_bytes(target)} ({target} bytes) is below the least this step "
                f"can need: a predicted peak of {human_bytes(least)} ({least} bytes) with every value the "
                f"budget may recompute recomputed and every saved value of at least {human_bytes(MIN_OFFLOAD_BYTES)} "
                f"offloaded to host memory (memfuse.plan.predicted_peak: the inputs, parameters included, and "
                f"the larger program's live values). Way out: a budget of at least {human_bytes(least)}, or a "
                f"smaller batch or sequence", target_bytes=target, least_bytes=least)
        if offload is not None and offload_rate <= recompute_rate:
            unhidden, transfer = candidates[offload]
            than = (f"recomputing the next values would cost {_seconds(recompute_seconds)} for "
                    f"{human_bytes(freed)}" if pending is not None else "nothing else the budget may recompute is left")
            moves[offload] = Move(offload, "offload", search.sizes[offload],
                                  f"to pinned host memory: {_seconds(transfer)} each way over the host link, "
                                  f"{_seconds(unhidden)} of it not hidden behind the compute after its producer "
                                  f"and before its backward reader; {than}")
            state = search.step(state.cut, state.offloaded | {offload})
        else:
            _, cut, released = pending
            than = (f"offloading {offload} would cost {_seconds(candidates[offload][0])} for "
                    f"{human_bytes(search.sizes[offload])}" if offload else
                    f"no saved value left of at least {human_bytes(MIN_OFFLOAD_BYTES)} to offload")
            for name in state.cut - cut:
                moves[name] = Move(name, "recompute", search.sizes[name],
                                   f"recomputing frees {human_bytes(freed)} for {_seconds(recompute_seconds)} of "
                                   f"the backward; {than}")
            for name in cut - state.cut:
                moves[name] = Move(name, "keep", search.sizes[name],
                                   "kept instead: the backward recomputes the released values from it")
            state = search.step(cut, state.offloaded & cut)
            released, pending = pending[2], next(cuts, None)
        least = min(least, state.peak)
    position = {name: k for k, name in enumerate(joint.nodes)}
    final = tuple(m for name, m in sorted(moves.items(), key=lambda item: position[item[0]])
                  if (m.choice == "recompute") != (name in state.cut) and
                  (m.choice != "offload" or name in state.offloaded) and
                  (m.choice != "keep" or name not in default_cut))
    return state.cut, state.offloaded, PeakBudget(target, before, state.peak, released, final)


def _recomputed(joint: Graph, cut, grads: list, backward_only: set) -> set:
    """The forward's nodes the backward of `cut` computes again: what the gradients need, up to
    the saved values and the inputs."""
    needed = _ancestors(joint, grads, stop=cut)
    return {n for n in needed - backward_only - cut if joint[n].op not in LEAF}


def row_statistics(joint: Graph, cut, grads: list, backward_only: set) -> dict:
    """The row reductions the backward of `cut` recomputes on a chain of more than
    MAX_ROW_REDUCTION_CHAIN of them (each reads, through recomputed nodes, the one before's result)
    -> that chain's length: kept as well, so that the rebuild is pointwise."""
    recomputed = _recomputed(joint, cut, grads, backward_only)
    users = joint.users()
    order = [name for name in joint.nodes if name in recomputed]
    depth: dict = {}      # the most row reductions on a recomputed path ending at the node
    for name in order:
        depth[name] = _is_row_reduction(joint[name]) + max((depth.get(i, 0) for i in joint[name].inputs), default=0)
    height: dict = {}     # ... starting at the node
    for name in reversed(order):
        height[name] = _is_row_reduction(joint[name]) + max((height.get(u, 0) for u in users[name]), default=0)
    return {name: depth[name] + height[name] - 1 for name in order
            if _is_row_reduction(joint[name]) and depth[name] + height[name] - 1 > MAX_ROW_REDUCTION_CHAIN}


def _is_row_reduction(node: Node) -> bool:
    return node.op in REDUCTION and isinstance(node.attr, Reduce) and node.attr.axis is Kind.ROW


def matmul_chain(graph: Graph, nodes) -> int:
    """The most matmuls among `nodes` on one path of `graph`: each reads, through `nodes` that are
    not matmuls, the one before's output."""
    depth: dict = {}
    for name in graph.nodes:
        if name in nodes:
            node = graph[name]
            is_matmul = node.op is Op.EXTERN and isinstance(node.attr, Matmul)
            depth[name] = int(is_matmul) + max((depth.get(i, 0) for i in node.inputs), default=0)
    return max(depth.values(), default=0)


def _saved_bytes(cut, joint: Graph, hints: dict) -> int:
    return sum(value_bytes(joint[n].value, hints) for n in cut if joint[n].op is not Op.INPUT)


def _held_bytes(cut, pins: dict, joint: Graph, hints: dict) -> dict:
    """pin -> bytes of the saved values that hang from it: the value itself, or one whose inputs
    lead up to the pin through nodes that are not pinned (the backward would recompute down from
    the pin). Releasing a pin no saved value hangs from changes nothing."""
    held: dict = {}
    for saved in cut:
        if joint[saved].op is Op.INPUT:
            continue
        size, seen, stack = value_bytes(joint[saved].value, hints), set(), [saved]
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in pins:
                held[name] = held.get(name, 0) + size
            else:
                stack.extend(joint[name].inputs)
    return held


def _short_of_target(cut, pins, index_bytes, joint: Graph, hints: dict) -> str:
    """What the rest of the saved bytes are, by kind, largest first."""
    kinds: Counter = Counter()
    for name in cut:
        node = joint[name]
        if node.op is Op.INPUT:
            continue
        if name in pins and budget_tier(node, index_bytes) is None:
            kind = "outputs of aten calls the budget never releases (attention, embeddings, seeded random ops, ...)"
        elif node.op is Op.EXTERN and isinstance(node.attr, Matmul):
            kind = "matmul outputs cheaper to keep than their operands"
        else:
            kind = "values cheaper to keep than what they are computed from"
        kinds[kind] += value_bytes(node.value, hints)
    return "the rest are " + "; ".join(f"{k} ({human_bytes(b)})" for k, b in kinds.most_common())


def _capacity(node: Node, hints: dict) -> float:
    """Bytes of keeping `node` for the backward."""
    if node.op is Op.INPUT:
        return INPUT_COST
    if node.value.dtype is None:
        return INFINITE   # a tuple result cannot be saved as one tensor
    if is_view(node):
        return INFINITE   # keeping a view keeps its base: the cut counts the base (once)
    return max(value_bytes(node.value, hints), 1)


def _subgraph(joint: Graph, inputs: list, outputs: list) -> Graph:
    """The nodes needed for `outputs` given `inputs`; the inputs become INPUT (or SEED) nodes."""
    needed = _ancestors(joint, [o for o in outputs if o is not None], stop=set(inputs))
    graph = Graph()
    for name in inputs:
        node = joint[name]
        op = Op.SEED if node.op is Op.SEED else Op.INPUT
        graph.add(Node(name, op, (), node.value))
    graph.inputs = list(inputs)
    for name, node in joint.nodes.items():
        if name in needed and name not in graph.nodes:
            graph.add(node)
    graph.outputs = list(outputs)
    return graph


def _ancestors(graph: Graph, roots, stop=frozenset()) -> set:
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name not in stop:
            stack.extend(graph[name].inputs)
    return seen


def _descendants(graph: Graph, roots) -> set:
    users = graph.users()
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(users[name])
    return seen


@dataclass(frozen=True)
class _Context:
    """What the reasons read: the joint graph and its users, the backward, the index ops' input
    bytes, the sizes, the budget's record and the nodes the default plan's backward recomputes."""
    joint: Graph
    users: dict
    backward: Graph
    index_bytes: dict
    hints: dict
    budget: Budget | PeakBudget | None
    default_recomputed: frozenset
    statistics: dict               # row_statistics: saved row reduction -> its chain's length


def _save_reason(node: Node, context: _Context) -> str:
    move = context.budget.move(node.name) if isinstance(context.budget, PeakBudget) else None
    if move is not None and move.choice == "offload":
        return f"offloaded for the memory budget {context.budget.label}: {move.reason}"
    if node.op is Op.INPUT:
        return "an input, alive anyway: the backward recomputes from it"
    upcasts = [u for u in context.users[node.name]
               if is_exact_upcast(context.joint[u], context.joint) and u in context.backward.nodes
               and context.backward[u].op is not Op.INPUT]
    narrow = f"; kept in {_dtype(node)}, the backward recomputes its {_dtype(context.joint[upcasts[0]])} " \
             f"upcast {upcasts[0]} (exact)" if upcasts else ""
    pinned = pinned_reason(node, context.index_bytes, context.hints, context.joint)
    if pinned == "an extern call" and node.name in context.index_bytes:
        return ("an index op on integer targets that does not expand them (a flip, a count): cheaper to keep "
                f"than another aten launch{narrow}")
    if pinned is not None:
        return f"{pinned}: cheaper to keep than to redo{narrow}"
    if node.name in context.statistics:
        return (f"a row statistic on a chain of {context.statistics[node.name]} row reductions the backward "
                f"would rebuild one after another: kept ([rows] values), the rebuild reads it instead")
    return f"cheaper to keep than to recompute from the inputs (min-cut){narrow}"


def _recompute_reason(node: Node, context: _Context) -> str:
    if context.budget is not None and node.name not in context.default_recomputed:
        kind = context.budget.released.get(node.name) or _budget_kind(node)
        return (f"recomputed for the memory budget {context.budget.label}: "
                f"{human_bytes(value_bytes(node.value, context.hints))}, {kind}")
    if not node.inputs:
        return "a constant (the column index, a fill): rebuilt in the backward for free"
    if is_view(node):
        return "a view: rebuilt from its base in the backward, for free"
    if node.name in context.index_bytes:
        return "index op on integer targets: recomputed from the targets"
    if is_exact_upcast(node, context.joint):
        return "an exact upcast: recomputed from the narrower value"
    if expanding_gather(node, context.joint, context.hints):
        return "a gather larger than what it reads: gathered again from its source and indices"
    return "recomputed in the backward from saved inputs"


def _budget_kind(node: Node) -> str:
    """The BUDGET_TIERS word for a node the budget moved into the backward."""
    if node.op is Op.EXTERN and isinstance(node.attr, Matmul):
        return "matmul"
    if node.op in REDUCTION or node.op is Op.STRIDED and node.attr.summed:
        return "reduction"
    return "pointwise"


def _dtype(node: Node) -> str:
    return str(node.value.dtype).replace("torch.", "")


def _decisions(joint, forward, backward, saved, backward_only, context) -> dict:
    saved_names = {s.name: s for s in saved}
    decisions = {}
    for name, node in joint.nodes.items():
        if node.op in FREE_LEAVES or node.op is Op.INPUT:
            continue
        if name in saved_names:
            decisions[name] = (Decision.SAVE, saved_names[name].reason)
        elif name in backward.nodes and name not in backward_only:
            if node.op is Op.RAND:
                decisions[name] = (Decision.REGENERATE, "redrawn from the seed: the mask is never saved")
            else:
                decisions[name] = (Decision.RECOMPUTE, _recompute_reason(node, context))
        elif name in forward.nodes:
            decisions[name] = (Decision.FORWARD, "needed by the forward outputs only")
    return decisions
