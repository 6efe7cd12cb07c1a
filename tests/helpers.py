"""Shared test helpers: the seed's blocks as workloads, eager references, error measures, and what a
function compiles to (`compiled`, `assert_compiles`, read from memfuse.explain's records)."""
from __future__ import annotations

import dataclasses

import torch

import memfuse
from benchmarks.lib import workloads

# The seed's three blocks, with their parameter counts and constants, from the benchmark registry.
BLOCKS = {w.fn.__name__: w for w in workloads.registry() if w.dtype == torch.float32}
assert set(BLOCKS) == {"layer_norm_block", "primitive_layer_norm_block", "rms_norm_block"}, BLOCKS


def workload(name: str, shape, dtype=torch.float32) -> workloads.Workload:
    return dataclasses.replace(BLOCKS[name], shape=tuple(shape), dtype=dtype)


def block_inputs(name: str, shape, dtype=torch.float32, dropout_prob: float = 0.0):
    """(tensors, consts, grad_output) for one block; every tensor requires grad."""
    step = workload(name, shape, dtype).make_inputs("cpu")
    consts = dict(step.consts, dropout_prob=dropout_prob)
    return step.tensors, consts, step.grad_output


def leaves_like(tensors, dtype=None):
    """Fresh leaf copies (optionally cast) that require grad like the originals."""
    return [t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad) for t in tensors]


def forward_backward(fn, tensors, consts, grad_output):
    """Run fn on fresh leaves, backward with grad_output; returns (output, [input grads])."""
    leaves = leaves_like(tensors)
    out = fn(*leaves, **consts)
    out.backward(grad_output.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - b|| / ||b||, computed in fp64 (||a - b|| where b is all zeros or empty)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    actual, expected = actual.double(), expected.double()
    diff, scale = (actual - expected).norm().item(), expected.norm().item()
    return diff / scale if scale > 0 else diff


def counters() -> dict:
    return dict(memfuse.stats())


def delta(before: dict) -> dict:
    after = memfuse.stats()
    return {k: after[k] - before[k] for k in after}


# -- what a function compiles to (as tinygrad's check_schedule): read from memfuse.explain's records --
@dataclasses.dataclass(frozen=True)
class CompiledFacts:
    """What memfuse compiled a call into, as its own records say (memfuse.explain's Report)."""
    forward_kernels: int               # generated Triton kernels of the forward program
    backward_kernels: int              # ... of the backward program (0: nothing needs a gradient)
    aten_groups: int                   # kernel groups run through aten instead, both programs
    externs: dict                      # program ("forward" / "backward") -> targets of its extern calls that compute
    saved: tuple                       # explain.SavedRow of every value the forward keeps for backward
    saved_bytes: int                   # planned bytes kept beyond the inputs (Plan.saved_bytes)
    regenerated: tuple                 # values the backward redraws from the seed instead of saving
    fallbacks: tuple                   # (node, target) of each op capture sent to aten
    report: object                     # the Report itself, printed when an expectation fails

    @property
    def saved_computed(self) -> tuple:
        """The saved values that are not inputs of the call."""
        return tuple(s for s in self.saved if not s.is_input)


def _computes(target: str) -> bool:
    """An extern step that calls an op which computes ("aten.mm.default"): not a view op run through
    aten (permute, view), a getitem of a tuple result, or the reshape the runtime makes of a finished
    column sum (explain's ExternRow.target: the op's qualified name, or words for the others)."""
    name = target.split(" ", 1)[0]
    if "." not in name:
        return False
    namespace, *rest = name.split(".")
    op = getattr(torch.ops, namespace)
    for part in rest:
        op = getattr(op, part, None)
    return not getattr(op, "is_view", False)


def compiled(fn, *args, **kwargs) -> CompiledFacts:
    """Compile `fn` for these arguments (memfuse.explain) and read what it compiled to. A call that
    runs through torch instead fails the test with memfuse's reason."""
    report = memfuse.explain(fn, *args, **kwargs)
    assert hasattr(report, "kernels_of"), f"the call runs through torch, not compiled: {report}"
    externs = {program: tuple(e.target for e in report.externs if e.program == program and _computes(e.target))
               for program in ("forward", "backward")}
    regenerated = tuple(d.name for d in report.decisions if d.decision.value == "regenerate")
    return CompiledFacts(len(report.kernels_of("forward")), len(report.kernels_of("backward")),
                         sum(not k.is_kernel for k in report.kernels), externs, tuple(report.saved),
                         report.saved_bytes, regenerated, tuple((f.node, f.target) for f in report.fallbacks), report)


def assert_compiles(fn, *args, forward_kernels: int = None, backward_kernels: int = None,
                    max_saved_bytes: int = None, forward_externs: int = None, backward_externs: int = None,
                    aten_groups: int = None, **kwargs) -> CompiledFacts:
    """Compile `fn(*args, **kwargs)` and check each expectation given (None: not checked); a failure
    names every expectation missed and prints explain's report. Returns the facts for further checks."""
    facts = compiled(fn, *args, **kwargs)
    actual = {"forward_kernels": facts.forward_kernels, "backward_kernels": facts.backward_kernels,
              "forward_externs": len(facts.externs["forward"]), "backward_externs": len(facts.externs["backward"]),
              "aten_groups": facts.aten_groups}
    expected = {"forward_kernels": forward_kernels, "backward_kernels": backward_kernels,
                "forward_externs": forward_externs, "backward_externs": backward_externs, "aten_groups": aten_groups}
    missed = [f"{name}: expected {want}, compiled to {actual[name]}"
              for name, want in expected.items() if want is not None and actual[name] != want]
    if max_saved_bytes is not None and facts.saved_bytes > max_saved_bytes:
        missed.append(f"saved_bytes: expected at most {max_saved_bytes}, the plan keeps {facts.saved_bytes} "
                      f"beyond the inputs")
    assert not missed, "; ".join(missed) + f"\n\n{facts.report}"
    return facts
