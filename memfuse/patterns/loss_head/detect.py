"""Finds the loss head in a model and computes it chunked (memfuse.patterns.loss_head.op), unchanged user code.

The pattern: `cross_entropy(x, target)` where x is a linear layer's output (or `hidden @ w.T` of a
2-D w), optionally transformed by constants (`* s`, `/ s`, `tanh`: Gemma's soft cap, Cohere's and
Granite's scales; loss_head.LogitTransform), cast (`.float()`, `.to(float32)`) and flattened to
[tokens, vocab] (`view`, `reshape`, `contiguous`), with no other reader on the way. It is replaced
by `torch.ops.memfuse.linear_cross_entropy` on the linear's input, weight and bias. Where the
linear's output is also read in the graph, the op returns the logits too and takes their gradient
into its backward; where a cast or flattened copy is read elsewhere, the head is left as it is,
with the reason. Logits the graph only returns (a HuggingFace model's) come out of the op without
gradient and get their own backward outside the compiled graph (loss_head.ReturnedLogits, placed
by a loss_head.LogitsReturn): autograd would otherwise hand the backward a [tokens, vocab] zero
gradient for them at every step.

Two ways in, one rule: `with_chunked_loss_heads(gm)` rewrites a Dynamo graph (the torch.compile
backend), `LossHeadMode` swaps the calls while memfuse traces a function or module
(memory_efficient_fusion, `capture_chunked`), where returned logits are only known once the
function has returned: every head is traced writing its logits, and those nothing reads are not
written after all (`unread_logits_unwritten`), so one trace serves either way.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import operator
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from memfuse.patterns.loss_head import op as loss_head
from memfuse.patterns.loss_head.call import OUTPUT, LossHeadCall
from memfuse.base.config import DEFAULT_LOSS_HEAD_CHUNK_ROWS, Config
from memfuse.base.debug import STATS, topic_log
from memfuse.ir.graph import Op

log = topic_log("graphs")
fallback_log = logging.getLogger("memfuse.fallbacks")

LINEARS = (torch._C._nn.linear, F.linear)
MATMULS = (operator.matmul, torch.matmul, torch.mm)
CASTS = ("float", "to")
FLATTENS = ("view", "reshape", "contiguous")
# the logits' transforms by a constant, by call: Dynamo's graphs hold operator.mul / truediv,
# torch.tanh and methods; a traced function's mode sees torch's and Tensor's functions
TRANSFORM_FUNCTIONS = {operator.mul: "mul", torch.mul: "mul", torch.multiply: "mul", operator.truediv: "div",
                       torch.div: "div", torch.true_divide: "div", torch.tanh: "tanh", F.tanh: "tanh"}
TRANSFORM_METHODS = {"mul": "mul", "multiply": "mul", "div": "div", "true_divide": "div", "tanh": "tanh",
                     "__mul__": "mul", "__rmul__": "mul", "__truediv__": "div"}
CROSS_ENTROPY_PARAMETERS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction",
                            "label_smoothing")


@dataclasses.dataclass(frozen=True)
class HeadDecision:
    """What memfuse did with one cross-entropy: chunked (with the settings) or left, and why."""
    loss: str                   # the cross-entropy's name in the graph
    chunked: bool
    reason: str
    vocab: Optional[int] = None
    returns_logits: bool = False
    chunk_bytes: Optional[int] = None
    gradients_in_forward: bool = False   # formed while each chunk's logits are at hand, scaled in the backward
    chunk_rows: Optional[int] = None     # token rows a chunk (fewer where there are fewer tokens)
    chunk_note: str = ""                 # why the chunk's size is not the default's (head.rows_cap)
    plan: str = ""                       # the plan at the traced sizes, where the forward forms the gradients
    transform: str = ""                  # what the model does to the logits before the loss (LogitTransform)

    def __str__(self) -> str:
        if not self.chunked:
            return f"loss head {self.loss}: not chunked: {self.reason}"
        logits = ("; the logits are also returned: written whole, not kept, differentiated only if read"
                  if self.returns_logits else "")
        note = f"; {self.chunk_note}" if self.chunk_note else ""
        gradients = ("; gradients formed in the forward, scaled in the backward" if self.gradients_in_forward
                     else "; the backward forms each chunk's logits again")
        if self.plan:
            gradients += f"; {self.plan}"
        transform = f" of the logits through {self.transform}" if self.transform else ""
        return (f"loss head {self.loss}: chunked linear + cross-entropy{transform} over vocab {self.vocab}, chunks of "
                f"{self.chunk_rows} token rows ({self.chunk_bytes / 2**20:.0f} MiB of logits{note})"
                f"{logits}{gradients}: {self.reason}")


# -- the one matcher both detectors call ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class HeadSite:
    """A cross_entropy of a linear's output (maybe transformed, cast and flattened), as either
    detector found it: the fx rewrite of a Dynamo graph, or LossHeadMode while memfuse traces."""
    logits_dim: Optional[int]       # dims of the logits the loss reads (None: unknown)
    linear_dtype: torch.dtype       # the linear's output's
    loss_in_float32: bool           # the loss is computed in float32 (a cast, or autocast)
    steps: tuple = ()               # the transform's steps, (kind, factor) each
    step_dtypes: frozenset = frozenset()    # the dtypes of the steps' results


def match_head(site: HeadSite) -> tuple:
    """(the LogitTransform, a problem or None): the checks either detector makes of a head, in order."""
    if site.logits_dim != 2:
        return loss_head.LogitTransform(), "the loss reads logits that are not [tokens, vocab]"
    if site.linear_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return loss_head.LogitTransform(), f"the logits are {site.linear_dtype}"
    if not site.loss_in_float32:
        return loss_head.LogitTransform(), "the loss is not computed in float32 (half logits without autocast or a cast)"
    return _transform_of(list(site.steps), set(site.step_dtypes), site.linear_dtype)


def _graph_site(arguments: dict, chain: list, linear: torch.fx.Node, loss: torch.fx.Node) -> HeadSite:
    """The site of a head in a Dynamo graph: each transform step rounds to the dtype of the value it
    makes (the logits' half dtype before the loss's float cast, fp32 after)."""
    flat = (chain[-1] if chain else linear).meta.get("example_value")
    steps = [(n, _transform_step(n)) for n in chain if _transform_step(n)]
    loss_value = loss.meta.get("example_value")
    return HeadSite(None if flat is None else flat.dim(), linear.meta["example_value"].dtype,
                    loss_value is not None and loss_value.dtype == torch.float32,
                    tuple(step[1:] for _, step in steps),
                    frozenset(n.meta["example_value"].dtype for n, _ in steps if "example_value" in n.meta))


def _traced_site(arguments: dict, steps: tuple, linear_output: torch.Tensor) -> HeadSite:
    """The site of a head LossHeadMode follows: `steps` (kind, factor, result dtype) each."""
    logits = arguments["input"]
    in_float32 = linear_output.dtype == torch.float32 or logits.dtype == torch.float32 or \
        torch.is_autocast_enabled(logits.device.type)
    return HeadSite(logits.dim(), linear_output.dtype, in_float32, tuple(step[:2] for step in steps),
                    frozenset(step[2] for step in steps))


def head_call(arguments: dict, hidden, weight, bias, logits, config: Config, transform, operands: list, *,
              return_logits: bool, differentiable_logits: bool) -> LossHeadCall:
    """The op's call for a matched head: the cross-entropy's settings, the chunk's bytes, the
    gradients formed in the forward where a mean or sum loss's operands need them."""
    return LossHeadCall(hidden, weight, bias, arguments["target"], arguments.get("ignore_index", -100),
                        arguments.get("reduction", "mean"), float(arguments.get("label_smoothing", 0.0)), logits.dtype,
                        return_logits=return_logits,
                        with_gradients=_gradients_in_forward(arguments.get("reduction", "mean"), operands),
                        chunk_bytes=chunk_bytes(config, int(logits.shape[-1]), logits.dtype),
                        differentiable_logits=differentiable_logits, plan=config.loss_head_plan, transform=transform)


