"""Long rows on the GPU. Default: persistent (whole row in registers) against looped (row in
chunks) kernels at one workload, side by side: which one `Config.max_row_length` should pick.
`--loss`: the loss head alone (bf16 logits as long as a vocabulary -> float -> cross_entropy,
forward and backward) for eager, torch.compile and memfuse, against the bytes it must move and
the copy bandwidth measured in the same run.

    python -m benchmarks.long_rows [--workload rms_norm_block[256x512x4096]bf16] [--limits 16384,2048,1024]
    python -m benchmarks.long_rows --loss [--shapes 16384x32000,16384x50257]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import memfuse
from benchmarks.lib.kernel_timing import copy_bandwidth
from benchmarks.lib.workloads import registry, sol_bytes


def compare_limits(args) -> None:
    workload = next(w for w in registry() if w.name.startswith(args.workload))
    inputs = workload.make_inputs("cuda")
    bandwidth = 4.2e12
    for limit in (int(x) for x in args.limits.split(",")):
        fused = memfuse.memory_efficient_fusion(workload.fn, config=memfuse.Config(max_row_length=limit))

        def step():
            out = fused(*inputs.tensors, **inputs.consts)
            out.backward(inputs.grad_output)
            for t in inputs.tensors:
                t.grad = None

        ms = do_bench(step, warmup=100, rep=500, return_mode="median")
        sol = sol_bytes(inputs) / bandwidth / (ms * 1e-3)
        kind = "persistent" if workload.shape[-1] <= limit else "looped"
        print(f"{workload.name}  max_row_length={limit:6d} ({kind:10s}): {ms * 1e3:8.1f} us/step  {sol:5.0%} of SOL")


# -- the loss head ------------------------------------------------------------------------------
def loss_head(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), target)


def loss_bytes(rows: int, vocabulary: int) -> tuple:
    """(forward, forward + backward) bytes that must move: the forward reads the bf16 logits and
    the int64 targets; the backward reads both again and writes the bf16 logits' gradient (a
    per-row logsumexp kept between them is M * 4 bytes: left out)."""
    logits, target = rows * vocabulary * 2, rows * 8
    return logits + target, 3 * logits + 2 * target


def loss_kernels(fused) -> str:
    """memfuse's generated kernels for the loss: passes over each row, and the online sums."""
    parts = []
    for entry in fused.cache.values():
        for program in (entry.function.forward, entry.function.backward):
            for step in (program.steps if program is not None else []):
                source = getattr(getattr(step, "kernel", None), "source", None)
                if source is not None and source.passes is not None:
                    parts.append(f"{source.name}: {source.passes} pass(es)"
                                 + (f", online {'; '.join(source.online)}" if source.online else ""))
    return "; ".join(parts) or "no looped kernel"


def time_loss(fn, logits: torch.Tensor, target: torch.Tensor) -> tuple:
    """(forward ms, forward + backward ms), medians."""
    def forward():
        fn(logits, target)

    def step():
        fn(logits, target).backward()
        logits.grad = None

    return tuple(do_bench(f, warmup=25, rep=200, return_mode="median") for f in (forward, step))


def check_loss(fused, logits: torch.Tensor, target: torch.Tensor) -> str:
    """memfuse's loss and gradient against eager's, as max relative differences."""
    got_loss, eager_loss = fused(logits, target), loss_head(logits, target)
    got_grad, = torch.autograd.grad(got_loss, logits)
    eager_grad, = torch.autograd.grad(eager_loss, logits)
    loss_err = ((got_loss - eager_loss).abs() / eager_loss.abs()).item()
    grad_err = ((got_grad.float() - eager_grad.float()).abs().max() / eager_grad.float().abs().max()).item()
    return f"loss rel err {loss_err:.1e}, grad max err / max |grad| {grad_err:.1e}"


def compare_loss(args) -> None:
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (1 GiB copy, this run)")
    for shape in args.shapes.split(","):
        rows, vocabulary = (int(n) for n in shape.split("x"))
        fused = memfuse.memory_efficient_fusion(loss_head)
        modes = {"eager": loss_head, "torch.compile": torch.compile(loss_head, dynamic=False), "memfuse": fused}
        logits = torch.randn(rows, vocabulary, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(0, vocabulary, (rows,), device="cuda")
        must_move = loss_bytes(rows, vocabulary)
        print(f"\nloss head [{rows}x{vocabulary}] bf16 -> float -> cross_entropy: must move "
              f"{must_move[0] / 1e9:.2f} GB forward, {must_move[1] / 1e9:.2f} GB forward+backward")
        for name, fn in modes.items():
            times = time_loss(fn, logits, target)
            rates = [b / (ms * 1e-3) for b, ms in zip(must_move, times)]
            print(f"  {name:14s} forward {times[0]:6.2f} ms {rates[0] / 1e9:5.0f} GB/s {rates[0] / bandwidth:4.0%}"
                  f"   forward+backward {times[1]:6.2f} ms {rates[1] / 1e9:5.0f} GB/s {rates[1] / bandwidth:4.0%}"
                  " of copy bandwidth")
        print(f"  memfuse: {check_loss(fused, logits, target)}")
        print(f"  memfuse kernels: {loss_kernels(fused)}")
        del logits, target
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="rms_norm_block[256x512x4096]bf16")
    parser.add_argument("--limits", default="16384,2048,1024", help="max_row_length values to compare")
    parser.add_argument("--loss", action="store_true", help="time the loss head instead (eager, torch.compile, memfuse)")
    parser.add_argument("--shapes", default="16384x32000,16384x50257", help="--loss: rows x vocabulary, comma-separated")
    args = parser.parse_args()
    if args.loss:
        compare_loss(args)
    else:
        compare_limits(args)


if __name__ == "__main__":
    main()
