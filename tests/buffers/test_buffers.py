"""Buffer lifetimes (memfuse.buffers): the plan frees every value once, after its last reader, and
never one a returned value may hold; the generated programs drop exactly what the plan says, and
the memory really goes: a probe before every step (kernel launch, aten call, aten group) reads the
tensor locals of the running program and checks, by weak references to their storages, that
every storage the plan released before the step is gone, saved tensors included, on both paths
(memory_efficient_fusion's autograd.Function and the torch.compile backend)."""
import gc
import re
import sys
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import memfuse
from memfuse.fronts import backend
from memfuse.runtime import program as runtime
from memfuse.buffers import ALLOCATED, BufferPlanError, Origin, memory_timeline, verify_buffer_plan
from memfuse.reports.explain import buffer_lines
from memfuse.runtime.program import KernelLaunch

from helpers import BLOCKS, block_inputs, leaves_like

SHAPE = (2, 5, 16)


# -- small graphs ---------------------------------------------------------------------------------
def layer_norm_block(x, residual, weight, bias1, bias2):
    return BLOCKS["layer_norm_block"].fn(x, residual, weight, bias1, bias2, normalization_axis=-1, dropout_prob=0.0)


def view_chain(x, w):
    """A value computed in one kernel and read through a transpose by the next: two kernels (a
    softmax, a row reduction, is written for the transpose to read; a pointwise value only a
    permute reads is computed at the permuted index instead)."""
    y = torch.softmax(x, -1) * w
    return torch.tanh(y.transpose(0, 1)) * 3


def scale_shift(x, w, b):
    """The backward's weight and bias grads are column sums: rows of one totals tensor."""
    return torch.tanh(x * w + b)


def mlp(x, w1, w2, g, b):
    """LayerNorm, then two extern matmuls around a kernel: aten views saved for the backward,
    extern results read by kernels, a dead kernel output whose storage a later one reuses."""
    h = F.layer_norm(x, (x.shape[-1],), g, b)
    h = torch.tanh(h @ w1)
    return (h * torch.sigmoid(h)) @ w2 + x


def mlp_scaled(x, w1, w2, g, b):
    """The mlp with its hidden activations scaled by their column sums: the forward saves a
    column sum, a row of its kernel's totals."""
    h = torch.tanh(F.layer_norm(x, (x.shape[-1],), g, b) @ w1)
    return (h * h.sum((0, 1))) @ w2 + x


def deep_mlp(x, w1, w2, g, b):
    """Four extern matmuls with tanh between: the forward saves three matmul results (the
    backward rebuilds the tanh and the transposes from them)."""
    h = torch.tanh(F.layer_norm(x, (x.shape[-1],), g, b) @ w1)
    h = torch.tanh(torch.tanh(h @ w2) @ w1)
    return h @ w2 + x


def _inputs(name):
    d = SHAPE[-1]
    x = torch.randn(SHAPE)
    if name == "layer_norm_block":
        tensors, _, _ = block_inputs(name, SHAPE)
        return layer_norm_block, tensors
    if name == "view_chain":
        return view_chain, [x, torch.randn(d)]
    if name == "scale_shift":
        return scale_shift, [x, torch.randn(d), torch.randn(d)]
    fn = {"mlp_scaled": mlp_scaled, "deep_mlp": deep_mlp}.get(name, mlp)
    return fn, [x, torch.randn(d, 2 * d) / 4, torch.randn(2 * d, d) / 4, torch.randn(d), torch.randn(d)]


GRAPHS = ["layer_norm_block", "view_chain", "scale_shift", "mlp"]


def _compiled(name):
    fn, tensors = _inputs(name)
    leaves = [t.requires_grad_() for t in tensors]
    fused = memfuse.memory_efficient_fusion(fn)
    return fn, leaves, fused, fused.compiled_for(*leaves)


# -- the plan --------------------------------------------------------------------------------------
def _reads(program, k: int) -> set:
    """What schedule step k (1-based, as in the plan) reads, from the schedule itself; a column sum
    made where its only reader (a reshape) is, is a read of its totals."""
    step = program.schedule.steps[k - 1]
    plan = program.buffers
    if step.name in plan.rows:
        return {plan.rows[step.name].totals}
    names = step.inputs if hasattr(step, "inputs") else program.graph[step.name].inputs
    return {n for n in names if n in plan.buffers}


