"""The HuggingFace models the model benchmarks train, and how one of their training steps is measured.

BERT (masked LM), GPT-2 and Llama (causal LM) built from configs with random weights (nothing is
downloaded); the modes that wrap them (eager, torch.compile, memfuse whole, per layer, through the
backend); a training step (forward, loss, backward) under bf16 autocast with fp32 parameters, timed
and measured for memory; the dropout-free check of a mode's loss and gradients against eager; each
model's JSON (metadata, rows) and where it is written. The commands that use it: benchmarks.models,
.budget, .loss_head, .peak, .profile_step, .kernel_sol, .instructions, .first_call, .distributed.

Importing this module with --tiny in sys.argv, or without CUDA, sets TRITON_INTERPRET=1: tiny
configs run on CPU in fp32 through the Triton interpreter (a smoke run, not a measurement).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import functools
import gc
import json
import operator
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

if "--tiny" in sys.argv or not torch.cuda.is_available():
    # Read when @triton.jit decorates, Triton's own helpers included: before anything imports
    # triton (torch._dynamo does).
    os.environ["TRITON_INTERPRET"] = "1"

import torch._dynamo  # noqa: E402
from torch import nn  # noqa: E402

import memfuse  # noqa: E402
from memfuse.fronts.backend import memfuse_backend  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
MODEL_SEED = 0  # the weights every mode starts from
DATA_SEED = 1  # the token ids and labels
DROPOUT = 0.1
MB = 1e6
# A gradient's error is measured against max(its own norm, this share of the largest gradient
# norm): BERT's attention key bias has a gradient of ~0 (softmax ignores a shift shared by every
# key), so its error relative to itself is noise.
GRAD_SCALE_FLOOR = 1e-3
ERROR_CHARS = 160  # of an error message in the Markdown table (the JSON has it whole)
TINY_BANNER = (
    "=" * 88 + "\n"
    "TINY RUN: tiny configs on CPU, fp32, memfuse through the Triton interpreter.\n"
    "These numbers say NOTHING about performance; they only show the harness and modes work.\n"
    + "=" * 88
)


# -- the models -----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    batch: int
    seq: int  # tokens (an encoder-decoder's source); wav2vec2's audio samples; Whisper's mel frames
    image: int = 0  # a vision model's image side in pixels
    classes: int = 0  # a classifier's labels
    experts: int = 0  # a mixture of experts' experts per layer


@dataclasses.dataclass(frozen=True)
class Family:
    """A model the benchmarks train: how to build it at a size, and a batch it takes whose output
    has `.loss`. Built by transformers' `model_class` from `config`, or by `construct` (a model from
    another library, wrapped so that it returns `.loss`)."""

    name: str
    model_class: str  # in transformers; or the constructed model's name
    # attribute paths of the ModuleLists of layers (wrapped one by one; an encoder-decoder has two);
    # None where the model has no list of layers
    layers: str | tuple[str, ...] | None
    size: Size
    tiny: Size
    config: Callable[[Size, float], object] | None  # (size, dropout) -> a transformers config
    inputs: Callable[[Size, torch.device], dict] | None = None  # a batch; None: make_batch's token ids
    construct: Callable[[Size, float], nn.Module] | None = None  # (size, dropout) -> a model, without config

    @property
    def layer_paths(self) -> tuple[str, ...]:
        return (self.layers,) if isinstance(self.layers, str) else tuple(self.layers or ())

    def make_batch(self, size: Size, device: torch.device) -> dict:
        """The family's batch at `size`: keyword arguments whose call returns an output with `.loss`."""
        return (self.inputs or make_batch)(size, device)


def _bert_config(size: Size, dropout: float):
    from transformers import BertConfig

    return BertConfig(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
                      intermediate_size=size.ffn, vocab_size=size.vocab, max_position_embeddings=max(512, size.seq),
                      hidden_dropout_prob=dropout, attention_probs_dropout_prob=0.0)


def _gpt2_config(size: Size, dropout: float):
    from transformers import GPT2Config

    return GPT2Config(n_embd=size.hidden, n_layer=size.layers, n_head=size.heads, n_inner=size.ffn,
                      vocab_size=size.vocab, n_positions=size.seq, bos_token_id=size.vocab - 1,
                      eos_token_id=size.vocab - 1, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=0.0)