def chunked_decision(name: str, reason: str, call: LossHeadCall, config: Config, logits, hidden, weight, *,
                     formed: bool, returned_unknown: bool = False) -> HeadDecision:
    """The decision of a head chunked by `call` (`formed`: the plan note applies)."""
    vocab = int(logits.shape[-1])
    return HeadDecision(name, True, reason, vocab, call.return_logits, call.chunk_bytes, call.with_gradients,
                        _rows(call.chunk_bytes, vocab, logits.dtype), rows_cap(config)[1],
                        _plan_note(config, logits, hidden, weight, call.chunk_bytes, formed, returned_unknown),
                        str(call.transform) if call.transform.steps else "")


# Where the memory budget shrinks the head's chunks it stops at this many token rows. Each chunk's
# weight gradient is an addmm that reads and writes the whole [vocab, H] fp32 gradient: rows / 4
# FLOPs a byte, memory-bound below about 1200 (MATMUL_FLOPS_PER_BYTE): small chunks spend much of
# the step in those addmms for little memory (GPT-2 at budget 0.2: 63 chunks of 264 rows, a few
# times the addmm time of 13 chunks, for 27 MB off the step's peak). The default chunk on one
# process holds this many rows already: the budget shrinks only larger chunks.
BUDGET_MIN_CHUNK_ROWS = 1024


def chunk_bytes(config: Config, vocab: int, dtype: torch.dtype) -> int:
    """A chunk's bytes of logits: rows_cap(config) token rows, or Config.loss_head_chunk_bytes
    where those take less. The memory budget scales that down (0.5 halves it), but not below
    BUDGET_MIN_CHUNK_ROWS rows nor above what is configured."""
    row = loss_head.row_bytes(vocab, dtype)
    rows, _ = rows_cap(config)
    configured = config.loss_head_chunk_bytes if rows is None else min(config.loss_head_chunk_bytes, rows * row)
    floor = min(configured, BUDGET_MIN_CHUNK_ROWS * row)
    return max(1, int(configured * config.memory_fraction), floor)


