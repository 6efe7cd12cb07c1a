"""Offloaded saved values (Plan.offloaded, memfuse.runtime.offload; Config.offload_saved forces it):
results and gradients are eager's and bitwise those of the run that keeps them on the device; the
forward returns host copies made right after the step that makes each value; the backward fetches
each one a few launching steps before its first reader and waits right before it, never at the
start; dropout masks are regenerated from the seed as without offloading; torch.compile's graphs
pass the host tensors through; CUDA graphs turn it off. On a GPU: the memory held between the
forward and the backward drops by the offloaded bytes."""
import re

import pytest
import torch
import torch.nn.functional as F

import memfuse
from helpers import rel_error
from memfuse.base.debug import human_bytes
from memfuse.fronts.backend import watch

ALL = memfuse.Config(offload_saved="all", offload_min_bytes=0, check=True)


def residual_layers(x, *weights):
    """Three pre-norm MLP layers on a residual stream, as a transformer's."""
    for up, down in zip(weights[::2], weights[1::2]):
        x = x + F.gelu(F.layer_norm(x, x.shape[-1:]) @ up) @ down
    return (x,)


def residual_inputs(rows=12, width=16, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(rows, width, generator=generator)]
    tensors += [torch.randn(*shape, generator=generator) / 4 for _ in range(3) for shape in ((width, 32), (32, width))]
    return [t.to(device) for t in tensors]


P = 0.3


def dropout_mlp(x, w1, w2):
    """The dropped input is an output too: the test reads the forward's mask from it."""
    dropped = F.dropout(x, P, training=True)
    return F.gelu(dropped @ w1) @ w2, dropped


def dropout_inputs():
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(12, 16, generator=generator).abs() + 0.5, torch.randn(16, 32, generator=generator) / 4,
            torch.randn(32, 8, generator=generator) / 4]


def leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def step(fn, tensors, config=None, seed=None):
    """(fused function, its leaves, outputs, gradients) of one step, backward through ones."""
    fused = memfuse.memory_efficient_fusion(fn, config=config)
    inputs = leaves(tensors)
    if seed is not None:
        torch.manual_seed(seed)
    outputs = fused(*inputs)
    outputs[0].backward(torch.ones_like(outputs[0]))
    return fused, inputs, [o.detach() for o in outputs], [t.grad for t in inputs]


def test_offloaded_step_matches_eager_and_the_step_that_keeps_them_bitwise():
    tensors = residual_inputs()
    fused, inputs, outputs, grads = step(residual_layers, tensors, ALL)
    offloaded = fused.compiled_for(*inputs).plan.offloaded
    assert len(offloaded) >= 3                       # the matmul outputs each layer saves
    _, _, kept_outputs, kept_grads = step(residual_layers, tensors, memfuse.Config(check=True))
    eager_inputs = leaves(tensors)
    expected = residual_layers(*eager_inputs)[0]
    expected.backward(torch.ones_like(expected))
    assert rel_error(outputs[0], expected.detach()) < 1e-5
    for actual, wanted in zip(grads, [t.grad for t in eager_inputs]):
        assert rel_error(actual, wanted) < 1e-5
    assert torch.equal(outputs[0], kept_outputs[0])
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads))


def test_all_offloads_only_what_the_forward_computes_and_does_not_return():
    """Inputs stay where the caller holds them, a returned value stays on the device for the
    caller; "all" leaves values under offload_min_bytes on the device."""
    tensors = dropout_inputs()
    fused, inputs, _, _ = step(dropout_mlp, tensors, ALL, seed=0)
    the_plan = fused.compiled_for(*inputs).plan
    returned = set(the_plan.forward.outputs[:the_plan.num_fwd_outputs])
    computed = [s.name for s in the_plan.saved if not s.is_input and s.name not in returned]
    assert computed and list(the_plan.offloaded) == computed
    big = memfuse.Config(offload_saved="all", offload_min_bytes=10**9)
    fused, inputs, _, _ = step(dropout_mlp, tensors, big, seed=0)
    assert fused.compiled_for(*inputs).plan.offloaded == ()


def program_lines(fused, inputs) -> tuple:
    entry = fused.compiled_for(*inputs)
    function = entry.function
    return entry.plan, function.forward.source.splitlines(), function.backward.source_unhooked.splitlines()


def local(name: str) -> str:
    """A pattern for the program's local `name` (not `x.mm(` for `mm`, nor `mm_1`)."""
    return rf"(?<![\w.]){name}(?!\w)"


def first_line(lines: list, pattern: str) -> int:
    return next(k for k, line in enumerate(lines) if re.search(pattern, line))


