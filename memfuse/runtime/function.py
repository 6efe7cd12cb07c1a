"""A plan made runnable: `CompiledFunction` (a forward Program, a backward one when gradients are
needed), the autograd.Function that runs them, and the seeds its random ops draw from.
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from memfuse.base import torch_private
from memfuse.base.config import Config
from memfuse.ir.patterns import with_output_hooks
from memfuse.ir.targets import InputError
from memfuse.runtime import offload
from memfuse.runtime.program import Program


class CompiledFunction:
    """A plan made runnable: a forward Program, and a backward one when gradients are needed.
    `contiguous[i]`: tensor input i is contiguous in every call (the compile key says so), so the
    forward need not check it. The backward checks its tangents, and what it reads of the
    forward: a saved-tensors hook may unpack anything."""

    def __init__(self, plan, captured, config: Config, build_schedule, contiguous=()):
        self.plan = plan
        self.symbol_order = list(captured.symbols)
        self.symbol_sources = [captured.symbols[s] for s in self.symbol_order]
        self.has_seed = captured.has_seed
        self.seed_from_memory = config.seed_from_memory   # kernels read a [1] seed tensor
        self.num_fwd_outputs = plan.num_fwd_outputs
        self.differentiable = captured.differentiable_outputs
        self.non_differentiable = [i for i in range(self.num_fwd_outputs) if i not in self.differentiable]
        reads = ", ".join(f"inputs[{i}].shape[{d}]" for i, d in self.symbol_sources)
        self.symbol_values = eval(f"lambda inputs: ({reads}{',' if len(self.symbol_sources) == 1 else ''})")
        primals = plan.forward.inputs[:len(contiguous)]
        self.forward = Program(build_schedule(plan.forward, "forward"), self.symbol_order, config,
                               {name for name, known in zip(primals, contiguous) if known}, plan.forward.inputs,
                               offloaded=plan.offloaded)
        self.backward = None
        if plan.backward is not None:    # inputs: what the forward saved, [the seed], the tangents
            inputs = plan.backward.inputs
            saved = len(inputs) - len(self.differentiable) - self.has_seed
            self.backward = Program(build_schedule(plan.backward, "backward"), self.symbol_order, config,
                                    device_inputs=inputs[saved:], saved_inputs=inputs[:saved], returns_gradients=True,
                                    offloaded=plan.offloaded)
        # (*tensor inputs) -> the forward's outputs: what a repeated call runs (api._Front)
        self.apply = self.forward_only if self.backward is None else functools.partial(_function_apply, self)
        # what the caller's outputs need after a run (memfuse.ir.patterns.OutputHook: the chunked loss
        # head's returned logits get their own backward): the caller's outputs are the first ones
        self.output_hooks = captured.output_hooks
        self.num_user_outputs = self.num_fwd_outputs - sum(h.extra_outputs for h in self.output_hooks)
        if self.output_hooks:
            self.apply = self._with_output_hooks
        # Until a backward has run once (memfuse.driver.fallback: the first run's rules), each forward
        # keeps its inputs, and a failed backward asks the front for the gradients through torch:
        # `backward_through_torch(error, inputs, their versions, grad_outputs) -> one gradient per input`.
        self.backward_proven = self.backward is None
        self.backward_through_torch: Optional[Callable] = None

    def run_forward(self, inputs) -> tuple:
        """(outputs, size values, seed input, device) of a forward run on the tensor inputs. The
        seed input is () without random ops, else a fresh draw, as a Python int or, for kernels
        that read it from memory, a [1] tensor on the device."""
        device = inputs[0].device
        seed = ()
        if self.has_seed:
            seed = _draw_seed(device)
            seed = (torch.tensor([seed], dtype=torch.int64, device=device),) if self.seed_from_memory else (seed,)
        symbol_values = self.symbol_values(inputs)
        return self.forward.run([*inputs, *seed], symbol_values, device), symbol_values, seed, device

    def forward_only(self, *inputs) -> tuple:
        return tuple(self.run_forward(inputs)[0][:self.num_fwd_outputs])

    def __call__(self, inputs: list) -> tuple:
        if self.output_hooks:
            return self._with_output_hooks(*inputs)
        if self.backward is None:
            return self.forward_only(*inputs)
        return _MemfuseFunction.apply(self, *inputs)

    def _with_output_hooks(self, *inputs) -> tuple:
        outputs = self.forward_only(*inputs) if self.backward is None else _function_apply(self, *inputs)
        return tuple(with_output_hooks(outputs, inputs, self.output_hooks, self.num_user_outputs))


SEED_LIMIT = 2 ** 31 - 1   # seeds are int32 kernel scalars (and kernels add a stream index)


_SEED_DRAWS: dict = {}   # device -> its seed draw (reading `device.type` costs more than a dict lookup)


def _draw_seed(device: torch.device) -> int:
    """A fresh seed in [0, SEED_LIMIT), with no kernel and no GPU sync: on CUDA from the device's
    default generator (`philox_seed_draw`; `torch.manual_seed` and `torch.cuda.manual_seed`
    reproduce a run, as for torch's own dropout), elsewhere from torch's CPU generator."""
    draw = _SEED_DRAWS.get(device)
    if draw is None:
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            draw = philox_seed_draw(torch.cuda.default_generators[index])
        else:
            draw = _cpu_seed
        _SEED_DRAWS[device] = draw
    return draw()


def _cpu_seed() -> int:
    """From torch's CPU generator, outside any FakeTensorMode (a compile-only run's programs run
    under one, where a drawn tensor would have no value to read)."""
    with unset_fake_temporarily():
        return int(torch.randint(0, SEED_LIMIT, (), dtype=torch.int64))


def philox_seed_draw(generator) -> Callable[[], int]:
    """Seeds from a CUDA generator's Philox state (seed, offset): each draw reserves one offset
    step (4, the unit torch's generator allows) as torch's own random kernels reserve theirs, so
    the next draw reads the next offset. Cheaper than a `torch.randint` draw (a host tensor op per
    call). The seed is the pair's hash (CPython's tuple hash: xxHash rounds over the ints' own
    hashes, the same in every process, PYTHONHASHSEED or not), which spreads successive offsets
    over unrelated seeds, never neighbours (kernels draw from seed + stream index), in one C call
    where a mixer such as splitmix64 takes several Python int operations. Inside a CUDA-graph
    capture the state is off limits: the CPU generator's seed is captured, as before (a constant
    of the graph)."""
    get_offset, set_offset, initial_seed = generator.get_offset, generator.set_offset, generator.initial_seed

    def philox_draw() -> int:
        try:
            offset = get_offset()
        except RuntimeError:
            if not torch.cuda.is_current_stream_capturing():
                raise
            return _cpu_seed()
        set_offset(offset + 4)
        return hash((initial_seed(), offset)) % SEED_LIMIT
    return philox_draw


class _MemfuseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, compiled: CompiledFunction, *inputs):
        outs, symbol_values, seed, device = compiled.run_forward(inputs)
        n = compiled.num_fwd_outputs
        ctx.save_for_backward(*outs[n:])
        # the backward's run: one attribute, not five; which program variant (Program.run_unhooked)
        # as autograd's SavedVariable decides whether to pack through a default hook
        unhooked = _saved_tensors_hooks(False) is None
        ctx.call = (compiled, symbol_values, seed, device, unhooked)
        if compiled.forward.offloaded and not unhooked:     # a hook may read the host copies
            offload.settle(device)
        if not compiled.backward_proven:     # for a first backward that fails (_first_backward)
            ctx.first_inputs = (inputs, [t._version for t in inputs])
        if compiled.non_differentiable:
            ctx.mark_non_differentiable(*[outs[i] for i in compiled.non_differentiable])
            ctx._materialize_non_diff_grads = False   # the backward drops their gradients: no zeros made
        return tuple(outs[:n])

    @staticmethod
    def backward(ctx, *grad_outputs):
        """The backward program takes the saved tensors over: read once into its input list, then
        autograd's references go (`maybe_clear_saved_tensors`: unless the graph is retained for
        another backward), so each one is freed after its last reader. The tangents stay alive
        until this returns: the engine holds them for the call."""
        compiled, symbol_values, seed, device, unhooked = ctx.call
        tangents = [grad_outputs[i] for i in compiled.differentiable] if compiled.non_differentiable else grad_outputs
        inputs = [*ctx.saved_tensors, *seed, *tangents]
        ctx.maybe_clear_saved_tensors()
        run = compiled.backward.run_unhooked if unhooked else compiled.backward.run
        if not compiled.backward_proven:
            return (None, *_first_backward(ctx, compiled, run, inputs, symbol_values, device, grad_outputs))
        return (None, *run(inputs, symbol_values, device))


def _first_backward(ctx, compiled: CompiledFunction, run: Callable, inputs: list, symbol_values: tuple, device,
                    grad_outputs: tuple):
    """A backward program's run until one succeeded. A failure recomputes the gradients through
    torch from the inputs this call's forward kept, where the front gave a way to
    (`backward_through_torch`); else it is raised. What the forward saved is memfuse's (a
    recomputation plan, a seed): torch cannot take over from it."""
    try:
        gradients = run(inputs, symbol_values, device)
    except InputError:
        raise
    except Exception as error:   # noqa: BLE001 -- the first run's failure: the front decides (driver.fallback)
        through_torch = compiled.backward_through_torch
        kept = getattr(ctx, "first_inputs", None)
        if through_torch is None or kept is None:
            raise
        return through_torch(error, *kept, grad_outputs)
    compiled.backward_proven = True
    return gradients



_saved_tensors_hooks = torch_private.saved_tensors_hooks   # (ignore_is_tracing) -> None or hooks

# memfuse's autograd node calls its backward directly (not through BackwardCFunction.apply)
torch_private.call_backward_directly(_MemfuseFunction)

# The C half of `_MemfuseFunction.apply`. Its Python half (torch.autograd.Function.apply) does
# three things on every call: routing functorch transforms (vmap, grad) to custom_function_call,
# unwrapping dead functorch wrappers, binding defaults for a setup_context memfuse does not
# define. A repeated call (fronts.function._Front) does the first two itself and calls this.
_function_apply = torch_private.function_apply_c(_MemfuseFunction)
