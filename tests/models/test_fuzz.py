"""Random programs of supported ops over random shapes and dtypes, against eager.

Each example is a small straight-line function (printed on failure as Python source, with
hypothesis' @reproduce_failure blob). The run is derandomized, so CI sees the same examples
every time; to explore new ones set MEMFUSE_FUZZ_SEED=<int> (and MEMFUSE_FUZZ_EXAMPLES=<n>):

    MEMFUSE_FUZZ_SEED=7 MEMFUSE_FUZZ_EXAMPLES=200 pytest tests/models/test_fuzz.py
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, note, reject, seed, settings
from hypothesis import strategies as st

import memfuse
from memfuse import Config

from compare import assert_same, run_both

EXAMPLES = int(os.environ.get("MEMFUSE_FUZZ_EXAMPLES", "25"))
SEED = os.environ.get("MEMFUSE_FUZZ_SEED")

UNARY = {
    "exp": "torch.exp(torch.tanh({0}))", "sin": "torch.sin({0})", "tanh": "torch.tanh({0})",
    "sigmoid": "torch.sigmoid({0})", "relu": "torch.relu({0})", "gelu": "F.gelu({0})",
    "gelu_tanh": "F.gelu({0}, approximate='tanh')", "silu": "F.silu({0})", "abs": "{0}.abs()",
    "neg": "-{0}", "square": "{0} * {0}", "softplus": "F.softplus({0})", "erf": "torch.erf({0})",
    "log1p": "torch.log1p({0}.abs())", "sqrt": "torch.sqrt({0}.abs() + 1)", "mish": "F.mish({0})",
    "hardswish": "F.hardswish({0})", "leaky_relu": "F.leaky_relu({0}, 0.1)", "elu": "F.elu({0})",
    "clamp": "{0}.clamp(-1, 1)", "pow": "({0}.abs() + 0.5) ** 1.5", "cube": "{0} ** 3",
    "rsqrt": "torch.rsqrt({0} * {0} + 1)", "reciprocal": "1 / ({0}.abs() + 1)",
    "float_cast": "{0}.float()", "expm1": "torch.expm1(torch.tanh({0}))", "cos": "torch.cos({0})",
    "atan": "torch.atan({0})", "asinh": "torch.asinh({0})", "sinh": "torch.sinh(torch.tanh({0}))",
    "asin": "torch.asin(torch.tanh({0}) * 0.9)", "erfc": "torch.erfc({0})",
    "lgamma": "torch.lgamma({0}.abs() + 0.5)",
}
BINARY = {
    "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "maximum": "torch.maximum({0}, {1})",
    "minimum": "torch.minimum({0}, {1})", "div": "{0} / ({1}.abs() + 1)",
    "where": "torch.where({0} > {1}, {0}, {1} * 0.5)", "lerp": "torch.lerp({0}, {1}, 0.25)",
    "addcmul": "torch.addcmul({0}, {0}, {1}, value=0.5)", "scaled_add": "torch.add({0}, {1}, alpha=-2)",
    "atan2": "torch.atan2({0}, {1}.abs() + 0.5)",
}
ROWWISE = {
    "sum": "{0}.sum(-1, keepdim=True)", "mean": "{0}.mean(-1, keepdim=True)",
    "amax": "{0}.amax(-1, keepdim=True)", "amin": "{0}.amin(-1, keepdim=True)",
    "softmax": "torch.softmax({0}, -1)", "log_softmax": "torch.log_softmax({0}, -1)",
    "normalize": "({0} - {0}.mean(-1, keepdim=True)) * torch.rsqrt({0}.var(-1, keepdim=True, unbiased=False) + 1e-5)",
    "rms": "{0} * torch.rsqrt({0}.pow(2).mean(-1, keepdim=True) + 1e-6)",
    "logsumexp": "torch.logsumexp({0}, -1, keepdim=True)", "max_values": "{0}.max(-1, keepdim=True)[0]",
    "var": "{0}.var(-1, keepdim=True)",
}
COLUMNWISE = {"colsum": "{0}.sum(0)", "colmean": "{0}.mean(0)", "colmax": "{0}.amax(0)"}
TOTAL = {"total_sum": "{0}.sum()", "total_mean": "{0}.mean()"}
FAMILIES = {"unary": UNARY, "binary": BINARY, "row": ROWWISE, "column": COLUMNWISE, "total": TOTAL}


@dataclass
class Program:
    lead: tuple
    d: int
    dtypes: tuple            # x0, x1, w (column), r (row)
    looped: bool             # Config(max_row_length) below D: the looped kernels
    steps: list              # (family, op, operand positions)
    outputs: tuple           # positions of the returned values

    def source(self) -> str:
        lines = ["def program(x0, x1, w, r):"]
        names = ["x0", "x1", "w", "r"]
        for k, (family, op, operands) in enumerate(self.steps):
            text = FAMILIES[family][op].format(*[names[i % len(names)] for i in operands])
            lines.append(f"    v{k} = {text}")
            names.append(f"v{k}")
        lines.append(f"    return {', '.join(names[i % len(names)] for i in self.outputs)},")
        return "\n".join(lines)

    def function(self):
        namespace = {"torch": torch, "F": F}
        exec(compile(self.source(), "<fuzz program>", "exec"), namespace)
        return namespace["program"]

    def inputs(self):
        generator = torch.Generator().manual_seed(0)
        shapes = [(*self.lead, self.d), (*self.lead, self.d), (self.d,), (*self.lead, 1)]
        return [torch.randn(shape, generator=generator).to(dtype).requires_grad_()
                for shape, dtype in zip(shapes, self.dtypes)]


@st.composite
def programs(draw) -> Program:
    lead = draw(st.sampled_from([(1,), (3,), (5,), (2, 3), (1, 4)]))
    d = draw(st.sampled_from([1, 3, 8, 17, 24]))
    main = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    mixed = draw(st.booleans())
    dtypes = (main, main, torch.float32 if mixed else main, main)
    steps = []
    for k in range(draw(st.integers(1, 6))):
        family = draw(st.sampled_from(["unary"] * 4 + ["binary"] * 4 + ["row"] * 3 + ["column", "total"]))
        op = draw(st.sampled_from(sorted(FAMILIES[family])))
        operands = [draw(st.integers(0, 3 + k)) for _ in range(2 if family == "binary" else 1)]
        steps.append((family, op, operands))
    last = 3 + len(steps)
    outputs = (last,) if draw(st.booleans()) else (last, draw(st.integers(4, last)))
    return Program(lead, d, dtypes, draw(st.booleans()), steps, outputs)


def _settings(fn):
    fn = settings(max_examples=EXAMPLES, deadline=None, print_blob=True, database=None,
                  derandomize=SEED is None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])(fn)
    return seed(int(SEED))(fn) if SEED is not None else fn


@_settings
@given(program=programs())
def test_random_programs_match_eager(program):
    note(f"program (lead={program.lead}, D={program.d}, dtypes={program.dtypes}, looped={program.looped}):\n"
         f"{program.source()}")
    fn = program.function()
    try:
        fn(*program.inputs())
    except RuntimeError:     # a program eager refuses (torch.lerp of mixed dtypes) tests nothing
        reject()
    config = Config(max_row_length=8, loop_block_d=4) if program.looped else None
    before = memfuse.stats()["kernels_launched"]
    both = run_both(fn, program.inputs(), config=config, reference=True)
    assert_same(both.fused, both.eager, scale=4.0, reference=both.reference)
    assert_same(both.fused_grads, both.eager_grads, scale=8.0, what="gradient", reference=both.reference_grads)
    assert memfuse.stats()["kernels_launched"] > before, "memfuse launched no kernel"
