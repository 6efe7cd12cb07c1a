"""memfuse under torch.distributed: DDP and FSDP2, next to eager and torch.compile, in one run.

    torchrun --nproc_per_node=2 -m benchmarks.distributed [--model gpt|bert|gpt2|llama] --out FILE.json

Every rank trains a model (AdamW) on its share of one global batch. `--model gpt` (the default) is
the GPT of examples/gpt.py (`--size real`: 6 pre-norm blocks of width 512, sequences of 128
tokens). Its blocks are wrapped first, then the model is wrapped for data parallelism, in the
order torchtitan uses:

  mode               each block becomes
  eager              the block
  memfuse            memfuse.memory_efficient_fusion(block)
  memfuse_compile    torch.compile(block, backend="memfuse", fullgraph=True)
  torch_compile      torch.compile(block, fullgraph=True)               (Inductor)

  wrapper            then the model becomes
  ddp                DistributedDataParallel(model)
  ddp_bucket_view    DistributedDataParallel(model, gradient_as_bucket_view=True)
  fsdp2              fully_shard(block) for every block, then fully_shard(model)

`--model bert|gpt2|llama` is a family of benchmarks/lib/hf_models.py (built from its config with random
weights, use_cache=False, bf16 autocast on a GPU, fp32 at `--size tiny`), in that script's modes:
models.WRAPPERS[mode] wraps the model (memfuse_per_layer and, when --modes names it,
torch_compile_per_layer: each transformer layer, as torchtitan compiles its blocks before sharding
them; memfuse_per_layer_backend: each layer, then the model through the backend, which runs the
fused layers as they are and compiles the rest, its loss head chunked; torch_compile,
memfuse_backend, memfuse_whole: the whole model), then DDP wraps the result,
or FSDP2 shards every transformer layer and then the root. memfuse_whole traces the layers' forward inside one
program, where FSDP2's per-layer hooks would never run: FSDP2 then shards the whole model as one
group (the case's note says so). Every step trains on the same tokens (models.make_batch).

Per case (dropout off): the loss of every step and the parameters after --steps steps against
single-process eager on the whole global batch; the bytes autograd keeps from forward to
backward (saved-tensor hooks, any device); then it/s and peak memory per rank. Then dropout
across ranks (GPT only): with the same seed every rank draws the same masks, with per-rank seeds
they differ, as in eager. memfuse's calls that ran through torch instead (eager_calls,
graph_fallbacks, their logged reasons) are recorded per case. Rank 0 prints a table and rewrites
the JSON at --out after every case.

Timing (`--rounds`, 3 by default): once every mode of a wrapper has run its steps and its first
timing (warm-up, --timed steps, the peak), the wrapper's cases, all kept alive, are timed in turn
--timed steps each, --rounds times over, and a case's it/s is the median of its rounds. Host-paced
steps (FSDP2 on small layers) drift by 20% within a minute on a shared host: cases timed one after
the other carried that drift into their ratios; cases timed in turn share it. A case's peak is
measured in its first timing, above what was allocated before it was built (the live cases').
The table also pairs each memfuse case's rounds with eager's and torch.compile's of the same round
(`paired_ratios`): the median of those ratios, and their range, say how far a ratio moves from
round to round on a drifting host.

A CPU run (gloo, kernels through the Triton interpreter) is the CI test's smoke run:
    torchrun --nproc_per_node=2 -m benchmarks.distributed --device cpu --size tiny --batch 8 \
        --modes eager,memfuse,memfuse_compile
    torchrun --nproc_per_node=2 -m benchmarks.distributed --device cpu --size tiny --model llama \
        --modes eager,memfuse_per_layer,memfuse_backend,memfuse_whole --steps 2
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # never NVLink multicast (NVLS)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402  (torch alone does not import triton: TRITON_INTERPRET can still be set)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchmarks.lib import fsdp_spans  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODES = ("eager", "memfuse", "memfuse_compile", "torch_compile")       # the GPT's
HF_MODELS = ("bert", "gpt2", "llama")        # benchmarks/lib/hf_models.py's FAMILIES (imported late: it loads triton)
WRAPPERS = ("ddp", "ddp_bucket_view", "fsdp2")
DROPOUT_MODES = ("eager", "memfuse", "memfuse_compile")
DROPOUT_SEED = 1234
# A parameter's update error is measured against max(its own update, this share of the largest
# parameter update): BERT's attention key bias has a gradient of ~0 (softmax ignores a shift shared
# by every key), so AdamW barely moves it and its error relative to its own move is noise.
UPDATE_SCALE_FLOOR = 1e-2
HF_LR = 1e-3                 # AdamW's learning rate for the HuggingFace models (weight decay 0.01, as the GPT's)
# What passes, as (largest relative loss error, largest update error): fp32 with TF32 off, and
# under bf16 autocast, where the split batch and every mode round differently (loose; the table
# prints the values).
FP32_TOLERANCES = (1e-4, 1e-2)
BF16_TOLERANCES = (1e-2, 1e-1)
# Under bf16 autocast the peers' own update errors are the noise floor: splitting the batch moves
# eager's parameters 0.2 of an update away from single-process eager's (GPT-2, BERT; AdamW turns
# the sign of a tiny gradient into a whole step), torch.compile's 0.3. A memfuse case passes when
# its update error is within this factor of the larger of the two in the same wrapper.
NOISE_FLOOR_FACTOR = 1.25
NOISE_FLOOR_MODES = ("eager", "torch_compile", "torch_compile_per_layer")
PER_LAYER_MODES = ("memfuse_per_layer", "memfuse_per_layer_backend")   # set against torch_compile_per_layer


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    parser.add_argument("--model", choices=("gpt", *HF_MODELS), default="gpt",
                        help="gpt: examples/gpt.py; the others: benchmarks/lib/hf_models.py FAMILIES")
    parser.add_argument("--size", choices=("tiny", "real"), default="real",
                        help="examples/gpt.py SIZES; for a models.py family, its tiny or full size")
    parser.add_argument("--batch", type=int, default=0, help="global batch (default: the size's batch per rank)")
    parser.add_argument("--modes", default="", help=f"comma-separated (default: all): gpt from {', '.join(MODES)}; "
                                                    "the others from benchmarks/lib/hf_models.py MODES")
    parser.add_argument("--wrappers", default="ddp,fsdp2", help=f"comma-separated, from {', '.join(WRAPPERS)}")
    parser.add_argument("--steps", type=int, default=5, help="training steps compared against eager")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    parser.add_argument("--timed", type=int, default=20,
                        help="timed steps (0: correctness only, without the saved-bytes step and the timing)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timing rounds: once every mode of a wrapper has run, its cases (all kept alive) "
                             "are timed in turn, --timed steps each, this many times over; a case's it/s is the "
                             "median of its rounds. 0: each case timed once, right after its own steps")
    parser.add_argument("--dropout", type=float, default=0.1, help="p of the dropout-across-ranks check (0: skip)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP bucket size; below 1 MiB DDP's first bucket shrinks with it (split graphs at a tiny size)")
    parser.add_argument("--loss-tol", type=float, default=None,
                        help=f"largest relative loss error that passes (default: {FP32_TOLERANCES[0]:g} in fp32, "
                             f"{BF16_TOLERANCES[0]:g} under bf16 autocast)")
    parser.add_argument("--update-tol", type=float, default=None,
                        help="largest update error (update_error()) over parameters that passes "
                             f"(default: {FP32_TOLERANCES[1]:g} in fp32, {BF16_TOLERANCES[1]:g} under bf16 autocast)")
    parser.add_argument("--budget-s", type=float, default=360.0, help="skip the cases left once this much time is spent")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: benchmarks/results/distributed.json (gpt), distributed-MODEL.json (the others)")
    parser.add_argument("--dump-params", type=Path, default=None, help="rank 0 saves every case's final parameters here")
    parser.add_argument("--profile", default="",
                        help="cases to profile once every case is timed (each built again), as WRAPPER/MODE, "
                             "comma-separated, or 'all' (CUDA): one step per rank under torch.profiler, its GPU "
                             "time split into compute, communication and idle")
    parser.add_argument("--fsdp-spans", action="store_true",
                        help="FSDP2 cases: each rank's forward split at FSDP2's hooks in the timed rounds, ms a "
                             "step, unprofiled (benchmarks.fsdp_spans): which layer's call or which part of the "
                             "root one mode pays more")
    parser.add_argument("--trace-dir", type=Path, default=None,
                        help="rank 0 writes each profiled case's Chrome traces here: the profiled step's "
                             "(GPU activity) and one more with the host's (benchmarks.host_trace reads it)")
    args = parser.parse_args(argv)
    args.wrappers = _choose(args.wrappers, WRAPPERS, "--wrappers")
    if args.out is None:
        suffix = "" if args.model == "gpt" else f"-{args.model}"
        args.out = ROOT / "benchmarks" / "results" / f"distributed{suffix}.json"
    return args


def _choose(text: str, offered: tuple, flag: str) -> tuple:
    chosen = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [c for c in chosen if c not in offered]
    if unknown or not chosen:
        sys.exit(f"{flag} {text!r}: choose from {', '.join(offered)}")
    return chosen


@dataclasses.dataclass
class CaseResult:
    wrapper: str
    mode: str
    losses: list = dataclasses.field(default_factory=list)   # mean over ranks, per step
    loss_rel_err: Optional[float] = None           # max over steps of |loss - eager| / |eager|
    update_rel_err: Optional[float] = None         # see update_error()
    update_bar: Optional[float] = None             # the update error that passes (see NOISE_FLOOR_FACTOR)
    noise_reference: bool = False                  # bf16: a NOISE_FLOOR_MODES case, whose update error sets the bar
    param_max_abs_err: Optional[float] = None
    ok: Optional[bool] = None
    grad_strides_match: Optional[bool] = None      # DDP: every .grad has its parameter's strides (first step)
    grad_storages: Optional[int] = None            # DDP: distinct storages among the .grads (first step)
    params: Optional[int] = None
    saved_activation_bytes: Optional[int] = None   # saved for backward, not a parameter, alive after forward
    saved_block_param_bytes: Optional[int] = None  # block parameters saved for backward: bytes still allocated after forward
    memfuse_compiles: Optional[int] = None
    eager_calls: Optional[int] = None              # memfuse calls that ran the original through torch instead
    graph_fallbacks: Optional[int] = None          # Dynamo graphs the memfuse backend left to torch
    fallback_reasons: list = dataclasses.field(default_factory=list)   # logged, new in this case
    note: Optional[str] = None                     # how the wrapping departs from the stated order, and why
    correctness_s: Optional[float] = None          # the --steps steps, compiles included
    it_s: Optional[float] = None                   # timed steps / the slowest rank's time (the median of rounds)
    it_s_alone: Optional[float] = None             # --rounds: the first timing, right after the case's own steps
    it_s_rounds: list = dataclasses.field(default_factory=list)   # --rounds: each round's it/s
    gc_ms_rounds: list = dataclasses.field(default_factory=list)  # --rounds: Python's gc pauses in each, ms (rank 0)
    host_ms_rounds: list = dataclasses.field(default_factory=list)  # --rounds: per round, per rank, ms a step
    #                                                until the round's last step call returned (the host's pace)
    phase_ms_rounds: list = dataclasses.field(default_factory=list)  # --rounds: per round, per rank, {phase: ms
    #                                                a step until its call returned} for STEP_PHASES
    device_mallocs_rounds: list = dataclasses.field(default_factory=list)  # --rounds, CUDA: per round, per rank,
    #                                                the caching allocator's cudaMalloc calls and its retries
    #                                                (each retry frees the cache: a device sync)
    span_ms_rounds: list = dataclasses.field(default_factory=list)  # --fsdp-spans, FSDP2: per round, per rank,
    #                                                {span of the forward between FSDP2's hooks: ms a step}
    peak_bytes: Optional[list] = None              # per rank, CUDA: max allocated over the timed steps, above
    #                                                what was allocated before the case was built
    forward_bytes: Optional[list] = None           # per rank, CUDA: allocated after forward and loss - before
    profile: Optional[list] = None                 # per rank, --profile: step_time_split() of one step
    host: Optional[list] = None                    # per rank, --profile: host_costs() of one step
    error: Optional[str] = None


@dataclasses.dataclass
class DropoutResult:
    wrapper: str
    mode: str
    same_seed_same_masks: Optional[bool] = None    # torch.manual_seed(s) on every rank: equal outputs
    rank_seeds_differ: Optional[bool] = None       # torch.manual_seed(s + rank): outputs differ across ranks
    repeatable: Optional[bool] = None              # the same seed again: the same output on this rank
    grads_match_local: Optional[bool] = None       # DDP: all-reduced grads == this rank's own (no_sync) grads
    error: Optional[str] = None


# -- the model and its data ----------------------------------------------------------------------
def load_gpt():
    """examples/gpt.py as a module (examples/ is not a package)."""
    if "gpt_example" in sys.modules:
        return sys.modules["gpt_example"]
    spec = importlib.util.spec_from_file_location("gpt_example", ROOT / "examples" / "gpt.py")
    module = sys.modules["gpt_example"] = importlib.util.module_from_spec(spec)   # dataclasses look it up
    spec.loader.exec_module(module)
    return module


class GptWorkload:
    """examples/gpt.py's GPT: each block wrapped per mode (MODES), then the model."""

    name = "gpt"

    def __init__(self, args: argparse.Namespace, world: int, device: torch.device, count: int):
        self.gpt = load_gpt()
        size = self.gpt.SIZES[args.size]
        self.modes = _choose(args.modes or ",".join(MODES), MODES, "--modes")
        self.dropout_modes = DROPOUT_MODES
        self.cfg = dataclasses.replace(size, batch=args.batch or size.batch * world, dropout=0.0)
        self.batch, self.lr, self.autocast = self.cfg.batch, self.cfg.lr, False
        generator = torch.Generator().manual_seed(1)       # as examples/gpt.py: seed + 1
        self.batches = [self.gpt.make_batch(self.cfg, generator, device) for _ in range(count)]

    def build(self, device: torch.device, dropout: float = 0.0):
        model, _ = self.gpt.build(dataclasses.replace(self.cfg, dropout=dropout), "eager", device, seed=0)
        return model

    def layers(self, model) -> list:
        return list(model.blocks)

    def wrap(self, model, mode: str):
        wrap_blocks(model, mode)
        return model

    def fsdp_groups(self, model, wrapped, mode: str) -> tuple:
        return self.layers(model), model, None

    def loss(self, module, batch: tuple) -> torch.Tensor:
        inputs, targets = batch
        return loss_of(module(inputs), targets)

    def config(self) -> dict:
        return dataclasses.asdict(self.cfg)


