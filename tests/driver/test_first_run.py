"""A memfuse failure at the first run of a compiled program (Triton's compile at the first launch, a
launch's argument checks, an extern's own rules) never reaches a loop that runs in eager: the graph
runs through torch from then on, with eager's outputs and gradients, logged and counted
(`first_run_fallbacks`); strict mode raises it (memfuse.driver.fallback: the first run's rules).
Failures are injected at a generated kernel's launch, in the forward or the backward program."""
import re

import pytest
import torch
from torch import nn

import memfuse
import memfuse.driver.compile
from memfuse.driver.fallback import StrictModeError
from memfuse.ir.graph import GraphError
from memfuse.runtime import launchers


def setup_function():
    torch._dynamo.reset()


def block(x, w):
    return torch.nn.functional.layer_norm(x * w, (x.shape[-1],)).sin() * 2


class Injected(RuntimeError):
    pass


@pytest.fixture
def failing_launch(monkeypatch):
    """`failing_launch("backward")`: every launch of a kernel of the backward program raises."""
    launch = launchers.KernelLaunch._launch
    launched = []

    def fail(program: str):
        def failing(self, device, rows, aligned, values):
            launched.append(self.kernel.source.name)
            if f"_{program}_" in self.kernel.source.name:
                raise Injected(f"injected: launching {self.kernel.source.name} failed")
            return launch(self, device, rows, aligned, values)
        monkeypatch.setattr(launchers.KernelLaunch, "_launch", failing)
        return launched
    return fail


def fallback_messages(logs) -> list:
    return [r.getMessage() for r in logs.records if r.name == "memfuse.fallbacks" and "runs through torch" in r.getMessage()]


def steps_match_eager(fn, compiled, steps: int = 3) -> None:
    """A loop of forward and backward steps on new inputs: every output and gradient is eager's."""
    for _ in range(steps):
        x, w = torch.randn(4, 8), torch.randn(8)
        leaves = [(x.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
        expected, got = fn(*leaves[0]), compiled(*leaves[1])
        expected.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close([t.grad for t in leaves[1]], [t.grad for t in leaves[0]])


def wrapped(front: str):
    """The block behind a front door: memory_efficient_fusion or the torch.compile backend."""
    if front == "function":
        return memfuse.memory_efficient_fusion(block)
    return torch.compile(block, backend="memfuse")


@pytest.mark.parametrize("front", ["function", "backend"])
@pytest.mark.parametrize("program", ["forward", "backward"])
def test_a_first_run_that_fails_runs_the_graph_through_torch(front, program, failing_launch, logs):
    launched = failing_launch(program)
    steps_match_eager(block, wrapped(front))
    stats = memfuse.stats()
    assert stats["compiles"] == 1 and stats["first_run_fallbacks"] == 1
    assert stats["graph_fallbacks" if front == "backend" else "eager_calls"] >= 1
    [message] = fallback_messages(logs)
    assert f"first {program} run failed" in message and "Injected: injected: launching memfuse_" in message
    # from then on through torch: no launch after the failed one
    assert launched[-1].startswith(f"memfuse_{program}_")


@pytest.mark.parametrize("program", ["forward", "backward"])
def test_a_fused_module_keeps_training(program, failing_launch, logs):
    failing_launch(program)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    fused = memfuse.memory_efficient_fusion(nn.Sequential(*[m for m in model]))
    reference = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))
    reference.load_state_dict(model.state_dict())
    for _ in range(2):
        x = torch.randn(5, 8)
        expected, got = reference(x), fused(x)
        expected.square().sum().backward()
        got.square().sum().backward()
        torch.testing.assert_close(got, expected)
        for p, q in zip(fused.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    assert memfuse.stats()["first_run_fallbacks"] == 1
    assert f"first {program} run failed" in fallback_messages(logs)[0]


@pytest.mark.parametrize("front", ["function", "backend"])
@pytest.mark.parametrize("program", ["forward", "backward"])
def test_strict_mode_raises_a_first_runs_failure(front, program, failing_launch, monkeypatch):
    monkeypatch.setenv("MEMFUSE_STRICT", "1")
    failing_launch(program)
    compiled = wrapped(front)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    expected = StrictModeError if front == "function" else RuntimeError
    with pytest.raises(expected, match=f"first {program} run failed") as info:
        compiled(x, w).sum().backward()
    assert isinstance(info.value.__cause__, Injected)
    assert memfuse.stats()["first_run_fallbacks"] == 0


@pytest.mark.parametrize("front", ["function", "backend"])
def test_a_later_runs_failure_is_raised(front, monkeypatch):
    """A program that ran once is no compile problem: its failure (a transient error) is raised."""
    compiled = wrapped(front)
    steps_match_eager(block, compiled, steps=1)

    def failing(self, *args):
        raise Injected("injected: a later launch failed")
    monkeypatch.setattr(launchers.KernelLaunch, "_launch", failing)
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    with pytest.raises(Injected):
        compiled(x, w).sum().backward()
    assert memfuse.stats()["first_run_fallbacks"] == 0


def test_the_backward_through_torch_refuses_inputs_modified_since_the_forward(failing_launch):
    """The recomputation reads the forward's inputs again: modified in place, they would give
    gradients of another forward (eager's autograd refuses such a backward too)."""
    def shifted(x, w):        # w's gradient reads nothing the forward saves: autograd checks no version
        return x * 2 + w
    failing_launch("backward")
    compiled = memfuse.memory_efficient_fusion(shifted)
    x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    y = compiled(x, w)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match=r"modified in place since the forward") as info:
        y.sum().backward()
    assert isinstance(info.value.__cause__, Injected)


