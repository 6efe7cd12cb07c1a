"""Each memfuse kernel of a model's training step, compiled for an H100 (sm_90) on any machine:
its SASS instructions against the bytes it moves, to tell a kernel bound by its arithmetic from one
bound by memory without a GPU.

    python -m benchmarks.instructions --model gpt2,llama,bert [--tokens 4] [--fp32] [--out DIR]

The model of `make bench-models`, at its own width (hidden, FFN, vocabulary) but `--tokens` tokens,
wrapped whole (`memory_efficient_fusion`), trains one step on the CPU through Triton's interpreter
under the CPU's bf16 autocast (`--fp32`: without), as the GPU runs under CUDA's. Each distinct
kernel is then compiled by Triton for sm_90 (Triton's wheel brings ptxas and cuobjdump) at the
launch configuration an H100 without a tuning cache uses (`memfuse.codegen.tuning.source_config`), and
its SASS instructions are counted. A kernel of one tile per program runs each instruction once a
tile and warp; a persistent kernel runs its loop over tiles (the widest span a backward branch
closes) once a tile and warp. **issue ns** is a tile's warp instructions at an H100's issue rate
(`ISSUE_RATE`), **memory ns** its bytes at the copy bandwidth (`BANDWIDTH`, measured by
benchmarks.kernel_sol), and **bound** the longer of the two. **registers** a thread (and bytes
spilled) and the **warps an SM** can hold at that count come from cuobjdump's resource usage: few
resident warps leave memory latency unhidden whatever the count says. A looped kernel (rows past the
persistent limit: passes over chunks) and a kernel over [D] alone get their static count only. A
count is not a time: it ranks kernels and says which side of the roofline a kernel is on; GPU time
comes from benchmarks.kernel_sol. The report's header also says how many launches a step makes, how
many functions they launch (codegen's twins: a model's layers share theirs) and the seconds Triton's
compiles of those took on this machine's CPU from an empty cache, one after another (a proxy for the
compile share of the first step: `precompile` on a GPU host runs them in threads, which Triton's
compiler holds the GIL in).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

# The step's modules (benchmarks.lib.hf_models, memfuse) are imported by the functions of the first process
# only: importing them turns the interpreter on where there is no GPU, and the second process, which
# compiles for sm_90, must import Triton with it off.
MODEL_NAMES = ("bert", "gpt2", "llama")

ISSUE_RATE = 132 * 4 * 1.755e9     # warp instructions a second: an H100 SXM's SMs x schedulers x boost clock
BANDWIDTH = 3.0e12                 # bytes a second: the H100's copy bandwidth (benchmarks.kernel_sol measured 3003 GB/s)
TARGET = ("cuda", 90, 32)          # sm_90, warps of 32
SM_REGISTERS = 65536               # an H100 SM's register file, 32-bit registers
SM_WARPS = 64                      # warps an H100 SM holds at once
POINTER_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
                 torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
                 torch.bool: "i1"}
CUDA = torch.device("cuda")        # the launch configuration's device: nothing runs there


def step_kernels(model_name: str, tokens: int, autocast: bool) -> list:
    """(graph, KernelLaunch) of each kernel of one training step of the whole model wrapped
    (`memory_efficient_fusion`), at the model's width and `tokens` tokens: under the CPU's bf16
    autocast as the GPU runs under CUDA's (their op lists are close, not the same), or in fp32."""
    from benchmarks.lib.hf_models import FAMILIES, TINY_SETTINGS, WRAPPERS, Setup, Templates, fresh, make_batch
    from memfuse.runtime.program import KernelLaunch
    family = FAMILIES[model_name]
    size = dataclasses.replace(family.size, batch=1, seq=tokens)
    setup = Setup(torch.device("cpu"), tiny=True, settings=TINY_SETTINGS)
    templates = Templates.build(family, size, use_cache=False)
    torch._dynamo.reset()
    fused = WRAPPERS["memfuse_whole"](fresh(templates.dropout, setup.device), family)
    batch = make_batch(size, setup.device)
    precision = torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast)
    with precision:
        loss = fused(**batch).loss
    loss.backward()
    with precision:             # the autocast state is part of the compile key: the step's own program
        entry = fused.compiled_for(**batch)
    return [(program.graph, step) for program in (entry.function.forward, entry.function.backward)
            if program is not None for step in program.steps if isinstance(step, KernelLaunch)]


