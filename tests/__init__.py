"""memfuse's tests, one folder per part of the package, in the order a call is processed: base/, ir/,
capture/, plan/, schedule/, buffers/, codegen/, runtime/, patterns/, driver/, fronts/, reports/; then
models/ (whole models and blocks end to end), gpu/ (CUDA only) and bench/ (the benchmarks' harness).
helpers.py and compare.py are shared (conftest.py puts tests/ on sys.path); every folder is a package,
so that files of the same name in two folders stay apart."""