def test_the_forward_copies_each_value_out_after_it_is_made_and_returns_the_host_copy():
    fused, inputs, _, _ = step(residual_layers, residual_inputs(), ALL)
    the_plan, forward, _ = program_lines(fused, inputs)
    returned = re.search(r"return \[(.*)\]", forward[-1]).group(1).split(", ")
    for name in the_plan.offloaded:
        made = first_line(forward, rf"^\s*{name} = ")
        assert re.fullmatch(rf"\s*mf_host_{name} = mf_offload\({name}, device\)", forward[made + 1])
        assert f"mf_host_{name}" in returned and name not in returned
        dropped = first_line(forward, rf"^\s*del .*{local(name)}")
        assert not any(re.search(local(name), line) for line in forward[dropped + 1:-1])


def launches(lines: list) -> int:
    """Lines of a program that launch work: a kernel or an aten matmul."""
    return sum(bool(re.search(r"memfuse_backward_\d+\(device|\.mm\(|_aten_\d+\(", line)) for line in lines)


def test_the_backward_fetches_ahead_of_the_first_reader_not_at_the_start():
    fused, inputs, _, _ = step(residual_layers, residual_inputs(), ALL)
    the_plan, _, backward = program_lines(fused, inputs)
    fetch_ahead = ALL.offload_fetch_ahead
    issued = []
    for name in the_plan.offloaded:
        fetch = first_line(backward, rf"^\s*{name}, mf_{name}_ready = mf_fetch\({name}, device\)")
        arrive = first_line(backward, rf"^\s*mf_arrive\(mf_{name}_ready, device\)")
        read = next(k for k in range(fetch + 1, len(backward)) if re.search(local(name), backward[k]))
        assert fetch < arrive < read, (name, fetch, arrive, read)
        assert 0 < launches(backward[fetch:arrive]) <= fetch_ahead or launches(backward[:fetch]) == 0
        issued.append(launches(backward[:fetch]))
    assert max(issued) > fetch_ahead      # fetches spread over the backward, not all at its start


def test_fetch_ahead_zero_fetches_right_before_the_reader():
    config = memfuse.Config(offload_saved="all", offload_min_bytes=0, offload_fetch_ahead=0)
    fused, inputs, _, _ = step(residual_layers, residual_inputs(), config)
    the_plan, _, backward = program_lines(fused, inputs)
    for name in the_plan.offloaded:
        fetch = first_line(backward, rf"mf_fetch\({name}, device\)")
        arrive = first_line(backward, rf"mf_arrive\(mf_{name}_ready")
        assert fetch < arrive and launches(backward[fetch:arrive]) == 0


def test_dropout_masks_are_the_same_with_offloading():
    tensors = dropout_inputs()
    _, _, kept, kept_grads = step(dropout_mlp, tensors, memfuse.Config(check=True), seed=11)
    fused, inputs, offloaded, grads = step(dropout_mlp, tensors, ALL, seed=11)
    assert fused.compiled_for(*inputs).plan.offloaded
    assert torch.equal(offloaded[1] == 0, kept[1] == 0) and 0 < (kept[1] == 0).float().mean() < 1
    assert all(torch.equal(a, b) for a, b in zip(offloaded, kept))
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads))


def test_a_name_the_graph_does_not_save_or_cannot_offload_is_skipped_with_a_warning(caplog):
    """Names are per graph (each of a model's graphs has an `mm`): a graph skips the names it does
    not save, and those it cannot offload (an input), and still compiles."""
    tensors = residual_inputs()
    config = memfuse.Config(offload_saved=("no_such_value", "primals_1", "mm"))
    fused, inputs, outputs, _ = step(residual_layers, tensors, config)
    assert fused.compiled_for(*inputs).plan.offloaded == ("mm",)
    assert "offload_saved names 'no_such_value', which this graph's plan does not save" in caplog.text
    assert "saved value 'primals_1' stays on the device: an input or a constant" in caplog.text


def test_offload_saved_takes_names_or_all():
    assert memfuse.Config(offload_saved=["mm"]).offload_saved == ("mm",)
    with pytest.raises(ValueError, match="offload_saved must be"):
        memfuse.Config(offload_saved="some")
    with pytest.raises(ValueError, match="offload_fetch_ahead must be"):
        memfuse.Config(offload_fetch_ahead=-1)


def test_one_named_value_is_offloaded_alone():
    tensors = residual_inputs()
    fused, inputs, _, _ = step(residual_layers, tensors, ALL)
    name = fused.compiled_for(*inputs).plan.offloaded[1]
    fused, inputs, outputs, grads = step(residual_layers, tensors, memfuse.Config(offload_saved=(name,)))
    the_plan, forward, backward = program_lines(fused, inputs)
    assert the_plan.offloaded == (name,)
    assert sum("mf_offload(" in line for line in forward) == 1 and sum("mf_fetch(" in line for line in backward) == 1