class HfWorkload:
    """A benchmarks/lib/hf_models.py family, dropout off: models.WRAPPERS[mode] wraps the model (per layer or
    whole), then the data-parallel wrapper takes it."""

    def __init__(self, args: argparse.Namespace, world: int, device: torch.device, count: int):
        import transformers

        from benchmarks.lib import hf_models as models
        transformers.logging.set_verbosity_error()
        self.models, self.name = models, args.model
        self.family = models.FAMILIES[args.model]
        size = self.family.tiny if args.size == "tiny" else self.family.size
        self.modes = _choose(args.modes or ",".join(models.MODES), models.ALL_MODES, "--modes")
        self.dropout_modes = ()                                   # the dropout check is the GPT's
        self.size = dataclasses.replace(size, batch=args.batch or size.batch * world)
        self.batch, self.lr = self.size.batch, HF_LR
        self.setup = models.Setup(device, tiny=args.size == "tiny" or device.type != "cuda",
                                  settings=models.TINY_SETTINGS)  # only its autocast is used
        self.autocast = not self.setup.tiny
        self.template = models.build(self.family, self.size, 0.0)
        self.batches = [models.make_batch(self.size, device)] * count     # the same tokens every step

    def build(self, device: torch.device, dropout: float = 0.0):
        assert dropout == 0.0, "the dropout check runs on the GPT only"
        return self.models.fresh(self.template, device)

    def layers(self, model) -> list:
        return list(self.models.layer_list(model, self.family))

    def wrap(self, model, mode: str):
        return self.models.WRAPPERS[mode](model, self.family)

    def fsdp_groups(self, model, wrapped, mode: str) -> tuple:
        """(modules to fully_shard one by one, the root to fully_shard last, why it departs from
        "every layer, then the root")."""
        if mode == "memfuse_whole":
            return [], wrapped, ("fsdp2 shards the whole model as one group: memfuse_whole traces every "
                                 "layer's forward into one program, where per-layer FSDP hooks would never run")
        return self.layers(model), model, None

    def loss(self, module, batch: dict) -> torch.Tensor:
        return self.models.forward_loss(module, batch, self.setup)

    def config(self) -> dict:
        return {"family": self.family.model_class, **dataclasses.asdict(self.size), "autocast_bf16": self.autocast}


