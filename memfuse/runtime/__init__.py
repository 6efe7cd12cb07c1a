"""runtime: the programs that run scheduled graphs, their autograd.Function, kernel precompilation."""
