"""What the benchmark commands share: their workloads, modes, timers, tables and charts.

The commands (benchmarks/<name>.py, each run as `python -m benchmarks.<name>`) import from here;
nothing here imports a command (tests/test_bench_layout.py holds both to that).
"""
