"""A small GPT trained on a synthetic reversal task: eager, memfuse-wrapped blocks, or torch.compile.

    python examples/gpt.py --mode memfuse --steps 200 --size real --device cuda --dropout 0.1

Each sequence is `n` random tokens, a separator, then the same tokens reversed; the model
learns to predict the reversed half (loss on that half only). Nothing is downloaded.

  --mode eager     plain PyTorch
  --mode memfuse   every transformer block wrapped: memfuse.memory_efficient_fusion(block)
  --mode compile   the whole model: torch.compile(model, backend="memfuse", dynamic=True)
  --mode inductor  the whole model: torch.compile(model), for comparison

On a CPU machine run it with TRITON_INTERPRET=1 (the kernels then run in Triton's interpreter).
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab: int            # task tokens; the separator is token `vocab`
    width: int
    heads: int
    layers: int
    digits: int           # tokens to reverse: sequences are 2 * digits + 1 long
    batch: int
    lr: float             # AdamW learning rate
    dropout: float = 0.0

    @property
    def seq_len(self) -> int:
        return 2 * self.digits + 1


SIZES = {
    "tiny": GPTConfig(vocab=8, width=32, heads=2, layers=2, digits=4, batch=8, lr=3e-3),
    "real": GPTConfig(vocab=64, width=512, heads=8, layers=6, digits=64, batch=32, lr=6e-4),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.dropout = cfg.dropout
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # Attention dropout stays off: aten's attention kernel draws its own randomness, which
        # memfuse cannot regenerate from its seed. Dropout on the residual branches is fused.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.proj = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab + 1, cfg.width)
        self.positions = nn.Embedding(cfg.seq_len, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab + 1, bias=False)
        self.apply(_init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):   # GPT-2: residual projections scaled by depth
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.layers))

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tokens(idx) + self.positions(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def make_batch(cfg: GPTConfig, generator: torch.Generator, device) -> tuple:
    """(inputs, targets): targets are -100 (ignored) outside the reversed half."""
    digits = torch.randint(0, cfg.vocab, (cfg.batch, cfg.digits), generator=generator)
    sep = torch.full((cfg.batch, 1), cfg.vocab)
    seq = torch.cat([digits, sep, digits.flip(1)], dim=1)
    inputs, targets = seq[:, :-1].clone(), seq[:, 1:].clone()
    targets[:, :cfg.digits] = -100
    return inputs.to(device), targets.to(device)


def build(cfg: GPTConfig, mode: str, device, seed: int = 0) -> tuple:
    """(model as trained, the plain GPT whose parameters it trains)."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    if mode == "eager":
        return model, model
    if mode == "memfuse":
        import memfuse
        for i, block in enumerate(model.blocks):
            model.blocks[i] = memfuse.memory_efficient_fusion(block)
        return model, model
    if mode == "compile":
        import memfuse  # noqa: F401  registers the backend
        return torch.compile(model, backend="memfuse", dynamic=True), model
    if mode == "inductor":
        return torch.compile(model), model
    raise ValueError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")


MODES = ("eager", "memfuse", "compile", "inductor")
WARMUP_STEPS = 5   # compile and allocator warm-up, left out of the it/s


def train(mode: str = "eager", steps: int = 20, size: str = "tiny", device: str = "cpu",
          dropout: float = 0.0, seed: int = 0, lr: float = 0.0, layers: int = 0, log_every: int = 0) -> list:
    """Train and return the loss of every step. `lr`, `layers`: override the size's (0: keep)."""
    cfg = GPTConfig(**{**SIZES[size].__dict__, "dropout": dropout, "layers": layers or SIZES[size].layers})
    model, plain = build(cfg, mode, device, seed)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=lr or cfg.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(seed + 1)
    losses = []
    model.train()
    start = time.perf_counter()
    timed_from = None
    if str(device).startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(steps):
        if step == WARMUP_STEPS:
            timed_from = time.perf_counter()
        inputs, targets = make_batch(cfg, generator, device)
        logits = model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:5d}  loss {losses[-1]:.4f}  {time.perf_counter() - start:7.1f} s", flush=True)
    if timed_from is not None and log_every:
        rate = (steps - WARMUP_STEPS) / (time.perf_counter() - timed_from)
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if str(device).startswith("cuda") else float("nan")
        print(f"{mode}: {rate:.1f} it/s after {WARMUP_STEPS} warm-up steps, peak memory {peak:.0f} MiB")
    return losses


def main(argv=None) -> list:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=MODES, default="memfuse",
                        help="compile: torch.compile(backend='memfuse'); inductor: torch.compile's default")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--lr", type=float, default=0.0, help="override the size's learning rate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layers", type=int, default=0, help="override the size's depth")
    args = parser.parse_args(argv)
    losses = train(args.mode, args.steps, args.size, args.device, args.dropout, args.seed, args.lr,
                   args.layers, log_every=max(1, args.steps // 20))
    print(f"{args.mode}: loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")
    return losses


if __name__ == "__main__":
    main()