class Rank:
    """This process's share of the run: device, the model's workload, the global batches."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") \
            if args.device == "cuda" else torch.device("cpu")
        count = max(args.steps, 1) + max(args.warmup + args.timed, 1)      # global batches
        workload = GptWorkload if args.model == "gpt" else HfWorkload
        self.work = workload(args, self.world, self.device, count)
        if self.work.batch % self.world:
            sys.exit(f"--batch {self.work.batch} does not split evenly over {self.world} ranks")
        self.local = self.work.batch // self.world
        self.loss_tol, self.update_tol = (
            given if given is not None else default for given, default in
            zip((args.loss_tol, args.update_tol), BF16_TOLERANCES if self.work.autocast else FP32_TOLERANCES))
        self.mesh = None
        self.spans = fsdp_spans.SpanRecorder() if args.fsdp_spans else None     # --fsdp-spans
        self.dumped: dict = {}                                  # case -> final parameters (--dump-params)

    @property
    def batches(self) -> list:
        return self.work.batches

    def shard(self, batch):
        """This rank's rows of every tensor in the batch (a tuple or a dict)."""
        rows = slice(self.rank * self.local, (self.rank + 1) * self.local)
        if isinstance(batch, dict):
            return {name: t[rows] for name, t in batch.items()}
        return tuple(t[rows] for t in batch)

    def build(self, dropout: float = 0.0):
        return self.work.build(self.device, dropout)

    def optimizer(self, params):
        return torch.optim.AdamW(params, lr=self.work.lr, weight_decay=0.01)   # weight decay as examples/gpt.py

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """examples/gpt.py's loss. Every rank holds as many counted targets: the mean over ranks of
    the per-rank losses is the loss of the global batch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# A training step's calls, as the host makes them: each phase's time is until its calls return, so
# it holds what the host did and any wait for a full launch queue or a synchronizing call.
STEP_PHASES = ("forward", "backward", "optimizer")


def train_step(r: "Rank", model, optimizer, batch, inspect=None, phases: Optional[dict] = None) -> torch.Tensor:
    """One step; `phases` (STEP_PHASES -> seconds) gets each phase's host time added."""
    started = time.perf_counter()
    loss = r.work.loss(model, batch)
    forward_returned = time.perf_counter()
    if r.spans is not None and r.spans.on:
        r.spans.end_step(forward_returned)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    backward_returned = time.perf_counter()
    if inspect is not None:
        inspect()
    optimizer.step()
    if phases is not None:
        phases["forward"] += forward_returned - started
        phases["backward"] += backward_returned - forward_returned
        phases["optimizer"] += time.perf_counter() - backward_returned
    return loss.detach()


def wrap_blocks(model, mode: str) -> None:
    """Each block fused or compiled in place of the original (before any data-parallel wrapper)."""
    for i, block in enumerate(model.blocks):
        if mode == "memfuse":
            import memfuse
            model.blocks[i] = memfuse.memory_efficient_fusion(block)
        elif mode == "memfuse_compile":
            import memfuse  # noqa: F401  registers the backend
            model.blocks[i] = torch.compile(block, backend="memfuse", fullgraph=True)
        elif mode == "torch_compile":
            model.blocks[i] = torch.compile(block, fullgraph=True)


def parallelize(r: Rank, model, wrapped, wrapper: str, mode: str) -> tuple:
    """DDP around the wrapped model, or FSDP2 per layer then at the root: (the module to call, a note
    where the sharding departs from that order). `model` is the plain model (its layers possibly
    wrapped), `wrapped` what the mode made of it."""
    if wrapper.startswith("ddp"):
        from torch.nn.parallel import DistributedDataParallel
        options = {"gradient_as_bucket_view": wrapper == "ddp_bucket_view"}
        if r.args.bucket_cap_mb is not None:
            options["bucket_cap_mb"] = r.args.bucket_cap_mb
        return DistributedDataParallel(wrapped, device_ids=[r.device.index] if r.device.type == "cuda" else None,
                                       **options), None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if r.mesh is None:
        r.mesh = init_device_mesh(r.device.type, (r.world,))
    layers, root, note = r.work.fsdp_groups(model, wrapped, mode)
    if note:
        say(r, f"{'':>15} {'':<16} note: {note}")
    for layer in layers:
        fully_shard(layer, mesh=r.mesh)
    fully_shard(root, mesh=r.mesh)
    return wrapped, note


def full_parameters(model) -> list:
    """Every parameter whole, copied to the CPU (FSDP2's are gathered: every rank must call this)."""
    from torch.distributed.tensor import DTensor
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for p in model.parameters()]


def mean_over_ranks(value: torch.Tensor) -> float:
    value = value.detach().double().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


# -- the cases ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Reference:
    losses: list
    initial: list        # parameters, on the CPU: they must not count in the cases' peak memory
    final: list


def reference(r: Rank) -> Reference:
    """Single-process eager on the whole global batch: what every case must reproduce."""
    model = r.build()
    initial = [p.detach().cpu().clone() for p in model.parameters()]
    optimizer = r.optimizer(model.parameters())
    losses = [train_step(r, model, optimizer, batch).item() for batch in r.batches[:r.args.steps]]
    return Reference(losses, initial, [p.detach().cpu().clone() for p in model.parameters()])


def build_case(r: Rank, wrapper: str, mode: str) -> tuple:
    """(model, the model wrapped in `mode` and `wrapper`, the wrapping's note, its optimizer)."""
    model = r.build()
    parallel, note = parallelize(r, model, r.work.wrap(model, mode), wrapper, mode)
    return model, parallel, note, r.optimizer(parallel.parameters())


