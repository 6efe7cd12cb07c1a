"""Run a function through memfuse and through eager torch, and compare outputs and gradients."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import memfuse

TOLERANCES = {   # (rtol, atol) for outputs; gradients get twice as much
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.bfloat16: (1.6e-2, 1e-2),
    torch.float16: (1e-3, 1e-3),
}


@dataclass
class Both:
    fused: list
    eager: list
    fused_grads: list
    eager_grads: list
    kernels: int            # kernels memfuse launched for the forward and backward
    fallbacks: list         # (node, target, reason) recorded by capture
    captured: list          # capture's result for each compiled program
    reference: list = None  # eager in float64 (bf16/fp16 runs): outputs, then gradients
    reference_grads: list = None


def as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def run_both(fn, args, *, config=None, seed: int = 0, reference: bool = False) -> Both:
    """Forward both ways from the same torch seed; backward with the same random output grads
    through every floating output that requires grad. With bf16/fp16 inputs (or `reference`)
    also eager in float64, to arbitrate rounding differences."""
    fused_fn = memfuse.memory_efficient_fusion(fn, config=config)
    before = memfuse.stats()["kernels_launched"]
    fused_args = [a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for a in args]
    torch.manual_seed(seed)
    fused = as_list(fused_fn(*fused_args))
    torch.manual_seed(seed)
    eager = as_list(fn(*args))
    fused_grads, eager_grads = _grads(fused, fused_args), _grads(eager, args)
    kernels = memfuse.stats()["kernels_launched"] - before
    captured = [entry.captured for entry in fused_fn.cache.values()]
    fallbacks = [f for c in captured for f in c.fallbacks]
    both = Both(fused, eager, fused_grads, eager_grads, kernels, fallbacks, captured)
    if reference or any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args):
        wide = [a.detach().double().requires_grad_(a.requires_grad) if _floating(a) else a for a in args]
        torch.manual_seed(seed)
        both.reference = as_list(fn(*wide))
        both.reference_grads = _grads(both.reference, wide, like=eager)
    return both


def _floating(a) -> bool:
    return isinstance(a, torch.Tensor) and a.is_floating_point()


def _grads(outputs, args, like=None) -> list:
    """Gradients for random output grads (drawn in the dtypes of `like`'s outputs)."""
    like = outputs if like is None else like
    diff = [(o, l) for o, l in zip(outputs, like) if isinstance(o, torch.Tensor) and o.requires_grad]
    inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if not diff or not inputs:
        return []
    generator = torch.Generator().manual_seed(1234)
    grads = [torch.randn(o.shape, generator=generator, dtype=torch.float32).to(l.dtype).to(o.dtype)
             for o, l in diff]
    return list(torch.autograd.grad([o for o, _ in diff], inputs, grads, allow_unused=True))


def assert_same(got, want, *, scale: float = 1.0, what: str = "output", reference=None) -> None:
    """memfuse's values match eager's within the dtype's tolerance; with a float64 `reference`,
    values that differ more must be as close to the reference as eager's are (memfuse rounds
    once per kernel, eager once per op: in bf16 memfuse is often the more accurate)."""
    assert len(got) == len(want), f"{what}: {len(got)} values, eager has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            assert g is None or not g.any(), f"{what} {i}: eager has no gradient, memfuse has one"
            continue
        assert g is not None, f"{what} {i}: memfuse has no gradient"
        assert g.dtype == w.dtype, f"{what} {i}: dtype {g.dtype}, eager {w.dtype}"
        assert g.shape == w.shape, f"{what} {i}: shape {tuple(g.shape)}, eager {tuple(w.shape)}"
        rtol, atol = TOLERANCES.get(w.dtype, (0, 0))
        try:
            torch.testing.assert_close(g, w, rtol=rtol * scale, atol=atol * scale, equal_nan=True,
                                       msg=lambda m: f"{what} {i}: {m}")
        except AssertionError:
            if reference is None or reference[i] is None:
                raise
            ref = reference[i].double()
            ours, theirs = (g.double() - ref).abs(), (w.double() - ref).abs()
            bound = theirs + atol * scale + rtol * scale * ref.abs()
            worse = ~((ours <= bound) | (ours.isnan() & theirs.isnan()))
            assert not worse.any(), (f"{what} {i}: memfuse is further from the float64 reference than eager "
                                     f"at {worse.sum().item()} elements, e.g. memfuse {g[worse][:3].tolist()} "
                                     f"eager {w[worse][:3].tolist()} reference {ref[worse][:3].tolist()}")


def assert_matches_eager(fn, args, *, config=None, grad_scale: float = 2.0, expect_kernels: bool = True) -> Both:
    both = run_both(fn, args, config=config)
    assert_same(both.fused, both.eager, reference=both.reference)
    assert_same(both.fused_grads, both.eager_grads, scale=grad_scale, what="gradient",
                reference=both.reference_grads)
    if expect_kernels:
        assert both.kernels > 0, "memfuse launched no kernel"
    return both
