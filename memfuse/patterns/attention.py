"""attention: an attention mask built from sizes alone runs as the attention kernel's own causal
mask (or as no mask), where at the call's sizes it is one.

Traced, HuggingFace's models build their attention mask as a tensor: under any trace (torch.compile's
too) their mask code takes its trace-friendly path and hands scaled_dot_product_attention a
[batch, 1, q, kv] mask made of aranges and compares, where eager passes none and asks for
`is_causal`. With a mask the attention kernel computes every block and reads the mask; the causal
kernel skips the blocks above the diagonal, about half the work of a square causal call (Llama of
benchmarks/models.py: its traced attention takes several times eager's).

A mask whose subgraph reads no tensor's values, only sizes, is one constant per set of sizes.
`size_only_masks` gives each attention call that reads such a mask (the forward's and the
backward's) the sizes in its place, and makes the call an `AttentionCall`: at each new set of sizes
the first call evaluates the mask's subgraph on the device and looks at it (one wait for the GPU
per set of sizes, shared by the forward and the backward); where it is the causal mask the call
runs with `is_causal=True` and no mask, where it masks nothing with neither, otherwise with the
mask, evaluated again at every call. Results never rest on a guess about the mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx
from torch.overrides import TorchFunctionMode

from memfuse.base.debug import STATS, register_counter
from memfuse.base.launch import outside_trace  # noqa: F401  (run on real tensors inside a trace)
from memfuse.ir.patterns import Reads, register_capture, register_extern, register_report, rule

aten = torch.ops.aten

# attention op -> (its mask argument, its is_causal argument), forward and backward alike
MASK_ARGUMENTS = {
    aten._scaled_dot_product_cudnn_attention.default: ("attn_bias", "is_causal"),
    aten._scaled_dot_product_cudnn_attention_backward.default: ("attn_bias", "is_causal"),
    aten._scaled_dot_product_efficient_attention.default: ("attn_bias", "is_causal"),
    aten._scaled_dot_product_efficient_attention_backward.default: ("attn_bias", "is_causal"),
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("attn_mask", "is_causal"),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("attn_mask", "is_causal"),
}
# A float mask's entry at most this masks its position: torch's cuDNN attention turns a boolean
# mask into a bias of -65504 (fp16's lowest) where eager's other kernels use -inf. Either way the
# position's weight, exp(score - 65504 - row max), is 0 in fp32 unless the row's scores differ by
# tens of thousands; `is_causal`, what eager runs for such a model, masks exactly.
MASKED_BIAS = -65504.0
# scaled_dot_product_attention(query, key, value, attn_mask, ...): where its mask sits
MASK_AT = 3
# ops that read a tensor's size, never its values: where a size-only subgraph starts
SIZE_READS = (aten.sym_size.int,)


@dataclass(frozen=True)
class MaskDecision:
    """What became of one attention call's mask (explain prints these)."""
    call: str                 # the attention node
    mask: str                 # the mask node it read
    taken: bool               # the call now gets sizes and decides per call
    reason: str

    def __str__(self) -> str:
        return f"{self.call}: mask {self.mask} {'replaced' if self.taken else 'kept'}: {self.reason}"


class SizeOnlyMask:
    """A mask's subgraph as a function of the sizes it reads, and what it is at each set of sizes
    seen: "causal", "none" (masks nothing) or None (anything else)."""

    def __init__(self, evaluate: torch.fx.GraphModule, name: str):
        self.evaluate = evaluate
        self.name = name
        self.forms: dict = {}

    def resolve(self, sizes: tuple) -> tuple:
        """(mask or None, is_causal) for a call at `sizes`."""
        form = self.forms.get(sizes, False)
        if form is False:
            # built from sizes alone: looked at on real values, also under a compile-only step's FakeTensorMode
            form = self.forms[sizes] = outside_trace(lambda: mask_form(self.evaluate(*sizes)))
            STATS["attention_masks_checked"] += 1
        if form is None:
            return self.evaluate(*sizes), False
        STATS["attention_masks_dropped"] += 1
        return None, form == "causal"