def run_case(r: Rank, ref: Reference, wrapper: str, mode: str, result: CaseResult) -> Optional[tuple]:
    """The case's correctness steps, saved bytes and first timing; (the wrapped model, its optimizer)
    when it was timed, for the rounds."""
    import memfuse
    r.synchronize()
    allocated_before = torch.cuda.memory_allocated(r.device) if r.device.type == "cuda" else 0
    model, parallel, result.note, optimizer = build_case(r, wrapper, mode)
    before, told = memfuse.stats(), set(memfuse.driver.fallback.TOLD)
    start = time.perf_counter()
    for step, batch in enumerate(r.batches[:r.args.steps]):
        inspect = (lambda: _inspect_grads(model, result)) if step == 0 and wrapper.startswith("ddp") else None
        result.losses.append(mean_over_ranks(train_step(r, parallel, optimizer, r.shard(batch), inspect)))
    r.synchronize()
    result.correctness_s = time.perf_counter() - start
    after = memfuse.stats()
    result.memfuse_compiles, result.eager_calls, result.graph_fallbacks = (
        after[name] - before[name] for name in ("compiles", "eager_calls", "graph_fallbacks"))
    result.fallback_reasons = sorted(f"{name}: {reason}" for name, reason in memfuse.driver.fallback.TOLD - told)
    _compare(r, ref, model, result)
    if r.args.timed == 0:
        return None
    _measure_saved(r, parallel, model, optimizer, result)
    if over_budget(r):
        result.error = "timing skipped: --budget-s spent"
        return None
    _time_steps(r, parallel, optimizer, result, allocated_before)
    return parallel, optimizer


def _inspect_grads(model, result: CaseResult) -> None:
    """After DDP's backward: what the optimizer (and DDP's buckets) received."""
    grads = [(p, p.grad) for p in model.parameters()]
    result.params = len(grads)
    result.grad_strides_match = all(g is not None and g.stride() == p.stride() for p, g in grads)
    result.grad_storages = len({g.untyped_storage().data_ptr() for _, g in grads if g is not None})


def update_error(final: list, ref: Reference) -> float:
    """Max over parameters of ||p - p_eager|| / max(||p_eager - p_init||, UPDATE_SCALE_FLOOR x the
    largest such norm)."""
    moved = [(want.double() - init.double()).norm().item() for want, init in zip(ref.final, ref.initial)]
    floor = UPDATE_SCALE_FLOOR * max(moved)
    return max((p.double() - want.double()).norm().item() / max(m, floor, 1e-30)
               for p, want, m in zip(final, ref.final, moved))


def _compare(r: Rank, ref: Reference, model, result: CaseResult) -> None:
    result.loss_rel_err = max(abs(a - b) / abs(b) for a, b in zip(result.losses, ref.losses))
    final = full_parameters(model)
    if [p.shape for p in final] != [p.shape for p in ref.final]:
        raise RuntimeError(f"{result.wrapper}/{result.mode}: parameter shapes differ from the plain model's")
    result.update_rel_err = update_error(final, ref)
    result.param_max_abs_err = max((p - want).abs().max().item() for p, want in zip(final, ref.final))
    judge(result, r.loss_tol, r.work.autocast)
    if r.args.dump_params is not None and r.rank == 0:
        r.dumped[f"{result.wrapper}/{result.mode}"] = final


def judge(result: CaseResult, loss_tol: float, autocast: bool) -> None:
    """Whether the case passes: its loss within `loss_tol` of single-process eager's and its update
    error within its bar. Under bf16 autocast eager's and torch.compile's update errors are the noise
    the bar is made of (splitting the batch alone moves eager's parameters 0.1-0.2 of an update at
    GPT-2's and BERT's sizes): they are judged on the loss alone."""
    result.noise_reference = autocast and result.mode in NOISE_FLOOR_MODES
    result.ok = result.loss_rel_err <= loss_tol and (result.noise_reference
                                                      or result.update_rel_err <= result.update_bar)


def _measure_saved(r: Rank, parallel, model, optimizer, result: CaseResult) -> None:
    """One step under saved-tensor hooks: what autograd keeps from forward and loss to backward, split
    into parameters of the blocks (under FSDP2 the gathered ones, freed after forward by FSDP itself)
    and everything else. Measured after the loss, when FSDP has resharded."""
    from torch.distributed.tensor import DTensor
    blocks = r.work.layers(model)
    packed = []

    def pack(t):
        params = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()
                  if not isinstance(p, DTensor)}
        packed.append((t.untyped_storage(), t.untyped_storage().data_ptr() in params))
        return t

    batch = r.shard(r.batches[0])
    r.synchronize()
    before = torch.cuda.memory_allocated(r.device) if r.device.type == "cuda" else 0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = r.work.loss(parallel, batch)
    r.synchronize()
    after = torch.cuda.memory_allocated(r.device) if r.device.type == "cuda" else 0
    storages = {s._cdata: (s.nbytes(), is_param) for s, is_param in packed}
    result.saved_activation_bytes = sum(n for n, is_param in storages.values() if not is_param)
    result.saved_block_param_bytes = sum(n for n, is_param in storages.values() if is_param)
    if r.device.type == "cuda":
        result.forward_bytes = gather(after - before)
    packed.clear()              # the saved storages: freed before the backward
    del storages
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def _time_steps(r: Rank, parallel, optimizer, result: CaseResult, allocated_before: int) -> None:
    """Warm-up, then the timed steps: it/s and the peak per rank above `allocated_before` (what other
    cases kept alive for the rounds hold, and the caches)."""
    for i in range(r.args.warmup):
        train_step(r, parallel, optimizer, _timing_batch(r, i))
    r.synchronize()
    if r.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(r.device)
    result.it_s = _timed_window(r, parallel, optimizer)
    if r.device.type == "cuda":
        result.peak_bytes = gather(torch.cuda.max_memory_allocated(r.device) - allocated_before)


def _timing_batch(r: Rank, i: int):
    batches = r.batches[r.args.steps:] or r.batches[:1]
    return r.shard(batches[i % len(batches)])


def _timed_window(r: Rank, parallel, optimizer, gc_pauses: Optional[list] = None,
                  result: Optional[CaseResult] = None) -> Optional[float]:
    """--timed steps from a barrier to the GPU's end: it/s at the slowest rank. `gc_pauses` gets the
    milliseconds Python's garbage collector paused this rank inside the window. With `result`, its
    round lists get each rank's milliseconds a step until its last step's call returned
    (host_ms_rounds: where that is the step's wall time, the rank's host paces the step; a rank
    whose launch queue fills, its GPU waiting in a collective for another rank, also returns late:
    then every rank reads near the wall time), the same split by phase (phase_ms_rounds), and on
    CUDA the allocator's cudaMallocs and retries in the window (device_mallocs_rounds)."""
    batches = [_timing_batch(r, r.args.warmup + i) for i in range(r.args.timed)]
    phases = dict.fromkeys(STEP_PHASES, 0.0)
    r.synchronize()
    dist.barrier()
    mallocs_before = _device_mallocs(r.device)
    with _gc_pauses(gc_pauses):
        start = time.perf_counter()
        for batch in batches:
            if r.spans is not None:
                r.spans.begin_step()
            train_step(r, parallel, optimizer, batch, phases=phases)
        enqueued = time.perf_counter() - start
        r.synchronize()
        elapsed = time.perf_counter() - start
    slowest = _max_over_ranks(elapsed, r)
    spans = r.spans.take_ms_per_step() if r.spans is not None else {}     # this window's alone
    if result is not None:
        per_step_ms = 1e3 / r.args.timed
        result.host_ms_rounds.append([round(ms, 2) for ms in gather(enqueued * per_step_ms)])
        result.phase_ms_rounds.append(gather({phase: round(s * per_step_ms, 2) for phase, s in phases.items()}))
        if spans:
            result.span_ms_rounds.append(gather(spans))
        if mallocs_before is not None:
            after = _device_mallocs(r.device)
            result.device_mallocs_rounds.append(gather([a - b for a, b in zip(after, mallocs_before)]))
    return r.args.timed / slowest if slowest > 0 else None


