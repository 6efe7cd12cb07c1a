"""attention_bias: attention written by hand with an additive float bias runs as one attention call.

Several model families write attention as matmuls and a softmax instead of calling
scaled_dot_product_attention, adding a float bias to the scores: Bloom's ALiBi
(`baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d))`, then the mask added), T5's relative position
bias (`q @ k^T + position_bias + mask`, no scale). Traced as written, the [batch x heads, q, kv]
scores and probabilities are values of the graph, and the backward keeps them. SDPA's
memory-efficient kernel takes an additive bias and returns its gradient: one attention call reads
q, k, v and the bias and keeps only its output and a log-sum-exp per row.

While memfuse traces (a capture trace mode, as the loss head's), `BiasedAttentionMode` follows
each product `q @ k^T` (matmul, bmm, baddbmm of two tensors with the same batch dims) through
   scale (a number, before any bias) -> bias terms added -> views that keep [q, kv] last
   -> softmax over the last dim -> casts -> dropout
to a product with v, and returns one `scaled_dot_product_attention(q, k, v, attn_mask=bias,
dropout_p=p, scale=scale)` there instead (the terms summed, broadcast to [b, h, q, kv], in the
product's dtype). AOTAutograd traces that call, forward and backward, into the attention op of the device (the efficient
kernel on CUDA, with the bias's gradient where the bias requires one; the math path on CPU). What
the product replaced (the scores, the softmax) nothing reads any more, and capture drops it
(capture.fx_passes.without_unused; sizes read off it are read off an input instead,
`sizes_read_from_inputs`); where something else reads it (a model returning its attention
weights), it is still computed: the results are the same, the saving lost.

Conditions, each checked where it can fail (`BiasDecision` says why a product was left as written):
- the same batch dims for q @ k^T and probs @ v, 3 or 4 dims, [q, kv] last throughout;
- a scale by numbers only before any bias (a scale after it would scale the bias);
- each bias term floating and broadcastable to the scores (not broadcasting them);
- the softmax over the kv dim, in the scores' dtype or float32;
- dropout: the attention call's own, of the same probability. On CUDA the efficient kernel draws
  its mask from a philox seed and offset it returns, and its backward reads those (an extern's
  outputs: memfuse keeps them, never recomputes the call), so forward and backward apply one mask;
  on CPU the math path's dropout is memfuse's own, regenerated from its seed. The dropout as
  written is traced too (a random draw the trace keeps though unread) and, where nothing but the
  product read it, erased after the trace (`unread_dropouts_dropped`). Where something else reads
  the dropped probabilities (a model returning them), they show a mask of their own: a dropout
  mask either way, not the one the output used;
- no write into the followed tensors the mode does not follow (`masked_fill_`, `x[i] = y`):
  a write stops the following;
- the result's dtype the written product's (q, k, v and the bias cast to it: under autocast the
  written matmuls run in the autocast dtype too).

Numerics, against the written form: the attention kernel accumulates the scores in float32 and
adds the bias to them there, where the written form under bf16 autocast rounds the scores to bf16
(`baddbmm`'s output) before the float32 softmax; the bias itself is rounded to the compute dtype
either way (baddbmm's autocast casts alibi; SDPA takes q's dtype). So the call's scores are at
least as exact; the probabilities are rounded to the compute dtype for the product with v in
both. tests/patterns/test_attention_bias.py bounds the difference against a float64 reference.
The bias's gradient comes out of the kernel in the compute dtype: where the bias is float32 under
bf16 autocast (T5's learned position bias), eager's gradient of it is float32 and the call's bf16,
cast up (a relative error of bf16's, ~4e-3).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.overrides import TorchFunctionMode

from memfuse.base.debug import STATS, register_counter
from memfuse.ir.patterns import register_capture, register_report

# functions and methods that multiply two batches of matrices (a @ b)
PRODUCTS = {torch.matmul, torch.bmm, torch.Tensor.matmul, torch.Tensor.bmm, torch.Tensor.__matmul__}
# x + bias (bias + x where the bias comes first)
ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.__iadd__}
SCALES = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.__imul__}
DIVIDES = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.__itruediv__}
VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}
CASTS = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.type_as, torch.Tensor.half, torch.Tensor.bfloat16}
BADDBMMS = {torch.baddbmm, torch.Tensor.baddbmm}
ATTENTION_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)   # what SDPA computes in
# node.meta["custom"] key of the nodes of a followed dropout as written
WRITTEN_DROPOUT = "memfuse_attention_bias_written_dropout"
# where each softmax and dropout takes its arguments
SOFTMAX_PARAMETERS = {F.softmax: ("input", "dim", "_stacklevel", "dtype"), torch.softmax: ("input", "dim", "dtype"),
                      torch.Tensor.softmax: ("input", "dim", "dtype")}
DROPOUT_PARAMETERS = {F.dropout: ("input", "p", "training", "inplace"), torch.dropout: ("input", "p", "train")}


@dataclass(frozen=True)
class BiasDecision:
    """What became of one `q @ k^T ... @ v` (explain prints these)."""
    name: str
    taken: bool
    reason: str
    run: Optional[int] = field(default=None, compare=False)   # id of the proxy mode recording the graph, if any

    def __str__(self) -> str:
        return f"{self.name}: {'one attention call' if self.taken else 'left as written'}: {self.reason}"


@dataclass
class Scores:
    """A followed tensor: `scale * (q @ k^T) + sum(terms)` in the shape `shape`, and, once past the
    softmax, that softmax's probabilities (`probs`)."""
    query: torch.Tensor                    # [*batch, q, d]
    key: torch.Tensor                      # [*batch, kv, d]
    scale: float
    terms: list = field(default_factory=list)   # bias terms, each expanded to `shape`
    shape: tuple = ()
    probs: bool = False                    # past the softmax
    dropout: float = 0.0

    def step(self, **changes) -> "Scores":
        return Scores(**{**self.__dict__, "terms": list(self.terms), **changes})