def _llama_config(size: Size, dropout: float):
    from transformers import LlamaConfig

    del dropout  # Llama has no dropout but attention's (left at 0): any value builds the same model
    return LlamaConfig(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
                       num_key_value_heads=size.kv_heads, intermediate_size=size.ffn, vocab_size=size.vocab,
                       max_position_embeddings=size.seq, bos_token_id=1, eos_token_id=2)


FAMILIES = {f.name: f for f in (
    Family("bert", "BertForMaskedLM", "bert.encoder.layer",
           Size(768, 4, 12, 12, 3072, 30522, 32, 512), Size(64, 2, 4, 4, 128, 100, 2, 16), _bert_config),
    Family("gpt2", "GPT2LMHeadModel", "transformer.h",
           Size(768, 4, 12, 12, 3072, 50257, 16, 1024), Size(64, 2, 4, 4, 256, 101, 2, 16), _gpt2_config),
    Family("llama", "LlamaForCausalLM", "model.layers",
           Size(1024, 4, 16, 4, 2816, 32000, 8, 2048), Size(64, 2, 4, 2, 96, 100, 2, 16), _llama_config),
)}


def build(family: Family, size: Size, dropout: float, weights: dict | None = None, use_cache: bool = False
          ) -> nn.Module:
    """A model from its config, in training mode, on the CPU: random weights drawn from
    MODEL_SEED, or `weights` (a state_dict) loaded over them. No cache by default: a training step
    needs no keys and values kept for generation, and a per-layer wrapper takes no Cache object."""
    torch.manual_seed(MODEL_SEED)
    if family.construct is not None:
        model = family.construct(size, dropout)
    else:
        import transformers

        config = family.config(size, dropout)
        config.use_cache = use_cache
        model = getattr(transformers, family.model_class)(config)
    if getattr(model, "loss_type", "") is None:
        # GPT2LMHeadModel's name gives transformers no loss type: its `loss_function` then warns once
        # through an lru_cache'd logger, where Dynamo breaks the graph between the head and the loss
        # (every compiled mode). The loss it falls back to, named: the same loss, one graph.
        model.loss_type = "ForCausalLM"
    if weights is not None:
        model.load_state_dict(weights)
    return model.train()


@dataclasses.dataclass(frozen=True)
class Templates:
    """One model's two CPU originals with the same weights; every mode trains copies of them. Where
    the two are the same model (a family without dropout, or a run at dropout 0) they are one
    object, `shared`: a mode's timed model is then also its checked one, and its first step's loss
    and gradients are the check (one compile per mode instead of two)."""

    dropout: nn.Module  # `dropout` (DROPOUT) where the family has dropout: the speed and memory steps
    dropout_free: nn.Module  # every dropout probability 0.0: the steps compared with eager

    @property
    def shared(self) -> bool:
        return self.dropout is self.dropout_free

    @staticmethod
    def build(family: Family, size: Size, use_cache: bool, dropout: float = DROPOUT) -> "Templates":
        model = build(family, size, dropout, use_cache=use_cache)
        if dropout == 0.0 or not has_dropout(family, size, dropout):
            return Templates(model, model)
        return Templates(model, build(family, size, 0.0, model.state_dict(), use_cache))


def has_dropout(family: Family, size: Size, dropout: float) -> bool:
    """Whether `dropout` changes the family's model: its config at `dropout` differs from its
    config at 0 (Llama's and most decoders' configs take no dropout). A constructed model has no
    config to compare: counted as having dropout, so it is checked on a dropout-free copy."""
    if family.config is None:
        return True
    return family.config(size, dropout).to_dict() != family.config(size, 0.0).to_dict()


def fresh(template: nn.Module, device: torch.device) -> nn.Module:
    return copy.deepcopy(template).to(device)


def layer_list(model: nn.Module, family: Family) -> nn.ModuleList:
    """The family's (first) list of layers."""
    return layer_lists(model, family)[0]