def _shape_of(entry) -> dict:
    """What the graphs exercise: kernels, column-sum rows (and those made at their reshape), aten steps."""
    programs = (entry.function.forward, entry.function.backward)
    return {"kernels": sum(len(p.schedule.kernels) for p in programs),
            "rows": sum(len(p.buffers.rows) for p in programs),
            "rows at a reshape": sum(local != r.value for p in programs for local, r in p.buffers.rows.items()),
            "aten steps": sum(len(p.schedule.steps) - len(p.schedule.kernels) for p in programs)}


@pytest.mark.parametrize("name, least", [
    ("layer_norm_block", {"rows": 3, "rows at a reshape": 1}),
    ("view_chain", {"kernels": 4}),
    ("scale_shift", {"rows": 2}),
    ("mlp", {"kernels": 5, "rows": 2, "aten steps": 8})])
def test_the_plan_drops_every_value_once_after_its_last_reader(name, least):
    _, _, _, entry = _compiled(name)
    shape = _shape_of(entry)
    assert all(shape[k] >= n for k, n in least.items()), shape
    for program in (entry.function.forward, entry.function.backward):
        plan = program.buffers
        dropped = {}
        for k, step in enumerate(plan.steps):
            for f in step.frees:
                assert f.buffer not in dropped, f"{f.buffer} dropped twice"
                dropped[f.buffer] = k
        returned = {o for o in program.graph.outputs if o is not None}
        assert set(dropped) == set(plan.buffers) - returned and not returned & set(dropped)
        for k in range(1, len(plan.steps)):
            for read in _reads(program, k):
                assert dropped.get(read, k) >= k, f"{read} dropped at {plan.steps[dropped[read]].name}, read by step {k}"
        for b in plan.buffers.values():
            if b.origin is Origin.ROW:           # a column sum holds its totals' storage
                assert b.storage == {plan.rows[b.name].totals}


def test_a_storage_a_returned_value_may_hold_is_never_released_nor_reused():
    """The forward saves a value whose storage is another buffer's (a column sum: a row of its
    kernel's totals; the plan saves no aten view, it saves the base): that buffer is dropped, its
    storage is not; the backward reuses a dead output."""
    _, _, _, entry = _compiled("mlp_scaled")
    forward, backward = entry.function.forward.buffers, entry.function.backward.buffers
    released = {r for step in forward.steps for f in step.frees for r in f.releases}
    for out in forward.outputs:
        assert not released & forward.buffers[out].storage, out
    bases = {base for out in forward.outputs for base in forward.buffers[out].storage - {out}
             if forward.buffers[base].origin in ALLOCATED}
    dropped = {f.buffer for step in forward.steps for f in step.frees}
    assert bases and bases <= dropped and not bases & released, bases
    reused = [a for step in backward.steps for a in step.allocations if a.reuses is not None]
    assert reused, "a dead kernel output of the same size is reused"
    program = entry.function.backward.source
    for a in reused:
        assert re.search(rf"^    {a.buffer} = .*\b{a.reuses}\b.*; del {a.reuses}$", program, re.MULTILINE), program


def test_the_verifier_rejects_a_free_before_the_last_reader_and_a_reuse_of_a_live_buffer():
    _, _, _, entry = _compiled("deep_mlp")     # its backward reuses storages (the mlp's, one kernel fewer, none)
    program = entry.function.backward
    plan = program.buffers
    verify_buffer_plan(plan, program.schedule)
    k = next(k for k, step in enumerate(plan.steps) if k > 1 and step.frees and step.frees[0].buffer in step.reads)
    early = list(plan.steps)
    f = early[k].frees[0]
    early[k] = replace(early[k], frees=early[k].frees[1:])
    early[k - 1] = replace(early[k - 1], frees=(*early[k - 1].frees, f))
    with pytest.raises(BufferPlanError, match=f"{f.buffer} is dropped after step"):
        verify_buffer_plan(replace(plan, steps=tuple(early)), program.schedule)
    j, a, live = next((j, a, n) for j, step in enumerate(plan.steps) for a in step.allocations if a.reuses is not None
                      for n in step.reads if plan.buffers[n].origin in ALLOCATED
                      and plan.buffers[n].dtype == plan.buffers[a.buffer].dtype)
    steps = list(plan.steps)
    steps[j] = replace(steps[j], allocations=tuple(replace(x, reuses=live) if x is a else x
                                                   for x in steps[j].allocations))
    with pytest.raises(BufferPlanError, match=f"{a.buffer} (cannot take|takes) {live}"):
        verify_buffer_plan(replace(plan, steps=tuple(steps)), program.schedule)