class BiasedAttentionMode(TorchFunctionMode):
    """Follows `q @ k^T` through scale, bias, views, softmax, casts and dropout; a product of the
    probabilities with v becomes one scaled_dot_product_attention call (the module's docstring)."""

    def __init__(self, decisions: list):
        super().__init__()
        self.followed: dict[int, tuple] = {}     # id(tensor) -> (Scores, the tensor: kept alive while followed)
        self.decisions = decisions

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in PRODUCTS and len(args) == 2 and not kwargs and self._scores(args[0]) is not None \
                and self._scores(args[0]).probs:
            return self._attention(func, args)
        if func in DROPOUT_PARAMETERS and args and self._scores(args[0]) is not None and self._scores(args[0]).probs:
            with fx_traceback.annotate({WRITTEN_DROPOUT: True}):   # dropped after the trace where unread
                result = func(*args, **kwargs)
        else:
            result = func(*args, **kwargs)
        followed = self._step(func, args, kwargs, result) if isinstance(result, torch.Tensor) else None
        if _writes(func, args, kwargs):
            self._forget(kwargs.get("out", args[0] if args else None))
        if followed is not None:
            self.followed[id(result)] = (followed, result)
        return result

    def _forget(self, written) -> None:
        """A write into `written` (in place, out=): no followed tensor of its storage holds what its
        Scores says any more (a step this mode follows, `scores += bias`, is followed again after)."""
        if not isinstance(written, torch.Tensor):
            return
        base = written._base if written._base is not None else written
        for key, (_, tensor) in list(self.followed.items()):
            if tensor is written or (tensor._base if tensor._base is not None else tensor) is base:
                del self.followed[key]

    def _scores(self, tensor) -> Optional[Scores]:
        entry = self.followed.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        return entry[0] if entry is not None and entry[1] is tensor else None

    def _step(self, func, args, kwargs, result: torch.Tensor) -> Optional[Scores]:
        """What `result` is, where it is a product q @ k^T or a step of a followed one, else None."""
        if func in PRODUCTS and len(args) == 2 and not kwargs:
            return _product(args[0], args[1], 1.0, result)
        if func in BADDBMMS:
            return _baddbmm(args, kwargs, result)
        scores = self._scores(args[0]) if args else None
        if scores is None:
            if func in ADDS and len(args) == 2 and self._scores(args[1]) is not None and not kwargs:
                return _added(self._scores(args[1]), args[0], result)      # bias + scores
            return None
        if func in VIEWS:
            return _viewed(scores, result)
        if func in CASTS:
            return scores.step(shape=tuple(result.shape)) if scores.probs and result.shape == args[0].shape else None
        if func in DROPOUT_PARAMETERS:
            return _dropped(func, scores, args, kwargs)
        if scores.probs:
            return None
        if func in SOFTMAX_PARAMETERS:
            return _softmax(func, scores, args, kwargs, result)
        if func in ADDS and len(args) == 2 and (not kwargs or kwargs == {"alpha": 1}):
            return _added(scores, args[1], result)
        if func in SCALES | DIVIDES and len(args) == 2 and not kwargs and _number(args[1]) and not scores.terms:
            factor = float(args[1]) if func in SCALES else 1.0 / float(args[1])
            return scores.step(scale=scores.scale * factor)
        return None

    def _attention(self, func, args) -> torch.Tensor:
        """probs @ v as one attention call where the conditions hold, else as written."""
        probs, value = args
        scores = self._scores(probs)
        written = func(probs, value)
        proxy = get_proxy_mode()
        run = None if proxy is None else id(proxy)
        name = f"attention_bias_{sum(d.run == run for d in self.decisions)}"
        problem = _problem(scores, probs, value, written)
        if problem is not None:
            self.decisions.append(BiasDecision(name, False, problem, run))
            return written
        out = _sdpa(scores, value, written.dtype).reshape(written.shape)
        self.decisions.append(BiasDecision(name, True, f"softmax(scale {scores.scale:g} * q @ k^T + "
                                           f"{len(scores.terms)} bias term(s)) @ v over [q, kv] "
                                           f"{tuple(probs.shape[-2:])}: scaled_dot_product_attention "
                                           f"with the bias as its float mask", run))
        return out