def mask_form(mask: torch.Tensor) -> Optional[str]:
    """"none" where the mask keeps every position, "causal" where it keeps exactly the lower
    triangle of each square [q, kv] block (what `is_causal=True` means), else None. A boolean
    mask keeps its True positions, a float mask its zeros; its others must be at most MASKED_BIAS."""
    if mask.dim() < 2:
        return None
    if mask.dtype == torch.bool:
        kept = mask
    elif mask.is_floating_point():
        kept = mask == 0
        if not bool((kept | (mask <= MASKED_BIAS)).all()):
            return None
    else:
        return None
    if bool(kept.all()):
        return "none"
    q, kv = kept.shape[-2:]
    if q == kv and bool((kept == torch.ones(q, kv, dtype=torch.bool, device=kept.device).tril()).all()):
        return "causal"
    return None


class AttentionCall:
    """An attention op whose mask argument holds the sizes of a SizeOnlyMask: per call, the mask
    (or None) and is_causal that `SizeOnlyMask.resolve` gives for them."""

    def __init__(self, op: torch._ops.OpOverload, mask: SizeOnlyMask):
        self.op = op
        self.calls = op                    # the op whose rules (memfuse.ir.patterns) the call keeps
        self.run = rule(op).implementation or op     # what a program calls for the op (the bias's rule)
        self.mask = mask
        self.schema = op._schema           # what memfuse's buffer and schedule rules read of an aten call
        mask_name, causal_name = MASK_ARGUMENTS[op]
        self.mask_at, self.causal_at = _position(op, mask_name), _position(op, causal_name)
        self.mask_name, self.causal_name = mask_name, causal_name
        # what torch.fx prints for a call of it (dumps of the aten graph, explain's)
        self.__name__ = f"sizes_mask_{op._schema.name.split('::')[-1]}"
        self.__module__ = __name__

    def __call__(self, *args, **kwargs):
        args = list(args)
        sizes = args[self.mask_at] if self.mask_at < len(args) else kwargs[self.mask_name]
        mask, causal = self.mask.resolve(tuple(sizes))
        _put(args, kwargs, self.mask_at, self.mask_name, mask)
        _put(args, kwargs, self.causal_at, self.causal_name, causal)
        return self.run(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.op} (mask {self.mask.name}: built from sizes, causal or none decided per size)"


# the keyword arguments an InputMaskCall takes beside its op's: the input its mask is made from,
# and the sizes the mask's subgraph reads
INPUT_MASK_KWARGS = ("mf_mask_input", "mf_mask_sizes")


class InputMask:
    """A mask's subgraph as a function of one boolean input mask and sizes: what it makes of that
    input where the input is a marked form (`marked_form`), at each set of sizes seen."""

    def __init__(self, evaluate: torch.fx.GraphModule, name: str):
        self.evaluate = evaluate
        self.name = name
        self.forms: dict = {}

    def resolve(self, source: torch.Tensor, sizes: tuple) -> Optional[str]:
        """"causal", "none", or None (use the mask as computed) for a call whose input is `source`."""
        marked = marked_form(source)
        if marked is None:
            return None
        key = (marked, tuple(source.shape), sizes)
        form = self.forms.get(key, False)
        if form is False:
            # as SizeOnlyMask.resolve
            form = self.forms[key] = outside_trace(lambda: mask_form(self.evaluate(mask_like(source, marked), *sizes)))
            STATS["attention_masks_checked"] += 1
        return form


