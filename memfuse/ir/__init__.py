"""memfuse's IR: the typed graph over [M, D] (graph), the per-op table (ops), view access maps and
layouts (views), what capture hands the later stages (captured), the extern targets that are not
aten ops (targets) and aten targets by how they read memory (aten)."""