def _writes(func, args, kwargs) -> bool:
    """Whether a call may write into its first argument or `out`: an in-place method (`x.add_`,
    `x += y`, `x[i] = y`) or an out= call. Unsure names count as writes: forgetting is safe."""
    name = getattr(func, "__name__", "")
    in_place = (name.endswith("_") and not name.endswith("__")) or (name.startswith("__i") and name.endswith("__"))
    return in_place or name == "__setitem__" or "out" in kwargs or kwargs.get("inplace") is True \
        or (func is F.dropout and len(args) > 3 and args[3] is True)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _product(a, b, scale: float, result: torch.Tensor) -> Optional[Scores]:
    """a @ b as q @ k^T: tensors of 3 or 4 dims with the same batch dims (no broadcast)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() != b.dim() \
            or a.dim() not in (3, 4) or a.shape[:-2] != b.shape[:-2] or not a.is_floating_point():
        return None
    return Scores(a, b.transpose(-1, -2), scale, [], tuple(result.shape))


def _baddbmm(args, kwargs, result: torch.Tensor) -> Optional[Scores]:
    """beta * bias + alpha * (q @ k^T), Bloom's ALiBi: the bias one term."""
    names = ("input", "batch1", "batch2")
    given = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if set(given) != set(names) or set(kwargs) - {*names, "beta", "alpha"} or not (_number(beta) and _number(alpha)):
        return None
    scores = _product(given["batch1"], given["batch2"], float(alpha), result)
    if scores is None:
        return None
    bias = given["input"] if beta == 1 else given["input"] * beta
    return _added(scores, bias, result) if beta != 0 else scores