def rows_cap(config: Config) -> tuple[Optional[int], str]:
    """(the most token rows of a chunk, None for no cap; why not the default, for explain(): "" where
    it is the default or set). Config.loss_head_chunk_rows where set;
    else DEFAULT_LOSS_HEAD_CHUNK_ROWS on one process, and no cap (the bytes alone) where
    torch.distributed runs more than one rank: each chunk costs the host its launches, and steps
    under FSDP2 are paced by the host (BERT under FSDP2 fell behind eager in 1024-row chunks and
    kept up in a few chunks of 256 MiB; docs/distributed.md)."""
    if config.loss_head_chunk_rows is not None:
        return config.loss_head_chunk_rows, ""
    ranks = _ranks()
    if ranks > 1:
        return None, f"no rows cap by default under torch.distributed's {ranks} ranks: host-paced steps"
    return DEFAULT_LOSS_HEAD_CHUNK_ROWS, ""


def _ranks() -> int:
    """Processes in torch.distributed's default group; 1 where it is not initialized."""
    distributed = torch.distributed
    if distributed.is_available() and distributed.is_initialized():
        return distributed.get_world_size()
    return 1


def _rows(chunk: int, vocab: int, dtype: torch.dtype) -> int:
    """Token rows of a chunk of `chunk` bytes, where there are tokens enough."""
    return loss_head.chunk_rows(sys.maxsize, vocab, dtype, chunk)


# -- the Dynamo graph (torch.compile backend) ----------------------------------------------------
@dataclasses.dataclass
class ChunkedGraph:
    """A Dynamo graph with its loss heads chunked: the graph to compile, the decisions, the
    returned logits to attach to the compiled graph's outputs (loss_head.LogitsReturn), and its
    output count before."""
    gm: torch.fx.GraphModule
    decisions: list
    returned: list
    outputs: int


def with_chunked_loss_heads(gm: torch.fx.GraphModule, config: Config) -> ChunkedGraph:
    """A copy of `gm` with its loss heads chunked, or `gm` itself when it has no cross_entropy or
    chunking is off. A copy: a graph memfuse cannot compile runs as captured."""
    outputs = len(_output_values(gm.graph))
    if not config.chunk_loss_head or not any(n.target is F.cross_entropy for n in gm.graph.nodes):
        return ChunkedGraph(gm, [], [], outputs)
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    copied = torch.fx.GraphModule(gm, graph)
    rewritten = [_rewrite(copied.graph, node, config) for node in list(copied.graph.nodes)
                 if node.op == "call_function" and node.target is F.cross_entropy]
    decisions = [decision for decision, _ in rewritten]
    if any(d.chunked for d in decisions):
        copied.graph.lint()
        copied.recompile()
    for decision in decisions:
        _record(decision)
    return ChunkedGraph(copied, decisions, [r for _, r in rewritten if r is not None], outputs)


def _output_values(graph: torch.fx.Graph) -> tuple:
    output = graph.find_nodes(op="output")[0]
    values = output.args[0]
    return tuple(values) if isinstance(values, (tuple, list)) else (values,)


def _record(decision: HeadDecision) -> None:
    if decision.chunked:
        STATS["loss_heads_chunked"] += 1
        log.info("memfuse: %s", decision)
    else:
        fallback_log.info("memfuse: %s", decision)


