"""Train a client's model a few steps in eager and in each memfuse style; compare losses per step
and the last step's gradients (fp32, dropout off)."""
from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

import memfuse

STYLES = ("whole", "backend", "layers")


def tiny_llama() -> nn.Module:
    """A 2-layer Llama of hidden 32 and vocabulary 64 (seed 0), no key-value cache: the clients'
    HuggingFace model."""
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      use_cache=False)
    return transformers.LlamaForCausalLM(config)


def fuse(model: nn.Module, style: str, layers: Callable[[nn.Module], nn.ModuleList]) -> nn.Module:
    """`model` in one memfuse style: the whole model wrapped, torch.compile's backend, or each
    layer of `layers(model)` wrapped (the rest eager)."""
    if style == "whole":
        return memfuse.memory_efficient_fusion(model)
    if style == "backend":
        torch._dynamo.reset()      # Dynamo's code cache is per code object: another test's GPT would serve this one
        return torch.compile(model, backend="memfuse")
    blocks = layers(model)
    for i, block in enumerate(blocks):
        blocks[i] = memfuse.memory_efficient_fusion(block)
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train(model: nn.Module, step: Callable, batches: list, optimizer: torch.optim.Optimizer) -> tuple[list, dict]:
    """(loss per step, name -> gradient of the last step) of optimizer steps; `step(model, batch)`
    returns the loss."""
    losses = []
    for batch in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = step(model, batch)
        loss.backward()
        losses.append(loss.item())
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        optimizer.step()
    return losses, grads


def assert_matches_eager(build: Callable[[], nn.Module], step: Callable, batches: list, style: str,
                         layers: Callable[[nn.Module], nn.ModuleList], optimizer: Callable = adamw) -> dict:
    """Eager and `style` from the same weights: the same losses per step and last gradients;
    returns the fused run's gradients. `optimizer(model)` is made before the model is fused, as
    a script makes it (the same Parameter objects either way)."""
    eager = build()
    fused = copy.deepcopy(eager)
    expected_losses, expected_grads = train(eager, step, batches, optimizer(eager))
    before = memfuse.stats()
    fused_optimizer = optimizer(fused)
    losses, grads = train(fuse(fused, style, layers), step, batches, fused_optimizer)
    after = memfuse.stats()
    assert after["compiles"] > before["compiles"]         # memfuse compiled it ...
    for count in ("eager_calls", "graph_fallbacks"):      # ... and ran nothing through torch
        assert after[count] == before[count], count
    torch.testing.assert_close(losses, expected_losses, rtol=1e-4, atol=1e-5)
    assert _plain(grads).keys() == _plain(expected_grads).keys()
    for name, grad in _plain(grads).items():
        torch.testing.assert_close(grad, _plain(expected_grads)[name], rtol=1e-3, atol=1e-5, msg=name)
    return grads


def _plain(grads: dict) -> dict:
    """Parameter names as the plain model has them: torch.compile's `_orig_mod.` prefix dropped."""
    return {name.removeprefix("_orig_mod."): g for name, g in grads.items()}
