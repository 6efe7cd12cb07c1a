"""The chunked loss head's own kernels, one chunk at a time (issue 18): how its launch settings
were chosen, and what its fp32 weight-gradient accumulation costs.

    python3 -m benchmarks.loss_head_kernels [--out DIR]      # CUDA: times, bf16
    python3 -m benchmarks.loss_head_kernels --tiny           # CPU, the Triton interpreter: no times

Per chunk of bf16 logits ([rows, vocab] as `chunk_rows` makes them for the Llama and GPT-2 of
`make bench-models` at 256 MiB, and for the 128256-word head of `make bench-loss-head`): a clone
(one read and one write of the chunk: the copy floor), then memfuse.patterns.loss_head.op's row statistics and
logits gradient as two kernels and as its one fused kernel, at BLOCK_SIZES columns a step and
WARPS warps (`triton.testing.do_bench`, ms). Then the fp32 gradient of a master weight, added
up from one chunk's bf16 product: a bf16 product added to the fp32 total, against `aten.addmm`
into the fp32 total in the matmul's epilogue (where the build has it), with each one's largest
difference from the fp32 product. Writes loss-head-kernels.json and .md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if "--tiny" in sys.argv:   # before triton loads (memfuse imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

# [rows, vocab] chunks: Llama's and GPT-2's at 256 MiB of logits, the head alone's
CHUNKS = ((4192, 32000), (2664, 50257), (1040, 128256))
TINY_CHUNKS = ((16, 101),)
# weight gradients: [vocab, hidden] from a chunk of rows
WEIGHTS = ((32000, 1024, 4192), (50264, 768, 2664))
TINY_WEIGHTS = ((104, 64, 16),)
BLOCK_SIZES = (1024, 2048, 4096, 8192)
WARPS = (4, 8, 16)
NO_TRANSFORM = (0,)     # loss_head.LogitTransform().constexpr: the logits as the matmul made them


def kernel_variants(rows: int, vocab: int, device: torch.device, dtype: torch.dtype) -> dict:
    """{(variant, block, warps): launch()} over one chunk: the kernels as the op runs them."""
    from memfuse.patterns.loss_head import op as loss_head
    padded = loss_head._padded(vocab)
    logits = torch.randn(rows, padded, device=device, dtype=dtype)
    target = torch.randint(0, vocab, (rows,), device=device)
    log_sum_exp, row_loss = (torch.empty(rows, device=device) for _ in range(2))
    count = torch.tensor(float(rows), device=device)      # a mean over every row
    scales = torch.full((rows,), 1.0 / rows, device=device)

    def separate(block, warps):
        loss_head._row_statistics[(rows,)](logits, logits.stride(0), 0, target, log_sum_exp, row_loss, vocab, padded,
                                           -100, 0.0, SMOOTHING=False, TRANSFORM=NO_TRANSFORM,
                                           WRITE_TRANSFORMED=False, BLOCK=block, num_warps=warps)
        loss_head._logits_gradient[(rows,)](logits, logits.stride(0), 0, log_sum_exp, target, scales, logits, 0,
                                            logits, logits.stride(0), vocab, padded, 0.0, SMOOTHING=False,
                                            HAS_INCOMING=False, TRANSFORM=NO_TRANSFORM, BLOCK=block, num_warps=warps)

    def fused(block, warps):
        loss_head._row_statistics_and_gradient[(rows,)](
            logits, logits.stride(0), 0, target, log_sum_exp, row_loss, count, logits, logits.stride(0), vocab,
            padded, -100, 0.0, MEAN=True, SMOOTHING=False, TRANSFORM=NO_TRANSFORM, WRITE_TRANSFORMED=False,
            BLOCK=block, num_warps=warps)
    variants = {("clone", None, None): logits.clone}
    for block in BLOCK_SIZES:
        for warps in WARPS:
            variants[("separate", block, warps)] = lambda b=block, w=warps: separate(b, w)
            variants[("fused", block, warps)] = lambda b=block, w=warps: fused(b, w)
    return variants


def accumulation_variants(vocab: int, hidden: int, rows: int, device: torch.device) -> dict:
    """{name: (launch(), total)}: one chunk's bf16 product added to an fp32 [vocab, hidden] total."""
    left = torch.randn(rows, vocab, device=device, dtype=torch.bfloat16).t()
    right = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    totals = {name: torch.zeros(vocab, hidden, device=device) for name in ("product then add", "addmm epilogue")}
    variants = {"product then add": (lambda: totals["product then add"].add_(torch.mm(left, right)),
                                     totals["product then add"])}
    epilogue = totals["addmm epilogue"]
    if device.type == "cuda" and hasattr(torch.ops.aten.addmm, "dtype_out"):
        variants["addmm epilogue"] = (
            lambda: torch.ops.aten.addmm.dtype_out(epilogue, left, right, torch.float32, out=epilogue), epilogue)
    exact = left.float() @ right.float()
    return {name: (launch, total, exact) for name, (launch, total) in variants.items()}


def measure(tiny: bool) -> dict:
    device = torch.device("cpu" if tiny else "cuda")
    timer = _timer(tiny)
    result = {"device": "CPU (interpreter)" if tiny else torch.cuda.get_device_name(), "torch": torch.__version__,
              "kernels": [], "accumulation": []}
    for rows, vocab in TINY_CHUNKS if tiny else CHUNKS:
        dtype = torch.float32 if tiny else torch.bfloat16
        for (variant, block, warps), launch in kernel_variants(rows, vocab, device, dtype).items():
            result["kernels"].append({"rows": rows, "vocab": vocab, "variant": variant, "block": block,
                                      "warps": warps, "ms": timer(launch)})
    for vocab, hidden, rows in TINY_WEIGHTS if tiny else WEIGHTS:
        for name, (launch, total, exact) in accumulation_variants(vocab, hidden, rows, device).items():
            total.zero_()
            launch()
            error = (total - exact).abs().max().item()
            result["accumulation"].append({"vocab": vocab, "hidden": hidden, "rows": rows, "variant": name,
                                           "ms": timer(launch), "max_error": error})
    return result


def _timer(tiny: bool):
    if tiny:
        return lambda launch: (launch(), None)[1]      # ran once: the harness, not a time
    from triton.testing import do_bench
    return do_bench


def report(result: dict) -> str:
    lines = [f"## The loss head's kernels, per chunk ({result['device']}, torch {result['torch']})", "",
             "| chunk | variant | block | warps | ms |", "| --- | --- | --- | --- | --- |"]
    for r in result["kernels"]:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        lines.append(f"| [{r['rows']}, {r['vocab']}] | {r['variant']} | {r['block'] or '-'} | "
                     f"{r['warps'] or '-'} | {ms} |")
    lines += ["", "| weight gradient | from rows | variant | ms | max error vs fp32 product |",
              "| --- | --- | --- | --- | --- |"]
    for r in result["accumulation"]:
        ms = "-" if r["ms"] is None else f"{r['ms']:.3f}"
        lines.append(f"| [{r['vocab']}, {r['hidden']}] | {r['rows']} | {r['variant']} | {ms} | {r['max_error']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny chunk on the CPU through the interpreter")
    parser.add_argument("--out", type=Path, help="directory for loss-head-kernels.json and .md")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("needs CUDA for times; --tiny runs the harness on the CPU")
    result = measure(args.tiny)
    text = report(result)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "loss-head-kernels.json").write_text(json.dumps(result, indent=1))
        (args.out / "loss-head-kernels.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
