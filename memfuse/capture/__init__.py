"""capture: trace the joint forward+backward graph with AOTAutograd (trace) and lower it to
memfuse's IR (lower: one table of rules, by op family in rules_*, the fusion rewrites in rewrite_*)."""
from memfuse.capture.decompositions import decomposition_table
from memfuse.capture.lower import lower_graph
from memfuse.capture.tables import EXTERN_REASONS, extern_reasons, lowering_table
from memfuse.capture.trace import capture, compiling

__all__ = ["EXTERN_REASONS", "extern_reasons", "capture", "compiling", "decomposition_table", "lower_graph", "lowering_table"]