def _chain(n):
    def fn(x):
        for _ in range(n):
            x = torch.cumsum(torch.tanh(x), -1)   # a kernel, then an aten call, n times
        return x
    return fn


def test_peak_of_a_chain_does_not_grow_with_its_length():
    """n kernels alternating with n aten calls, forward only: each step's input dies once read, so
    the program holds two values at most, whatever n (the caller's x goes after the first step)."""
    x = torch.randn(SHAPE)
    peaks, real = [], []
    for n in (2, 6):
        fused = memfuse.memory_efficient_fusion(_chain(n))
        program = fused.compiled_for(x).function.forward
        timeline = memory_timeline(program.buffers, {s: v for s, v in zip(program.symbols, SHAPE[:2])})
        peaks.append(max(p.during for p in timeline))
        with StepWatch(program) as watch:
            torch.testing.assert_close(fused(x), _chain(n)(x))
        real.append(max(r.live_bytes for r in watch.records))
    value = x.numel() * 4
    assert peaks[0] == peaks[1] == 2 * value, peaks     # a step's input and its result
    assert real[0] == real[1] == 3 * value, real        # the same, and the caller's x


# -- the running program: a probe before each step --------------------------------------------------
@dataclass
class Record:
    step: int                  # the plan step about to run
    alive: set                 # the plan buffers the program's locals hold (a contiguous copy counts as its value)
    expired: set               # buffers seen so far whose storage is gone
    live_bytes: int            # bytes of the storages seen so far that are not gone


