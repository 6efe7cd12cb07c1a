"""fallback: the calls and graphs memfuse runs through torch, op by op, instead of a compiled program.

A memory_efficient_fusion call: each is a decision, an `EagerCall` with its reason and the way
out, that fronts.function.FusedFunction makes:
- an argument it cannot trace (`untraceable_argument`): an object the call may mutate, such as a
  KV cache; decided per call, since the object is new in every call;
- a functorch transform around the call (`under_transform`);
- a compile that failed (`compile_failed`, through driver.compile.compile_or_decide), decided
  once per compile key: the stage it failed in, the exception's type and first line, and the way
  out its type calls for (WAYS_OUT).
`say_once` logs each reason once per process on the `fallbacks` topic; in strict mode the
decision is a StrictModeError instead.

A torch.compile graph whose compile failed, wherever it did (`graph_fallback`): the reason and
where it was raised, logged and counted when the backend hands the graph back to torch; in strict
mode a RuntimeError chained to the failure.

A compiled program whose FIRST run fails (`first_run_failed`, `graph_fallback(first_run=...)`):
Triton compiles a kernel at its first launch, a launch checks its arguments (their device, a
kernel's limits), an extern checks its own rules (an attention kernel's alignment). Such a failure
is a compile problem found late: the graph (a FusedFunction's compile key, a torch.compile graph)
runs through torch from then on, logged and counted (`first_run_fallbacks`); strict mode raises.
A later run's failure is raised as it is: the program ran before, so the failure is no compile
problem (a transient error, the caller's input). An `InputError` (memfuse.ir.targets: a gather
index outside the vocabulary, which eager's op rejects too) is the caller's at any run: raised, the
program kept. So is a `MemoryBudgetError` (memfuse.plan: a byte budget below the least the step
can need), at compile time: the caller's setting, which running through torch would ignore. The
rules of the first run, what it may redo:
- a forward's first run failing: nothing happened that torch could see twice. A program writes
  only into buffers it allocates, never into its inputs (FusedFunction refuses an input mutation
  at the trace; AOTAutograd applies a graph's input mutations, BatchNorm's running statistics,
  after the compiled forward returned), so the call runs again through torch from its inputs.
- a backward's first run failing: the forward ran memfuse's program and saved memfuse's values
  (recomputation plan, seeds), which torch cannot read. So until a backward has run once, each
  forward keeps its inputs (references, checked for in-place changes), and the failed backward
  recomputes the gradients through torch from them: the traced function again (FusedFunction)
  or the joint graph AOTAutograd traced (the backend). A graph with random ops (dropout) draws its
  masks again there: its gradients for that one step are those of torch's masks, not of the masks
  whose loss the forward returned (documented limit; strict mode raises instead). A traced
  function is run again as capture traced it (driver.compile.Compiled.traced: the patterns'
  wrappers in, a chunked loss head's hidden states returned for its logits' own backward), so
  every output the program returns gets its gradient. On a GPU a kernel Triton refuses fails the compile itself
  (runtime.precompile), before any forward ran, which leaves launches and externs to this rule.
"""
from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from pathlib import Path

from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from memfuse.ir.captured import MutatedInputError
from memfuse.base.debug import STATS, topic_log

fallback_log = topic_log("fallbacks")
STRICT = " (strict mode: MEMFUSE_STRICT=1 / Config.strict)"   # the end of every strict-mode error
CONSTANT_NAMES = "bool, int, float, str, None, torch.dtype"   # fronts.function.CONSTANT_TYPES, as messages name them
MESSAGE_LIMIT = 400   # characters of a failure's first line in its reason (the traceback: MEMFUSE_LOG=fallbacks)


class StrictModeError(NotImplementedError):
    """Strict mode (Config.strict, MEMFUSE_STRICT=1): something would run through aten or torch."""


class UntraceableOutputError(TypeError):
    """fn returns something memfuse.fronts.outputs cannot rebuild: no tensor, an object it cannot see
    into (no `__dict__`), a symbolic size no returned tensor carries."""