def manifest_entry(graph, launch) -> dict:
    """What compiling the kernel (a runtime.KernelLaunch) for sm_90 needs (its file, signature,
    constexprs, an H100's default launch configuration) and what judging it needs (bytes a row,
    tile, whether one tile a program)."""
    from benchmarks.lib.kernel_timing import config_text
    from memfuse.base.config import Config
    from memfuse.runtime.precompile import warmup_arguments
    from memfuse.codegen.tuning import source_config
    source = launch.kernel.source
    chosen = source_config(source)
    launch.configs[CUDA] = chosen
    args, keywords = warmup_arguments(graph, launch, CUDA, Config())
    num_warps = keywords.pop("num_warps")
    names = launch.kernel.fn.arg_names       # the launched function's (a twin's own names are other)
    signature = {name: "*" + POINTER_TYPES[arg] if isinstance(arg, torch.dtype) else
                 "fp32" if isinstance(arg, float) else "i32" for name, arg in zip(names, args)}
    return {"path": str(launch.kernel.path), "name": launch.kernel.function_name, "signature": signature,
            "constexprs": keywords,
            "num_warps": num_warps, "num_stages": chosen.num_stages, "config": config_text(dataclasses.asdict(chosen)),
            "block_m": chosen.block_m, "block_d": source.constexprs["BLOCK_D"], "d": source.constexprs["D"],
            "bytes_per_row": source.bytes_per_row, "summary": source.summary,
            "one_tile": not source.persistent and source.passes is None,
            "persistent": source.persistent and source.passes is None}


def compile_sm90(entry: dict):
    """The kernel of a manifest entry compiled by Triton for sm_90 (a process not interpreting:
    Triton's interpreter patches triton.language while it runs kernels)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.util.spec_from_file_location(f"memfuse_sm90_{Path(entry['path']).stem}", entry["path"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, entry["name"])
    signature = {**entry["signature"], **{name: "constexpr" for name in entry["constexprs"]}}
    # Triton's launcher specializes a pointer to a 16-byte aligned buffer (every tensor of the caching
    # allocator) as such, which lets loads and stores be vectors: without it each element is one
    # instruction, and the count overstates a kernel's arithmetic
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
               if signature.get(name, "").startswith("*")}
    return triton.compile(ASTSource(fn, signature, constexprs=entry["constexprs"], attrs=aligned),
                          target=GPUTarget(*TARGET),
                          options={"num_warps": entry["num_warps"], "num_stages": entry["num_stages"]})


def cuobjdump(kernel, flag: str) -> str:
    """cuobjdump's `flag` output for the kernel's cubin."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([str(tool), flag, cubin.name], capture_output=True, text=True, check=True).stdout


def sass_listing(kernel) -> list:
    """(address, instruction) of the kernel's SASS (cuobjdump of its cubin), NOPs left out."""
    found = (re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line) for line in cuobjdump(kernel, "-sass").splitlines())
    return [(int(m.group(1), 16), m.group(2)) for m in found if m and "NOP" not in m.group(2)]