def _rewrite(graph: torch.fx.Graph, loss: torch.fx.Node, config: Config) -> tuple:
    """(the decision, the LogitsReturn when the head's logits leave the graph, else None)."""
    arguments = dict(zip(CROSS_ENTROPY_PARAMETERS, loss.args)) | dict(loss.kwargs)
    problem = _settings_problem(arguments)
    if problem:
        return HeadDecision(loss.name, False, problem), None
    chain, linear = _chain_to_linear(arguments["input"])
    if linear is None:
        return HeadDecision(loss.name, False, "its input is not a linear layer's output or x @ w.T "
                                              "(transformed by constants, cast and flattened at most)"), None
    problem = _chain_problem(chain, linear)
    if problem:
        return HeadDecision(loss.name, False, problem), None
    transform, problem = match_head(_graph_site(arguments, chain, linear, loss))
    if problem:
        return HeadDecision(loss.name, False, problem), None
    hidden_input, weight, bias = _graph_operands(linear)
    logits_value = linear.meta["example_value"]
    # the logits as the model has them: the linear's output, or the last step of its transform
    logits_node = max((n for n in chain if _transform_step(n)), key=chain.index, default=linear)
    position = chain.index(logits_node) if logits_node in chain else -1
    next_reader = chain[position + 1] if position + 1 < len(chain) else loss
    returned_at = [i for i, value in enumerate(_output_values(graph)) if value is logits_node]
    read_in_graph = [u for u in logits_node.users if u is not next_reader and u.op != "output"]
    returns_logits = len(logits_node.users) > 1
    returned_anywhere = sum(leaf is logits_node for leaf in torch.utils._pytree.tree_leaves(_output_values(graph)))
    # returned at top level only: a nested one would keep the op's logits, without their gradient path
    only_returned = bool(returned_at) and not read_in_graph and returned_anywhere == len(returned_at)
    if returns_logits and not transform.returns_in(logits_value.dtype):
        return HeadDecision(loss.name, False, f"the logits through {transform} are also read or returned, in "
                                              "float32, not their dtype"), None
    with graph.inserting_before(loss):
        hidden = graph.call_function(_flat_rows, (hidden_input,))
        call = head_call(arguments, hidden, weight, bias, logits_value, config, transform, [
            _example(n) for n in (hidden_input, weight, bias)], return_logits=returns_logits,
            differentiable_logits=not only_returned)
        head = graph.call_function(LossHeadCall.op(), call.args())
        head_loss = graph.call_function(operator.getitem, (head, OUTPUT["loss"]))
    loss.replace_all_uses_with(head_loss)
    graph.erase_node(loss)
    for node in reversed(chain[position + 1:]):     # the casts and flattens past the model's logits
        graph.erase_node(node)
    returned = None
    if returns_logits:
        with graph.inserting_after(head_loss):
            flat_logits = graph.call_function(operator.getitem, (head, OUTPUT["logits"]))
        with graph.inserting_after(flat_logits):
            logits = graph.call_function(_rows_like, (flat_logits, hidden_input))
        if only_returned:
            returned = _return_without_gradient(graph, logits, returned_at, hidden_input, weight, bias, transform.spec,
                                                call.chunk_bytes)
        logits_node.replace_all_uses_with(logits)
    for node in reversed(chain[:position + 1]):     # the transform's steps and casts before them
        graph.erase_node(node)
    transposed = linear.args[1] if len(linear.args) > 1 else None
    graph.erase_node(linear)
    if isinstance(transposed, torch.fx.Node) and transposed is not weight and not transposed.users:
        graph.erase_node(transposed)        # x @ w.T: the .T of the weight
    return chunked_decision(loss.name, "a linear layer's output feeds only the loss"
                            + (" and readers past it (returned logits)" if returns_logits else ""), call, config,
                            logits_value, _example(hidden_input), _example(weight),
                            formed=call.with_gradients and not returns_logits), returned


def _return_without_gradient(graph: torch.fx.Graph, logits: torch.fx.Node, positions: list, hidden: torch.fx.Node,
                             weight: torch.fx.Node, bias: Optional[torch.fx.Node], transform: str, chunk: int
                             ) -> loss_head.LogitsReturn:
    """The graph returns `logits` (the op's, which carry no gradient) at `positions`; the linear's
    operands go to attach_returned_logits as the graph's inputs where they are inputs (or a whole
    view of one: HuggingFace's `hidden_states[:, slice(0, None), :]`), else as outputs after the
    graph's own. An operand returned as an output is a copy of it in memfuse's program (a graph
    output never aliases an input): Llama's fp32 hidden states, where FSDP2 or DDP split the head's
    graph from the layers, 33 MB more kept to the backward on a rank of 8192 tokens."""
    output = graph.find_nodes(op="output")[0]
    values = list(_output_values(graph))
    for position in positions:
        values[position] = logits
    inputs = {node: index for index, node in enumerate(graph.find_nodes(op="placeholder"))}

    def place(operand: Optional[torch.fx.Node]) -> Optional[tuple]:
        if operand is None:
            return None
        source = _whole_view_source(operand)
        if source in inputs:
            return "input", inputs[source]
        values.append(operand)
        return "output", len(values) - 1
    places = [place(operand) for operand in (hidden, weight, bias)]
    output.args = (tuple(values),)
    return loss_head.LogitsReturn(tuple(positions), *places, transform, chunk)


def _whole_view_source(node: torch.fx.Node) -> torch.fx.Node:
    """The tensor `node` views whole, through indexing by full slices (`x[:, 0:, :]`, `x[...]`): it
    holds the same elements at the same indices. `node` itself otherwise."""
    while (node.op == "call_function" and node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node)
           and isinstance(node.args[0].meta.get("example_value"), torch.Tensor)
           and all(_whole(index) for index in (node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)))):
        node = node.args[0]
    return node


def _whole(index) -> bool:
    """An index that keeps its dim whole: `...`, or a slice from 0 to the end by 1."""
    return index is Ellipsis or (isinstance(index, slice) and index.start in (None, 0) and index.stop is None
                                 and index.step in (None, 1))


