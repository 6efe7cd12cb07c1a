"""HuggingFace Trainer fine-tuning a Llama-style model with memfuse beside the same Trainer with
torch.compile: tokens/s, the peak above parameters, gradients and optimizer state, and the loss curve.

    python -m benchmarks.trainer [--modes NAME,..] [--steps N] [--tiny] [--out DIR]

Modes (each in a fresh process, so one mode's compile caches and allocator leave nothing behind):
  eager            Trainer(model)
  torch_compile    TrainingArguments(torch_compile=True): what a Trainer user turns on today
  memfuse          Trainer(model=memfuse.memory_efficient_fusion(model))
  memfuse_backend  Trainer(model=torch.compile(model, backend="memfuse")) (TrainingArguments'
                   torch_compile_backend takes only accelerate's DynamoBackend names)
  memfuse_in_place Trainer(model=memfuse.memory_efficient_fusion(model, in_place=True)): the whole
                   model fused, Trainer holding the model itself (save_model writes its config)
  memfuse_layers   Trainer(model=memfuse.fuse_layers(model, model.model.layers)): each layer fused,
                   the rest (embeddings, final norm, head and loss) through the backend, in place

The model: 16 layers, hidden 2048, 32 heads, 8 KV heads, FFN 8192, vocab 128256 (about 1.2B
parameters, embeddings tied), fp32 parameters under bf16 autocast (TrainingArguments(bf16=True)),
AdamW, 8 x 2048 tokens a step, the same random-token dataset and seed in every mode. Step times come
from a callback that synchronizes the GPU at each step's end; tokens/s leaves out the first
WARMUP_STEPS steps (compiles). The peak is torch.cuda.max_memory_allocated over the run less the
bytes of parameters, gradients and optimizer state, counted from the tensors at the end. The same
callback splits it by phase (each phase's peak counter reset as it begins, the largest over the
steps after the warmup): forward and backward (on_step_begin to on_pre_optimizer_step: gradient
clipping included) and the optimizer step (on_pre_optimizer_step to on_optimizer_step), whose
temporaries (AdamW's foreach buffers) are the same in every mode: the forward+backward peak above
state is what the modes differ in.

Without CUDA, or with --tiny: a 2-layer model of hidden 64 on CPU through the Triton interpreter, a
smoke run of the harness (no torch_compile unless --modes names it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

MODES = ("eager", "torch_compile", "memfuse", "memfuse_backend", "memfuse_in_place", "memfuse_layers")
WARMUP_STEPS = 5
RESULTS = Path(__file__).parent / "results"


def model_config(tiny: bool):
    import transformers
    if tiny:
        return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                        tie_word_embeddings=True, use_cache=False)
    return transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                    rope_theta=500000.0, tie_word_embeddings=True, use_cache=False)


class StepWatch:
    """A TrainerCallback: wall time of each optimizer step (the GPU synchronized at its end) and, on
    CUDA, each step's peak allocation by phase: forward and backward (the peak counter reset at the
    step's beginning, read before the optimizer step), then the optimizer step (reset before it,
    read after it). The run's peak is the largest the counter read before each reset and at the end."""

    def __init__(self, cuda: bool):
        import transformers
        self.cuda = cuda
        self.seconds: list[float] = []
        self.forward_backward_peaks: list[int] = []
        self.optimizer_peaks: list[int] = []
        self.peak = 0
        watch = self

        def read_and_reset() -> int:
            """The peak since the last reset; the counter reset to what is allocated now."""
            peak = torch.cuda.max_memory_allocated()
            watch.peak = max(watch.peak, peak)
            torch.cuda.reset_peak_memory_stats()
            return peak

        class Callback(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if watch.cuda:
                    torch.cuda.synchronize()
                    read_and_reset()        # the Trainer's setup, or the last step's tail (scheduler, zero_grad)
                watch.start = time.perf_counter()

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                if watch.cuda:
                    watch.forward_backward_peaks.append(read_and_reset())

            def on_optimizer_step(self, args, state, control, **kwargs):
                if watch.cuda:
                    watch.optimizer_peaks.append(read_and_reset())

            def on_step_end(self, args, state, control, **kwargs):
                if watch.cuda:
                    torch.cuda.synchronize()
                watch.seconds.append(time.perf_counter() - watch.start)

        self.callback = Callback()

    def run_peak(self) -> int:
        """The largest allocation of the run so far (0 without CUDA)."""
        return max(self.peak, torch.cuda.max_memory_allocated()) if self.cuda else 0

    def phase_peaks(self) -> tuple[int, int]:
        """(forward+backward, optimizer step): the largest peak of each over the steps after the
        warmup (all steps where there are no more); 0 without CUDA."""
        def largest(peaks: list[int]) -> int:
            return max(peaks[WARMUP_STEPS:] or peaks or [0])
        return largest(self.forward_backward_peaks), largest(self.optimizer_peaks)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, their gradients (as if all present) and the optimizer's state tensors."""
    params = {p.data_ptr(): p for p in model.parameters()}.values()
    total = sum(2 * p.numel() * p.element_size() for p in params)
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
    return total


def run_mode(mode: str, steps: int, tiny: bool, seq: int, batch: int) -> dict:
    import transformers
    import memfuse
    cuda = torch.cuda.is_available() and not tiny
    torch.manual_seed(0)
    config = model_config(tiny)
    model = transformers.LlamaForCausalLM(config)
    if cuda:
        model = model.cuda()
    if mode == "memfuse":
        model = memfuse.memory_efficient_fusion(model)
    elif mode == "memfuse_backend":
        model = torch.compile(model, backend="memfuse")
    elif mode == "memfuse_in_place":
        memfuse.memory_efficient_fusion(model, in_place=True)
    elif mode == "memfuse_layers":
        memfuse.fuse_layers(model, model.model.layers)
    ids = torch.randint(0, config.vocab_size, (batch * steps, seq), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), f"trainer-bench-{mode}"), max_steps=steps,
        per_device_train_batch_size=batch, learning_rate=1e-5, logging_steps=1, report_to="none",
        save_strategy="no", bf16=cuda, use_cpu=not cuda, seed=0, data_seed=0, dataloader_num_workers=0,
        torch_compile=mode == "torch_compile",
        remove_unused_columns=mode != "memfuse_backend")   # a compiled module's forward shows (*args, **kwargs)
    clock = StepWatch(cuda)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset, callbacks=[clock.callback])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - started
    timed = clock.seconds[WARMUP_STEPS:] or clock.seconds
    forward_backward, optimizer = clock.phase_peaks()
    peak = clock.run_peak()
    state = state_bytes(trainer.model, trainer.optimizer)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return {"mode": mode, "steps": steps, "tokens_per_step": batch * seq,
            "tokens_per_s": batch * seq * len(timed) / sum(timed), "first_step_s": clock.seconds[0],
            "wall_s": wall, "peak_bytes": peak, "state_bytes": state, "peak_above_state_bytes": peak - state,
            "forward_backward_peak_bytes": forward_backward, "optimizer_peak_bytes": optimizer,
            "forward_backward_above_state_bytes": forward_backward - state,
            "optimizer_above_state_bytes": optimizer - state,
            "losses": losses, "memfuse": memfuse.stats(), "device": torch.cuda.get_device_name() if cuda else "cpu",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


ABOVE_STATE = (("peak above state", "peak_above_state_bytes"),
               ("forward+backward above state", "forward_backward_above_state_bytes"),
               ("optimizer step above state", "optimizer_above_state_bytes"))


def report(rows: list[dict]) -> str:
    """The markdown table: speed, and each peak above state (the run's, forward+backward's, the
    optimizer step's) in GB and against torch.compile's, beside the loss curve."""
    base = next((r for r in rows if r["mode"] == "torch_compile" and "error" not in r), None)

    def ratio(r: dict, key: str) -> str:
        return f"{r[key] / base[key]:.2f}x" if base and base.get(key, 0) > 0 and key in r else "-"

    memory = [part for title, _ in ABOVE_STATE for part in (f"{title} GB", "vs torch.compile")]
    header = ["mode", "tokens/s", "vs torch.compile", *memory, "first step s", "loss: first, last",
              "largest loss gap to torch.compile"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | failed: {r['error'][:120]} |" + " |" * (len(header) - 2))
            continue
        gap = (f"{max(abs(a - b) for a, b in zip(r['losses'], base['losses'])):.3f}"
               if base and r["losses"] and base["losses"] else "-")
        cells = [r["mode"], f"{r['tokens_per_s']:.0f}", ratio(r, "tokens_per_s")]
        for _, key in ABOVE_STATE:
            cells += [f"{r.get(key, 0) / 2**30:.2f}", ratio(r, key)]
        cells += [f"{r['first_step_s']:.1f}", f"{r['losses'][0]:.3f}, {r['losses'][-1]:.3f}", gap]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", help=f"comma-separated, from {', '.join(MODES)} (default: all; --tiny: all "
                        "but torch_compile)")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU through the Triton interpreter")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--one", help=argparse.SUPPRESS)          # a worker: run this mode, print its JSON
    args = parser.parse_args(argv)
    tiny = args.tiny or not torch.cuda.is_available()
    seq, batch = (32, 2) if tiny else (2048, 8)
    if args.one:
        print("RESULT " + json.dumps(run_mode(args.one, args.steps, tiny, seq, batch)), flush=True)
        return
    modes = args.modes.split(",") if args.modes else [m for m in MODES if not (tiny and m == "torch_compile")]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"--modes: unknown {unknown}; expected names from {', '.join(MODES)}")
    rows = []
    for mode in modes:
        command = [sys.executable, "-m", "benchmarks.trainer", "--one", mode, "--steps", str(args.steps)]
        if tiny:
            command.append("--tiny")
        done = subprocess.run(command, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
        result = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if result:
            rows.append(json.loads(result[-1][len("RESULT "):]))
        else:
            rows.append({"mode": mode, "error": (done.stderr.strip().splitlines() or ["no output"])[-1]})
            sys.stderr.write(done.stderr[-4000:])
        print(f"{mode}: {'failed' if 'error' in rows[-1] else 'done'}", flush=True)
    table = report(rows)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "trainer-tiny" if tiny else "trainer"
    (args.out / f"{name}.json").write_text(json.dumps(rows, indent=1))
    (args.out / f"{name}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