# -- what escaped before ---------------------------------------------------------------------------
@pytest.mark.compile_fails
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_graph_error_from_a_fused_modules_compile_falls_back(mode, monkeypatch, logs):
    """The issue's BatchNorm in eval: a GraphError (memfuse's own limit: "cannot read in one [M, D]
    space") escaped compile_or_decide into the training loop. Now it is a decision like any other."""
    def failing(graph, config, kind):
        raise GraphError("memfuse IR: sum_1 (view, col) cannot read sum_1_total (row) in one [M, D] space")
    monkeypatch.setattr(memfuse.driver.compile, "schedule", failing)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4, track_running_stats=False), nn.ReLU())
    getattr(model, mode)()
    fused = memfuse.memory_efficient_fusion(model)
    x = torch.randn(2, 3, 6, 6)
    torch.testing.assert_close(fused(x), model(x))
    assert memfuse.stats()["eager_calls"] == 1
    assert "GraphError: memfuse IR: sum_1 (view, col)" in logs.text


@pytest.mark.compile_fails
def test_strict_mode_raises_a_graph_error_chained(monkeypatch):
    monkeypatch.setenv("MEMFUSE_STRICT", "1")

    def failing(graph, config, kind):
        raise GraphError("memfuse IR: injected")
    monkeypatch.setattr(memfuse.driver.compile, "schedule", failing)
    with pytest.raises(StrictModeError, match="GraphError: memfuse IR: injected") as info:
        memfuse.memory_efficient_fusion(block)(torch.randn(4, 8), torch.randn(8))
    assert isinstance(info.value.__cause__, GraphError)


def test_a_kernel_argument_on_another_device_is_a_clear_error_at_the_first_launch():
    """BART's crash was Triton's `Pointer argument (at 1) cannot be accessed from Triton (cpu
    tensor?)`: a program launched on one device with a tensor of another. The first launch on a
    device now checks, and names the kernel and the argument (the first run's guard then runs the
    graph through torch for that reason)."""
    compiled = memfuse.memory_efficient_fusion(block)
    x, w = torch.randn(4, 8), torch.randn(8)
    compiled(x, w)
    entry = compiled.compiled_for(x, w)
    launch = next(s for s in entry.function.forward.steps if isinstance(s, launchers.KernelLaunch))
    launch.record = True              # keeps the next call's arguments
    compiled(x, w)
    device, rows, _, values = launch.recorded
    on_meta = tuple(torch.empty(v.shape, device="meta") if isinstance(v, torch.Tensor) else v for v in values)
    assert launch.checked == {device}   # checked once per device, at the first launch: here again
    launch.checked.clear()
    with pytest.raises(launchers.KernelDeviceError, match=rf"kernel {launch.kernel.source.name}: argument \w+ is a "
                                                         r"tensor on meta, but the program launches on cpu"):
        launch._launch(device, rows, False, on_meta)