class InputMaskCall(AttentionCall):
    """An attention op whose mask is made from one boolean input mask (`InputMask`): where that
    input arrives marked causal or masking nothing, and the mask made from it is then causal or
    masks nothing, the op runs with is_causal and no mask; otherwise with the mask as computed."""

    def __init__(self, op: torch._ops.OpOverload, mask: InputMask):
        super().__init__(op, mask)
        self.__name__ = f"input_mask_{op._schema.name.split('::')[-1]}"

    def __call__(self, *args, **kwargs):
        source, sizes = kwargs.pop(INPUT_MASK_KWARGS[0]), kwargs.pop(INPUT_MASK_KWARGS[1])
        form = self.mask.resolve(source, tuple(sizes))
        if form is not None:
            args = list(args)
            STATS["attention_masks_dropped"] += 1
            _put(args, kwargs, self.mask_at, self.mask_name, None)
            _put(args, kwargs, self.causal_at, self.causal_name, form == "causal")
        return self.run(*args, **kwargs)

    def __str__(self) -> str:
        return f"{self.op} (mask {self.mask.name}: made from an input, causal or none where it arrives marked)"


def _position(op: torch._ops.OpOverload, name: str) -> int:
    """Where argument `name` sits in `op`'s schema."""
    return [a.name for a in op._schema.arguments].index(name)


def _put(args: list, kwargs: dict, at: int, name: str, value) -> None:
    if at < len(args):
        args[at] = value
    else:
        kwargs[name] = value


