"""The compile driver: capture, patterns, plan, schedule, buffers, codegen and runtime in order, and the
decisions to run a call through torch instead."""