class StepWatch:
    """Wraps every step a Program's generated functions call (kernel launches, aten calls, aten
    groups) with a probe that reads the calling frame's tensor locals and keeps a weak reference to
    each storage it sees. Records what it found before every step."""

    def __init__(self, program):
        self.program = program
        self.plan = program.buffers
        self.records: list = []
        self.storages: dict = {}          # buffer -> (StorageWeakRef, data_ptr, nbytes) when first seen
        self.undo: list = []

    def __enter__(self):
        program = self.program
        for run, source in {id(program.run): (program.run, program.source),
                            id(program.run_unhooked): (program.run_unhooked, program.source_unhooked)}.values():
            namespace = run.__globals__
            for name, step in self._steps(namespace, source).items():
                self.undo.append((namespace, name, namespace[name]))
                namespace[name] = self._probed(namespace[name], step)
        return self

    def __exit__(self, *exc):
        for namespace, name, value in reversed(self.undo):
            namespace[name] = value

    def _steps(self, namespace: dict, source: str) -> dict:
        """namespace name -> the plan step that calls it."""
        steps = {}
        for name, value in namespace.items():
            if isinstance(value, KernelLaunch):
                steps[name] = next(k for k, s in enumerate(self.plan.steps) if s.name == value.group.name)
        for first, name in re.findall(r"^    (\w+)[\w, ]* = (mf_aten_\d+)\(", source, re.MULTILINE):
            steps[name] = self.plan.buffers[first].step
        return steps

    def _probed(self, call, step: int):
        def probed(*args, **kwargs):
            self.probe(step, sys._getframe(1))
            return call(*args, **kwargs)
        return probed

    def probe(self, step: int, frame) -> None:
        tensors = {n: v for n, v in frame.f_locals.items() if isinstance(v, torch.Tensor)}
        del frame
        # Triton's interpreter leaves each launch's arguments in a reference cycle (its recursive
        # `_to_cpu` / `_from_cpu` closures hold the storages); a compiled launch does not
        gc.collect()
        alive = set()
        for name, t in tensors.items():
            value = name[3:] if name.startswith("mf_") and name[3:] in self.plan.buffers else name
            alive.add(value)
            if value not in self.storages:
                s = t.untyped_storage()
                self.storages[value] = (StorageWeakRef(s), s.data_ptr(), s.nbytes())
        expired = {n for n, (ref, _, _) in self.storages.items() if ref.expired()}
        live = {ptr: size for n, (ref, ptr, size) in self.storages.items() if n not in expired}
        self.records.append(Record(step, alive, expired, sum(live.values())))

    # -- what the plan says -----------------------------------------------------------------------
    def expected_alive(self, k: int) -> set:
        """Buffers the program holds when step k is called: made before it, its allocations, less
        what was dropped before and the storages its allocations took over."""
        alive = set()
        for j, step in enumerate(self.plan.steps[:k + 1]):
            alive |= set(step.made) if j < k else {a.buffer for a in step.allocations}
            alive -= {a.reuses for a in step.allocations}
            if j < k:
                alive -= {f.buffer for f in step.frees if f.reused_by is None}
        return alive

    def released_before(self, k: int) -> set:
        """Storages the plan released before step k that no allocation took over."""
        taken = {a.reuses for step in self.plan.steps for a in step.allocations}
        return {r for step in self.plan.steps[:k] for f in step.frees for r in f.releases} - taken

    def check(self, owned_inputs=frozenset()) -> None:
        self.check_locals()
        self.check_storages(owned_inputs)

    def check_locals(self) -> None:
        """Every probe found exactly the plan's buffers in the program's locals."""
        assert self.records, "no step was probed"
        for r in self.records:
            expected = self.expected_alive(r.step)
            assert r.alive == expected, f"before {self.plan.steps[r.step].name}: {sorted(r.alive ^ expected)}"

    def check_storages(self, owned_inputs=frozenset()) -> None:
        """Every storage the plan released before a step is gone when it runs: intermediates, and
        of the inputs those nobody but the program holds (`owned_inputs`)."""
        assert self.records, "no step was probed"
        inputs = {n for n, b in self.plan.buffers.items() if b.origin is Origin.INPUT}
        for r in self.records:
            gone = {n for n in self.released_before(r.step) if n in self.storages and
                    (n not in inputs or n in owned_inputs)}
            assert gone <= r.expired, f"before {self.plan.steps[r.step].name}: still alive: {sorted(gone - r.expired)}"


def _saved_activations(forward, backward) -> set:
    """The backward's inputs that its forward computed in storage of its own (not a view of a
    primal): once autograd lets go, only the backward program holds them."""
    plan = forward.buffers
    primals = {n for n, b in plan.buffers.items() if b.origin is Origin.INPUT}
    return {n for n in backward.graph.inputs if n in plan.outputs and not plan.buffers[n].storage & primals}


@pytest.mark.parametrize("name", GRAPHS)
def test_the_programs_free_what_they_read_last_and_grads_match_eager(name):
    fn, leaves, fused, entry = _compiled(name)
    refs = leaves_like(leaves)
    with StepWatch(entry.function.forward) as forward, StepWatch(entry.function.backward) as backward:
        out = fused(*leaves)
        grad = torch.randn_like(out)
        out.backward(grad)
    forward.check()
    backward.check(owned_inputs=_saved_activations(entry.function.forward, entry.function.backward))
    fn(*refs).backward(grad)
    for mine, ref in zip(leaves, refs):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_saved_activations_go_as_the_backward_reads_them():
    """The deep mlp's forward saves computed values (three matmul results); each storage is gone
    before the first step after its last reader, not at the end of the backward."""
    _, leaves, fused, entry = _compiled("deep_mlp")
    saved = _saved_activations(entry.function.forward, entry.function.backward)
    assert len(saved) >= 3, saved
    with StepWatch(entry.function.backward) as watch:
        fused(*leaves).sum().backward()
    watch.check(owned_inputs=saved)
    last = watch.records[-1]
    assert saved <= last.expired, saved - last.expired