def test_cuda_graphs_keep_saved_values_on_the_device():
    fused = memfuse.memory_efficient_fusion(residual_layers, config=ALL, cuda_graphs=True)
    inputs = leaves(residual_inputs())
    fused(*inputs)[0].sum().backward()
    assert fused.compiled_for(*inputs).plan.offloaded == ()


def test_torch_compile_graphs_pass_host_tensors_through():
    """AOTAutograd saves what the forward step returns (`ctx.save_for_backward`) and hands it to
    the backward step: the host copies travel as they are; the fakes it traced say host."""
    torch._dynamo.reset()
    tensors = residual_inputs()
    options = {"offload_saved": "all", "offload_min_bytes": 0}
    compiled = torch.compile(residual_layers, backend="memfuse", options=options)
    inputs, eager_inputs = leaves(tensors), leaves(tensors)
    with watch() as records:
        actual = compiled(*inputs)[0]
    expected = residual_layers(*eager_inputs)[0]
    actual.backward(torch.ones_like(actual))
    expected.backward(torch.ones_like(expected))
    record, = records
    assert record.plan.offloaded and "mf_offload(" in record.function.forward.source
    assert rel_error(actual.detach(), expected.detach()) < 1e-5
    for a, e in zip(inputs, eager_inputs):
        assert rel_error(a.grad, e.grad) < 1e-5
    torch._dynamo.reset()


@pytest.mark.parametrize("style", ["whole", "backend"])
def test_a_compile_only_step_offloads_on_fakes(style):
    torch._dynamo.reset()
    report = memfuse.check_compiles(residual_layers, *leaves(residual_inputs()), style=style, config=ALL)
    assert report.graphs and report.backward_covered, report


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offloading_frees_the_saved_bytes_between_forward_and_backward_on_cuda():
    """The memory held between the forward and the backward drops by about the offloaded bytes,
    and the gradients are those of the step that keeps them on the device."""
    tensors = residual_inputs(rows=8192, width=1024, device="cuda")

    def held(config):
        fused = memfuse.memory_efficient_fusion(residual_layers, config=config)
        inputs = leaves(tensors)
        fused(*inputs)[0].sum().backward()          # compile and warm up outside the measure
        inputs = leaves(tensors)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = fused(*inputs)[0]
        torch.cuda.synchronize()
        between = torch.cuda.memory_allocated() - before
        torch.cuda.reset_peak_memory_stats()
        out.sum().backward()
        torch.cuda.synchronize()
        backward_peak = torch.cuda.max_memory_allocated() - before
        entry = fused.compiled_for(*inputs)
        offloaded = sum(s.bytes for s in entry.plan.saved if s.name in entry.plan.offloaded)
        return between, backward_peak, offloaded, [t.grad for t in inputs]

    kept, kept_peak, _, kept_grads = held(memfuse.Config())
    moved, moved_peak, offloaded_bytes, grads = held(memfuse.Config(offload_saved="all", offload_min_bytes=0))
    assert offloaded_bytes > 0
    assert kept - moved >= 0.9 * offloaded_bytes, (kept, moved, offloaded_bytes)
    # fetched ahead, never all at once: the backward holds no more than the step that kept them
    assert moved_peak <= 1.05 * kept_peak, (moved_peak, kept_peak)
    assert all(torch.equal(a, b) for a, b in zip(grads, kept_grads))


def test_explain_lists_the_offloaded_values_with_their_bytes(capsys):
    fused = memfuse.memory_efficient_fusion(residual_layers, config=ALL)
    report = memfuse.explain(fused, *leaves(residual_inputs()))
    text = capsys.readouterr().out
    offloaded = [s for s in report.saved if s.offloaded]
    assert [s.name for s in offloaded] == list(fused.compiled_for(*leaves(residual_inputs())).plan.offloaded)
    for s in offloaded:
        assert re.search(rf"^  {s.name} .* {human_bytes(s.bytes)}  computed, offloaded to host: ",
                         text, re.MULTILINE), text
    total = human_bytes(sum(s.bytes for s in offloaded))
    assert f"offloaded to host memory: {total} in {len(offloaded)} values" in text


