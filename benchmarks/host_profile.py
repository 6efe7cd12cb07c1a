"""Where the host time of a memfuse step goes: the floor and memfuse timed in interleaved repeats
(the minimum of each mode's), then cProfile over memfuse's steps.

On a GPU, with --tiny the leading dims shrink to [2, 4], so the GPU finishes each kernel at once and
the step time is the host's alone; the floor mode (an autograd.Function that launches nothing) is
the reference.

--stub-launches (no GPU): a CPU proxy for memfuse's host Python. The kernels compile and run once
through Triton's interpreter; then every launch goes through memfuse's direct launch
(runtime.DirectLaunch) into a launcher that does nothing, and seeds are drawn as on CUDA
(runtime.philox_seed_draw) from a stand-in generator. Implies --tiny. CPU tensors come from the
CPU allocator and no driver is called: compare the two modes, or two versions of memfuse, not
these numbers with a GPU host's.

--layer bert|gpt2|llama: one HuggingFace decoder layer, wrapped as benchmarks/lib/hf_models.py's per-layer
mode wraps it and called with the arguments its model passes it (recorded from an eager forward:
Llama's (cos, sin) tuple, masks, keyword constants), against the floor: an autograd.Function over
the same tensors (the layer's parameters and tensor arguments) that launches nothing. On a GPU the
family's benchmark size at leading dims [2, 4] under bf16 autocast; with --stub-launches its tiny
size in fp32. The eager layer is timed beside them; its matmuls and attention, like memfuse's
externs, run for real (the floor runs none). So is the layer under torch.compile's memfuse backend
(one Dynamo graph, as FSDP2's hooks cut a model into a graph per layer): its time less the
wrapper's is what Dynamo's frame and AOTAutograd's runtime add around a graph's programs. On a
GPU the layer under torch.compile (Inductor, one graph) is timed too: the host time memfuse's
backend would have to match per graph piece where FSDP2 steps are host-paced (issue 19).

    python -m benchmarks.host_profile [--workload layer_norm_block] [--steps 2000] [--tiny] [--stub-launches]
    python -m benchmarks.host_profile --layer llama [--steps 2000] [--stub-launches]
    python -m benchmarks.host_profile --model bert --stub-launches [--modes eager,memfuse_backend,...]

--model bert|gpt2|llama (with --stub-launches): the whole model of benchmarks/lib/hf_models.py at its tiny
size, one training step (forward, loss, backward) per mode, every memfuse program's launches stubbed
(FusedModules' and the backend's graphs alike): the host Python each wrapping style adds around
the same externs, and cProfile of the last mode named.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import functools
import os
import pstats
import time
import types

import torch


class StandInGenerator:
    """The three methods of a CUDA torch.Generator that runtime.philox_seed_draw calls (also the
    tests' stand-in: it refuses offsets torch's CUDA generator refuses)."""

    def __init__(self, seed: int = 0):
        self.seed, self.offset = seed, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        if offset % 4:
            raise RuntimeError("torch's CUDA generator takes offsets that are multiples of 4")
        self.offset = offset


def _stub_launches(entry) -> None:
    """From now on every kernel of `entry` (compiled and launched once) launches directly, into
    nothing, and seeds come from a stand-in CUDA generator."""
    from memfuse.runtime import program as runtime
    cpu = torch.device("cpu")
    runtime.raw_stream = lambda index: 0
    runtime._SEED_DRAWS[cpu] = runtime.philox_seed_draw(StandInGenerator())
    nothing = types.SimpleNamespace(run=lambda *args: None, function=None, packed_metadata=None)
    for program in (entry.function.forward, entry.function.backward):
        for launch in program.steps if program is not None else ():    # an inference graph has no backward
            if isinstance(launch, runtime.KernelLaunch):
                config, most = launch.grids[cpu]
                launch.direct[cpu] = runtime.DirectLaunch(launch, cpu, config, most, nothing)


def _interleaved(steps: dict, inputs, count: int, repeats: int, device: torch.device) -> dict:
    """Mode name -> its fastest repeat of `count` steps (run_step on `inputs`), in us per step."""
    from benchmarks.lib.measure import run_step
    return _interleaved_calls({name: functools.partial(run_step, step, inputs) for name, step in steps.items()},
                              count, repeats, device)


def _report(name: str, best: dict, stubbed: bool) -> None:
    for mode, us in best.items():
        print(f"{name} {mode}: {us:.1f} us per step ({1e6 / us:.0f} it/s)")
    print(f"{name}: memfuse - floor = {best['memfuse'] - best['floor']:.1f} us"
          + (" (CPU proxy: launches stubbed)" if stubbed else ""))


def _profile(step, steps: int) -> None:
    """cProfile over `steps` steps; first the Python function calls per step, a measure of host
    work that other load on the machine does not change."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"Python function calls per step: {stats.total_calls / steps:.0f}")
    stats.sort_stats("tottime").print_stats(25)
    print("memfuse's own functions (every one, however little time it took):")
    stats.print_stats(r"memfuse[/\\]")


