"""Column sums (reductions over M: the weight and bias grads of a norm block) finish inside their
kernel: each program writes its partials and takes a ticket, and the program with the last
ticket combines every program's partials into the totals. So a kernel with column sums is one
launch with no aten reduction after it, its totals have the same bits whichever program
finishes last, and its ticket counter is back at 0 for the next launch."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton
from compare import assert_same, run_both
from helpers import BLOCKS, block_inputs, forward_backward, leaves_like
from torch.utils._python_dispatch import TorchDispatchMode

import memfuse
from memfuse.fronts import cuda_graphs as graphs
from memfuse.ir.graph import Op
from memfuse.runtime.program import KernelLaunch
from memfuse.schedule.groups import ExternStep

CPU = torch.device("cpu")
D = 40
ROWS = 37
# row kernel: BLOCK_D = 64, 2 rows a tile, so 19 tiles; looped: chunks of 8 columns, 2 rows a
# tile. Three programs walk the tiles, and the finish reads their partials 2 programs at a time
# (the last block half full).
KERNELS = {
    "row": memfuse.Config(tile_elements=128, cpu_programs=3),
    "looped": memfuse.Config(tile_elements=16, cpu_programs=3, max_row_length=16, loop_block_d=8),
}
REDUCERS = {
    "sum": lambda x: x.sum(0),
    "amax": lambda x: x.amax(0),
    "amin": lambda x: x.amin(0),
    "prod": lambda x: x.prod(0),
}

REDUCTIONS = ("sum", "amax", "amin", "prod")   # aten reduction ops no backward may call
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="drives Triton's interpreter")


def every_reducer(x):
    return x.sum(0), x.amax(0), x.amin(0), x.prod(0)


def near_one(rows: int, d: int = D) -> torch.Tensor:
    """Values in [0.9, 1.1): products over 37 rows stay far from overflow and underflow."""
    return torch.rand(rows, d) * 0.2 + 0.9


def launches(fused) -> list:
    programs = [p for entry in fused.cache.values() for p in (entry.function.forward, entry.function.backward)]
    return [s for p in programs if p is not None for s in p.steps if isinstance(s, KernelLaunch)]


def column_launch(fused) -> KernelLaunch:
    launch, = [s for s in launches(fused) if s.reductions]
    return launch


class AtenCalls(TorchDispatchMode):
    """The aten ops called while active, by overload packet name (`sum`, `_to_copy`, ...)."""

    def __init__(self):
        super().__init__()
        self.names: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


# -- every reducer, both kernels, against eager -----------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("reducer", REDUCERS)
def test_every_column_reducer_matches_eager(kernel, reducer):
    both = run_both(REDUCERS[reducer], [near_one(ROWS)], config=KERNELS[kernel])
    assert_same(both.fused, both.eager)
    assert both.kernels == 1 and not both.fallbacks


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("programs", [1, 3, 64], ids=["one_program", "programs_walk_tiles", "a_program_per_tile"])
def test_all_reducers_in_one_kernel_over_any_grid(kernel, programs):
    """One program (its own ticket is the last), programs that walk several tiles, and more
    programs allowed than there are tiles (one tile each, 19 partial rows)."""
    config = dataclasses.replace(KERNELS[kernel], cpu_programs=programs)
    both = run_both(every_reducer, [near_one(ROWS)], config=config)
    assert_same(both.fused, both.eager)
    assert both.kernels == 1 and not both.fallbacks


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_rows_still_write_the_totals(kernel):
    """M = 0: one program walks no rows and writes the neutral totals (zeros, ones), as eager."""
    both = run_both(lambda x: (x.sum(0), x.prod(0)), [near_one(0)], config=KERNELS[kernel])
    assert_same(both.fused, both.eager)
    assert both.kernels == 1
    w = torch.rand(D, requires_grad=True)
    grads = run_both(lambda x, w: (x * w).sum(-1), [near_one(0), w], config=KERNELS[kernel])
    assert_same(grads.fused_grads, grads.eager_grads, what="gradient")
    assert not grads.fused_grads[0].any()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_totals_are_rounded_once_to_nearest_even(kernel, dtype):
    """Integer values: every column sum is exact in the fp32 partials, in any order, and lies
    between two bf16 / fp16 neighbours (often halfway): eager rounds the exact sum to nearest
    even, and so must the kernel's store. The fp32 sum of the same values comes out of the same
    kernel, into a second totals tensor."""
    high = {torch.bfloat16: 16, torch.float16: 120}[dtype]    # sums past 256 (bf16) / 2048 (fp16)
    x = torch.randint(0, high, (ROWS, D)).to(dtype)
    fused = memfuse.memory_efficient_fusion(lambda x: (x.sum(0), x.float().sum(0)), config=KERNELS[kernel])
    half, single = fused(x)
    assert torch.equal(half, x.sum(0)) and half.dtype == dtype
    assert torch.equal(single, x.float().sum(0))
    assert not torch.equal(half.float(), single), "the check can tell a rounding"
    launch = column_launch(fused)
    assert set(launch.kernel.source.totals) == {dtype, torch.float32}


# -- one launch, no aten reduction, the counter back at 0 ---------------------------------------
@pytest.mark.parametrize("name", sorted(BLOCKS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_backward_is_one_launch_and_no_aten_reduction(name, dtype):
    """Apart from casts the plan placed after a column sum (layer_norm_block's bf16 weight and
    bias grads are fp32 sums cast to bf16), no aten op computes anything in the backward."""
    tensors, consts, grad_output = block_inputs(name, (3, 5, 48), dtype)
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn, config=KERNELS["row"])
    leaves = leaves_like(tensors)
    out = fused(*leaves, **consts)
    before = memfuse.stats()["kernels_launched"]
    with AtenCalls() as calls:
        out.backward(grad_output)
    assert memfuse.stats()["kernels_launched"] - before == 1
    assert not set(REDUCTIONS) & set(calls.names), calls.names
    entry, = fused.cache.values()
    backward = entry.function.backward
    casts = [s for s in backward.schedule.steps if isinstance(s, ExternStep) and backward.graph[s.name].op is Op.CAST]
    assert calls.names.count("_to_copy") == len(casts), calls.names
    _, ref_grads = forward_backward(BLOCKS[name].fn, tensors, consts, grad_output)
    assert_same([t.grad for t in leaves], ref_grads, scale=4, what="gradient")


@pytest.mark.parametrize("kernel", KERNELS)
def test_the_counter_is_back_at_zero_after_each_launch(kernel):
    """One int32 counter buffer per kernel and device serves every grid: 3 programs, 3 again, then 1."""
    fused = memfuse.memory_efficient_fusion(lambda x: (x.sum(0), x.prod(0)), config=KERNELS[kernel])
    for rows in (ROWS, 5, 1):
        fused(near_one(rows))
        counters = [launch.counter(CPU) for launch in launches(fused)]
        assert not any(c.any() for c in counters)
    for launch in launches(fused):             # rows 1 compiled on its own: two kernels
        assert list(launch._counters) == [CPU] and launch._counters[CPU].dtype == torch.int32


# -- determinism -------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", ["layer_norm_block", "rms_norm_block"])
def test_two_backwards_give_the_same_bits(kernel, name):
    tensors, consts, grad_output = block_inputs(name, (3, 7, D))
    fused = memfuse.memory_efficient_fusion(BLOCKS[name].fn, config=KERNELS[kernel])
    first = forward_backward(fused, tensors, consts, grad_output)[1]
    second = forward_backward(fused, tensors, consts, grad_output)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@interpreted
@pytest.mark.parametrize("kernel", KERNELS)
def test_the_totals_do_not_depend_on_which_program_finishes_last(kernel, monkeypatch):
    """The interpreter runs programs in index order, so program P-1 takes the last ticket. Run
    them backwards and program 0 finishes instead: the totals keep their bits."""
    tensors, consts, grad_output = block_inputs("layer_norm_block", (3, 7, D))
    fused = memfuse.memory_efficient_fusion(BLOCKS["layer_norm_block"].fn, config=KERNELS[kernel])
    forward_order = forward_backward(fused, tensors, consts, grad_output)[1]
    builder = triton.runtime.interpreter.interpreter_builder
    index, order = builder.set_grid_idx, []

    def backwards(x, y, z):
        order.append(builder.grid_dim[0] - 1 - x)
        index(order[-1], y, z)

    monkeypatch.setattr(builder, "set_grid_idx", backwards)
    reverse_order = forward_backward(fused, tensors, consts, grad_output)[1]
    assert order[-3:] == [2, 1, 0]              # the backward's three programs, last one first
    for a, b in zip(forward_order, reverse_order):
        assert torch.equal(a, b)


# -- CUDA-graph mode ---------------------------------------------------------------------------
def test_graph_replays_find_the_counter_at_zero(monkeypatch):
    """Emulated replays (graphs.EagerRecorder) rerun the same launches: each finds the counter at
    0 and gives the normal mode's bits."""
    monkeypatch.setattr(graphs, "default_recorder", graphs.EagerRecorder)
    tensors, consts, grad_output = block_inputs("layer_norm_block", (3, 7, D))
    fn = BLOCKS["layer_norm_block"].fn
    normal = forward_backward(memfuse.memory_efficient_fusion(fn, config=KERNELS["row"]), tensors, consts, grad_output)[1]
    fused = memfuse.memory_efficient_fusion(fn, config=KERNELS["row"], cuda_graphs=True)
    for _ in range(3):
        grads = forward_backward(fused, tensors, consts, grad_output)[1]
        for a, b in zip(grads, normal):
            assert torch.equal(a, b)
        assert not column_launch(fused).counter(CPU).any()
    assert memfuse.stats()["graph_replays"] == 3