def resident_warps(kernel, num_warps: int) -> tuple[int, int, int]:
    """(registers a thread, bytes spilled to local memory a thread, warps an SM can hold at that
    register count): an SM has 64K registers, allocated 8 a thread at a time, and holds 64 warps."""
    usage = cuobjdump(kernel, "-res-usage")
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    spilled = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    per_program = -(-registers // 8) * 8 * 32 * num_warps
    return registers, spilled, min(SM_WARPS, SM_REGISTERS // per_program * num_warps)


def tile_loop(listing: list) -> int:
    """Instructions in a persistent kernel's loop over tiles: the widest span that a branch back
    to an earlier address closes (one tile's work; the code before and after runs once a program)."""
    spans = [(int(m.group(1), 16), address) for address, text in listing
             if (m := re.search(r"BRA\b.*?0x([0-9a-f]+)", text)) and int(m.group(1), 16) < address]
    if not spans:
        return 0
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return sum(1 for address, _ in listing if start <= address <= end)


def kernel_row(entry: dict) -> dict:
    start = time.perf_counter()
    kernel = compile_sm90(entry)
    compile_s = time.perf_counter() - start     # Triton's compile on this machine's CPU (a cold cache: a fresh one)
    listing = sass_listing(kernel)
    row = {k: entry[k] for k in ("name", "summary", "d", "config", "one_tile")}
    row["compile_s"] = compile_s
    row["sass"] = len(listing)
    row["registers"], row["spilled"], row["warps_per_sm"] = resident_warps(kernel, entry["num_warps"])
    per_tile = len(listing) if entry["one_tile"] else tile_loop(listing) if entry["persistent"] else 0
    if per_tile and entry["bytes_per_row"]:        # (a kernel over [D] alone moves no rows: one program, not judged)
        elements = entry["block_m"] * entry["block_d"] / (32 * entry["num_warps"])   # a thread's, a tile
        issue_ns = per_tile * entry["num_warps"] / ISSUE_RATE * 1e9                # the GPU's time a tile, at full issue
        memory_ns = entry["bytes_per_row"] * entry["block_m"] / BANDWIDTH * 1e9
        row.update(per_tile=per_tile, per_element=per_tile / elements, issue_ns=issue_ns, memory_ns=memory_ns,
                   bound="arithmetic" if issue_ns > memory_ns else "memory")
    return row


def report(model_name: str, rows: list, launches: int = 0) -> str:
    compiled = (f"{launches} kernel launches a step, {len(rows)} functions (codegen's twins share one), "
                f"compiled by Triton for sm_90 in {sum(r.get('compile_s', 0) for r in rows):.1f} s on this CPU, "
                f"one after another" if launches else "")
    lines = [f"## {model_name}, the whole model wrapped: SASS of each kernel for sm_90 (static count, an H100's "
             f"default launch configurations)", "", *([compiled, ""] if compiled else []),
             "| kernel | D | config | SASS | registers (spilled B) | warps an SM | a tile | per element | "
             "issue ns / tile | memory ns / tile | bound | what |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        judged = [str(r["per_tile"]), f"{r['per_element']:.1f}", f"{r['issue_ns']:.2f}", f"{r['memory_ns']:.2f}",
                  r["bound"]] if "bound" in r else ["-", "-", "-", "-", "not judged"]
        lines.append(f"| `{r['name']}` | {r['d']} | {r['config']} | {r['sass']} | {r['registers']} ({r['spilled']}) | "
                     f"{r['warps_per_sm']} | " + " | ".join(judged) +
                     f" | {r['summary']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help=f"comma-separated, from {', '.join(MODEL_NAMES)}")
    parser.add_argument("--tokens", type=int, default=4, help="tokens of the step (the width is the model's)")
    parser.add_argument("--fp32", action="store_true", help="trace the step in fp32 (default: bf16 autocast)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"),
                        help="directory for instructions-MODEL.json and .md")
    parser.add_argument("--compile", type=Path, metavar="MANIFEST", help=argparse.SUPPRESS)   # the second process
    args = parser.parse_args(argv)
    if args.compile:
        os.environ["TRITON_INTERPRET"] = "0"       # compiled for sm_90, not interpreted
        entries = json.loads(args.compile.read_text())
        args.compile.with_suffix(".rows.json").write_text(json.dumps([kernel_row(e) for e in entries]))
        return
    if not args.model:
        parser.error("--model is required")
    models = args.model.split(",")
    unknown = [m for m in models if m not in MODEL_NAMES]
    if unknown:
        parser.error(f"--model: unknown {unknown}; expected some of {', '.join(MODEL_NAMES)}")
    os.environ["TRITON_INTERPRET"] = "1"           # the step runs through the interpreter
    args.out.mkdir(parents=True, exist_ok=True)
    for model_name in models:
        launches = step_kernels(model_name, args.tokens, not args.fp32)
        entries = list({e["path"]: e for e in (manifest_entry(graph, launch) for graph, launch in launches)}.values())
        manifest = args.out / f"instructions-{model_name}.manifest.json"
        manifest.write_text(json.dumps(entries))
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-")}
        subprocess.run([sys.executable, "-m", "benchmarks.instructions", "--compile", str(manifest)], check=True,
                       env=env, cwd=Path(__file__).resolve().parent.parent)
        rows = json.loads(manifest.with_suffix(".rows.json").read_text())
        rows.sort(key=lambda r: -(r.get("issue_ns", 0) / max(r.get("memory_ns", 0), 1e-9)))
        text = report(model_name, rows, len(launches))
        print(text + "\n", flush=True)
        (args.out / f"instructions-{model_name}.json").write_text(json.dumps(rows, indent=1))
        (args.out / f"instructions-{model_name}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
