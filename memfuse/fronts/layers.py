"""layers: `fuse_layers(model, layers)`, the per-layer style in one call, the head included.

Each layer of `layers` is fused in place (`memory_efficient_fusion`, a program per layer), and the
rest of the model, the part before the first layer and after the last (embeddings, the final norm,
the head and its loss), is compiled in place through memfuse's backend (`model.compile(backend=...)`),
where the loss head runs chunked. Left eager, that rest is what sets the step's peak on a large
vocabulary: the head's [tokens, vocab] logits, upcast to fp32 by the cross-entropy, and their
gradient, none of which the fused layers can save (16384 tokens x 128256 x 4 B = 8.4 GB each).
Dynamo runs each fused layer as it is (a graph break at each, `FusedModule._fused_forward` is
`torch.compiler.disable`d), so the layers keep their own programs.

In place, as `nn.Module.compile` is: the model keeps its class, forward signature, attributes and
state_dict keys, so clients that look at it (HuggingFace Trainer's `isinstance(model,
PreTrainedModel)` when it saves, its column filter) see the model they were given.
"""
from __future__ import annotations

import functools
from typing import Optional

from torch import nn

from memfuse.base.config import Config
from memfuse.fronts.backend import memfuse_backend
from memfuse.fronts.module import FusedModule
from memfuse.fronts.wrap import memory_efficient_fusion


def fuse_layers(model: nn.Module, layers: nn.ModuleList, *, config: Optional[Config] = None) -> nn.Module:
    """Fuse each module of `layers` (a ModuleList inside `model`, e.g. `model.model.layers`) in place
    and compile the rest of `model` in place through memfuse's backend; returns `model`. `config`
    applies to both. A layer fused already stays as it is."""
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"memfuse.fuse_layers: layers must be the model's nn.ModuleList of layers "
                        f"(e.g. model.model.layers), got {type(layers).__name__}")
    if not any(sub is layers for sub in model.modules()):
        raise ValueError("memfuse.fuse_layers: layers is not a submodule of model; pass the ModuleList the "
                         "model's forward iterates (e.g. model.model.layers)")
    config = config or Config()
    for index, layer in enumerate(layers):
        if not isinstance(layer, FusedModule):
            layers[index] = memory_efficient_fusion(layer, config=config)
    # A backend callable of this model's own: Dynamo keeps compiled code per code object and runs an
    # entry whose backend compares equal, so another model of the same class must not share it.
    model.compile(backend=functools.partial(memfuse_backend, config=config))
    return model