@pytest.mark.parametrize("front", ["wrap", "backend"])
def test_the_forward_waits_for_the_copies_out_only_under_a_saved_tensors_hook(front, monkeypatch):
    """A hook may read the host copies on the host while packing them (save_on_cpu copies them):
    the forward then waits for its side stream (runtime.offload.settle); without one it does not."""
    settled = []
    monkeypatch.setattr(memfuse.runtime.offload, "settle", settled.append)
    torch._dynamo.reset()
    options = {"offload_saved": "all", "offload_min_bytes": 0}
    fused = memfuse.memory_efficient_fusion(residual_layers, config=ALL) if front == "wrap" else \
        torch.compile(residual_layers, backend="memfuse", options=options)
    fused(*leaves(residual_inputs()))[0].sum().backward()
    assert settled == []
    with torch.autograd.graph.save_on_cpu():
        out = fused(*leaves(residual_inputs()))[0]
    assert settled == [torch.device("cpu")]
    out.sum().backward()
    torch._dynamo.reset()


def test_a_small_llama_under_torch_compile_offloads_bitwise():
    """A whole decoder (attention's extern calls and their tuple elements, rotary views, the loss
    head) with every saved value offloaded: the loss and every gradient are the kept run's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8))

    def train_step(options):
        torch._dynamo.reset()
        copy = transformers.LlamaForCausalLM(config)
        copy.load_state_dict(model.state_dict())
        with watch() as records:
            loss = torch.compile(copy, backend="memfuse", options=options)(input_ids=ids, labels=ids).loss
        loss.backward()
        offloaded = sum(len(r.plan.offloaded) for r in records if r.plan is not None)
        return loss.detach(), [p.grad for p in copy.parameters()], offloaded

    kept_loss, kept_grads, none = train_step({})
    loss, grads, offloaded = train_step({"offload_saved": "all", "offload_min_bytes": 0})
    assert none == 0 and offloaded > 0
    assert torch.equal(loss, kept_loss) and all(torch.equal(a, b) for a, b in zip(grads, kept_grads))
    torch._dynamo.reset()


class _Log(list):
    """The stream operations runtime.offload makes, in order, with torch.cuda's calls faked."""

    def fake_cuda(self, monkeypatch):
        log = self

        class Stream:
            def __init__(self, device=None):
                self.name = "side"

            def wait_stream(self, other):
                log.append(f"{self.name} waits for {other.name}")

            def wait_event(self, event):
                log.append(f"{self.name} waits for {event.name}")

            def synchronize(self):
                log.append(f"host waits for {self.name}")

        class Event:
            def record(self, stream):
                self.name = f"event on {stream.name}"
                log.append(f"record {self.name}")

        compute = Stream()
        compute.name = "compute"
        current = [compute]

        class StreamContext:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                current.append(self.stream)

            def __exit__(self, *exc):
                current.pop()

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "stream", StreamContext)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
        monkeypatch.setattr(memfuse.runtime.offload, "_SIDE_STREAMS", {})
        return current


class _OnDevice(torch.Tensor):
    """A CPU tensor standing for a CUDA one: its `record_stream` calls are logged."""
    log: list = []

    @property
    def device(self):
        return torch.device("cuda", 0)

    def record_stream(self, stream):
        self.log.append(f"device tensor used by {stream.name}")


def test_the_copies_are_ordered_on_the_side_stream_as_the_allocator_needs(monkeypatch):
    """The stream rules of runtime.offload, with torch.cuda's calls faked (no GPU here): a copy out
    runs on the side stream after the compute stream's work so far, and marks the device tensor as
    used there (the caching allocator keeps its memory until the copy read it); a fetch runs there
    after the compute stream's work so far (its memory may be freed work's) and records an event
    the compute stream waits for before the reader."""
    log = _Log()
    current = log.fake_cuda(monkeypatch)
    _OnDevice.log = log
    pinned = []
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda t, device, pin_memory: pinned.append((device, pin_memory)) or
                        real_empty_like(t))
    cuda = torch.device("cuda", 0)
    value = torch.Tensor._make_subclass(_OnDevice, torch.randn(4, 3))
    copied = []     # (the stream a copy was issued on, non_blocking)
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, source, non_blocking=False: copied.append(
        (current[-1].name, non_blocking)) or log.append("copy") or self)
    memfuse.runtime.offload.offload(value, cuda)
    assert log == ["side waits for compute", "copy", "device tensor used by side"] and copied == [("side", True)]
    assert pinned == [("cpu", True)]
    log.clear(), copied.clear()
    monkeypatch.setattr(torch, "empty_like", lambda t, device: torch.Tensor._make_subclass(_OnDevice,
                                                                                           real_empty_like(t)))
    fetched, ready = memfuse.runtime.offload.fetch(torch.randn(4, 3), cuda)
    memfuse.runtime.offload.arrive(ready, cuda)
    memfuse.runtime.offload.settle(cuda)
    assert log == ["side waits for compute", "copy", "record event on side", "compute waits for event on side",
                   "host waits for side"] and copied == [("side", True)]