def test_the_backends_program_runs_where_the_graph_makes_its_tensors():
    """BART's crash: its encoder's mask graph (transformers' create_bidirectional_mask at static
    sizes) takes no argument at all and makes its tensors with `torch.arange(n, device=...)` on
    the GPU. The program's device came from its tensor arguments alone, none, so it launched on the
    CPU with GPU tensors (seen on an H200). Fake CUDA tensors stand in for the GPU's."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from memfuse.fronts.backend import program_device

    graph = torch.fx.Graph()
    scale = graph.get_attr("scale")                  # a CPU scalar beside it, as eager allows
    arange = graph.call_function(torch.ops.aten.arange.default, (16,), {"device": torch.device("cuda")})
    node = graph.call_function(torch.ops.aten.mul.Tensor, (arange, scale))
    with FakeTensorMode():
        arange.meta["val"] = node.meta["val"] = torch.arange(16, device="cuda")
        scale.meta["val"] = torch.tensor(2.0)
    graph.output((node,))
    assert program_device(graph) == torch.device("cuda", 0)
    with FakeTensorMode():
        scale.meta["val"] = torch.tensor(2.0, device="cuda:1")
    with pytest.raises(NotImplementedError, match="several devices"):
        program_device(graph)


def test_tensor_arguments_on_two_devices_run_through_torch(logs):
    """Eager takes a CPU scalar beside GPU tensors; a compiled program runs on one device. The key
    raised a ValueError into the loop; now the call runs through torch, with the reason."""
    def scaled(x, y):
        return x * 2, y * 3
    fused = memfuse.memory_efficient_fusion(scaled)
    x, y = torch.randn(4, 8), torch.randn(8, device="meta")
    for _ in range(2):
        a, b = fused(x, y)
        torch.testing.assert_close(a, x * 2)
        assert b.device.type == "meta" and b.shape == y.shape
    assert memfuse.stats()["eager_calls"] == 2 and memfuse.stats()["compiles"] == 0
    assert "argument 'y' (position 1) is on meta, the other tensor arguments on cpu" in logs.text


@pytest.mark.compile_fails
@pytest.mark.parametrize("front", ["function", "backend"])
def test_a_kernel_triton_refuses_fails_the_compile_before_the_first_run(front, monkeypatch, logs):
    """On a GPU every kernel of both programs is compiled before the first run (precompile): a
    Triton CompilationError there fails the compile, so the graph runs through torch before a
    memfuse forward saved anything a memfuse backward would need (dropout's seed included)."""
    import ast
    from triton.compiler.errors import CompilationError
    from memfuse.runtime import precompile

    def refused(graph, launch, device, config):
        if "_backward_" in launch.kernel.source.name:
            raise CompilationError(None, ast.parse("x").body[0], "injected: this kernel does not compile")
    monkeypatch.setattr(precompile, "enabled", lambda device, config: True)   # the GPU's path, on the CPU
    monkeypatch.setattr(precompile, "_warm_up", refused)
    steps_match_eager(block, wrapped(front), steps=2)
    assert memfuse.stats()["compiles"] == 0 and memfuse.stats()["first_run_fallbacks"] == 0
    assert re.search(r"KernelCompileError: (memfuse: )?kernel memfuse_backward_0 does not compile with Triton: "
                     r"injected", logs.text)


@pytest.mark.parametrize("front", ["function", "backend"])
def test_a_failed_first_backward_with_dropout_recomputes_with_torchs_masks(front, failing_launch):
    """The documented limit: a graph with random ops whose first backward fails gets its gradients
    for that step from torch's recomputation, with torch's masks (a dropout sample of its own); the
    loop goes on, and the steps after run through torch as eager does."""
    def dropped(x, w):
        return torch.nn.functional.dropout(x * w, p=0.5, training=True).sum(-1)
    failing_launch("backward")
    compiled = memfuse.memory_efficient_fusion(dropped) if front == "function" else \
        torch.compile(dropped, backend="memfuse")
    for _ in range(2):
        x, w = torch.randn(4, 8, requires_grad=True), torch.randn(8, requires_grad=True)
        compiled(x, w).sum().backward()
        kept = x.grad != 0                 # the recomputed mask: each gradient is w (scaled) or 0
        torch.testing.assert_close(x.grad[kept], (2 * w).expand(4, 8)[kept])
    assert memfuse.stats()["first_run_fallbacks"] == 1


def test_a_failed_first_backward_recomputes_a_chunked_loss_heads_returned_logits(failing_launch):
    """A traced function returning a chunked loss head's logits: the program returns the head's
    hidden states too, for the logits' own backward (an output hook). The recomputation runs the
    function as capture traced it (Compiled.traced, the head chunked in it), so gradients reaching
    the logits are recomputed as well."""
    def head(h, w, target):
        logits = torch.nn.functional.linear(torch.tanh(h), w)
        return torch.nn.functional.cross_entropy(logits, target), logits
    failing_launch("backward")
    compiled = memfuse.memory_efficient_fusion(head)
    for _ in range(2):
        h, w, target = torch.randn(6, 8), torch.randn(11, 8), torch.randint(0, 11, (6,))
        leaves = [(h.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
        results = [head(*leaves[0], target), compiled(*leaves[1], target)]
        for loss, logits in results:
            (loss + logits.square().mean()).backward()
        torch.testing.assert_close(results[1], results[0])
        torch.testing.assert_close([t.grad for t in leaves[1]], [t.grad for t in leaves[0]])
    assert memfuse.stats()["loss_heads_chunked"] == 1 and memfuse.stats()["first_run_fallbacks"] == 1