# -- what the GPU runs: the finish's ordering in PTX ----------------------------------------------
PTX_OF = r'''
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = json.loads(sys.argv[1])
loader = importlib.util.spec_from_file_location("kernel", spec["path"])
module = importlib.util.module_from_spec(loader)
loader.loader.exec_module(module)
source = ASTSource(getattr(module, spec["name"]), spec["signature"], spec["constexprs"])
print(triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"])
'''
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int32: "*i32"}


def kernel_ptx(launch: KernelLaunch, graph) -> str:
    """The kernel compiled for an H100/H200 (sm_90) in a child process without the interpreter:
    Triton compiles to PTX without a GPU."""
    source = launch.kernel.source
    signature = {}
    # the launched function's parameter names: a twin (codegen) launches an earlier kernel's function
    for name, arg in zip(launch.kernel.fn.arg_names, source.args):
        if arg.role in ("read", "write"):
            signature[name] = POINTER_TYPES[graph[arg.value].value.dtype]
        elif arg.role == "totals":
            signature[name] = POINTER_TYPES[getattr(torch, arg.value)]
        elif arg.role == "partials":
            signature[name] = POINTER_TYPES[launch.partials_dtypes[Op(arg.value)]]
        elif arg.role == "counter":
            signature[name] = "*i32"
        else:
            assert arg.role in ("rows", "tiles"), arg
            signature[name] = "i32"
    constexprs = {**source.constexprs, "BLOCK_M": 4, "NUM_STAGES": 1}
    signature.update({name: "constexpr" for name in ("D", "BLOCK_M", "BLOCK_D", "NUM_STAGES")})
    spec = {"path": launch.kernel.path, "name": launch.kernel.function_name, "signature": signature,
            "constexprs": constexprs}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", PTX_OF, json.dumps(spec)], env=env, capture_output=True,
                           text=True, timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-3000:]
    return child.stdout