def layer_lists(model: nn.Module, family: Family) -> list[nn.ModuleList]:
    """Every list of layers the per-layer modes wrap (an encoder-decoder's two)."""
    if not family.layer_paths:
        raise ValueError(f"{family.name} has no list of layers to wrap one by one (Family.layers is None): "
                         f"wrap the whole model instead")
    return [operator.attrgetter(path)(model) for path in family.layer_paths]


def make_batch(size: Size, device: torch.device) -> dict:
    """Random token ids, and random token ids as labels (every position counts in the loss)."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    ids, labels = (torch.randint(0, size.vocab, (size.batch, size.seq), generator=generator) for _ in range(2))
    return {"input_ids": ids.to(device), "labels": labels.to(device)}


# -- the modes ------------------------------------------------------------------------------------
def _each_layer(wrap: Callable[[nn.Module], nn.Module]) -> Callable[[nn.Module, Family], nn.Module]:
    """A mode that wraps every transformer layer in place and leaves the rest of the model eager."""
    def wrapper(model: nn.Module, family: Family) -> nn.Module:
        for layers in layer_lists(model, family):
            for index in range(len(layers)):
                layers[index] = wrap(layers[index])
        return model
    return wrapper


def _fused_layers_then_backend(model: nn.Module, family: Family) -> Callable:
    """Each layer fused in place, then the model through the backend: Dynamo runs a FusedModule as
    it is (a graph break at each layer), and the backend compiles the rest, its loss head chunked."""
    return _through_backend(_each_layer(memfuse.memory_efficient_fusion)(model, family))


def _through_backend(model: nn.Module) -> Callable:
    """`torch.compile(model, backend="memfuse")` with a backend callable of its own, as one model in
    its own process has. Dynamo keeps compiled code per code object and runs any entry whose guards
    pass and whose backend compares equal (two `backend="memfuse"` calls do). The modes of a run are
    models of one class sharing transformers' wrapper frames, whose entries guard little more than
    the model's type: the backend's model ran the graphs each-layer-fused-with-the-backend had
    compiled, graph breaks at every layer included, and its layers compiled on their own (two H200s
    under DDP, 2026-11-27: 10-17% slower than its own graph)."""
    return torch.compile(model, backend=functools.partial(memfuse_backend))


WRAPPERS: dict[str, Callable[[nn.Module, Family], Callable]] = {
    "eager": lambda model, family: model,
    "torch_compile": lambda model, family: torch.compile(model),
    "memfuse_backend": lambda model, family: _through_backend(model),
    "memfuse_whole": lambda model, family: memfuse.memory_efficient_fusion(model),
    # the embeddings, final norm, head and loss stay eager
    "memfuse_per_layer": _each_layer(memfuse.memory_efficient_fusion),
    # the same layers; the embeddings, final norm, head and loss through the backend: memfuse.fuse_layers'
    # recipe (issue 52 item 2), as a torch.compile wrapper where fuse_layers compiles the model in place
    "memfuse_per_layer_backend": _fused_layers_then_backend,
    # torchtitan's way under FSDP2: each block compiled, then sharded (`--modes` adds it)
    "torch_compile_per_layer": _each_layer(torch.compile),
}
# Without a GPU, torch.compile's first step builds C++ kernels for a minute or more: --modes adds it.
COMPILING_MODES = ("torch_compile", "torch_compile_per_layer")
ALL_MODES = tuple(WRAPPERS)                      # what --modes may name
MODES = tuple(m for m in ALL_MODES if m != "torch_compile_per_layer")   # the default run
TINY_MODES = tuple(m for m in MODES if m not in COMPILING_MODES)
DYNAMO_MODES = ("torch_compile", "memfuse_backend", "memfuse_per_layer_backend")
BASELINE_MODE = "torch_compile"  # "vs compile" divides by this mode's it/s; its errors are the noise floor


@dataclasses.dataclass(frozen=True)
class Settings:
    warmup_steps: int  # after the first step
    timed_steps: int  # each timed on its own; the median is reported


GPU_SETTINGS = Settings(warmup_steps=3, timed_steps=10)
TINY_SETTINGS = Settings(warmup_steps=0, timed_steps=1)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where and how every step of a run executes."""

    device: torch.device
    tiny: bool
    settings: Settings
    use_cache: bool = False  # the models' config.use_cache
    dropout: float = DROPOUT  # the timed models' dropout (0: the timed model is the checked one)
    # Held around the warm-up, timed and memory steps (not the first step, which compiles): what
    # keeps processes sharing one host and GPU off the timed steps (benchmarks.zoo's TimingSlot:
    # a lock, the other workers paused).
    exclusive: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext

    def autocast(self):
        if self.tiny:
            return contextlib.nullcontext()  # fp32: the interpreter is slow enough
        return torch.autocast("cuda", dtype=torch.bfloat16)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def forward_loss(model: Callable, batch: dict, setup: Setup) -> torch.Tensor:
    with setup.autocast():
        return model(**batch).loss


