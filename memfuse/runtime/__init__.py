"""runtime: run scheduled graphs.

program      Program: a scheduled graph written out as one Python function (`_ProgramWriter`)
launchers    KernelLaunch, Launcher, DirectLaunch: a generated kernel's launches; launch_log
aten_groups  AtenGroup: a group the code generator declined, run op by op in torch
function     CompiledFunction: a plan's forward and backward Programs, their autograd.Function, seeds
externs      what a program calls in place of some aten ops
precompile   kernels compiled (or loaded from Triton's cache) when a program is built
"""