def test_the_watch_sees_a_program_that_keeps_what_it_read(monkeypatch):
    """The probe can fail: without the writer's dels, or with autograd keeping the saved tensors,
    dead values stay alive and `check` says which."""
    monkeypatch.setattr(runtime._ProgramWriter, "frees", lambda self, step: None)
    _, leaves, fused, entry = _compiled("mlp")
    with StepWatch(entry.function.backward) as watch:
        fused(*leaves).sum().backward()
    with pytest.raises(AssertionError, match=r"still alive: \['\w+'"):
        watch.check_storages()
    monkeypatch.undo()
    monkeypatch.setattr(torch.autograd.function.BackwardCFunction, "maybe_clear_saved_tensors", lambda self: None)
    _, leaves, fused, entry = _compiled("mlp")
    with StepWatch(entry.function.backward) as watch:
        fused(*leaves).sum().backward()
    watch.check_locals()
    with pytest.raises(AssertionError, match="still alive: .*'mm'"):
        watch.check_storages(owned_inputs=_saved_activations(entry.function.forward, entry.function.backward))


def test_retain_graph_keeps_the_saved_tensors_for_a_second_backward():
    fn, leaves, fused, entry = _compiled("mlp")
    saved = _saved_activations(entry.function.forward, entry.function.backward)
    refs = leaves_like(leaves)
    out = fused(*leaves)
    grad = torch.randn_like(out)
    with StepWatch(entry.function.backward) as watch:
        out.backward(grad, retain_graph=True)
    assert not saved & watch.records[-1].expired, "a retained graph keeps its saved tensors"
    out.backward(grad)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(grad)
    ref_out = fn(*refs)
    ref_out.backward(grad, retain_graph=True)
    ref_out.backward(grad)
    for mine, ref in zip(leaves, refs):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_the_program_empties_the_input_list_it_is_given():
    _, leaves, _, entry = _compiled("scale_shift")
    inputs = [t.detach() for t in leaves]
    symbols = entry.function.symbol_values(inputs)
    entry.function.forward.run(inputs, symbols, torch.device("cpu"))
    assert inputs == []


# -- the torch.compile backend ----------------------------------------------------------------------
def test_the_backend_clears_aotautograds_lists_and_frees_saved_tensors(monkeypatch):
    """AOTAutograd's boxed call hands its list over: BackwardStep empties it, and each saved
    activation's storage is gone after its last reader in the backward program."""
    torch._dynamo.reset()
    programs, lists = [], []
    compile_program = backend.compile_program

    def recording_compile(source, config):
        compiled = compile_program(source, config)
        programs.extend(compiled.function)      # the forward and the backward Program
        return compiled
    monkeypatch.setattr(backend, "compile_program", recording_compile)
    boxed = backend.BackwardStep.boxed

    def recording_boxed(self, args):
        lists.append(args)
        return boxed(self, args)
    monkeypatch.setattr(backend.BackwardStep, "boxed", recording_boxed)

    fn, tensors = _inputs("deep_mlp")
    leaves, refs = leaves_like([t.requires_grad_() for t in tensors]), leaves_like(tensors)
    compiled = torch.compile(fn, backend="memfuse")
    out = compiled(*leaves)
    forward, backward = programs
    saved = _saved_activations(forward, backward)
    assert len(saved) >= 3, saved
    with StepWatch(backward) as watch:
        out.backward(torch.ones_like(out))
    watch.check(owned_inputs=saved)
    assert lists and all(args == [] for args in lists)
    fn(*refs).backward(torch.ones_like(out))
    for mine, ref in zip(leaves, refs):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_explain_formats_each_programs_buffer_plan(capsys):
    fn, tensors = _inputs("scale_shift")
    report = memfuse.explain(fn, *[t.requires_grad_() for t in tensors])
    capsys.readouterr()
    text = "\n".join(buffer_lines(report))
    assert "  forward\n" in text and "  backward\n" in text
    assert "allocate mf_totals_float32: float32[2, 16], 128 B: column totals: a new float32 buffer" in text
    assert re.search(r"drop tangents_1: last read by memfuse_backward_0 \(releases tangents_1\)", text), text
    assert re.search(r"peak: \d+ B while memfuse_backward_0 runs", text), text