class _DenseMasks(TorchFunctionMode):
    """While memfuse traces: scaled_dot_product_attention gets its mask dense in its last dim.
    HuggingFace's bidirectional mask (BERT) is a [1, 1, q, 1] compare broadcast to
    [batch, 1, q, kv]: a mask whose last stride is 0, which neither cuDNN nor the efficient kernel
    takes, so the trace decomposed the attention into fp32 matmuls and a softmax whose [batch x
    heads, q, kv] weights the backward kept. Made contiguous, the trace keeps a fused attention op
    (the same values), whose mask `size_only_masks` can then drop."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch._C._nn.scaled_dot_product_attention:
            args, kwargs = dense_mask(args, kwargs)
        return func(*args, **kwargs)


def dense_mask(args: tuple, kwargs: dict) -> tuple:
    """scaled_dot_product_attention's (args, kwargs), a mask broadcast along its last dim made
    contiguous."""
    mask = args[MASK_AT] if len(args) > MASK_AT else kwargs.get("attn_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() == 0 or mask.stride(-1) != 0 or mask.shape[-1] == 1:
        return args, kwargs
    if len(args) > MASK_AT:
        return (*args[:MASK_AT], mask.contiguous(), *args[MASK_AT + 1:]), kwargs
    return args, {**kwargs, "attn_mask": mask.contiguous()}


def dense_masks() -> TorchFunctionMode:
    """A context: inside it, attention masks broadcast along their last dim reach the trace
    contiguous."""
    return _DenseMasks()


def size_only_masks(gm: torch.fx.GraphModule) -> list:
    """Rewrites `gm` in place: each attention call whose mask is built from sizes alone, and is
    causal or masks nothing at the traced sizes, becomes an AttentionCall reading those sizes (the
    caller drops the mask's nodes nothing reads any more). Returns a MaskDecision per attention
    call with a mask."""
    decisions, masks, from_inputs = [], {}, {}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in MASK_ARGUMENTS:
            continue
        mask_name, _ = MASK_ARGUMENTS[node.target]
        at = _position(node.target, mask_name)
        mask = node.args[at] if at < len(node.args) else node.kwargs.get(mask_name)
        if not isinstance(mask, torch.fx.Node):
            continue
        if mask not in masks:
            masks[mask] = _size_only(gm, mask)
        found = masks[mask]
        if isinstance(found, str):
            if mask not in from_inputs:
                from_inputs[mask] = _from_one_input(gm, mask)
            source = from_inputs[mask]
            if source is None:
                decisions.append(MaskDecision(node.name, mask.name, False, found))
                continue
            input_mask, placeholder, leaves = source
            node.update_kwarg(INPUT_MASK_KWARGS[0], placeholder)
            node.update_kwarg(INPUT_MASK_KWARGS[1], list(leaves))
            node.target = InputMaskCall(node.target, input_mask)
            decisions.append(MaskDecision(node.name, mask.name, True,
                                          f"made from input {placeholder.name} alone: where that input arrives marked "
                                          f"by the graph that built it from sizes (causal or masking nothing), the "
                                          f"call runs with is_causal and no mask (looked at once per form and size); "
                                          f"otherwise with the mask"))
            continue
        size_mask, leaves, form = found
        if at < len(node.args):
            node.update_arg(at, list(leaves))
        else:
            node.update_kwarg(mask_name, list(leaves))
        node.target = AttentionCall(node.target, size_mask)
        decisions.append(MaskDecision(node.name, mask.name, True,
                                      f"built from sizes alone, {form} at the traced sizes: the call gets the sizes "
                                      f"and runs with is_causal={form == 'causal'} and no mask at every size where "
                                      f"the mask is {form} (checked once per size)"))
    return decisions


def _from_one_input(gm: torch.fx.GraphModule, mask: torch.fx.Node):
    """(InputMask, the input it reads, the size nodes it reads) where `mask` is computed from one
    boolean [batch, 1, q, kv] input, sizes and constants (HuggingFace's `where(mask, 0, -inf)` of
    a mask another graph built: a layer wrapped alone, a graph Dynamo's DDPOptimizer split off), else
    None."""
    found = _mask_subgraph(mask, takes_an_input=True)
    if isinstance(found, str):
        return None
    leaves, inside, source = found
    if source is None or None in [_hint(leaf) for leaf in leaves]:
        return None
    return InputMask(_evaluator(gm, [source, *leaves], inside, mask), source.name), source, leaves


def _size_only(gm: torch.fx.GraphModule, mask: torch.fx.Node):
    """(SizeOnlyMask, the size nodes it reads, its form at the traced sizes), or why not."""
    found = _mask_subgraph(mask, takes_an_input=False)
    if isinstance(found, str):
        return found
    leaves, inside, _ = found
    hints = [_hint(leaf) for leaf in leaves]
    if None in hints:
        return "reads a size with no traced value"
    evaluate = _evaluator(gm, leaves, inside, mask)
    try:
        form = mask_form(outside_trace(lambda: evaluate(*hints)))
    except Exception as error:          # a device this process cannot run on, say: leave the mask be
        return f"could not be evaluated at the traced sizes ({type(error).__name__}: {error})"
    if form is None:
        return "built from sizes alone, but neither causal nor empty at the traced sizes"
    return SizeOnlyMask(evaluate, mask.name), leaves, form


def _mask_subgraph(mask: torch.fx.Node, takes_an_input: bool):
    """(the size nodes the subgraph computing `mask` reads, its nodes, the one boolean 4-d input it
    reads where `takes_an_input`, else None), or why it is not a function of sizes (and that input)."""
    leaves, inside, stack, source = [], set(), [mask], None
    while stack:
        node = stack.pop()
        if node in inside or node in leaves or node is source:
            continue
        val = node.meta.get("val")
        if node.op == "placeholder":
            if isinstance(val, (torch.SymInt, int)):
                leaves.append(node)
                continue
            if not takes_an_input or source is not None or not isinstance(val, torch.Tensor) \
                    or val.dtype != torch.bool or val.dim() != 4:
                return f"reads the values of input {node.name}"
            source = node
            continue
        if node.op == "call_function" and node.target in SIZE_READS:
            leaves.append(node)
            continue
        if node.op == "get_attr":
            inside.add(node)
            continue
        if node.op != "call_function":
            return f"reads {node.format_node()}"
        if isinstance(node.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in node.target.tags:
            return f"draws random numbers ({node.target})"
        inside.add(node)
        stack.extend(node.all_input_nodes)
    return leaves, inside, source


def _evaluator(gm: torch.fx.GraphModule, placeholders: list, inside: set, mask: torch.fx.Node) -> torch.fx.GraphModule:
    """The nodes `inside` as a graph of its own, taking `placeholders` and returning `mask`."""
    graph, env = torch.fx.Graph(), {}
    for node in placeholders:
        env[node] = graph.placeholder(node.name)
    for node in gm.graph.nodes:
        if node in inside:
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(env[mask])
    return torch.fx.GraphModule(gm, graph)


# -- masks that leave one compiled graph for another: marked by the first, rebuilt by the second ----
# Under torch.compile, HuggingFace's model code (transformers 5.17 on torch 2.11) builds the causal
# mask in a graph before the first layer and hands it to every layer call. Where those layers are
# FusedModules (each layer fused, the rest through the backend) a layer receives the mask as a
# tensor argument, and a tensor argument is a mask: Llama's attention takes more than twice its
# is_causal time so. The backend marks such an output (a [batch, 1, q, q]
# boolean mask the graph computes) with its form ("causal", "none") and the tensor's version
# counter. It looks at the mask once per key: the call's sizes and, for each tensor the mask reads
# (HuggingFace's reads the position ids, to find packed sequences), that tensor's SIZES_MARK, which
# the graph that built it from sizes alone left on it (the graph, the output, the sizes: the same
# values every time). A mask that reads an unmarked tensor (HuggingFace's position ids come from
# eager code where Dynamo breaks the model at each fused layer) is left unmarked, unless
# Config.check_returned_masks has it looked at every call (one wait for the GPU). A FusedFunction
# that receives a tensor whose mark still holds (same version: not written since) traces the call
# with a mask built from its sizes in its place, which `size_only_masks` then runs as is_causal.
# The mark joins the compile key: an unmarked mask of the same shape gets a program that reads it.
MARK = "_memfuse_mask_form"
SIZES_MARK = "_memfuse_built_from_sizes"


def returned_masks(gm: torch.fx.GraphModule, count: int) -> tuple[list, list]:
    """What OutputMasks marks among the first `count` outputs of `gm`, the values it computes
    (not an input passed through): (masks, sized). masks: (position, the placeholder positions its
    subgraph reads) of each [batch, 1, q, q] boolean mask that reads nothing else (no randomness);
    sized: the positions of the other outputs built from sizes alone."""
    outputs = gm.graph.find_nodes(op="output")[0].args[0]
    placeholders = gm.graph.find_nodes(op="placeholder")
    masks, sized = [], []
    for position, node in enumerate(outputs[:count]):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or _passes_an_input(node):
            continue
        reads = _tensors_read(node)
        if reads is None:
            continue
        if val.dtype == torch.bool and val.dim() == 4 and val.shape[1] == 1 and val.shape[2] == val.shape[3]:
            masks.append((position, tuple(placeholders.index(p) for p in reads)))
        elif not reads:
            sized.append(position)
    return masks, sized


def _passes_an_input(node: torch.fx.Node) -> bool:
    """Whether `node` is an input or a chain of views of one."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view:
        node = node.args[0]
    return node.op == "placeholder"


def _tensors_read(value: torch.fx.Node) -> Optional[list]:
    """The tensor inputs whose values `value`'s subgraph reads, or None where it also draws random
    numbers or reads anything but calls, sizes and constants."""
    tensors, seen, stack = [], set(), [value]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if not isinstance(node.meta.get("val"), (torch.SymInt, int)):
                tensors.append(node)
            continue
        if node.op == "get_attr" or (node.op == "call_function" and node.target in SIZE_READS):
            continue
        if node.op != "call_function" or (isinstance(node.target, torch._ops.OpOverload)
                                          and torch.Tag.nondeterministic_seeded in node.target.tags):
            return None
        stack.extend(node.all_input_nodes)
    return tensors


class OutputMasks:
    """Marks a compiled graph's returned masks and values built from sizes (`returned_masks`)."""

    def __init__(self, masks: list, sized: list, every_call: bool = False):
        self.masks = masks
        self.sized = sized
        self.every_call = every_call     # Config.check_returned_masks
        self.reads = sorted({i for _, reads in masks for i in reads})
        self.forms: dict = {}      # (position, sizes, marks of what it reads) -> "causal", "none" or None

    def read_marks(self, inputs: list) -> dict:
        """The SIZES_MARK of each input a mask reads (None where it has none): before the call,
        which empties its input list."""
        return {i: sizes_mark(inputs[i]) for i in self.reads}

    def mark(self, outputs, sizes: tuple, input_marks: dict) -> None:
        for position in self.sized:
            setattr(outputs[position], SIZES_MARK, ((self, position, sizes), outputs[position]._version))
        for position, reads in self.masks:
            mask = outputs[position]
            marks = tuple(input_marks[i] for i in reads)
            key = (position, sizes, marks) if None not in marks else None
            if key is None and not self.every_call:
                continue
            form = self.forms.get(key, False)
            if form is False:
                form = mask_form(mask)
                STATS["attention_masks_checked"] += 1
                if key is not None:
                    self.forms[key] = form
            if form is not None:
                setattr(mask, MARK, (form, mask._version))


def sizes_mark(tensor) -> Optional[tuple]:
    """Which graph, output and sizes built `tensor` from sizes alone, or None: never marked, or
    written since."""
    mark = getattr(tensor, SIZES_MARK, None) if isinstance(tensor, torch.Tensor) else None
    return mark[0] if mark is not None and mark[1] == tensor._version else None


def marked_form(tensor: torch.Tensor) -> Optional[str]:
    """The form an OutputMasks marked `tensor` with, or None: never marked, or written since. On
    the compile key's path: a dtype read before the attribute lookup, which misses on most tensors."""
    if tensor.dtype is not torch.bool:
        return None
    mark = getattr(tensor, MARK, None)
    return mark[0] if mark is not None and mark[1] == tensor._version else None


def mask_like(mask: torch.Tensor, form: str) -> torch.Tensor:
    """A boolean mask of `mask`'s shape built from its sizes alone: the lower triangle of each
    [q, kv] block ("causal") or every position ("none")."""
    q, kv = mask.shape[-2:]
    kept = torch.ones(q, kv, dtype=torch.bool, device=mask.device)
    return (kept.tril() if form == "causal" else kept).expand(mask.shape)


def _hint(node: torch.fx.Node) -> Optional[int]:
    val = node.meta.get("val")
    if isinstance(val, torch.SymInt):
        return val.node.hint
    return val if isinstance(val, int) else None


# -- what the core must know (memfuse.ir.patterns) --------------------------------------------------
# Attention reads query, key, value, its output and their gradients in any strides whose last is 1:
# eager hands it `linear(x).view(b, s, h, d).transpose(1, 2)` as it lies, and its backward returns
# gradients laid out as those inputs.
ATTENTION_OPS = (aten._scaled_dot_product_cudnn_attention.default,
                 aten._scaled_dot_product_cudnn_attention_backward.default,
                 aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_efficient_attention_backward.default,
                 aten._scaled_dot_product_flash_attention.default,
                 aten._scaled_dot_product_flash_attention_backward.default,
                 aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward.default)


# -- the memory-efficient kernel's rule for its bias -----------------------------------------------
# The memory-efficient attention kernel reads its bias in vectors: every stride but the last must be
# a multiple of BIAS_ALIGNMENT elements (a dim of size 1 or of stride 0 aside), the last stride 1, the
# data aligned to BIAS_ALIGNMENT_BYTES; else it raises "attn_bias is not correctly aligned". Eager's
# scaled_dot_product_attention obeys the rule before it calls the op (aten's attention.cpp,
# preprocess_mask: the last dim padded to a multiple of 8, then sliced back), and so must memfuse's
# programs, whose kernels write a bias dense in its own shape (Swin's [windows, heads, 49, 49]:
# stride 7203) or hand over a saved one: the program calls the op through `with_aligned_bias`.
BIAS_ALIGNMENT = 8               # elements: aten's mem_eff_alignment (preprocess_mask)
BIAS_ALIGNMENT_BYTES = 16        # the bias's address: a 16-byte vector's
ALIGNED_BIAS_OPS = (aten._scaled_dot_product_efficient_attention.default,
                    aten._scaled_dot_product_efficient_attention_backward.default)


def bias_aligned(bias: torch.Tensor) -> bool:
    """Whether the memory-efficient kernel takes `bias` as it lies (the rule above)."""
    if bias.dim() == 0 or bias.stride(-1) != 1 or bias.data_ptr() % BIAS_ALIGNMENT_BYTES:
        return False
    return all(size == 1 or stride % BIAS_ALIGNMENT == 0
               for size, stride in zip(bias.shape[:-1], bias.stride()[:-1]))


def aligned_bias(bias: torch.Tensor) -> torch.Tensor:
    """`bias` itself where the kernel takes it, else its values in a fresh tensor whose last dim is
    padded to a multiple of BIAS_ALIGNMENT and sliced back (what aten's preprocess_mask does); dims
    broadcast with stride 0 stay broadcast (copied once, not once per index)."""
    if bias_aligned(bias):
        return bias
    if bias.dim() == 0:
        bias = bias.reshape(1)
    distinct = bias[tuple(slice(0, 1) if stride == 0 and k < bias.dim() - 1 else slice(None)
                          for k, stride in enumerate(bias.stride()))]
    width = bias.shape[-1]
    padded = -(-width // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    aligned = bias.new_empty((*distinct.shape[:-1], padded))[..., :width]
    aligned.copy_(distinct)
    return aligned.expand(bias.shape)


def with_aligned_bias(op: torch._ops.OpOverload) -> Callable:
    """`op` called with its attn_bias made one the memory-efficient kernel takes (`aligned_bias`):
    what memfuse's programs call in the op's place (ExternRule.implementation)."""
    at = _position(op, "attn_bias")

    def call(*args, **kwargs):
        bias = args[at] if at < len(args) else kwargs.get("attn_bias")
        if isinstance(bias, torch.Tensor) and not bias_aligned(bias):
            args, kwargs = list(args), dict(kwargs)
            _put(args, kwargs, at, "attn_bias", aligned_bias(bias))
        return op(*args, **kwargs)

    call.__name__ = f"aligned_bias_{op._schema.name.split('::')[-1]}"
    call.__module__ = __name__
    return call


def _size_only_rewrite(gm: torch.fx.GraphModule) -> tuple:
    """(whether any call now takes sizes for its mask, the MaskDecisions): capture's hook."""
    decisions = size_only_masks(gm)
    return any(d.taken for d in decisions), decisions


for _op in ATTENTION_OPS:
    register_extern(_op, reads=Reads.LAST_DIM_IN_PLACE,
                    implementation=with_aligned_bias(_op) if _op in ALIGNED_BIAS_OPS else None)
# a broadcast mask would send the trace to SDPA's math path: masks reach it dense
register_capture("attention_masks", trace_mode=dense_masks, rewrite=_size_only_rewrite)
register_report("attention_masks", "attention masks (memfuse.patterns.attention)")
register_counter("attention_masks_checked", "sets of sizes at which an attention mask built from sizes alone was "
                                            "evaluated and looked at (memfuse.patterns.attention: one wait for the "
                                            "GPU each)")
register_counter("attention_masks_dropped", "attention calls run with is_causal or no mask where the traced graph "
                                            "passed a mask built from sizes alone, found causal or empty at the "
                                            "call's sizes")
