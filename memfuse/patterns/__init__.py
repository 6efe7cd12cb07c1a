"""Patterns: plug-ins (the loss head, attention masks and biases) that register what the core needs to know in
memfuse.ir.patterns' table, and `rewrite_graph`, their one entry for the compile driver. Imported
once by the package (memfuse/__init__.py); capture, schedule and runtime never import it."""
from memfuse.patterns import attention  # noqa: F401  (registers attention's rules and capture hooks)
from memfuse.patterns import attention_bias  # noqa: F401  (hand-written attention with a bias traced as one call)
from memfuse.patterns import custom_backward  # noqa: F401  (custom ops' backwards run as one call while memfuse traces)
from memfuse.patterns import range_indexes  # noqa: F401  (x[..., [k]] traced as the slice it reads)
from memfuse.patterns.loss_head import rules  # noqa: F401  (registers the loss head's ops' rules)
from memfuse.patterns.rewrite import Rewritten, rewrite_graph

__all__ = ["Rewritten", "rewrite_graph"]
