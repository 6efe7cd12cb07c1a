"""The patterns' one entry for the compile driver: `rewrite_graph`, at one moment, for either front
door (the fx graph Dynamo hands torch.compile's backend, or a function memfuse traces itself)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from memfuse.base.config import Config
from memfuse.ir.patterns import with_output_hooks
from memfuse.patterns.loss_head import detect
from memfuse.patterns.loss_head.rules import returned_logits_hook


@dataclass
class Rewritten:
    """What the patterns made of one graph or traced function: `graph` is what to compile (the
    rewritten GraphModule) or what the trace gave (the Captured); `decisions` each pattern's, by its
    name (memfuse.ir.patterns: explain prints them); `output_hooks` what the caller's outputs need
    after a run; `outputs` the caller's output count (a Dynamo graph's before the rewrite)."""
    graph: Any
    decisions: dict = field(default_factory=dict)
    output_hooks: list = field(default_factory=list)
    outputs: int = 0

    def attach(self, compiled: Callable) -> Callable:
        """`compiled` (the rewritten graph, compiled) returning the caller's outputs, the hooks applied
        (the chunked loss head's returned logits given their backward)."""
        if not self.output_hooks:
            return compiled

        def with_hooks(*args):          # Dynamo wraps what a backend returns in disable() itself
            return with_output_hooks(compiled(*args), args, self.output_hooks, self.outputs)
        return with_hooks


def rewrite_graph(source, config: Config, *, trace: Optional[Callable] = None,
                  returned_logits: bool = True) -> Rewritten:
    """The patterns' rewrites of `source`:
    - a Dynamo graph (`torch.fx.GraphModule`, the backend): `rewrite_graph(gm, config)`; compile
      `.graph` (a copy where anything changed) and return `.attach(compiled)` to Dynamo;
    - a function memfuse traces (memory_efficient_fusion): `rewrite_graph(fn, config, trace=...)`,
      where `trace(f)` captures f (capture.capture); `.graph` is its Captured, traced with the
      patterns in place. `returned_logits` False: the caller cannot take outputs that need a hook
      (CUDA graphs replay the outputs as compiled).
    Loss heads are chunked either way (memfuse.patterns.loss_head.detect); attention masks are
    capture's hooks (memfuse.ir.patterns.register_capture), run inside `trace`."""
    if isinstance(source, torch.fx.GraphModule):
        chunked = detect.with_chunked_loss_heads(source, config)
        hooks = [returned_logits_hook(chunked.returned)] if chunked.returned else []
        return Rewritten(chunked.gm, {"loss_heads": chunked.decisions}, hooks, chunked.outputs)
    if trace is None:
        raise TypeError("memfuse: rewrite_graph of a function needs trace=, the capture to run it through")
    traced, decisions, returns = detect.capture_chunked(trace, source, config, returned_logits=returned_logits)
    hooks = [returned_logits_hook(returns)] if returns else []
    return Rewritten(traced, {"loss_heads": decisions}, hooks)
