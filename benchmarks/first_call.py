"""First-call cost in fresh processes, cold (empty compile caches) and warm (same caches).

The parent runs `python -m benchmarks.first_call WORKLOAD MODE` twice per (workload, mode)
with every compile cache pointed into one new temporary directory: the first run finds
them empty ("cold"), the second finds what the first wrote ("warm disk cache"). Each child
reports memfuse's counters and `memfuse.compile_times()`: where a memfuse compile's seconds went,
stage by stage (trace, plan, schedule, codegen, precompile: Triton's compile on a GPU), and
whether the warm run loaded its kernels (`kernels_loaded`) instead of compiling them.

A workload `model:NAME` (bert, gpt2, llama) is a whole HuggingFace model's first training step
(benchmarks/lib/hf_models.py: its benchmark size on a GPU, tiny with --smoke) in one of models.py's modes:

    python -m benchmarks.first_call --models bert,gpt2,llama --modes torch_compile,memfuse_whole [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.lib.first_calls import MODEL_PREFIX, RESULT_PREFIX, measure_first_calls  # noqa: E402


def _child(workload_name: str, mode: str, smoke: bool) -> dict:
    """Measure in this fresh process; returns ChildRun's fields (less process_s)."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when @triton.jit decorates: before memfuse
    import torch

    from benchmarks.lib.measure import first_call
    from benchmarks.lib.modes import memfuse_stats, resolve_modes
    from benchmarks.lib.workloads import workloads_for

    device = torch.device("cpu" if smoke else "cuda")
    if workload_name.startswith(MODEL_PREFIX):
        return _model_child(workload_name[len(MODEL_PREFIX):], mode, device)
    workload = {w.name: w for w in workloads_for(smoke)}[workload_name]
    torch.manual_seed(0)
    inputs = workload.make_inputs(device)
    start = time.perf_counter()
    mode_set = resolve_modes((mode,), cuda=device.type == "cuda")
    import_s = time.perf_counter() - start
    if mode not in mode_set.factories:
        return {"import_s": import_s, "error": mode_set.unavailable.get(mode, f"{mode} not offered here")}
    _, seconds = first_call(mode_set.factories[mode], workload.fn, inputs, device)
    return {"import_s": import_s, "first_call_s": seconds, "stats": memfuse_stats(), "compile_times": _compile_times()}


def _model_child(name: str, mode: str, device) -> dict:
    """A whole model's first training step (models.py: wrap, forward, loss, backward)."""
    import torch

    start = time.perf_counter()
    from benchmarks.lib import hf_models as models
    from benchmarks.lib.modes import memfuse_stats
    import_s = time.perf_counter() - start
    family = models.FAMILIES[name]
    tiny = device.type == "cpu"
    size = family.tiny if tiny else family.size
    setup = models.Setup(device, tiny, models.TINY_SETTINGS if tiny else models.GPU_SETTINGS)
    model = models.build(family, size, models.DROPOUT).to(device)
    batch = models.make_batch(size, device)
    if not tiny:
        torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)  # CUDA and cuBLAS up, as models.py
    setup.synchronize()
    start = time.perf_counter()
    models.train_step(models.WRAPPERS[mode](model, family), batch, setup)
    setup.synchronize()
    return {"import_s": import_s, "first_call_s": time.perf_counter() - start, "stats": memfuse_stats(),
            "compile_times": _compile_times()}


def _compile_times() -> dict | None:
    memfuse = sys.modules.get("memfuse")
    return memfuse.compile_times() if memfuse is not None and hasattr(memfuse, "compile_times") else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workload", nargs="?", help=f"one child: a workload name or {MODEL_PREFIX}NAME")
    parser.add_argument("mode", nargs="?")
    parser.add_argument("--models", help="the parent: cold and warm first steps of these models (bert,gpt2,llama)")
    parser.add_argument("--modes", default="torch_compile,memfuse_whole,memfuse_per_layer",
                        help="with --models: models.py's modes")
    parser.add_argument("--smoke", action="store_true", help="tiny CPU workloads, Triton interpreter")
    args = parser.parse_args(argv)
    if args.models:
        workloads = [MODEL_PREFIX + name for name in args.models.split(",")]
        measure_first_calls(workloads, args.modes.split(","), args.smoke)
        return
    if not (args.workload and args.mode):
        parser.error("a child needs WORKLOAD and MODE (or use --models)")
    result = _child(args.workload, args.mode, args.smoke)
    print(RESULT_PREFIX + json.dumps(result, default=str), flush=True)


if __name__ == "__main__":
    main()