def _plan_note(config: Config, logits, hidden, weight, chunk: int, formed: bool, returned_unknown: bool = False
               ) -> str:
    """The plan loss_head.choose_plan picks at the traced sizes where the forward forms the
    gradients (it picks per call: another token count may pick the other); "" elsewhere.
    `returned_unknown`: whether the logits are returned is known only after the trace (a returned
    head's op writes them and runs the rows plan)."""
    if not formed or not all(isinstance(t, torch.Tensor) for t in (logits, hidden, weight)):
        return ""
    vocab, hidden_size = (_hint(size) for size in weight.shape)
    tokens = _hint(logits.numel()) // max(1, vocab)
    choice = loss_head.choose_plan(tokens, hidden_size, vocab, logits.dtype, weight.dtype, hidden.dtype, chunk,
                                   config.loss_head_plan)
    unless = ", unless the logits are returned" if returned_unknown and choice.name != "rows" else ""
    return f"at {tokens} tokens the {choice} (picked per call{unless})"


def _hint(size) -> int:
    """A size's value at the trace (a symbolic size's hint)."""
    return size if isinstance(size, int) else int(size.node.hint)


def _example(node) -> Optional[torch.Tensor]:
    return getattr(node, "meta", {}).get("example_value") if isinstance(node, torch.fx.Node) else None


def _gradients_in_forward(reduction: str, operands: list) -> bool:
    """A mean or sum loss whose operands need gradients: the forward forms them for an upstream
    gradient of 1 while each chunk's logits are at hand (loss_head.linear_cross_entropy)."""
    return reduction != "none" and torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in operands)


def _settings_problem(arguments: dict) -> Optional[str]:
    if arguments.get("weight") is not None:
        return "a class weight is given (weight=...), which the chunked head does not take"
    if arguments.get("size_average") is not None or arguments.get("reduce") is not None:
        return "the deprecated size_average / reduce arguments are given"
    if arguments.get("reduction", "mean") not in loss_head.REDUCTIONS:
        return f"reduction {arguments['reduction']!r} is not one of {loss_head.REDUCTIONS}"
    for name in ("ignore_index", "label_smoothing", "reduction"):
        if isinstance(arguments.get(name), torch.fx.Node):
            return f"{name} is computed in the graph, not a constant"
    return None


def _chain_to_linear(node) -> tuple[list, Optional[torch.fx.Node]]:
    """The transform's steps, casts and flattens between the loss and a linear, nearest to the
    linear first."""
    chain = []
    while isinstance(node, torch.fx.Node):
        if _graph_operands(node) is not None:
            return list(reversed(chain)), node
        step = _transform_step(node)
        if step is not None:
            chain.append(node)
            node = step[0]
            continue
        if node.op != "call_method" or node.target not in CASTS + FLATTENS:
            return [], None
        chain.append(node)
        node = node.args[0]
    return [], None


def _transform_step(node: torch.fx.Node) -> Optional[tuple]:
    """(the node it transforms, kind, factor) of `x * c`, `c * x`, `x / c` (a number c) or
    `tanh(x)` in a Dynamo graph; None for anything else."""
    if node.op == "call_function":
        kind = TRANSFORM_FUNCTIONS.get(node.target)
    elif node.op == "call_method":
        kind = TRANSFORM_METHODS.get(node.target)
    else:
        return None
    if kind is None or node.kwargs:
        return None
    return _step_of(kind, node.args, torch.fx.Node)


def _step_of(kind: str, args: tuple, tensor_type) -> Optional[tuple]:
    """(the tensor, kind, factor) of a transform's call on `args`: tanh of one tensor, or a multiply
    (either order) or divide (tensor first) of a tensor by a finite number (not 0 for a divide)."""
    if kind == "tanh":
        return (args[0], "tanh", None) if len(args) == 1 and isinstance(args[0], tensor_type) else None
    if len(args) != 2:
        return None
    tensor, factor = args if isinstance(args[0], tensor_type) else (args[1], args[0]) if kind == "mul" else (None, None)
    if not isinstance(tensor, tensor_type) or isinstance(factor, bool) or not isinstance(factor, (int, float)) \
            or not math.isfinite(factor) or (kind == "div" and factor == 0):
        return None
    return tensor, kind, float(factor)


def _transform_of(steps: list, dtypes: set, logits_dtype: torch.dtype) -> tuple:
    """(LogitTransform, problem or None) of steps (kind, factor) whose results were of `dtypes`."""
    if not steps:
        return loss_head.LogitTransform(), None
    if len(dtypes) != 1 or not dtypes <= {torch.float32, logits_dtype}:
        return loss_head.LogitTransform(), "the logits' transform changes dtype between its steps"
    (dtype,) = dtypes
    return loss_head.LogitTransform(tuple(steps), None if dtype == torch.float32 else dtype), None


def _graph_operands(node: torch.fx.Node) -> Optional[tuple]:
    """(hidden, weight, bias) of a linear layer, or of `hidden @ weight.T` (matmul of a transposed
    2-D weight, no bias); None for anything else."""
    if node.op != "call_function":
        return None
    if node.target in LINEARS:
        weight = node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
        return node.args[0], weight, node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    if node.target in MATMULS and len(node.args) == 2 and isinstance(node.args[1], torch.fx.Node):
        weight = _transposed_base(node.args[1])
        return None if weight is None else (node.args[0], weight, None)
    return None