def train_step(model: Callable, batch: dict, setup: Setup) -> torch.Tensor:
    loss = forward_loss(model, batch, setup)
    loss.backward()
    return loss.detach()


# -- one model x mode -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Row:
    """One model x mode. Fields are None where not measured (memory on CPU) or where it failed."""

    model: str
    mode: str
    first_step_s: float | None = None  # wrap + first step, compile included
    step_s: float | None = None  # median of the timed steps
    step_samples_s: tuple = ()
    peak_bytes: int | None = None  # a step's peak above the memory allocated at its start
    kept_bytes: int | None = None  # allocated after forward+loss minus before: kept for the backward
    memfuse_compile: dict | None = None  # memfuse.stats() after the first step (a mode that compiles)
    memfuse_compile_s: dict | None = None  # memfuse.compile_times() after the first step: seconds per stage
    memfuse_per_step: dict | None = None  # the counters' growth over the later steps, per step
    compile_cache: dict | None = None  # the first step's compile-cache lookups, see compile_cache()
    compile_cached: bool | None = None  # every lookup hit (None: nothing was looked up, e.g. eager)
    dynamo: dict | None = None  # Dynamo's graph and graph-break counts (torch.compile modes)
    error: str | None = None  # the speed/memory part raised: type and message
    loss: float | None = None  # the dropout-free copy's first-step loss
    loss_error: float | None = None  # |loss - eager's| / |eager's|
    grad_error: float | None = None  # worst over parameters, see grad_error()
    worst_grad: str | None = None  # the parameter with that error
    check_error: str | None = None  # the dropout-free check raised
    checked_on: str | None = None  # CHECKED_ON_FIRST_STEP or CHECKED_ON_COPY
    check_s: float | None = None  # the check's own time (its compile included; ~0 on the first step)

    @property
    def it_s(self) -> float | None:
        return 1.0 / self.step_s if self.step_s else None


def isolate(setup: Setup) -> None:
    """Forget every earlier mode: Dynamo's caches and counters, memfuse's counters, freed memory."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    memfuse.reset_stats()
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(setup.device)


def step_seconds(run: Callable[[], object], steps: int, setup: Setup) -> list[float]:
    """Each step's time: CUDA events around it on a GPU, the host clock on CPU."""
    if setup.device.type != "cuda":
        samples = []
        for _ in range(steps):
            start = time.perf_counter()
            run()
            samples.append(time.perf_counter() - start)
        return samples
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    setup.synchronize()
    for start, end in events:
        start.record()
        run()
        end.record()
    setup.synchronize()
    return [start.elapsed_time(end) * 1e-3 for start, end in events]


def step_memory(model: Callable, batch: dict, setup: Setup) -> tuple[int, int]:
    """(peak, kept) of one step, relative to what is allocated at its start: the model, its
    gradients (they exist: earlier steps made them) and the batch."""
    setup.synchronize()
    before = torch.cuda.memory_allocated(setup.device)
    torch.cuda.reset_peak_memory_stats(setup.device)
    loss = forward_loss(model, batch, setup)
    setup.synchronize()
    kept = torch.cuda.memory_allocated(setup.device) - before
    loss.backward()
    setup.synchronize()
    return torch.cuda.max_memory_allocated(setup.device) - before, kept