@pytest.mark.skipif("nvidia" not in triton.backends.backends, reason="Triton without its NVIDIA backend")
def test_the_finish_is_ordered_in_ptx():
    """At each level of the finish: the stores it publishes (partials, then a group's row), a CTA
    barrier, one acq_rel atomic at GPU scope (the ticket); in the program that drew the last
    ticket, a barrier after it, then loads that bypass L1 (ld.global.cg); the counters reset
    after the loads."""
    tensors, consts, grad_output = block_inputs("rms_norm_block", (2, 3, 1024))
    fused = memfuse.memory_efficient_fusion(BLOCKS["rms_norm_block"].fn)
    forward_backward(fused, tensors, consts, grad_output)
    entry, = fused.cache.values()
    lines = [line.strip() for line in kernel_ptx(column_launch(fused), entry.function.backward.graph).splitlines()]

    def where(pattern, start=0, last=False):
        found = [i for i, line in enumerate(lines) if i >= start and re.search(pattern, line)]
        assert found, f"no {pattern!r} after line {start}"
        return found[-1] if last else found[0]

    tickets = [i for i, line in enumerate(lines) if re.search(r"atom\.global\.gpu\.acq_rel\.add", line)]
    assert len(tickets) == 2 and len([line for line in lines if "atom." in line]) == 2   # a group's, the groups'
    for ticket in tickets:
        last_store = max(i for i in range(ticket) if "st.global" in lines[i])
        assert any(line.startswith("bar.sync") for line in lines[last_store:ticket])
        first_load = where(r"ld\.global", ticket)
        assert any(line.startswith("bar.sync") for line in lines[ticket:first_load])
    loads = [line for line in lines[tickets[0]:] if "ld.global" in line]
    assert loads and all("ld.global.cg" in line for line in loads), loads[:3]
    reset = where(r"st\.global\.b32", where(r"ld\.global", tickets[1], last=True), last=True)
    assert reset > tickets[1]