def _transposed_base(node: torch.fx.Node) -> Optional[torch.fx.Node]:
    """w of `w.T`, `w.mT`, `w.t()`, `torch.t(w)` or `w.transpose(0, 1)` for a 2-D w."""
    base = node.args[0] if node.args else None
    value = getattr(base, "meta", {}).get("example_value")
    if value is None or value.dim() != 2:
        return None
    if node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"):
        return base
    if (node.op == "call_method" and node.target == "t") or (node.op == "call_function" and node.target is torch.t):
        return base
    if node.op == "call_method" and node.target == "transpose" and {d % 2 for d in node.args[1:3]} == {0, 1}:
        return base
    return None


def _chain_problem(chain: list, linear: torch.fx.Node) -> Optional[str]:
    if "example_value" not in linear.meta:
        return "the linear's traced value is unknown"
    steps = [n for n in chain if _transform_step(n)]
    if steps and len(linear.users) != 1:
        return "the linear's output is also read besides its transform"
    for node in chain:
        value = node.meta.get("example_value")
        if len(node.users) != 1 and not (steps and node is steps[-1]):
            return f"{node.name} ({node.target}) between the linear and the loss is also read elsewhere"
        if node.target == "to" and (value is None or value.dtype != torch.float32):
            return f"{node.name} converts to something other than float32"
    return None


def _flat_rows(hidden: torch.Tensor) -> torch.Tensor:
    """The linear's input as [tokens, hidden]."""
    return hidden.reshape(-1, hidden.shape[-1])