def _counter_growth(after: dict, before: dict, steps: int) -> dict:
    return {name: (after[name] - before.get(name, 0)) / steps for name in after}


def _dynamo_counts() -> dict:
    counters = torch._dynamo.utils.counters
    return {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values())}


@dataclasses.dataclass(frozen=True)
class Case:
    """One model's run: the family, where its steps execute, the originals every mode copies and
    the batch every mode trains on."""

    family: Family
    setup: Setup
    templates: Templates
    batch: dict


def compile_cache(memfuse_stats: dict, setup: Setup) -> tuple[dict, bool | None]:
    """The first step's lookups in the on-disk compile caches, from the counters isolate() cleared:
    inductor's FX graph cache and AOTAutograd's cache (torch.compile and Dynamo's graphs), memfuse's
    kernel binaries (precompile.BinaryIndex over Triton's cache: on a GPU only; the interpreter
    compiles nothing). And whether every lookup hit: None where there was none (eager)."""
    counters = torch._dynamo.utils.counters
    lookups = {
        "fx_graph_hits": counters["inductor"]["fxgraph_cache_hit"],
        "fx_graph_misses": counters["inductor"]["fxgraph_cache_miss"] + counters["inductor"]["fxgraph_cache_bypass"],
        "aot_autograd_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "aot_autograd_misses": counters["aot_autograd"]["autograd_cache_miss"]
        + counters["aot_autograd"]["autograd_cache_bypass"],
    }
    if setup.device.type == "cuda":
        binaries = memfuse_stats.get("kernels_generated", 0) - memfuse_stats.get("kernels_shared", 0)
        lookups["memfuse_binaries_loaded"] = memfuse_stats.get("kernels_loaded", 0)
        lookups["memfuse_binaries_compiled"] = max(0, binaries - lookups["memfuse_binaries_loaded"])
    hits = sum(v for k, v in lookups.items() if k.endswith(("_hits", "_loaded")))
    misses = sum(v for k, v in lookups.items() if k.endswith(("_misses", "_compiled")))
    return lookups, (None if hits + misses == 0 else misses == 0)


CHECKED_ON_FIRST_STEP = "the timed model's first step (it has no dropout)"
CHECKED_ON_COPY = "a dropout-free copy's first step (a second compile)"


@dataclasses.dataclass(frozen=True)
class Timed:
    """measure_speed's result: the row, and the first step's loss and gradients where the timed
    model is the dropout-free one (Templates.shared; else None)."""

    row: Row
    first_step: StepResult | None


def measure_speed(case: Case, mode: str) -> Timed:
    """First step (wrap and compile included), warm-up, the timed steps, then one step's memory."""
    setup, batch = case.setup, case.batch
    model = fresh(case.templates.dropout, setup.device)
    setup.synchronize()
    start = time.perf_counter()
    wrapped = WRAPPERS[mode](model, case.family)
    loss = train_step(wrapped, batch, setup)
    setup.synchronize()
    first_step_s = time.perf_counter() - start
    compiled, compile_s = memfuse.stats(), memfuse.compile_times()
    cache, cached = compile_cache(compiled, setup)
    # gradients from zero: the first step's are what a fresh dropout-free copy's step would give
    first_step = StepResult(loss.item(), gradients(model)) if case.templates.shared else None
    model.zero_grad(set_to_none=False)  # the gradients stay allocated: part of the model's own memory
    with setup.exclusive():
        for _ in range(setup.settings.warmup_steps):
            train_step(wrapped, batch, setup)
        samples = step_seconds(lambda: train_step(wrapped, batch, setup), setup.settings.timed_steps, setup)
        steps = setup.settings.warmup_steps + setup.settings.timed_steps
        peak = kept = None
        if setup.device.type == "cuda":
            peak, kept = step_memory(wrapped, batch, setup)
            steps += 1
    row = Row(case.family.name, mode, first_step_s=first_step_s, step_s=statistics.median(samples),
              step_samples_s=tuple(samples), peak_bytes=peak, kept_bytes=kept, memfuse_compile=compiled,
              memfuse_compile_s=compile_s, memfuse_per_step=_counter_growth(memfuse.stats(), compiled, steps),
              compile_cache=cache, compile_cached=cached,
              dynamo=_dynamo_counts() if mode in DYNAMO_MODES else None)
    return Timed(row, first_step)


def gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's gradient by its name in the plain model (a layer torch.compile wrapped in
    place names its parameters through `_orig_mod`)."""
    return {_plain_name(name): p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def grad_error(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The worst parameter's ||grad - reference|| / max(||reference||, GRAD_SCALE_FLOOR x the
    largest reference norm), in fp32; a gradient missing where the reference has one is inf."""
    norms = {name: ref.float().norm().item() for name, ref in reference.items()}
    floor = GRAD_SCALE_FLOOR * max(norms.values())
    errors = {
        name: (grads[name].float() - ref.float()).norm().item() / max(norms[name], floor)
        if name in grads else float("inf")
        for name, ref in reference.items()
    }
    worst = max(errors, key=errors.get)
    return errors[worst], worst


@dataclasses.dataclass(frozen=True)
class StepResult:
    """A step's loss and its parameters' gradients (by name)."""

    loss: float
    grads: dict[str, torch.Tensor]


def dropout_free_step(case: Case, mode: str) -> StepResult:
    """One step of a fresh dropout-free copy in `mode`: its loss and its parameters' gradients."""
    model = fresh(case.templates.dropout_free, case.setup.device)
    loss = train_step(WRAPPERS[mode](model, case.family), case.batch, case.setup)
    return StepResult(loss.item(), gradients(model))


def check(case: Case, row: Row, reference: StepResult, first_step: StepResult | None = None) -> Row:
    """The dropout-free model's loss and gradients against eager's (eager's row: a second eager
    model, so its errors show eager's own run-to-run differences): the timed model's first step
    where it is dropout-free (`first_step`), else a fresh dropout-free copy's step."""
    start = time.perf_counter()
    result = first_step if first_step is not None else dropout_free_step(case, row.mode)
    error, worst = grad_error(result.grads, reference.grads)
    loss = result.loss
    return dataclasses.replace(row, loss=loss, loss_error=abs(loss - reference.loss) / abs(reference.loss),
                               grad_error=error, worst_grad=worst, check_s=time.perf_counter() - start,
                               checked_on=CHECKED_ON_FIRST_STEP if first_step is not None else CHECKED_ON_COPY)


def _error_text(error: Exception) -> str:
    """The type, where it was raised (the innermost frame outside torch and triton) and the message;
    the traceback goes to stderr."""
    traceback.print_exc()
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not any(part in Path(f.filename).parts for part in ("torch", "triton"))]
    if not frames:
        return f"{type(error).__name__}: {error}"
    where = "/".join(Path(frames[-1].filename).parts[-2:])
    return f"{type(error).__name__} at {where}:{frames[-1].lineno} ({frames[-1].name}): {error}"


def run_mode(case: Case, mode: str, reference: StepResult | None) -> Row:
    """Speed and memory, then the dropout-free check; either part that raises is reported in the row."""
    print(f"{case.family.name} {mode} ...", flush=True)
    row, first_step = Row(case.family.name, mode), None
    isolate(case.setup)
    try:
        timed = measure_speed(case, mode)
        row, first_step = timed.row, timed.first_step
    except Exception as error:  # one failing mode must not end the comparison
        row = dataclasses.replace(row, error=_error_text(error))
    isolate(case.setup)
    try:
        if reference is None:
            raise RuntimeError("no eager reference (eager's dropout-free step failed)")
        row = check(case, row, reference, first_step)
    except Exception as error:  # reported in the row
        row = dataclasses.replace(row, check_error=_error_text(error))
    isolate(case.setup)
    return row


def prepare(family: Family, setup: Setup) -> tuple[Case, StepResult | None]:
    """The model's case (originals, batch) and eager's dropout-free step (None where it failed)."""
    size = family.tiny if setup.tiny else family.size
    templates = Templates.build(family, size, setup.use_cache, setup.dropout)
    case = Case(family, setup, templates, family.make_batch(size, setup.device))
    try:
        return case, dropout_free_step(case, "eager")
    except Exception as error:  # every row's check says so
        _error_text(error)
        return case, None


