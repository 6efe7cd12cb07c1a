"""memfuse's IR: the typed graph over [M, D], the per-op table, view access maps and layouts."""