def _rows_like(flat_logits: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """[tokens, vocab] logits back in the linear's output shape: hidden's leading dims."""
    return flat_logits.view(*hidden.shape[:-1], flat_logits.shape[-1])


# -- while memfuse traces a function (memory_efficient_fusion) -------------------------------------
@dataclasses.dataclass
class _Logits:
    """A tensor the mode follows: a linear's output, or a transformed, cast or flattened form of one."""
    linear_output: torch.Tensor
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: Optional[torch.Tensor]


class LogitsReturned(Exception):
    """A chunked head's logits are also read past the loss: the trace must be redone without it."""


class LossHeadMode(TorchFunctionMode):
    """Follows each linear's output through its transform, casts and flattens; a cross_entropy of
    one becomes the chunked op, called as though the function returned the logits: whether it does
    is known only once it has (`settle`). A followed tensor read by anything else marks its head as read past
    the loss, which this path does not chunk (`LogitsReturned` after the trace)."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.logits: dict[str, torch.Tensor] = {}  # by name: the op's logits of each chunked head
        self.followed: dict[int, _Logits] = {}
        self.transposed: dict[int, torch.Tensor] = {}   # id(w.T) -> w, for x @ w.T
        self.chunked: dict[str, _Logits] = {}     # by the decision's name
        self.read_elsewhere: set[int] = set()     # id() of linear outputs read past their loss
        # id(a followed tensor) -> (its transform's steps (kind, factor, dtype), the last step's result)
        self.lineage: dict[int, tuple] = {}
        self.model_logits: dict[str, torch.Tensor] = {}    # by name: the logits as the model has them
        self.transforms: dict[str, tuple] = {}   # by name: (its LogitTransform, its chunks' bytes)
        self.decisions: list[HeadDecision] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.cross_entropy and id(args[0]) in self.followed:
            return self._chunked_loss(args, kwargs)
        result = func(*args, **kwargs)
        if func in LINEARS:
            self._follow(result, _Logits(result, args[0], *_weight_and_bias(args, kwargs)))
        elif _is_transpose(func, args) and isinstance(result, torch.Tensor):
            self.transposed[id(result)] = args[0]
        elif getattr(func, "__name__", None) in ("matmul", "mm", "__matmul__") and len(args) == 2 \
                and id(args[1]) in self.transposed:
            self._follow(result, _Logits(result, args[0], self.transposed[id(args[1])], None))
        elif args and id(args[0]) in self.followed and _keeps_logits(func, args[0], result):
            self._follow(result, self.followed[id(args[0])])
            self.lineage[id(result)] = self.lineage.get(id(args[0]), ((), None))
        elif (step := _called_step(func, args, kwargs)) is not None and id(step[0]) in self.followed and \
                isinstance(result, torch.Tensor):
            self._follow_step(result, step)
        elif isinstance(result, (torch.Tensor, tuple, list)) and not isinstance(result, torch.Size):
            self._note_reads(args, kwargs)
        return result

    def _follow(self, tensor: torch.Tensor, origin: _Logits) -> None:
        self.followed[id(tensor)] = origin

    def _follow_step(self, result: torch.Tensor, step: tuple) -> None:
        """Follows a step of a transform (loss_head.LogitTransform) of a followed tensor: `result`
        carries its steps so far and is the last one's result."""
        tensor, kind, factor = step
        self._follow(result, self.followed[id(tensor)])
        steps, _ = self.lineage.get(id(tensor), ((), None))
        self.lineage[id(result)] = (steps + ((kind, factor, result.dtype),), result)

    def _note_reads(self, args, kwargs) -> None:
        for leaf in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.followed:
                self.read_elsewhere.add(id(self.followed[id(leaf)].linear_output))

    def _chunked_loss(self, args, kwargs) -> torch.Tensor:
        arguments = dict(zip(CROSS_ENTROPY_PARAMETERS, args)) | kwargs
        origin = self.followed[id(arguments["input"])]
        name = f"cross_entropy_{len(self.decisions)}"
        steps, transformed = self.lineage.get(id(arguments["input"]), ((), None))
        problem = _settings_problem(arguments)
        transform, site_problem = match_head(_traced_site(arguments, steps, origin.linear_output))
        if problem or site_problem:
            self.decisions.append(HeadDecision(name, False, problem or site_problem))
            return F.cross_entropy(*args, **kwargs)
        hidden = origin.hidden.reshape(-1, origin.hidden.shape[-1])
        call = head_call(arguments, hidden, origin.weight, origin.bias, origin.linear_output, self.config, transform,
                         [origin.hidden, origin.weight, origin.bias], return_logits=True, differentiable_logits=False)
        loss, _, logits, *_ = LossHeadCall.op()(*call.args())
        self.chunked[name] = origin
        self.logits[name] = logits
        self.model_logits[name] = origin.linear_output if transformed is None else transformed
        self.transforms[name] = transform, call.chunk_bytes
        # written as though returned; those that are not stay unwritten after the trace (unread_logits_unwritten)
        self.decisions.append(chunked_decision(name, "a linear layer's output feeds only the loss",
                                               dataclasses.replace(call, return_logits=False), self.config,
                                               origin.linear_output, origin.hidden, origin.weight,
                                               formed=call.with_gradients, returned_unknown=True))
        return loss

    def settle(self, outputs: tuple, inputs: tuple) -> tuple:
        """(outputs with each returned head's linear output replaced by the op's logits, then the
        heads' hidden states that are not inputs; their LogitsReturns), or LogitsReturned when a
        head's logits leave in another form (cast, reshaped, read past the loss) or its weight is
        not an input. The decisions of the returned heads say so; the others' logits, written by
        no one, are left to `unread_logits_unwritten` after the trace."""
        returned = set(self.returned_logits(outputs))
        self.decisions = [dataclasses.replace(d, returns_logits=True, reason=d.reason + " and the outputs")
                          if d.loss in returned else d for d in self.decisions]
        outputs, returns, extras = list(outputs), [], []
        for name, logits in self.logits.items():
            if name not in returned:
                continue
            origin, model_logits = self.chunked[name], self.model_logits[name]
            transform, chunk = self.transforms[name]
            positions = tuple(i for i, t in enumerate(outputs) if t is model_logits)
            weight, bias = _input_index(origin.weight, inputs), _input_index(origin.bias, inputs)
            if not positions or id(origin.linear_output) in self.read_elsewhere or weight is None or \
                    (origin.bias is not None and bias is None) or \
                    any(self.followed.get(id(t)) is origin and t is not model_logits for t in outputs):
                raise LogitsReturned([name], "its logits leave cast, reshaped or read past the loss, or its "
                                             "weight is not an input of the traced function")
            if not transform.returns_in(origin.linear_output.dtype):
                raise LogitsReturned([name], f"its logits through {transform} are returned in float32, not "
                                             "their dtype")
            for position in positions:
                outputs[position] = logits.view(model_logits.shape)
            hidden = _input_index(origin.hidden, inputs)
            if hidden is None:      # an intermediate: returned too, as a value of its own (AOTAutograd's
                extras.append(origin.hidden.clone())   # export takes no output that aliases another)
            returns.append(loss_head.LogitsReturn(
                positions, ("input", hidden) if hidden is not None else ("output", len(outputs) + len(extras) - 1),
                ("input", weight), None if bias is None else ("input", bias), transform.spec, chunk))
        return (*outputs, *extras), returns

    def returned_logits(self, outputs) -> list[str]:
        """The chunked heads whose logits are read past the loss or returned."""
        returned = {id(t) for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)}
        returned |= {id(self.followed[i].linear_output) for i in returned if i in self.followed}
        return [name for name, o in self.chunked.items()
                if id(o.linear_output) in returned or id(o.linear_output) in self.read_elsewhere]


def _called_step(func, args, kwargs) -> Optional[tuple]:
    """(the tensor, kind, factor) where a call is a step of a transform: `x * c`, `x / c` (a number
    c), `tanh(x)` as torch's or Tensor's functions; None for anything else."""
    name = getattr(func, "__name__", None)
    kind = TRANSFORM_FUNCTIONS.get(func) or (TRANSFORM_METHODS.get(name) if _is_method(func, (name,)) else None)
    return _step_of(kind, args, torch.Tensor) if kind is not None and not kwargs else None