def describe(case: Case) -> dict:
    """The model's part of the JSON but its rows."""
    config = getattr(case.templates.dropout, "config", None)  # a constructed model may have none
    size = case.family.tiny if case.setup.tiny else case.family.size
    return {"model": case.family.name, "class": case.family.model_class, "size": dataclasses.asdict(size),
            "dropout": case.setup.dropout, "timed_model_is_checked": case.templates.shared,
            "use_cache": getattr(config, "use_cache", None),
            "attention": getattr(config, "_attn_implementation", None),
            "parameters": sum(p.numel() for p in case.templates.dropout.parameters())}


def row_json(row: Row) -> dict:
    return {**dataclasses.asdict(row), "it_s": row.it_s}


def run_model(family: Family, modes: tuple[str, ...], setup: Setup) -> dict:
    """Every mode on the same weights and tokens; the model's part of the JSON."""
    case, reference = prepare(family, setup)
    rows = [run_mode(case, mode, reference) for mode in modes]
    return {**describe(case), "rows": [row_json(r) for r in rows]}


# -- metadata, files ------------------------------------------------------------------------------
def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def metadata(setup: Setup) -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tiny": setup.tiny,
        "device": (platform.processor() or "cpu") if setup.tiny else torch.cuda.get_device_name(setup.device),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "precision": "fp32" if setup.tiny else "bf16 autocast, fp32 parameters",
        "argv": sys.argv[1:],
        "settings": dataclasses.asdict(setup.settings),
        "definitions": {
            "it_s": "1 / median time of the timed steps (CUDA events around each; host clock on CPU); "
                    "a step is forward, loss, backward into gradients that stay allocated",
            "peak_bytes": "max_memory_allocated over one step - memory_allocated at its start "
                          "(model, gradients, batch)",
            "kept_bytes": "memory_allocated after forward+loss - at the step's start: kept for the backward",
            "first_step_s": "wrap + first step, compile included, in this process (earlier modes, or "
                            "other processes sharing the on-disk caches, may have left kernels there: "
                            "compile_cached)",
            "memfuse_compile": "memfuse.stats() after the first step",
            "memfuse_compile_s": "memfuse.compile_times() after the first step: seconds per compile stage "
                                 "(docs/debugging.md)",
            "memfuse_per_step": "growth of memfuse.stats() over the later steps, per step",
            "compile_cache": "the first step's lookups in inductor's FX graph and AOTAutograd caches and "
                             "memfuse's kernel binaries (GPU); compile_cached: every lookup hit",
            "checked_on": "the dropout-free model the loss and gradients come from: the timed model's first "
                          "step where it has no dropout, else a dropout-free copy compiled again",
            "loss_error": "dropout-free model: |loss - eager's| / |eager's| on the same weights and tokens",
            "grad_error": "dropout-free model: max over parameters of ||g - eager's g|| / "
                          f"max(||eager's g||, {GRAD_SCALE_FLOOR:g} x the largest ||eager's g||)",
        },
    }


def json_path(out_dir: Path, model: str, tiny: bool) -> Path:
    return out_dir / f"models-{'tiny-' if tiny else ''}{model}.json"


def report_stem(out_dir: Path, tiny: bool) -> Path:
    return out_dir / ("models-tiny" if tiny else "models")


def load_results(out_dir: Path, tiny: bool) -> list[dict]:
    """Every model's JSON in out_dir of this kind (tiny or not), in FAMILIES order."""
    found = {}
    for name in FAMILIES:
        path = json_path(out_dir, name, tiny)
        if path.exists():
            found[name] = json.loads(path.read_text())
    return list(found.values())


# -- the commands' arguments ---------------------------------------------------------------------
def _names(text: str | None, offered: tuple[str, ...], what: str) -> tuple[str, ...]:
    if not text:
        return offered
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in offered]
    if unknown:
        sys.exit(f"unknown {what} {unknown}; choose from {', '.join(offered)}")
    return tuple(n for n in offered if n in names)
