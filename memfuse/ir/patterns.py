"""patterns: the one table where a plug-in (memfuse.patterns: the loss head, attention masks) tells
the core what it must know about the ops it adds or owns, as Thunder's
`register_implementation(op, impl, checker=...)` does.

Per extern op, one frozen `ExternRule`, looked up with a default (`rule(target)`):
- `reads`: how the op reads its tensor operands: in memory as they lie (CONTIGUOUS, aten's default),
  through any strides (ANY_STRIDES: the chunked loss head), through any strides whose last is 1
  (LAST_DIM_IN_PLACE: attention), or in the strides the trace gave them (AS_TRACED: a custom op
  no pattern registered). capture keeps a view only such readers read an aten view.
- `implementation`: what a program calls in the op's place (memfuse.runtime.externs): the same
  arguments and results, without the dispatcher's and autograd's wrappers.
- `in_place`: the op's in-place twin (memfuse.schedule.reinplace): a callable that, given the graph
  and the node, says whether and why the call may write into its operands (an `InPlaceChoice`), or
  None.
- `untracked`: the output positions autograd does not track for a call (by the call's arguments).
- `reason`: why it is an extern (capture's fallbacks, the coverage table).

Per pattern, hooks capture runs at fixed moments (`CaptureHooks`): a mode entered while AOTAutograd
traces, and a rewrite of the aten graph before lowering that returns the pattern's decisions
(kept in `Captured.decisions[name]`, which explain prints under the pattern's title).

The core consults these tables and never names a pattern; the plug-ins register from
memfuse.patterns, which the package imports once (memfuse/__init__.py). A wrapper target (a
pattern's callable standing for an aten op, as attention's size-only mask calls) names the op it
calls as its `calls` attribute: its rule is that op's.
"""
from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


class Reads(enum.Enum):
    CONTIGUOUS = "in memory as they lie"              # aten's default: a view may need a copy first
    ANY_STRIDES = "through any strides"
    LAST_DIM_IN_PLACE = "through any strides whose last is 1"
    AS_TRACED = "in the strides the trace gave them"


@dataclass(frozen=True)
class InPlaceChoice:
    """An extern call made in place: the twin op to call (same arguments), what it writes into, and
    why that is safe."""
    target: Any
    base: str
    reason: str


@dataclass(frozen=True)
class ExternRule:
    """What the core knows of one extern op (see the module's docstring)."""
    op: Any = None
    reads: Reads = Reads.CONTIGUOUS
    implementation: Optional[Callable] = None
    in_place: Optional[Callable] = None            # (graph, node, users, outputs, replayed) -> InPlaceChoice | None
    untracked: Optional[Callable] = None           # (Extern) -> frozenset of output positions
    reason: str = ""
    # results that alias a saved value only the call reads (an in-place twin's): the program's own
    # memory, not the caller's, so a returned view of one may alias it (memfuse.schedule.groups)
    own_aliases: tuple = ()


DEFAULT = ExternRule()
# A custom op (torch.library, not aten's) no pattern registered: eager hands it its operands as
# they are (a transposed weight as a transposed view), and torch.compile keeps their exact strides
# (torch._functorch.config.custom_op_default_layout_constraint, "needs_exact_strides"). Copying such
# a view to contiguous memory first would cost a kernel that reads and writes all of it (a stack of
# expert weights per layer, forward and backward) and would hand the op strides eager never does.
CUSTOM_OP = ExternRule(reads=Reads.AS_TRACED)
RULES: dict = {}


def register_extern(op, **rule) -> ExternRule:
    """Register what the core must know of `op` (ExternRule's fields by name); returns the record."""
    record = ExternRule(op, **rule)
    RULES[op] = record
    return record


def called_op(target):
    """The op an extern's target calls: a wrapper's `calls`, else the target itself."""
    return target if isinstance(target, torch._ops.OpOverload) else getattr(target, "calls", target)


def rule(target) -> ExternRule:
    """The registered rule of `target` (or of the op a wrapper target calls), else CUSTOM_OP for a
    custom op, else DEFAULT."""
    op = called_op(target)
    if op in RULES:
        return RULES[op]
    custom = isinstance(op, torch._ops.OpOverload) and op.namespace not in ("aten", "prim", "prims")
    return CUSTOM_OP if custom else DEFAULT


def reading(how: Reads) -> set:
    """The registered ops that read their operands `how`."""
    return {op for op, r in RULES.items() if r.reads is how}


# -- per pattern: capture's hooks and explain's sections -------------------------------------------
@dataclass(frozen=True)
class CaptureHooks:
    """A pattern's part in capture: `trace_mode()` a context entered while AOTAutograd traces;
    `rewrite(gm)` runs on the aten graph before lowering and returns (whether it changed the graph,
    the pattern's decisions)."""
    name: str                                     # the key of its decisions (Captured.decisions)
    trace_mode: Optional[Callable] = None
    rewrite: Optional[Callable] = None


@dataclass(frozen=True)
class ReportSection:
    """How explain prints a pattern's decisions: a title and a line per decision."""
    name: str                                     # the key of its decisions (Captured.decisions)
    title: str
    line: Callable = str


HOOKS: dict = {}          # pattern name -> CaptureHooks, in registration order
SECTIONS: dict = {}       # pattern name -> ReportSection, in registration order


def register_capture(name: str, *, trace_mode: Optional[Callable] = None,
                     rewrite: Optional[Callable] = None) -> CaptureHooks:
    HOOKS[name] = CaptureHooks(name, trace_mode, rewrite)
    return HOOKS[name]


def register_report(name: str, title: str, line: Callable = str) -> ReportSection:
    SECTIONS[name] = ReportSection(name, title, line)
    return SECTIONS[name]


@contextlib.contextmanager
def trace_modes():
    """Every registered pattern's trace mode, entered while AOTAutograd traces."""
    with contextlib.ExitStack() as stack:
        for hooks in HOOKS.values():
            if hooks.trace_mode is not None:
                stack.enter_context(hooks.trace_mode())
        yield


def rewrite_aten(gm) -> tuple:
    """(whether any pattern changed `gm`, {pattern name: its decisions}) of every registered rewrite."""
    changed, decisions = False, {}
    for hooks in HOOKS.values():
        if hooks.rewrite is not None:
            took, decisions[hooks.name] = hooks.rewrite(gm)
            changed |= took
    return changed, decisions


@dataclass(frozen=True)
class OutputHook:
    """What a compiled call's outputs need after a program ran: `extra_outputs` outputs past the
    caller's are for it, and `apply(results, outputs, inputs)` puts its values into `results` (the
    caller's outputs, a list). The chunked loss head's returned logits get their backward so."""
    extra_outputs: int
    apply: Callable = field(compare=False)


def with_output_hooks(outputs, inputs, hooks: list, count: int) -> list:
    """The first `count` outputs (the caller's), each hook applied."""
    results = list(outputs[:count])
    for hook in hooks:
        hook.apply(results, outputs, inputs)
    return results