def _added(scores: Scores, bias, result: torch.Tensor) -> Optional[Scores]:
    """scores + bias: a floating tensor broadcastable to the scores, not broadcasting them."""
    if scores.probs or not isinstance(bias, torch.Tensor) or not bias.is_floating_point() \
            or tuple(result.shape) != scores.shape:
        return None
    try:
        term = bias.expand(scores.shape)
    except RuntimeError:
        return None
    return scores.step(terms=[*scores.terms, term])


def _viewed(scores: Scores, result: torch.Tensor) -> Optional[Scores]:
    """A view that keeps [q, kv] last and changes only the batch dims (3 or 4 of them in all)."""
    if tuple(result.shape[-2:]) != scores.shape[-2:] or result.dim() not in (3, 4):
        return None
    return scores.step(terms=[t.reshape(result.shape) for t in scores.terms], shape=tuple(result.shape))


def _softmax(func, scores: Scores, args, kwargs, result: torch.Tensor) -> Optional[Scores]:
    """softmax over the last dim, in the scores' dtype or float32."""
    given = dict(zip(SOFTMAX_PARAMETERS[func], args)) | kwargs
    if given.get("dim") not in (-1, len(scores.shape) - 1) or given.get("dtype") not in (None, torch.float32) \
            or set(given) - {"input", "dim", "dtype", "_stacklevel"}:
        return None
    return scores.step(probs=True, shape=tuple(result.shape))


def _dropped(func, scores: Scores, args, kwargs) -> Optional[Scores]:
    """dropout of the probabilities: its probability, 0 where not training."""
    if not scores.probs:
        return None
    given = dict(zip(DROPOUT_PARAMETERS[func], args)) | kwargs
    p, training = given.get("p", 0.5), given.get("training", given.get("train", True))
    return scores.step(dropout=float(p) if training else 0.0)


def _problem(scores: Scores, probs: torch.Tensor, value: torch.Tensor, written: torch.Tensor) -> Optional[str]:
    """Why probs @ v stays as written, or None."""
    if value.dim() != probs.dim() or value.shape[:-2] != probs.shape[:-2] or value.shape[-2] != probs.shape[-1]:
        return f"v {tuple(value.shape)} does not match the probabilities {tuple(probs.shape)} batch for batch"
    if scores.query.shape[:-2].numel() != probs.shape[:-2].numel():
        return "q @ k^T and probs @ v have different batch sizes"
    if written.dtype not in ATTENTION_DTYPES:
        return f"the product's dtype {written.dtype} is not one attention computes in"
    return None