@dataclasses.dataclass(frozen=True)
class LayerCall:
    """One decoder layer and the arguments its model called it with."""
    layer: torch.nn.Module
    args: tuple
    kwargs: dict

    def tensors(self) -> list:
        """The tensors the compiled program takes: the hidden states (first: the floor returns an
        alias of it), the parameters, the other tensor arguments (pytree leaves)."""
        from torch.utils._pytree import tree_leaves
        others = [v for v in tree_leaves((self.args[1:], self.kwargs)) if isinstance(v, torch.Tensor)]
        return [self.args[0], *self.layer.parameters(), *others]


def record_layer_call(family_name: str, device: torch.device, stubbed: bool) -> LayerCall:
    """The first layer of `family_name`'s model (models.py's size, tiny when stubbed) and the
    arguments of its call in one eager forward over [2, 4] token ids (bf16 autocast on a GPU)."""
    from benchmarks.lib import hf_models as models
    family = models.FAMILIES[family_name]
    size = dataclasses.replace(family.tiny if stubbed else family.size, batch=2, seq=4)
    model = models.build(family, size, models.DROPOUT).to(device)
    layer = models.layer_list(model, family)[0]
    calls = []
    hook = layer.register_forward_pre_hook(lambda module, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    with _autocast(device), torch.no_grad():
        model(**models.make_batch(size, device))
    hook.remove()
    args, kwargs = calls[0]
    hidden = args[0].detach().requires_grad_()     # the layer's input, as a training step sees it
    return LayerCall(layer, (hidden, *args[1:]), kwargs)


def _autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def _first_tensor(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def _layer_steps(call: LayerCall, fused, compiled, inductor, device: torch.device) -> dict:
    """Mode -> a fwd+bwd step of the layer: the floor over the same tensors, the layer in eager,
    memfuse's wrapper, the layer under torch.compile's memfuse backend (Dynamo's frame and
    AOTAutograd's runtime around the same kind of programs: the cost of a graph piece, as FSDP2's
    hooks cut a model into one per layer), and under Inductor where `inductor` is given. Each step
    sets the gradients it made back to None, as run_step does."""
    from benchmarks.lib.modes import FACTORIES
    tensors = call.tensors()
    floor = FACTORIES["floor"](None, {})
    grad = torch.ones_like(call.args[0])

    def step_of(forward):
        def step():
            with _autocast(device):
                out = _first_tensor(forward())
            out.backward(grad)
            for t in tensors:
                t.grad = None
        return step
    steps = {"floor": step_of(lambda: floor(*tensors)),
             "eager": step_of(lambda: call.layer(*call.args, **call.kwargs)),
             "memfuse": step_of(lambda: fused(*call.args, **call.kwargs)),
             "memfuse_backend": step_of(lambda: compiled(*call.args, **call.kwargs))}
    if inductor is not None:
        steps["torch_compile"] = step_of(lambda: inductor(*call.args, **call.kwargs))
    return steps


def _interleaved_calls(steps: dict, count: int, repeats: int, device: torch.device) -> dict:
    """Mode name -> its fastest repeat of `count` calls of its step, in us per step. On the CPU
    proxy the clock is the process's CPU time (one torch thread): other work on a shared host
    then stretches the wall clock, not the measure."""
    from benchmarks.lib.measure import synchronize
    clock = time.process_time if device.type == "cpu" else time.perf_counter
    best = {name: float("inf") for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            synchronize(device)
            start = clock()
            for _ in range(count):
                step()
            synchronize(device)
            best[name] = min(best[name], (clock() - start) / count * 1e6)
    return best


def profile_layer(family_name: str, steps: int, stubbed: bool) -> None:
    import memfuse
    device = torch.device("cpu" if stubbed else "cuda")
    if stubbed:
        torch.set_num_threads(1)
    from memfuse.fronts.backend import watch
    call = record_layer_call(family_name, device, stubbed)
    fused = memfuse.memory_efficient_fusion(call.layer)
    compiled = torch.compile(call.layer, backend="memfuse", fullgraph=True)
    # Inductor's CPU kernels would run for real on the proxy: its host time is comparable on a GPU only
    inductor = None if stubbed else torch.compile(call.layer, fullgraph=True)
    modes = _layer_steps(call, fused, compiled, inductor, device)
    modes["memfuse"]()                                   # compiles (and, stubbed, runs the kernels once)
    with watch() as graphs:
        modes["memfuse_backend"]()
    if stubbed:
        _stub_launches(fused.compiled_for(*call.args, **call.kwargs))
        for graph in graphs:
            _stub_launches(graph)
    _interleaved_calls(modes, 20, 1, device)             # warm-up
    best = _interleaved_calls(modes, max(1, steps // 10), 10, device)
    _report(f"{family_name} layer", best, stubbed)
    print(f"{family_name} layer: memfuse_backend - memfuse = {best['memfuse_backend'] - best['memfuse']:.1f} us "
          f"(Dynamo's frame and AOTAutograd's runtime around one graph)")
    if inductor is not None:
        print(f"{family_name} layer: memfuse_backend - torch_compile = "
              f"{best['memfuse_backend'] - best['torch_compile']:.1f} us (memfuse's programs against Inductor's)")
    _profile(modes["memfuse"], steps // 4)
    if inductor is not None:
        print("== memfuse_backend")
        _profile(modes["memfuse_backend"], steps // 4)
        print("== torch_compile")
        _profile(modes["torch_compile"], steps // 4)


def _stub_model_launches(model, graphs: list) -> int:
    """Stub every compiled program a model runs: each FusedModule's cache entries and each backend
    graph `watch()` saw. Returns how many programs were stubbed."""
    from memfuse.fronts.module import FusedModule
    entries = [graph for graph in graphs if graph.function is not None]
    for module in model.modules():
        if isinstance(module, FusedModule):
            for call in module.__dict__["_memfuse_calls"].values():
                entries += [e for e in call.fused.cache.values() if hasattr(e, "function")]
    for entry in entries:
        _stub_launches(entry)
    return len(entries)


class _NoKernel:
    """`kernel[grid](*args)` that launches nothing: the loss head's own kernels, stubbed; with
    `writes_ones` it fills its last argument with ones (the targets' count kernel, whose "all
    inside" flag the op asserts)."""

    def __init__(self, writes_ones: bool = False):
        self.writes_ones = writes_ones

    def __getitem__(self, grid):
        return lambda *args, **kwargs: args[-1].fill_(1.0) if self.writes_ones else None


def _fully_sharded(model, family) -> None:
    """FSDP2 as benchmarks/distributed.py applies it, on a one-rank gloo group: every layer, then
    the model (a FusedModule layer is sharded as the layer it replaced)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from benchmarks.lib import hf_models as models
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    for layer in models.layer_list(model, family):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def profile_model(family_name: str, modes: list, steps: int, fsdp2: bool = False) -> None:
    """CPU proxy for a whole model's step: each mode in turn wraps its own copy of the tiny model
    (Dynamo reset first: two compiled copies of one model class would share, and fight over, the
    frames' caches), runs one step for real (compiles, kernels interpreted), then its launches are
    stubbed and its steps timed (process time, one torch thread, best of 10 repeats)."""
    import memfuse
    from memfuse.patterns.loss_head import op as loss_head
    from memfuse.runtime import program as runtime
    from memfuse.fronts.backend import watch
    from benchmarks.lib import hf_models as models
    torch.set_num_threads(1)
    cpu_allocate = runtime._allocator(torch.device("cpu"))
    # stubbed kernels write nothing: zeroed buffers keep the indices later externs read in range
    runtime._ALLOCATORS[torch.device("cpu")] = lambda sizes, strides, dtype: cpu_allocate(sizes, strides, dtype).zero_()
    family = models.FAMILIES[family_name]
    device = torch.device("cpu")
    batch = models.make_batch(family.tiny, device)
    for mode in modes:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = models.build(family, family.tiny, 0.0)
        wrapped = models.WRAPPERS[mode](model, family)
        if fsdp2:
            _fully_sharded(model, family)

        def step():
            wrapped(**batch).loss.backward()
            for p in model.parameters():
                p.grad = None
        with watch() as graphs:
            step()
        stubbed = _stub_model_launches(model, graphs)
        for kernel in loss_head.direct_kernels():
            kernel.fn = _NoKernel()                          # compiled and run once by now
        loss_head.COUNT_TARGETS.fn = _NoKernel(writes_ones=True)     # every target inside the vocabulary
        memfuse.reset_stats()
        _interleaved_calls({mode: step}, 5, 1, device)                             # warm-up
        best = _interleaved_calls({mode: step}, max(1, steps // 10), 10, device)[mode]
        print(f"{family_name} model {mode}{' under FSDP2' if fsdp2 else ''}: {best:.1f} us per step ({stubbed} memfuse programs; CPU proxy: "
              f"launches stubbed); recompiles: {memfuse.stats().get('compiles', 0)} memfuse compiles while timed")
    _profile(step, max(1, steps // 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="layer_norm_block[64x128x1024]")
    parser.add_argument("--layer", choices=("bert", "gpt2", "llama"),
                        help="one wrapped HuggingFace layer, called as its model calls it (instead of a workload)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--tiny", action="store_true", help="leading dims [2, 4]: host time only")
    parser.add_argument("--stub-launches", action="store_true",
                        help="CPU proxy: kernels launch into nothing after one interpreted run (implies --tiny)")
    parser.add_argument("--model", choices=("bert", "gpt2", "llama"),
                        help="a whole tiny model, one step per mode (with --stub-launches)")
    parser.add_argument("--fsdp2", action="store_true",
                        help="--model: every layer, then the model, fully_shard-ed on a one-rank gloo group")
    parser.add_argument("--modes", default="eager,memfuse_per_layer,memfuse_backend,memfuse_per_layer_backend",
                        help="--model's modes (benchmarks.lib.hf_models.WRAPPERS), cProfile of the last")
    args = parser.parse_args()
    if args.model and not args.stub_launches:
        parser.error("--model runs on the CPU proxy only: add --stub-launches")
    if args.stub_launches:
        os.environ.setdefault("TRITON_INTERPRET", "1")    # read when triton is imported (by memfuse)
    if args.model:
        return profile_model(args.model, args.modes.split(","), args.steps, args.fsdp2)
    if args.layer:
        return profile_layer(args.layer, args.steps, args.stub_launches)
    import memfuse
    from benchmarks.lib.measure import run_step
    from benchmarks.lib.modes import FACTORIES
    from benchmarks.lib.workloads import registry

    workload = next(w for w in registry() if w.name.startswith(args.workload))
    if args.tiny or args.stub_launches:
        workload = dataclasses.replace(workload, shape=(2, 4, workload.shape[-1]))
    device = torch.device("cpu" if args.stub_launches else "cuda")
    inputs = workload.make_inputs(device)
    fused = memfuse.memory_efficient_fusion(workload.fn)
    memfuse_step = functools.partial(fused, **inputs.consts)
    run_step(memfuse_step, inputs)                       # compiles (and, stubbed, runs the kernels once)
    if args.stub_launches:
        _stub_launches(fused.compiled_for(*inputs.tensors, **inputs.consts))
    steps = {"floor": FACTORIES["floor"](workload.fn, inputs.consts), "memfuse": memfuse_step}
    _interleaved(steps, inputs, 20, 1, device)           # warm-up
    best = _interleaved(steps, inputs, max(1, args.steps // 10), 10, device)
    _report(workload.name, best, args.stub_launches)
    _profile(lambda: run_step(memfuse_step, inputs), args.steps // 4)


if __name__ == "__main__":
    main()