@dataclass(frozen=True)
class EagerCall:
    """The decision to run a call of `name` through torch, op by op, instead of a compiled program:
    why, and what the user can do about it. `memfuse.explain` returns it for such a call."""
    name: str
    reason: str
    way_out: str

    def __str__(self) -> str:
        return f"memfuse: {self.name} runs through torch, not compiled: {self.reason}. Way out: {self.way_out}"


CACHE_WAY_OUT = ("a KV cache is for generation: for training pass use_cache=False to the model "
                 "(or set model.config.use_cache = False), so that the layers get no cache")
UNTRACEABLE_WAY_OUT = ("pass tensors and constants, or tuples, lists, dicts or registered dataclasses of them "
                       "(torch.utils._pytree.register_dataclass); keep objects the call may mutate out of it")

# A failed compile's way out, by what failed: the first row whose exception types match.
WAYS_OUT = (
    ((GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException),
     "the function depends on a tensor's values (.item(), `if t.any():`, nonzero): move that part out of "
     "the fused function, or pass the value as a Python number"),
    ((MutatedInputError,),
     "write results to new tensors instead of into an argument (x = x * 2, not x.mul_(2)), or leave that "
     "module unfused (a module's buffers written in place are written back after the call)"),
    ((UntraceableOutputError,),
     f"return a tensor, or a pytree (tuple, list, dict, dataclass) of tensors, constants ({CONSTANT_NAMES}) and "
     f"objects whose attributes hold them (memfuse.fronts.outputs), with at least one tensor"),
    ((Exception,), "MEMFUSE_STRICT=1 raises the error with its traceback; if the original runs in eager, "
                   "this is memfuse's limit: please report it"),
)


def untraceable_argument(name: str, argument: str, value) -> EagerCall:
    """`argument` (as messages name it) is `value`, which is no tensor, constant or pytree of them."""
    reason = (f"argument {argument} is a {type(value).__name__}, which memfuse cannot trace: not a tensor, "
              f"a constant ({CONSTANT_NAMES}) or a pytree of them")
    cache = any(c.__name__.endswith("Cache") for c in type(value).__mro__)
    return EagerCall(name, reason, CACHE_WAY_OUT if cache else UNTRACEABLE_WAY_OUT)


def mixed_devices(name: str, argument: str, device, expected) -> EagerCall:
    """A call whose tensor arguments lie on two devices (eager allows a CPU scalar beside GPU
    tensors); a program launches on one."""
    return EagerCall(name, f"argument {argument} is on {device}, the other tensor arguments on {expected}: a "
                           f"compiled program runs on one device",
                     "pass every tensor argument on one device (a CPU scalar as a Python number, or moved with .to())")


def under_transform(name: str) -> EagerCall:
    """memfuse's kernels read real tensors' memory, not a functorch transform's wrappers."""
    return EagerCall(name, "a functorch transform (vmap, grad, jacrev, ...) is active",
                     "apply the transform outside a function memfuse compiles, or call the original under it")


def compile_failed(name: str, error: Exception) -> EagerCall:
    """The decision for a compile that raised `error`: the stage it failed in, its type and message."""
    way_out = next(text for types, text in WAYS_OUT if isinstance(error, types))
    message = (str(error).strip().splitlines() or [""])[0].removeprefix("memfuse: ").rstrip(".")
    return EagerCall(name, f"compiling it failed in {_failed_stage(error)}: {type(error).__name__}: "
                           f"{message[:MESSAGE_LIMIT]}", way_out)


# Functions outside fronts.function and fronts.module that call the user's code, or torch on its behalf, while capture
# traces it: a failure under them is the trace's (memfuse.patterns.loss_head.detect's wrapper and TorchFunctionMode that
# swap in the chunked loss head).
USER_CODE_WRAPPERS = ("chunked", "__torch_function__")


