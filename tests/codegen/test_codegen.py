"""Triton source generation: deterministic, tutorial-like text for the LayerNorm forward, and
hand-built groups launched directly on CPU tensors through the interpreter."""
import re
from pathlib import Path

import pytest
import sympy
import torch
import torch.nn.functional as F

from helpers import BLOCKS, block_inputs, forward_backward, rel_error

import memfuse
from memfuse.capture import capture
from memfuse.codegen import generate
from memfuse.codegen.cache import structure
from memfuse.base.config import Config
from memfuse.ir.graph import Graph, Kind, Node, Op, Reduce, Value, verify
from memfuse.plan import plan
from memfuse.runtime.launchers import FINISH_GROUPS_MAX
from memfuse.schedule.groups import schedule
from memfuse.codegen.tuning import cpu_config
from memfuse.driver.fallback import EagerCall

SHAPE = (2, 7, 48)


def cdiv(a, b):
    return -(-a // b)


def block_m(kernel, tile_elements: int = Config().tile_elements) -> int:
    """Rows per tile the runtime launches with on the CPU (BLOCK_M is a launch choice)."""
    return cpu_config(kernel.source.constexprs["BLOCK_D"], tile_elements).block_m


def launch(kernel, env: dict, rows: int, programs: int = None, tile_elements: int = Config().tile_elements) -> dict:
    """Launch a generated kernel by its argument roles. Outputs go into env, and so do the
    column totals (each column sum's row of its [n, D] totals tensor); returns the partials
    buffers and the ticket counter (key "counter")."""
    src = kernel.source
    rows_per_tile = block_m(kernel, tile_elements)
    tiles = cdiv(rows, rows_per_tile)
    programs = programs or tiles
    d = src.constexprs["D"]
    buffers = {}
    args = []
    for arg in src.args:
        if arg.role in ("read", "scalar", "write"):
            args.append(env[arg.value])
        elif arg.role == "totals":
            dtype = getattr(torch, arg.value)
            names = src.totals[dtype]
            totals = torch.full((len(names), d), float("nan")).to(dtype)
            env.update(zip(names, totals))
            args.append(totals)
        elif arg.role == "partials":
            op = next(op for op in src.column_sums if op.value == arg.value)
            shape = (programs, len(src.column_sums[op]), d)
            buffers[arg.value] = torch.full(shape, float("nan"), dtype=src.partials_dtypes[op])
            args.append(buffers[arg.value])
        elif arg.role == "counter":
            buffers["counter"] = torch.zeros(1 + FINISH_GROUPS_MAX, dtype=torch.int32)
            args.append(buffers["counter"])
        elif arg.role == "rows":
            args.append(rows)
        elif arg.role == "stream_base":
            args.append(arg.constant)
        else:
            assert arg.role == "tiles", arg
            args.append(cdiv(tiles, programs))
    kernel.fn[(programs,)](*args, **src.constexprs, BLOCK_M=rows_per_tile, NUM_STAGES=1)
    return buffers


# -- the LayerNorm block's forward kernel ------------------------------------------------------
def layer_norm_forward(p=0.0):
    tensors, consts, _ = block_inputs("layer_norm_block", SHAPE, dropout_prob=p)
    captured = capture(lambda *t: (BLOCKS["layer_norm_block"].fn(*t, **consts),), tensors, trace_joint=True)
    the_plan = plan(captured)
    kernels = schedule(the_plan.forward, Config(), "forward").kernels
    assert len(kernels) == 1
    return captured, the_plan.forward, kernels[0], tensors, consts


def test_source_is_deterministic_and_content_addressed():
    _, graph, group, _, _ = layer_norm_forward(0.1)
    first = generate(graph, group, Config())
    _, graph2, group2, _, _ = layer_norm_forward(0.1)    # a second capture from scratch
    second = generate(graph2, group2, Config())
    assert first.source.source == second.source.source
    assert first.path == second.path
    path = Path(first.path)
    assert path.read_text() == first.source.source
    assert path.is_relative_to(Config().cache_dir)


def test_layer_norm_forward_reads_like_the_tutorial():
    captured, graph, group, _, _ = layer_norm_forward(0.1)
    src = generate(graph, group, Config()).source
    text = src.source
    fx_names = {n.name for n in captured.aten_graph.graph.nodes}
    # one store per output: the block's output, nothing saved for the backward
    assert len(group.outputs) == 1
    out = group.outputs[0]
    assert text.count("tl.store(") == 1 and text.count(f"tl.store({out}_ptr") == 1
    # values are named after the FX nodes they come from
    for name in group.nodes:
        assert any(name == fx or name.startswith(fx + "_") for fx in fx_names), name
        assert re.search(rf"^\s+{re.escape(name)} = ", text, re.M), name
    for arg in src.args:
        if arg.role in ("read", "write"):
            assert arg.name == f"{arg.value}_ptr" and arg.value in fx_names
    # the header states the bytes per row: two [M, D] inputs read, one written, fp32
    assert f"moves {3 * SHAPE[-1] * 4} bytes per row" in text
    assert "tl.rand" in text and "seed" in text and "M," in text
    assert not re.search(r"\b14\b", text), "the row count must not be baked in"


def test_layer_norm_forward_runs_in_the_interpreter():
    _, graph, group, tensors, consts = layer_norm_forward(0.0)
    kernel = generate(graph, group, Config())
    env = {name: t.detach() for name, t in zip(graph.inputs, tensors)}
    out = group.outputs[0]
    env[out] = torch.full(SHAPE, float("nan"))
    rows = SHAPE[0] * SHAPE[1]
    assert cdiv(rows, block_m(kernel, 256)) > 1                  # 4 rows a tile: 4 programs
    launch(kernel, env, rows, tile_elements=256)
    expected = BLOCKS["layer_norm_block"].fn(*[t.detach() for t in tensors], **consts)
    assert rel_error(env[out], expected) <= 1e-5


# -- hand-built groups -------------------------------------------------------------------------
M = sympy.Symbol("s0", positive=True, integer=True)
D = 40


def full(dtype=torch.float32):
    return Value(dtype, Kind.FULL, (M, D), m=M, d=D)


def row(dtype=torch.float32):
    return Value(dtype, Kind.ROW, (M, 1), m=M)


def col(dtype=torch.float32):
    return Value(dtype, Kind.COL, (D,), d=D)


def build(nodes, inputs, outputs) -> Graph:
    graph = Graph()
    for node in nodes:
        graph.add(node)
    graph.inputs, graph.outputs = inputs, outputs
    verify(graph)
    return graph


def test_hand_built_pointwise_group_matches_torch(tmp_path):
    """out = a * b + c, with a [M, D], b a column vector [D], c a row vector [M, 1]."""
    graph = build([
        Node("a", Op.INPUT, (), full()),
        Node("b", Op.INPUT, (), col()),
        Node("c", Op.INPUT, (), row()),
        Node("ab", Op.MUL, ("a", "b"), full()),
        Node("out", Op.ADD, ("ab", "c"), full()),
    ], ["a", "b", "c"], ["out"])
    config = Config(cache_dir=tmp_path, tile_elements=128)       # 2 rows a tile
    sched = schedule(graph, config, "forward")
    assert len(sched.kernels) == 1 and not sched.not_fused
    group = sched.kernels[0]
    assert group.nodes == ["ab", "out"] and group.outputs == ["out"] and group.aten_reason is None
    kernel = generate(graph, group, config)
    assert kernel.path.startswith(str(tmp_path))
    rows = 7                                                     # 4 tiles, the last one half full
    env = {"a": torch.randn(rows, D), "b": torch.randn(D), "c": torch.randn(rows, 1),
           "out": torch.full((rows, D), float("nan"))}
    launch(kernel, env, rows, tile_elements=config.tile_elements)
    torch.testing.assert_close(env["out"], env["a"] * env["b"] + env["c"], rtol=1e-6, atol=1e-6)


def test_hand_built_row_and_column_reductions_match_torch(tmp_path):
    """r = sum over D of a * b (a row vector), s = sum over M of a (a column, via partials)."""
    graph = build([
        Node("a", Op.INPUT, (), full()),
        Node("b", Op.INPUT, (), col()),
        Node("ab", Op.MUL, ("a", "b"), full()),
        Node("r", Op.SUM, ("ab",), row(), Reduce(Kind.ROW)),
        Node("s", Op.SUM, ("a",), col(), Reduce(Kind.COL)),
        Node("m", Op.MAX, ("ab",), col(), Reduce(Kind.COL)),
    ], ["a", "b"], ["r", "s", "m"])
    config = Config(cache_dir=tmp_path, tile_elements=128)
    group, = schedule(graph, config, "forward").kernels
    assert group.outputs == ["r"] and sorted(group.column_sums) == ["m", "s"]
    kernel = generate(graph, group, config)
    assert kernel.source.persistent
    rows = 9                                                     # 5 tiles over 2 programs
    a, b = torch.randn(rows, D), torch.randn(D)
    env = {"a": a, "b": b, "r": torch.full((rows, 1), float("nan"))}
    buffers = launch(kernel, env, rows, programs=2, tile_elements=config.tile_elements)
    torch.testing.assert_close(env["r"], (a * b).sum(1, keepdim=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(env["s"], a.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(env["m"], (a * b).amax(0), rtol=0, atol=0)
    assert not buffers["counter"].any()                            # the finishing programs reset them


def bf16_truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounding toward zero: the top 16 bits of each fp32."""
    return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def test_hand_built_bf16_rounds_once_at_the_store(tmp_path):
    """bf16 in, bf16 out: computed in fp32 registers, one rounding at the store. On a GPU the
    store rounds to nearest even; Triton's interpreter (3.9) truncates fp32 -> bf16 casts, so
    either neighbour of the fp32 result is accepted, and nothing else (a bf16 intermediate
    would round twice)."""
    bf16 = torch.bfloat16
    graph = build([
        Node("a", Op.INPUT, (), full(bf16)),
        Node("b", Op.INPUT, (), full(bf16)),
        Node("ab", Op.MUL, ("a", "b"), full(bf16)),
        Node("out", Op.ADD, ("ab", "a"), full(bf16)),
    ], ["a", "b"], ["out"])
    config = Config(cache_dir=tmp_path)
    group, = schedule(graph, config, "forward").kernels
    kernel = generate(graph, group, config)
    rows = 64
    a, b = torch.randn(rows, D, dtype=bf16), torch.randn(rows, D, dtype=bf16)
    env = {"a": a, "b": b, "out": torch.empty(rows, D, dtype=bf16)}
    launch(kernel, env, rows)
    exact = a.float() * b.float() + a.float()
    nearest, toward_zero = exact.to(bf16), bf16_truncated(exact)
    assert bool(((env["out"] == nearest) | (env["out"] == toward_zero)).all())
    twice = ((a * b) + a)                                        # eager bf16 rounds the product too
    assert not bool(((twice == nearest) | (twice == toward_zero)).all()), "the check can tell"


# -- the LayerNorm block's backward kernel: column sums finished by its last program ------------
def test_layer_norm_backward_finishes_its_column_sums_and_reads_like_the_tutorial():
    """The weight and bias grads: partials, a ticket, and in the last program one named total
    per column sum, read back from every program's partials at L2."""
    tensors, consts, grad_output = block_inputs("layer_norm_block", SHAPE)
    fused = memfuse.memory_efficient_fusion(BLOCKS["layer_norm_block"].fn)
    forward_backward(fused, tensors, consts, grad_output)
    entry, = fused.cache.values()
    backward = entry.function.backward
    launch = backward.steps[0]
    sums = launch.group.column_sums
    text = launch.kernel.source.source
    assert "totals_float32_ptr,  # [3, D] float32 column totals over M" in text
    assert "done_ptr,  # int32 tickets: [0] groups finished, [1 + g] programs of group g done" in text
    finish = [line.strip() for line in text[text.index("# finish:"):].splitlines()]
    # a ticket per program in its group, a branch for the group's last, a ticket per group, a
    # branch for the last group: named values, one statement a line
    assert "group_size = tl.ceil(tl.sqrt(num_programs.to(tl.float32))).to(tl.int32)" in finish
    assert 'ticket = tl.atomic_add(done_ptr + 1 + group, 1, sem="acq_rel", scope="gpu")' in finish
    assert "group_end = tl.minimum(num_programs, group_first + group_size)" in finish
    assert "if ticket == group_end - group_first - 1:" in finish
    assert 'group_ticket = tl.atomic_add(done_ptr, 1, sem="acq_rel", scope="gpu")' in finish
    assert "if group_ticket == groups - 1:" in finish
    for ticket in ("ticket = ", "group_ticket = "):
        at = next(i for i, line in enumerate(finish) if line.startswith(ticket))
        assert finish[at - 1].startswith("tl.debug_barrier()") and finish[at + 2].startswith("tl.debug_barrier()")
    assert "for block in range(group_first, group_end, BLOCK_M):" in finish
    assert "for block in range(0, num_programs, BLOCK_M * group_size):" in finish
    assert "programs = (block + tl.arange(0, BLOCK_M) * group_size).to(tl.int64)" in finish
    for j, name in enumerate(sums):
        assert finish.count(f"{name}_total = tl.full([BLOCK_D], 0.0, tl.float32)") == 2
        loads = [line for line in finish if line.startswith(f"{name}_partials = tl.load(")]
        assert len(loads) == 2 and all(load.endswith('other=0.0, cache_modifier=".cg")') for load in loads)
        assert f"{name}_total = ({name}_total + tl.sum({name}_partials, axis=0))" in finish
        assert (f"tl.store(partials_sum_ptr + (group_first * {len(sums)} + {j}) * D + cols, {name}_total, "
                "mask=col_mask)") in finish
        assert f"tl.store(totals_float32_ptr + {j} * D + cols, {name}_total, mask=col_mask)" in finish
    assert finish[-1].startswith("tl.store(done_ptr, 0)")
    # the program takes the totals' rows: no reduction, no cast after the launch, and the weight
    # grad's [D] -> [1, 1, D] -> [D] reshapes written as none
    program = backward.source
    assert ".sum(" not in program and ".to(" not in program and "mf_totals = " not in program
    assert ".reshape(" not in program
    d = SHAPE[-1]
    for j in range(len(sums)):          # a sum, or the reshape its only reader made of it
        assert re.search(rf"^    \w+ = mf_reinterpret\(mf_totals_float32, \({d},\), \(1,\), {j * d}\)$", program,
                         re.MULTILINE), program


# -- programs: what a call checks -----------------------------------------------------------------
def test_programs_check_contiguity_only_where_nothing_promises_it():
    """The forward reads inputs the compile key says are contiguous as they are. The backward
    checks its tangents (an output grad may come in any strides) and what it reads of the
    forward (a saved-tensors hook may unpack a tensor in other strides): the grads stay eager's."""
    def fn(x, b):
        return torch.tanh(x * b)

    x, b = torch.randn(6, 24, requires_grad=True), torch.randn(24, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(fn)
    function = fused.compiled_for(x, b).function
    assert ".is_contiguous()" not in function.forward.source
    backward = function.backward.source
    assert "primals_1.is_contiguous()" in backward and "tangents_1.is_contiguous()" in backward

    def transposed_copy(t):
        return t.t().contiguous().t() if t.dim() == 2 else t

    grad = torch.randn(24, 6).t()                 # a non-contiguous output grad
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, transposed_copy):
        fused(x, b).backward(grad)
    assert not transposed_copy(x).is_contiguous()
    ref_x, ref_b = x.detach().requires_grad_(), b.detach().requires_grad_()
    fn(ref_x, ref_b).backward(grad)
    torch.testing.assert_close(x.grad, ref_x.grad)
    torch.testing.assert_close(b.grad, ref_b.grad)


def test_program_allocator_and_rows():
    """Programs allocate through inductor's allocator where torch has one for the device type,
    else through torch.empty_strided: a contiguous tensor of the shape and dtype, on the device.
    Rows of totals are tensors over the totals' memory: inductor's, else an as_strided view."""
    from memfuse.base.torch_private import as_strided_at as _as_strided_at
    from memfuse.runtime.program import _allocator, _reinterpret
    assert _allocator(torch.device("cpu")) is torch._C._dynamo.guards._empty_strided_cpu
    t = _allocator(torch.device("meta"))((2, 3, 4), (12, 4, 1), torch.bfloat16)
    assert (t.shape, t.stride(), t.dtype, t.device.type) == ((2, 3, 4), (12, 4, 1), torch.bfloat16, "meta")
    totals = torch.arange(12.0).reshape(3, 4)[1:]
    for make in (_reinterpret, _as_strided_at):
        row = make(totals, (1, 4), (4, 1), 4)
        assert torch.equal(row, totals[1:2]) and row.data_ptr() == totals[1].data_ptr()


def test_programs_call_views_and_matmuls_as_tensor_methods():
    """A program's matmuls are the tensor's own methods (an OpOverload call costs 2-6 us more host
    time on a CPU), not bound aten calls; so are its views where it does not know the source's
    layout, the others are made by strides (tests/ir/test_view_layouts.py). Values and gradients as eager's."""
    def projected_scores(x, w):
        h = (x @ w.t()).view(x.shape[0], 4, 8)
        return (h @ h.transpose(1, 2)).relu()

    x, w = torch.randn(6, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(projected_scores)
    fused(x, w).sum().backward()
    got = [t.grad for t in (x, w)]
    for t in (x, w):
        t.grad = None
    projected_scores(x, w).sum().backward()
    for a, t in zip(got, (x, w)):
        torch.testing.assert_close(a, t.grad)
    entry, = fused.cache.values()
    source = entry.function.forward.source + entry.function.backward.source
    assert ".mm(" in source and ".bmm(" in source
    assert "mf_reinterpret(primals_2, (16, 32), (1, 16), 0)" in source    # w.t(): w is a contiguous input
    assert "mf_aten_" not in source               # every aten call here has a method form


# -- twins: kernels of the same code launch one function, compiled once -----------------------------
def four_layers(x, *weights):
    """Four layers of one code (matmul, then ReLU, residual add and LayerNorm), other values each: the
    middle ones' kernels are the same code (the first reads the input, the last writes the output)."""
    for w, g in zip(weights[0::2], weights[1::2]):
        x = F.layer_norm(torch.relu(F.linear(x, w)) + x, (x.shape[-1],), g)
    return x


def four_layer_inputs(d=24):
    weights = [t for _ in range(4) for t in ((torch.randn(d, d) / d ** 0.5), torch.randn(d))]
    return [torch.randn(3, 5, d, requires_grad=True)] + [w.requires_grad_() for w in weights]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_layers_of_one_code_share_their_kernels_and_match_eager(tmp_path, autocast):
    """Kernels of one code are one function. The weight gradients are their matmuls' outputs (a
    transpose of the transposed matmul is the matmul: capture._composed_permutes), cast by twin
    kernels under autocast, read through a transpose by none."""
    tensors = four_layer_inputs()
    fused = memfuse.memory_efficient_fusion(four_layers, config=Config(cache_dir=tmp_path))
    grad_output = torch.randn(3, 5, 24)
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with precision:
        out, grads = forward_backward(fused, tensors, {}, grad_output)
        expected, expected_grads = forward_backward(four_layers, tensors, {}, grad_output)
        function = fused.compiled_for(*tensors).function
    tolerance = 1e-2 if autocast else 1e-5
    assert rel_error(out, expected) <= tolerance
    for grad, expected_grad in zip(grads, expected_grads):
        assert rel_error(grad, expected_grad) <= tolerance
    kernels = [step.kernel for program in (function.forward, function.backward) for step in program.steps
               if hasattr(step, "kernel")]
    twins = [k for k in kernels if k.twin_of is not None]
    assert twins and memfuse.stats()["kernels_shared"] == len(twins)
    by_name = {k.source.name: k for k in kernels}
    for twin in twins:
        first = by_name[twin.twin_of]
        assert first.twin_of is None and twin.fn is first.fn and twin.path == first.path
        assert twin.source.source != first.source.source              # its own names, for dumps and explain
        assert structure(twin.source.source, twin.source.name) == structure(first.source.source, first.source.name)
    assert len({id(k.fn) for k in kernels}) == len(kernels) - len(twins)
    files = list((tmp_path / "kernels").glob("*.py"))
    assert len(files) == len(kernels) - len(twins)                     # a twin writes and imports no file
    assert not [k.source.name for k in kernels if "through access maps" in k.source.summary]


def dropout_layers(x, *weights, masks=None):
    """Layers of one code drawing dropout masks: each output's zeros are its dropped elements (the
    value before dropout is at least 1). With `masks`, eager applies those instead of drawing."""
    outputs = []
    for i, w in enumerate(weights):
        before = torch.relu(x @ w) + 1.0
        x = F.dropout(before, 0.5, training=True) if masks is None else before * masks[i] * 2.0
        outputs.append(x)
    return tuple(outputs)


def test_twins_draw_their_own_dropout_streams_in_both_directions(tmp_path):
    """A twin launches the first kernel's binary with its own stream base: each layer's mask is its
    own (not the first layer's), and the backward regenerates the forward's mask in every layer."""
    x = torch.randn(6, 16, requires_grad=True)
    weights = [(torch.randn(16, 16) / 4).requires_grad_() for _ in range(4)]
    fused = memfuse.memory_efficient_fusion(dropout_layers, config=Config(cache_dir=tmp_path))
    outputs = fused(x, *weights)
    function = fused.compiled_for(x, *weights).function
    drawing = [step.kernel for program in (function.forward, function.backward) for step in program.steps
               if hasattr(step, "kernel") and "tl.rand" in step.kernel.source.source]
    bases = [a.constant for k in drawing for a in k.source.args if a.role == "stream_base"]
    assert any(k.twin_of for k in drawing) and len(bases) == len(drawing)
    masks = [(o != 0).float() for o in outputs]
    assert all(0.2 < m.mean() < 0.8 for m in masks)
    assert all(not torch.equal(masks[i], masks[j]) for i in range(4) for j in range(i))
    upstream = [torch.randn_like(o) for o in outputs]
    grads = torch.autograd.grad(sum((o * u).sum() for o, u in zip(outputs, upstream)), [x, *weights])
    expected_outputs = dropout_layers(x, *weights, masks=masks)
    expected = torch.autograd.grad(sum((o * u).sum() for o, u in zip(expected_outputs, upstream)), [x, *weights])
    for output, expected_output in zip(outputs, expected_outputs):
        assert rel_error(output.detach(), expected_output.detach()) <= 1e-5
    for grad, expected_grad in zip(grads, expected):
        assert rel_error(grad, expected_grad) <= 1e-5


def test_structure_renames_locals_and_keeps_what_changes_meaning():
    def kernel(name, *, a="x", b="y", literal="0.5", keyword="mask", dns="x"):
        return (f"import triton\nimport triton.language as tl\n\n"
                f"@triton.jit(do_not_specialize=['{dns}'])\n"
                f"def {name}({a}, {b}_ptr, M):\n"
                f"    {b} = tl.load({b}_ptr + tl.arange(0, 16), {keyword}=tl.arange(0, 16) < M)  # a comment\n"
                f"    tl.store({b}_ptr, {b} * {literal} + {a})\n")
    first = structure(kernel("memfuse_forward_3"), "memfuse_forward_3")
    assert structure(kernel("memfuse_forward_9", a="seed_v", b="add_7", dns="seed_v"), "memfuse_forward_9") == first
    assert "comment" not in first and "memfuse_forward" not in first
    assert structure(kernel("k", literal="0.25"), "k") != first           # a literal: another dropout site, scale
    assert structure(kernel("k", keyword="other"), "k") != first          # keyword names are not renamed
    assert structure(kernel("k", dns="M"), "k") != first                  # nor is what do_not_specialize means
    assert structure(kernel("k", a="y", b="x", dns="y"), "k") == first    # names swapped: the same function


def test_kernels_of_other_types_or_sizes_are_not_twins(tmp_path):
    """The same code over bf16 or over rows of another length is another binary (Triton specializes
    on pointer dtypes and constexprs; the binary index and tuning cache are keyed by the file)."""
    config = Config(cache_dir=tmp_path)
    kernels = []
    for dtype, d in [(torch.float32, 40), (torch.bfloat16, 40), (torch.float32, 48), (torch.float32, 40)]:
        graph = build([Node("a", Op.INPUT, (), Value(dtype, Kind.FULL, (M, d), m=M, d=d)),
                       Node("b", Op.INPUT, (), Value(dtype, Kind.FULL, (M, d), m=M, d=d)),
                       Node(f"sum_{len(kernels)}", Op.ADD, ("a", "b"), Value(dtype, Kind.FULL, (M, d), m=M, d=d))],
                      ["a", "b"], [f"sum_{len(kernels)}"])
        group = schedule(graph, config, "forward").kernels[0]
        kernels.append(generate(graph, group, config))
    assert [k.twin_of for k in kernels] == [None, None, None, kernels[0].source.name]
    assert len({id(k.fn) for k in kernels}) == 3


def test_a_tile_of_many_values_gets_the_warps_that_hold_them():
    """The table's warps for a LayerNorm's row; more for a row of 26 [M, 768] values (BERT's rebuild:
    2 warps took 255 registers), never past MAX_WARPS; persistent kernels keep the table's."""
    from memfuse.codegen.tuning import MAX_WARPS, default_config
    table = default_config(1024, False)
    assert default_config(1024, False, bytes_per_row=4 * 768 * 2, d=768) == table
    heavy = default_config(1024, False, bytes_per_row=66192, d=768)
    assert heavy.block_m == table.block_m and heavy.num_warps == 8 > table.num_warps
    assert default_config(1024, False, bytes_per_row=10**8, d=768).num_warps == MAX_WARPS
    assert default_config(1024, True, bytes_per_row=10**8, d=768) == default_config(1024, True)


def test_a_persistent_tile_of_a_light_row_gets_the_rows_that_keep_loads_in_flight():
    """A bias gradient (a column sum that only reads one bf16 [M, 768] value) at the table's 2 rows
    and 4 programs an SM keeps 12 KB an SM in flight; it gets rows (a power of two) that reach
    PERSISTENT_BYTES_PER_SM. A LayerNorm backward's row already does at the table's rows."""
    from memfuse.codegen.tuning import PERSISTENT_BYTES_PER_SM, default_config
    table = default_config(1024, True)
    light = default_config(1024, True, bytes_per_row=768 * 2, d=768)
    assert light.block_m > table.block_m and light.block_m & (light.block_m - 1) == 0
    assert light.block_m * 768 * 2 * light.programs_per_sm >= PERSISTENT_BYTES_PER_SM
    assert (light.block_m // 2) * 768 * 2 * light.programs_per_sm < PERSISTENT_BYTES_PER_SM
    assert light.num_warps >= table.num_warps
    assert default_config(1024, True, bytes_per_row=768 * 16, d=768) == table


def shift_right(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """T5's and BART's decoder inputs: the labels shifted one right, a start token written in front
    (`s[..., 0] = 0`: under Dynamo a 0-d tensor constant broadcast into a column)."""
    shifted = ids.new_zeros(ids.shape)
    shifted[..., 1:] = ids[..., :-1].clone()
    shifted[..., 0] = 0
    shifted.masked_fill_(shifted == -100, 0)
    return table[shifted].sum(-1)


def test_a_zero_dim_tensor_broadcast_into_rows_is_read_in_place():
    """A strided read whose root has no dims (every stride 0) compiles: it raised an IndexError in
    codegen and the graph ran through torch."""
    ids, table = torch.randint(0, 10, (8, 12)), torch.randn(10, 16)
    torch._dynamo.reset()
    got = torch.compile(shift_right, backend="memfuse")(ids, table)
    assert memfuse.stats()["graph_fallbacks"] == 0
    torch.testing.assert_close(got, shift_right(ids, table))


@torch.jit.script
def root_width(x: torch.Tensor, factor: int) -> torch.Tensor:
    """DeBERTa-v2's `scaled_size_sqrt` (TorchScript in transformers 5.17): a tensor made from a size."""
    return torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * factor)


def divided_by_root_width(x: torch.Tensor) -> torch.Tensor:
    return (x / root_width(x, 2).to(x.dtype)).softmax(-1)


def test_a_cast_of_an_integer_constant_is_a_tensor_cast():
    """The cast of a constant reads `tl.full(...).to(...)`: `8.to(tl.float32)` does not parse, and the
    call ran through torch."""
    x = torch.randn(6, 8, requires_grad=True)
    fused = memfuse.memory_efficient_fusion(divided_by_root_width)
    assert not isinstance(fused.compiled_for(x), EagerCall)
    torch.testing.assert_close(fused(x), divided_by_root_width(x))


def size_scattered_into_a_table(x: torch.Tensor) -> torch.Tensor:
    """BEiT's relative-position index: sizes written into a table's first row and column."""
    m = x.shape[0]
    table = torch.zeros(m, m, dtype=torch.long)
    table[0, 0:] = m - 3
    table[0:, 0] = m - 2
    return (x * table.sum(-1, keepdim=True).float()).sum(-1)


def test_a_view_of_a_size_expression_is_the_scalar_not_a_load():
    """A strided read whose root is a size expression (a scalar the kernel takes by value) reads
    the scalar: the kernel loaded from `sub_ptr`, which it has no argument for (NameError at the
    first launch: the call ran through torch)."""
    fused = memfuse.memory_efficient_fusion(size_scattered_into_a_table)
    for m in (6, 9):
        x = torch.randn(m, 8)
        torch.testing.assert_close(fused(x), size_scattered_into_a_table(x))
    stats = memfuse.stats()
    assert stats["eager_calls"] == 0 and stats["first_run_fallbacks"] == 0, stats