def _device_mallocs(device: torch.device) -> Optional[tuple]:
    """(cudaMalloc calls, allocation retries) of the caching allocator so far; None off CUDA."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_device_alloc", 0), stats.get("num_alloc_retries", 0)


@contextlib.contextmanager
def _gc_pauses(pauses: Optional[list]):
    """Appends to `pauses` the length of each garbage collection inside the block, in ms."""
    if pauses is None:
        yield
        return
    started = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)
    gc.callbacks.append(on_gc)
    try:
        yield
    finally:
        gc.callbacks.remove(on_gc)


def time_rounds(r: Rank, live: list) -> None:
    """Every live case of a wrapper timed in turn, --rounds times over; its it/s becomes the median
    of its rounds. On a host-paced step (FSDP2, small layers) the same case's it/s drifts by 20%
    within a minute on a shared host (two H200s, 2026-11-27): cases timed one after the other take
    that drift into their ratios, cases timed in turn share it.

    First an untimed round (--warmup steps each): a compiled model called after another one may
    compile again once. Under DDP, Dynamo's DDPOptimizer hands each DDP module's graphs to its own
    backend callable, and a frame two such models share (transformers' forward wrapper) fails
    BACKEND_MATCH the first time it is called from the other model (two H200s, 2026-11-27: 1.5-2.5 s
    in the first round of the backend after torch.compile). The case's note says so. A case that
    compiles in a timed round is an error: that round's time is not the case's own. Each memfuse
    mode compiles through a backend callable of its own (models._through_backend): with one
    shared, the backend's model ran the graphs another mode had compiled (Dynamo runs any entry of
    a frame whose guards pass and whose backend compares equal)."""
    for result, _, _ in live:
        result.it_s_alone, result.it_s_rounds, result.gc_ms_rounds = result.it_s, [], []
        result.host_ms_rounds, result.phase_ms_rounds, result.device_mallocs_rounds = [], [], []
        result.span_ms_rounds = []
    for result, parallel, optimizer in live:
        with _compiles() as compiled:
            for i in range(max(r.args.warmup, 1)):
                train_step(r, parallel, optimizer, _timing_batch(r, i))
        if any(compiled):
            result.note = "; ".join(filter(None, [result.note, (
                f"compiled again when called after the other cases ({compiled[0]} Dynamo graphs, {compiled[1]} "
                f"memfuse compiles), in the untimed round before the timed ones")]))
    for _ in range(r.args.rounds):
        for result, parallel, optimizer in live:
            pauses: list = []
            with _compiles() as compiled:
                result.it_s_rounds.append(_timed_window(r, parallel, optimizer, pauses, result))
            result.gc_ms_rounds.append(round(sum(pauses), 1))
            if any(compiled):
                result.error = (f"compiled during a timing round ({compiled[0]} Dynamo graphs, {compiled[1]} memfuse "
                                f"compiles): that round's time is not the case's own")
    for result, _, _ in live:
        times = sorted(t for t in result.it_s_rounds if t is not None)
        result.it_s = times[len(times) // 2] if times else None


@contextlib.contextmanager
def _compiles():
    """[Dynamo graphs, memfuse compiles] made inside the block (filled in when it ends)."""
    import memfuse
    from torch._dynamo.utils import counters
    made = [0, 0]
    graphs, compiles = counters["stats"]["unique_graphs"], memfuse.stats()["compiles"]
    try:
        yield made
    finally:
        made[:] = [counters["stats"]["unique_graphs"] - graphs, memfuse.stats()["compiles"] - compiles]


def _profiled(chosen: str, wrapper: str, mode: str) -> bool:
    cases = {c.strip() for c in chosen.split(",") if c.strip()}
    return "all" in cases or f"{wrapper}/{mode}" in cases


def cases_to_profile(cases: list, chosen: str) -> list:
    """The cases --profile names that were timed, in the order they ran."""
    return [c for c in cases if c.it_s is not None and _profiled(chosen, c.wrapper, c.mode)]


def profile_case(r: Rank, result: CaseResult) -> None:
    """The timed case built again and warmed up, then one step profiled (`_profile_step`). This runs
    after every case is timed: a profiled step (torch.profiler, cProfile, torch.cuda's sync debug
    mode; which of them was not isolated) left the process slower for the rest of its life, and
    the cases timed after one ran up to 1.6x slower (BERT's backend under DDP on two H200s,
    2026-11-27: 31.8 it/s timed after profiled cases, 50.3 and 51.6 it/s in a run that profiled
    none; torch.compile under FSDP2 on GPT-2: 23.0 against 41.6)."""
    _, parallel, _, optimizer = build_case(r, result.wrapper, result.mode)
    batch = r.shard(r.batches[0])
    for _ in range(max(r.args.warmup, 1)):
        train_step(r, parallel, optimizer, batch)
    _profile_step(r, parallel, optimizer, result)


def _profile_step(r: Rank, parallel, optimizer, result: CaseResult) -> None:
    """One more step on every rank under torch.profiler (GPU activity only, to keep the host's cost
    as it is): where its wall time went, per rank."""
    from torch.profiler import ProfilerActivity, profile
    batch = r.shard(r.batches[0])
    r.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as trace:
        start = time.perf_counter()
        train_step(r, parallel, optimizer, batch)
        r.synchronize()
        wall_ms = (time.perf_counter() - start) * 1e3
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in trace.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    result.profile = gather(step_time_split(kernels, wall_ms))
    if r.args.trace_dir is not None and r.rank == 0:
        r.args.trace_dir.mkdir(parents=True, exist_ok=True)
        trace.export_chrome_trace(str(r.args.trace_dir / f"trace-{r.work.name}-{result.wrapper}-{result.mode}.json"))
    result.host = gather(host_costs(r, lambda: train_step(r, parallel, optimizer, batch),
                                    f"host-{r.work.name}-{result.wrapper}-{result.mode}.txt"))
    if r.args.trace_dir is not None:
        _host_trace(r, lambda: train_step(r, parallel, optimizer, batch),
                    r.args.trace_dir / f"host-trace-{r.work.name}-{result.wrapper}-{result.mode}-rank{r.rank}.json")


def _host_trace(r: Rank, step, path: Path) -> None:
    """One more step on every rank under torch.profiler with the CPU's activity too (its own cost
    stretches the host, so apart from the GPU-only step above): each rank's Chrome trace (a step
    is paced by its slowest rank's host), which
    `python -m benchmarks.host_trace` splits by the host's regions (FSDP2's hooks, Dynamo's frames,
    the compiled programs, the optimizer)."""
    from torch.profiler import ProfilerActivity, profile
    r.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        step()
        r.synchronize()
    r.args.trace_dir.mkdir(parents=True, exist_ok=True)
    trace.export_chrome_trace(str(path))


def host_costs(r: Rank, step, name: str, top: int = 15) -> dict:
    """The host's side of a step: how long it takes to enqueue one (`host_ms`, the step returns
    before the GPU is done unless something waits for it; `wall_ms` after synchronizing), the
    operations that made the host wait for the GPU (torch.cuda's sync debug mode: each warning's
    Python line), and under cProfile the functions with the most time of their own and the most
    time under them (where a mode's extra host time sits, without --trace-dir). Rank 0 writes the
    whole cProfile listing to --trace-dir."""
    import cProfile
    import io
    import pstats
    import warnings
    r.synchronize()
    dist.barrier()
    start = time.perf_counter()
    step()
    host_ms = (time.perf_counter() - start) * 1e3
    r.synchronize()
    wall_ms = (time.perf_counter() - start) * 1e3
    dist.barrier()
    profiler = cProfile.Profile()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            profiler.enable()
            step()
            profiler.disable()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    r.synchronize()
    syncs: dict = {}
    for w in caught:
        if "synchroniz" in str(w.message):
            where = f"{Path(w.filename).name}:{w.lineno}"
            syncs[where] = syncs.get(where, 0) + 1
    stats = pstats.Stats(profiler)
    own = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
    cumulative = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:2 * top]
    if r.args.trace_dir is not None and r.rank == 0:
        listing = io.StringIO()
        pstats.Stats(profiler, stream=listing).sort_stats("cumulative").print_stats(80)
        (r.args.trace_dir / name).write_text(listing.getvalue())
    return {"host_ms": host_ms, "wall_ms": wall_ms, "syncs": syncs,
            "top_own": _function_rows(own), "top_cumulative": _function_rows(cumulative)}


def _function_rows(entries: list) -> list:
    """cProfile's (function, stats) entries as JSON rows: where, calls, own and cumulative ms."""
    return [{"function": f"{Path(file).name}:{line}:{func}", "calls": calls, "own_ms": own_s * 1e3,
             "cumulative_ms": cum_s * 1e3}
            for (file, line, func), (_, calls, own_s, cum_s, _) in entries]


def merged_intervals(intervals) -> list:
    """(start, end) pairs, sorted and merged where they overlap or touch."""
    out: list = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def _length(merged: list) -> float:
    return sum(end - start for start, end in merged)


def _intersection(a: list, b: list) -> float:
    """Length of the overlap of two merged interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def step_time_split(kernels: list, wall_ms: float, top: int = 8) -> dict:
    """A profiled step's GPU kernels, (name, start us, end us), on any streams: time the GPU computed
    (any non-communication kernel running), communicated, communicated with nothing computing beside
    it (`exposed_comm_ms`: the collectives the step waits for; NCCL kernels also spin while the other
    rank catches up), and was idle while the step's wall clock ran (`idle_ms`: the host was behind);
    then the time by kernel class (profile_step.CLASSES) and the kernels with the most time."""
    from benchmarks.lib.profiling import kernel_class
    compute = merged_intervals((s, e) for name, s, e in kernels if kernel_class(name) != "communication")
    comm = merged_intervals((s, e) for name, s, e in kernels if kernel_class(name) == "communication")
    busy_ms = _length(merged_intervals([*map(tuple, compute), *map(tuple, comm)])) / 1e3
    by_class: dict = {}
    by_kernel: dict = {}
    for name, s, e in kernels:
        ms = (e - s) / 1e3
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + ms
        count, total = by_kernel.get(name, (0, 0.0))
        by_kernel[name] = (count + 1, total + ms)
    return {
        "wall_ms": wall_ms, "busy_ms": busy_ms, "idle_ms": max(0.0, wall_ms - busy_ms),
        "compute_ms": _length(compute) / 1e3, "comm_ms": _length(comm) / 1e3,
        "exposed_comm_ms": (_length(comm) - _intersection(comm, compute)) / 1e3,
        "launches": len(kernels),
        "by_class": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
        "top": [{"kernel": name, "launches": n, "ms": ms}
                for name, (n, ms) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
    }


def _max_over_ranks(value: float, r: Rank) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=r.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def gather(value) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def dropout_case(r: Rank, wrapper: str, mode: str, result: DropoutResult) -> None:
    """The same rows on every rank, dropout p = --dropout in and around the blocks."""
    model = r.build(dropout=r.args.dropout)
    parallel, _ = parallelize(r, model, r.work.wrap(model, mode), wrapper, mode)
    inputs = r.batches[0][0][:r.local]
    ddp = wrapper.startswith("ddp")

    def run(seed: int, sync: bool = True):
        torch.manual_seed(seed)
        with contextlib.nullcontext() if sync or not ddp else parallel.no_sync():
            logits = parallel(inputs)
            logits.float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()] if ddp else []
        for p in parallel.parameters():
            p.grad = None
        return logits.detach(), grads

    out, synced = run(DROPOUT_SEED)
    again, _ = run(DROPOUT_SEED)
    own, _ = run(DROPOUT_SEED + r.rank)
    outs, owns = gather(out.cpu()), gather(own.cpu())
    result.same_seed_same_masks = all(_close(o, outs[0]) for o in outs)
    result.rank_seeds_differ = not any(_close(o, owns[0]) for o in owns[1:])
    result.repeatable = _close(out, again)
    if ddp:
        _, local = run(DROPOUT_SEED, sync=False)
        result.grads_match_local = all(_close(a, b) for a, b in zip(synced, local))
    for name in ("same_seed_same_masks", "rank_seeds_differ", "repeatable", "grads_match_local"):
        value = getattr(result, name)
        if value is not None:
            setattr(result, name, all(gather(value)))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float noise (bitwise on CPU; GPU reductions may reorder): another dropout mask
    changes ~10% of the elements and moves the norm by far more than 1e-4."""
    return bool((a.double() - b.double()).norm() <= 1e-4 * b.double().norm())


# -- driving ---------------------------------------------------------------------------------------
_START = time.perf_counter()


def over_budget(r: Rank) -> bool:
    """Rank 0's clock decides for every rank, so that all of them skip together."""
    flag = [time.perf_counter() - _START > r.args.budget_s]
    dist.broadcast_object_list(flag, src=0)
    return bool(flag[0])


def _release(r: Rank, reset: bool = True) -> None:
    """What a finished case held. Dynamo's caches are reset (every case compiles from scratch, no
    recompile limit carried over) unless cases are kept alive for the rounds, which would then
    compile again."""
    if reset:
        torch._dynamo.reset()
    gc.collect()
    if r.device.type == "cuda":
        torch.cuda.empty_cache()


def _error(error: Exception) -> str:
    traceback.print_exc()
    return f"{type(error).__name__}: {error}"


def run_all(r: Rank) -> dict:
    if r.args.rounds > 0:
        # a wrapper's cases stay alive together, each model's frames compiled once per compiling mode:
        # room for all of them in Dynamo's per-frame caches, which reach 8 entries by default
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    results = {"metadata": metadata(r), "reference_losses": None, "cases": [], "dropout": []}
    ref = reference(r)
    results["reference_losses"] = ref.losses
    r.dumped["eager_single_process"] = ref.final
    with fsdp_spans.recording(r.spans) if r.spans is not None else contextlib.nullcontext():
        _run_wrappers(r, ref, results)
    rejudge(r, results["cases"])
    write(r, results)
    profiled = cases_to_profile(results["cases"], r.args.profile) if r.device.type == "cuda" else []
    for result in profiled:       # after every case is timed: profiling slows what runs after it
        if over_budget(r):
            break
        say(r, f"{result.wrapper:>15} {result.mode:<16} profiling ...")
        try:
            profile_case(r, result)
        except Exception as error:
            result.error = _error(error)
        _release(r)
        write(r, results)
    if r.args.dropout > 0:
        for wrapper in (w for w in r.args.wrappers if w != "ddp_bucket_view"):
            for mode in (m for m in r.work.modes if m in r.work.dropout_modes):
                result = DropoutResult(wrapper, mode)
                results["dropout"].append(result)
                if over_budget(r):
                    result.error = "skipped: --budget-s spent"
                    continue
                try:
                    dropout_case(r, wrapper, mode, result)
                except Exception as error:
                    result.error = _error(error)
                _release(r)
        write(r, results)
    return results



def _run_wrappers(r: Rank, ref, results: dict) -> None:
    """Every case of every wrapper, each wrapper's cases then timed in turn (--rounds)."""
    for wrapper in r.args.wrappers:
        live = []            # --rounds: (result, wrapped model, optimizer) of every timed case
        for mode in r.work.modes:
            result = CaseResult(wrapper, mode)
            results["cases"].append(result)
            if over_budget(r):
                result.error = "skipped: --budget-s spent"
                continue
            result.update_bar = update_bar(r, results["cases"], wrapper)
            say(r, f"{wrapper:>15} {mode:<16} ...")
            kept = None
            try:
                kept = run_case(r, ref, wrapper, mode, result)
                if kept is not None and r.args.rounds > 0:
                    live.append((result, *kept))
            except Exception as error:     # one failing case must not end the comparison
                result.error = _error(error)
            del kept
            _release(r, reset=not live)
            say(r, f"{'':>15} {'':<16} {summary(result)}")
            write(r, results)
        if live:
            say(r, f"{wrapper:>15} {len(live)} cases timed in turn, {r.args.rounds} rounds ...")
            try:
                time_rounds(r, live)
            except Exception as error:
                for result, _, _ in live:
                    result.error = _error(error)
            live.clear()
            _release(r)
            write(r, results)


def update_bar(r: Rank, done: list, wrapper: str) -> float:
    """--update-tol, or under bf16 autocast NOISE_FLOOR_FACTOR x the largest update error of the
    NOISE_FLOOR_MODES cases in `done` of this wrapper, whichever is larger."""
    if not r.work.autocast:
        return r.update_tol
    floor = [c.update_rel_err for c in done
             if c.wrapper == wrapper and c.mode in NOISE_FLOOR_MODES and c.update_rel_err is not None]
    return max([r.update_tol] + [NOISE_FLOOR_FACTOR * e for e in floor])


def rejudge(r: Rank, cases: list) -> None:
    """Each case judged again at its wrapper's bar from all its reference cases: one that ran before
    them (`--modes memfuse_backend,torch_compile,eager`) had only the floor. The progress line
    printed while the case ran keeps the bar it had then."""
    for case in cases:
        if case.loss_rel_err is not None and case.update_rel_err is not None:
            case.update_bar = update_bar(r, cases, case.wrapper)
            judge(case, r.loss_tol, r.work.autocast)


def metadata(r: Rank) -> dict:
    import triton
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(r.device) if r.device.type == "cuda" else "cpu",
        "backend": dist.get_backend(), "world_size": r.world, "torch": torch.__version__,
        "triton": triton.__version__, "model": r.work.name, "size": r.args.size, "config": r.work.config(),
        "batch_per_rank": r.local, "argv": sys.argv[1:],
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def say(r: Rank, text: str) -> None:
    if r.rank == 0:
        print(f"[{time.perf_counter() - _START:6.1f} s] {text}", flush=True)


def summary(c: CaseResult) -> str:
    if c.error and c.ok is None:
        return f"error: {c.error}"
    return (f"loss err {c.loss_rel_err:.1e}  update err {c.update_rel_err:.1e}  "
            f"{'ok' if c.ok else 'MISMATCH'}  {c.correctness_s:.1f} s" + (f"  {c.it_s:.1f} it/s" if c.it_s else ""))


def write(r: Rank, results: dict) -> None:
    if r.rank != 0:
        return
    r.args.out.parent.mkdir(parents=True, exist_ok=True)
    plain = {**results, "cases": [dataclasses.asdict(c) for c in results["cases"]],
             "dropout": [dataclasses.asdict(d) for d in results["dropout"]]}
    r.args.out.write_text(json.dumps(plain, indent=1))
    if r.args.dump_params is not None:
        torch.save(r.dumped, r.args.dump_params)


def _mb(value) -> str:
    if value is None:
        return "-"
    return f"{max(value) / 2**20:.0f}" if isinstance(value, list) else f"{value / 2**20:.1f}"


def _rounds(case) -> str:
    times = [t for t in case.it_s_rounds if t is not None]
    return f"{min(times):.1f}-{max(times):.1f}" if times else "-"


def paired_ratios(case, peer) -> list:
    """Each round's it/s of `case` over `peer`'s in the same round (timed in turn, within seconds of
    each other): host drift over a run moves both, and leaves their ratio. Rounds either lacks are
    left out."""
    return [mine / theirs for mine, theirs in zip(case.it_s_rounds, peer.it_s_rounds)
            if mine is not None and theirs]


def _paired(case, peer) -> str:
    ratios = sorted(paired_ratios(case, peer)) if peer is not None else []
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.3f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def _paired_table(cases: list) -> list:
    """Per memfuse case of a wrapper timed in rounds: the median of its paired ratios against eager
    and torch.compile (`paired_ratios`), and their range."""
    peers = {(c.wrapper, c.mode): c for c in cases if c.mode in ("eager", "torch_compile")}
    paired = [c for c in cases if c.mode.startswith("memfuse") and len(c.it_s_rounds) > 1]
    if not paired:
        return []
    lines = ["", "paired rounds: each round's it/s over eager's and torch.compile's in the same round, the median "
                 "of the rounds (lowest-highest)",
             f"{'wrapper':<16}{'mode':<27}{'vs eager':>24}{'vs compile':>24}"]
    for c in paired:
        lines.append(f"{c.wrapper:<16}{c.mode:<27}{_paired(c, peers.get((c.wrapper, 'eager'))):>24}"
                     f"{_paired(c, peers.get((c.wrapper, 'torch_compile'))):>24}")
    return lines


def _per_layer_ratio(case, peer) -> str:
    """A per-layer memfuse case's it/s and peak against torch.compile's per layer, "-" otherwise."""
    if case.mode not in PER_LAYER_MODES or peer is None or not (case.it_s and peer.it_s):
        return "-"
    peak = f" {max(case.peak_bytes) / max(peer.peak_bytes):.2f}x" if case.peak_bytes and peer.peak_bytes else ""
    return f"{case.it_s / peer.it_s:.2f}x{peak}"


def _host_pace(case) -> str:
    """Each rank's median host ms a step, its phases' medians, and the allocator's calls in all rounds."""
    parts = []
    for rank, ranks_ms in enumerate(zip(*case.host_ms_rounds)):
        text = f"{statistics.median(ranks_ms):.1f}"
        if case.phase_ms_rounds:
            phases = [statistics.median(r[rank][phase] for r in case.phase_ms_rounds) for phase in STEP_PHASES]
            text += " (" + " / ".join(f"{ms:.1f}" for ms in phases) + ")"
        if case.device_mallocs_rounds:
            mallocs, retries = (sum(r[rank][i] for r in case.device_mallocs_rounds) for i in range(2))
            text += f" mallocs {mallocs} retries {retries}"
        parts.append(text)
    return ";  ".join(parts)


def _span_table(cases: list) -> list:
    """--fsdp-spans: per wrapper, each span of the forward (rows, in the order the first case met
    them) against each mode (columns), ms a step, each rank's median over the rounds."""
    lines = []
    for wrapper in dict.fromkeys(c.wrapper for c in cases if c.span_ms_rounds):
        timed = [c for c in cases if c.wrapper == wrapper and c.span_ms_rounds]
        medians = {c.mode: [{name: statistics.median(r[rank].get(name, 0.0) for r in c.span_ms_rounds)
                             for name in c.span_ms_rounds[0][rank]} for rank in range(len(c.span_ms_rounds[0]))]
                   for c in timed}
        names = list(dict.fromkeys(name for c in timed for ranks in medians[c.mode] for name in ranks))
        width = max(len(name) for name in names) + 2
        lines += ["", f"{wrapper}: the forward split at FSDP2's hooks (--fsdp-spans), ms a step, rank 0 / rank 1 "
                      "(median of rounds; a body: the module's call between its pre and post hook)",
                  f"{'span':<{width}}" + "".join(f"{c.mode:>28}" for c in timed)]
        for name in names:
            cells = [" / ".join(f"{ranks[name]:.2f}" if name in ranks else "-" for ranks in medians[c.mode])
                     for c in timed]
            lines.append(f"{name:<{width}}" + "".join(f"{cell:>28}" for cell in cells))
        totals = [" / ".join(f"{sum(ranks.values()):.2f}" for ranks in medians[c.mode]) for c in timed]
        lines.append(f"{'forward, all spans':<{width}}" + "".join(f"{cell:>28}" for cell in totals))
    return lines


def table(results: dict) -> str:
    m = results["metadata"]
    lines = [f"memfuse under torch.distributed: {m['model']} size={m['size']}, {m['world_size']} ranks x batch "
             f"{m['batch_per_rank']}, {m['device']} ({m['backend']}), torch {m['torch']}, triton {m['triton']}",
             "loss err: max over steps vs single-process eager; update err: max ||p - p_eager|| / ||p_eager - p0|| "
             f"(floor: {UPDATE_SCALE_FLOOR:g} x the largest ||p_eager - p0||); bar: the update err that passes "
             f"(under bf16 autocast at least {NOISE_FLOOR_FACTOR:g} x eager's or torch.compile's, whole or per "
             "layer, in the wrapper; those, marked ref, are then judged on the loss alone);",
             "it/s: with --rounds the median of the rounds, in which every case of the wrapper was timed in turn "
             "(rounds: their lowest and highest);",
             "peak/fwd MB: the largest rank (peak: above what was allocated before the case was built); saved MB: kept for backward after forward and loss "
             "(activations | layer params); vs cmp/layer: a memfuse per-layer mode's it/s and peak against "
             "torch_compile_per_layer's",
             "",
             f"{'wrapper':<16}{'mode':<27}{'loss err':>9}{'upd err':>9}{'bar':>8}{'':>4}{'it/s':>8}{'rounds':>12}{'vs eager':>9}"
             f"{'vs compile':>11}{'peak MB':>9}{'vs compile':>11}{'fwd MB':>8}{'saved act':>10}{'params':>8}"
             f"{'compiles':>9}{'vs cmp/layer':>13}"]
    eager = {c.wrapper: c.it_s for c in results["cases"] if c.mode == "eager"}
    compiled = {c.wrapper: c for c in results["cases"] if c.mode == "torch_compile"}
    # a mode that wraps each layer, against torch.compile wrapping each layer (when it ran)
    compiled_per_layer = {c.wrapper: c for c in results["cases"] if c.mode == "torch_compile_per_layer"}
    for c in results["cases"]:
        if c.ok is None:
            lines.append(f"{c.wrapper:<16}{c.mode:<27}  {c.error}")
            continue
        vs = f"{c.it_s / eager[c.wrapper]:.2f}x" if c.it_s and eager.get(c.wrapper) else "-"
        peer = compiled.get(c.wrapper)
        vs_compile = f"{c.it_s / peer.it_s:.2f}x" if c.it_s and peer and peer.it_s else "-"
        peak_vs_compile = (f"{max(c.peak_bytes) / max(peer.peak_bytes):.2f}x"
                           if c.peak_bytes and peer and peer.peak_bytes else "-")
        lines.append(
            f"{c.wrapper:<16}{c.mode:<27}{c.loss_rel_err:>9.1e}{c.update_rel_err:>9.1e}{c.update_bar:>8.1e}"
            f"{('ref' if c.noise_reference else 'ok') if c.ok else 'BAD':>4}"
            f"{(f'{c.it_s:.1f}' if c.it_s else '-'):>8}{_rounds(c):>12}{vs:>9}{vs_compile:>11}{_mb(c.peak_bytes):>9}"
            f"{peak_vs_compile:>11}{_mb(c.forward_bytes):>8}"
            f"{_mb(c.saved_activation_bytes):>10}{_mb(c.saved_block_param_bytes):>8}"
            f"{(c.memfuse_compiles if c.mode.startswith('memfuse') else '-'):>9}"
            f"{_per_layer_ratio(c, compiled_per_layer.get(c.wrapper)):>13}")
    remarks = [f"  {c.wrapper:<16}{c.mode:<27}{text}" for c in results["cases"]
               for text in ([c.note] if c.note else []) + [f"ran through torch: {why}" for why in c.fallback_reasons]
               + ([f"error: {c.error}"] if c.error and c.ok is not None else [])]
    if remarks:
        lines += ["", "notes:", *remarks]
    paced = [c for c in results["cases"] if c.host_ms_rounds and c.it_s]
    if paced:
        lines += ["", "the host's pace in the timed rounds, ms a step: until each rank's last step call returned "
                      f"(median of rounds; in parentheses its {' / '.join(STEP_PHASES)} calls), against the step's "
                      "wall time at the median it/s; CUDA: the caching allocator's cudaMallocs and retries in "
                      "all rounds, per rank",
                  f"{'wrapper':<16}{'mode':<27}{'wall':>8}  host per rank"]
        for c in paced:
            lines.append(f"{c.wrapper:<16}{c.mode:<27}{1e3 / c.it_s:>8.1f}  {_host_pace(c)}")
    lines += _paired_table(results["cases"])
    lines += _span_table(results["cases"])
    profiled = [c for c in results["cases"] if c.profile]
    if profiled:
        lines += ["", "one profiled step per rank, ms: wall clock; GPU busy; computing; communicating; communicating "
                      "with nothing computing beside it (exposed); GPU idle (wall - busy); launches",
                  f"{'wrapper':<16}{'mode':<27}{'rank':>5}{'wall':>8}{'busy':>8}{'compute':>9}{'comm':>8}"
                  f"{'exposed':>9}{'idle':>8}{'launches':>9}"]
        for c in profiled:
            for rank, p in enumerate(c.profile):
                lines.append(f"{c.wrapper:<16}{c.mode:<27}{rank:>5}{p['wall_ms']:>8.1f}{p['busy_ms']:>8.1f}"
                             f"{p['compute_ms']:>9.1f}{p['comm_ms']:>8.1f}{p['exposed_comm_ms']:>9.1f}"
                             f"{p['idle_ms']:>8.1f}{p['launches']:>9}")
    hosted = [c for c in results["cases"] if c.host]
    if hosted:
        lines += ["", "the host's side of one step per rank, ms: time to enqueue it (host); wall clock after "
                      "synchronizing; operations that waited for the GPU (where, count)",
                  f"{'wrapper':<16}{'mode':<27}{'rank':>5}{'host':>8}{'wall':>8}  waits"]
        for c in hosted:
            for rank, h in enumerate(c.host):
                waits = ", ".join(f"{where} x{n}" for where, n in sorted(h["syncs"].items())) or "none"
                lines.append(f"{c.wrapper:<16}{c.mode:<27}{rank:>5}{h['host_ms']:>8.1f}{h['wall_ms']:>8.1f}  {waits}")
    if results["dropout"]:
        lines += ["", "dropout across ranks (same seed: equal masks on every rank; per-rank seeds: different; "
                      "DDP grads == each rank's own):"]
        for d in results["dropout"]:
            flags = d.error or "  ".join(f"{k}={getattr(d, k)}" for k in
                                         ("same_seed_same_masks", "rank_seeds_differ", "repeatable", "grads_match_local"))
            lines.append(f"  {d.wrapper:<16}{d.mode:<27}{flags}")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> dict:
    args = parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")   # read when triton decorates: before memfuse loads
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))   # memfuse launches on the current device
        torch.backends.cuda.matmul.allow_tf32 = False                  # fp32 means fp32 for the comparison
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=300))
    if args.bucket_cap_mb is not None and args.bucket_cap_mb * 2**20 < dist._DEFAULT_FIRST_BUCKET_BYTES:
        # Dynamo's DDPOptimizer splits a compiled graph at a first bucket of this size (1 MiB) and
        # refuses one larger than the others: shrink it too, to get split graphs at a tiny size.
        dist._DEFAULT_FIRST_BUCKET_BYTES = int(args.bucket_cap_mb * 2**20)
    try:
        r = Rank(args)
        results = run_all(r)
        if r.rank == 0:
            print("\n" + table(results), flush=True)
            print(f"\nwrote {args.out}", flush=True)
        return results
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(ROOT))
    main()