def _is_transpose(func, args) -> bool:
    """w.T, w.mT (property getters), w.t(), torch.t(w), w.transpose(0, 1) of a 2-D w."""
    if not args or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2:
        return False
    name = getattr(func, "__name__", None)
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", None) in ("T", "mT")
    if name == "transpose":
        return len(args) == 3 and {args[1] % 2, args[2] % 2} == {0, 1}
    return name == "t"


def _weight_and_bias(args, kwargs) -> tuple:
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    return weight, args[2] if len(args) > 2 else kwargs.get("bias")


def _is_method(func, names: tuple) -> bool:
    name = getattr(func, "__name__", None)
    return name in names and getattr(torch.Tensor, name, None) is func


def _keeps_logits(func, before: torch.Tensor, after) -> bool:
    """A cast to float32, or a view, reshape or contiguous copy that keeps the vocabulary last."""
    if not isinstance(after, torch.Tensor) or after.shape[-1:] != before.shape[-1:]:
        return False
    if _is_method(func, CASTS):
        return after.dtype in (torch.float32, before.dtype)
    return _is_method(func, FLATTENS) and after.dtype == before.dtype


def _input_index(tensor: Optional[torch.Tensor], inputs: tuple) -> Optional[int]:
    return next((i for i, t in enumerate(inputs) if t is tensor), None) if tensor is not None else None


def capture_chunked(trace: Callable, fn: Callable, config: Config, returned_logits: bool = True):
    """(`trace(fn)` with each loss head of fn chunked, the decisions, the LogitsReturns). Whether fn
    also returns a head's logits is only known once it has (the linear ran before the loss), so
    every head is traced writing its logits: those fn returns replace the linear's in fn's outputs,
    and the traced function also returns their hidden states, for the runtime to give the logits
    their own backward (loss_head.attach_returned_logits); those it does not return, nothing reads,
    and after the trace their op writes none (`unread_logits_unwritten`): one trace either way.
    Where a head cannot be chunked so (its logits leave cast or reshaped, are read past the loss, or
    the caller cannot take them: `returned_logits` False, CUDA graphs), fn is traced unchunked, and
    that is the decision."""
    if not config.chunk_loss_head:
        return trace(fn), [], []
    modes, returns = [], []      # one mode per run of fn: AOTAutograd runs it more than once

    def chunked(*args):          # eager.USER_CODE_WRAPPERS: a failure in fn below is the trace's
        modes.append(LossHeadMode(config))
        with modes[-1] as mode:
            outputs = fn(*args)
        returned = mode.returned_logits(outputs)
        if returned and not returned_logits:
            raise LogitsReturned(sorted(returned), "CUDA graphs (cuda_graphs=True) replay the outputs as "
                                                   "compiled, and returned chunked logits need their own backward")
        outputs, returns[:] = mode.settle(outputs, args)
        return outputs
    try:
        traced = trace(chunked)
    except LogitsReturned as e:
        why = e.args[1] if len(e.args) > 1 else "its logits are also read past the loss"
        decisions = [HeadDecision(name, False, f"memory_efficient_fusion cannot chunk it: {why}; "
                                  "torch.compile(backend='memfuse') can") for name in e.args[0]]
        for decision in decisions:
            _record(decision)
        return trace(fn), decisions, []
    unread_logits_unwritten(traced)
    decisions = modes[-1].decisions if modes else []
    for decision in decisions:
        _record(decision)
    return traced, decisions, list(returns)


def unread_logits_unwritten(captured) -> None:
    """Each chunked head whose logits nothing in the traced graph reads (fn did not return them)
    calls the op with `return_logits` off and its default `differentiable_logits`, as a head traced
    without them: no [tokens, vocab] logits written. The backward is the same either way (logits
    nobody differentiates hand it no gradient). In the lowered joint graph and in the aten graph
    kept for dumps alike."""
    op = LossHeadCall.op()
    graph = captured.joint
    users = graph.users()
    for name, node in list(graph.nodes.items()):
        if node.op is not Op.EXTERN or node.attr.target is not op:
            continue
        call = LossHeadCall.of(node.attr.args, node.attr.kwargs)
        if not call.return_logits or any(graph[u].op is Op.GETITEM and graph[u].attr.index == OUTPUT["logits"]
                                         for u in users[name]):
            continue
        graph.nodes[name] = dataclasses.replace(node, attr=dataclasses.replace(
            node.attr, args=call.without_logits().args(), kwargs=()))
    for fx_node in captured.aten_graph.graph.nodes if captured.aten_graph is not None else ():
        if fx_node.target is not op:
            continue
        call = LossHeadCall.of(fx_node.args, fx_node.kwargs)
        if call.return_logits and not any(u.target is operator.getitem and u.args[1] == OUTPUT["logits"]
                                          for u in fx_node.users):
            fx_node.args, fx_node.kwargs = call.without_logits().args(), {}