def _failed_stage(error: BaseException) -> str:
    """The innermost memfuse module in the traceback, leaving out the wrappers that run the user's
    code (fronts.function, fronts.module, USER_CODE_WRAPPERS): "memfuse.capture.trace" for a trace of the user's code that
    fails."""
    package = Path(__file__).resolve().parents[1]
    stage = "memfuse"
    tb = error.__traceback__
    while tb is not None:
        path = Path(tb.tb_frame.f_code.co_filename)
        if package in path.parents:
            name = ".".join(path.relative_to(package).with_suffix("").parts)
            runs_user_code = name in ("fronts.function", "fronts.module") or tb.tb_frame.f_code.co_name in USER_CODE_WRAPPERS
            stage = stage if runs_user_code else f"memfuse.{name}"
        tb = tb.tb_next
    return stage


TOLD: set = set()   # (name, reason) of the decisions logged


def say_once(decision: EagerCall) -> None:
    """Log a decision on the `fallbacks` topic, once per name and reason in this process."""
    if (decision.name, decision.reason) not in TOLD:
        TOLD.add((decision.name, decision.reason))
        fallback_log.warning("%s (said once per reason)", decision)


def first_run_failed(name: str, program: str, error: Exception) -> EagerCall:
    """The decision for a compiled call whose first `program` run ("forward", "backward") raised
    `error`: run through torch from now on, for the reason."""
    message = (str(error).strip().splitlines() or [""])[0].removeprefix("memfuse: ").rstrip(".")
    return EagerCall(name, f"the compiled program's first {program} run failed in {_failed_stage(error)}: "
                           f"{type(error).__name__}: {message[:MESSAGE_LIMIT]}", WAYS_OUT[-1][1])


def count_first_run_fallback(error: Exception) -> None:
    """Count a first run's failure, its traceback logged at MEMFUSE_LOG=debug (the decision itself:
    say_once)."""
    STATS["first_run_fallbacks"] += 1
    fallback_log.debug("memfuse: a compiled program's first run failed", exc_info=error)


# -- a torch.compile graph --------------------------------------------------------------------------
def graph_fallback(name: str, error: Exception, strict: bool, first_run: str = "") -> str:
    """The decision for a torch.compile graph whose compile raised `error` (wherever it did:
    AOTAutograd's trace, the partition, a compiler), or whose program's `first_run` ("forward",
    "backward") did: the reason (the exception, where it was raised), logged once with the way
    out and counted (`graph_fallbacks`, and `first_run_fallbacks`); in strict mode an error,
    chained to the failure."""
    reason = f"{type(error).__name__}: {error} (raised {_raised_at(error)})"
    if first_run:
        reason = f"its first {first_run} run failed: {reason}"
    if strict:
        what = f"run graph {name}" if first_run else f"compile graph {name}"
        raise RuntimeError(f"memfuse: could not {what}: {reason}; strict mode "
                           f"(MEMFUSE_STRICT=1 / Config.strict) makes this an error, without it "
                           f"the graph runs through torch") from error
    STATS["graph_fallbacks"] += 1
    STATS["first_run_fallbacks"] += bool(first_run)
    fallback_log.warning("memfuse: graph %s runs through torch (eager), not memfuse: %s. MEMFUSE_STRICT=1 "
                         "raises it with its traceback; MEMFUSE_LOG=debug logs the traceback here", name,
                         reason, exc_info=error if fallback_log.isEnabledFor(logging.DEBUG) else None)
    return reason


_MEMFUSE_DIR = Path(__file__).resolve().parents[1]


def _raised_at(error: Exception) -> str:
    """Where `error` was raised (file:line (function), the file from its package folder on) and,
    when that is outside memfuse, the innermost memfuse stage it passed through."""
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if _MEMFUSE_DIR in Path(f.filename).parents and f.name != "memfuse_backend"]
    where = f"in {_frame(frames[-1])}"
    if ours and ours[-1] is not frames[-1]:
        where += f", from {_frame(ours[-1])}"
    return where


def _frame(frame: traceback.FrameSummary) -> str:
    path = Path(frame.filename)
    package = next((p for p in path.parents if p.parent.name in ("site-packages", "dist-packages")
                    or p == _MEMFUSE_DIR), None)
    shown = path.relative_to(package.parent) if package is not None else path.name
    return f"{shown}:{frame.lineno} ({frame.name})"