def _sdpa(scores: Scores, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The attention call: q, k, v and the summed bias in [b, h, ., .] form, in `dtype`."""
    batch = scores.shape[:-2] if len(scores.shape) == 4 else (1, *scores.shape[:-2])

    def four(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*batch, *t.shape[-2:]).to(dtype)
    bias = None
    for term in scores.terms:
        bias = term if bias is None else bias + term
    if bias is not None:
        if torch.finfo(bias.dtype).max > torch.finfo(dtype).max:
            bias = bias.clamp(min=torch.finfo(dtype).min)   # a mask's lowest value stays finite in `dtype`
        bias = four(bias)
    with torch.autocast(value.device.type, enabled=False):
        return F.scaled_dot_product_attention(four(scores.query), four(scores.key), four(value), attn_mask=bias,
                                              dropout_p=scores.dropout, scale=scores.scale)


# -- capture's hooks: the mode while AOTAutograd traces; its decisions after -------------------------
# Each trace_modes() entry opens one mode (capture's and the backend's may nest). Capture's rewrite
# hooks run after the trace, inside the backend's entry or after capture's: the decisions of the
# modes opened since the outermost one are the graph's, the latest that decided anything.
_OPEN: list = []        # the decision lists of the modes opened since the outermost
_DEPTH = [0]


class _Trace:
    def __enter__(self):
        if _DEPTH[0] == 0:
            _OPEN.clear()          # a trace that failed before its rewrite hook ran leaves nothing behind
        _DEPTH[0] += 1
        self.decisions = []
        _OPEN.append(self.decisions)
        self.mode = BiasedAttentionMode(self.decisions)
        self.mode.__enter__()
        return self.mode

    def __exit__(self, *exc):
        _DEPTH[0] -= 1
        self.mode.__exit__(*exc)


def biased_attention() -> _Trace:
    """A context: inside it, hand-written biased attention is traced as one attention call."""
    return _Trace()


def _decisions(gm: torch.fx.GraphModule) -> tuple:
    """(whether the dropouts as written were dropped, the decisions of the last trace, counted)."""
    last = next((d for d in reversed(_OPEN) if d), [])
    decisions = traced_run(last)
    for made in _OPEN:
        made.clear()
    for decision in decisions:
        STATS["attention_biases_fused" if decision.taken else "attention_biases_kept"] += 1
    if not any(d.taken for d in decisions):
        return False, decisions
    return unread_dropouts_dropped(gm) | sizes_read_from_inputs(gm), decisions


def unread_dropouts_dropped(gm: torch.fx.GraphModule) -> bool:
    """Erases the followed dropouts as written (WRITTEN_DROPOUT) that nothing reads: a random draw
    stays in a trace though unread (capture.fx_passes.without_unused: it advances the generator),
    and would keep the scores and softmax it reads alive. The attention call draws its own mask.
    Whether any went (their inputs may be unread now)."""
    erased = False
    for node in reversed(list(gm.graph.nodes)):
        if node.op == "call_function" and not node.users and node.meta.get("custom", {}).get(WRITTEN_DROPOUT):
            gm.graph.erase_node(node)
            erased = True
    return erased


def traced_run(decisions: list) -> list:
    """The decisions made while the graph was recorded: AOTAutograd runs the traced function more
    than once inside one trace (a pass that collects metadata, then the recorded one), deciding
    alike each time; the recorded run is the last one under a proxy mode."""
    runs = [d.run for d in decisions if d.run is not None]
    return [d for d in decisions if d.run == runs[-1]] if runs else decisions


def sizes_read_from_inputs(gm: torch.fx.GraphModule) -> bool:
    """Each size the graph reads off a computed value, where an input has that size in some dim,
    read off the input instead: a size read is a use, and one of the written scores or
    probabilities (Bloom's `probs.view(b * h, q, -1)` reads its last size) would keep them, and
    the products and softmax they come from, in the graph. Whether any changed."""
    sym_size = torch.ops.aten.sym_size.int
    sources = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        for dim, size in enumerate(val.shape if isinstance(val, torch.Tensor) else ()):
            if isinstance(size, torch.SymInt):
                sources.setdefault(size.node.expr, (node, dim))
    changed = False
    for node in list(gm.graph.find_nodes(op="call_function", target=sym_size)):
        val, source = node.meta.get("val"), node.args[0]
        found = sources.get(val.node.expr) if isinstance(val, torch.SymInt) else None
        if found is None or source.op == "placeholder":
            continue
        with gm.graph.inserting_before(node):
            read = gm.graph.call_function(sym_size, found)
        read.meta = dict(node.meta)
        node.replace_all_uses_with(read)
        gm.graph.erase_node(node)
        changed = True
    return changed


register_capture("attention_bias", trace_mode=biased_attention, rewrite=_decisions)
register_report("attention_bias", "attention with an additive bias (memfuse.patterns.attention_bias)")
register_counter("attention_biases_fused", "hand-written attention with an additive bias (softmax(q @ k^T + bias) "
                                           "@ v) traced as one scaled_dot_product_attention call "
                                           "(memfuse.patterns.attention_bias)")
register_counter("attention_biases_kept", "hand-written attention with an additive bias left as written, for the "
                                          "reason its decision gives (memfuse.patterns.attention_bias)")
