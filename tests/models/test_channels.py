"""Reductions over the channels of NCHW tensors: BatchNorm2d in training (per-channel statistics
over N, H, W; running statistics written in place) and eval (the running statistics read), and
channels-first LayerNorm (a mean over C), in a conv block and in HuggingFace's ResNet and ConvNeXt
from tiny configs, through memory_efficient_fusion and the torch.compile backend: the loss, every
gradient and the running statistics are eager's, and no graph or call runs through torch. At a
ResNet-50 width and 224x224 images the same models compile (compile only)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import memfuse
from benchmarks.lib.hf_models import grad_error
from memfuse.driver.fallback import EagerCall

transformers = pytest.importorskip("transformers")

GRAD_RTOL = 1e-5     # relative to each gradient's norm, floored at 1e-3 x the largest (hf_models.grad_error)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


class ConvBlock(nn.Module):
    def __init__(self, channels: int = 6):
        super().__init__()
        # no bias: before a BatchNorm in training its gradient is 0 but for rounding (the norm
        # subtracts each channel's mean), nothing to compare
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).square().mean()


def _wrap(front: str, model: nn.Module):
    if front == "memory_efficient_fusion":
        return memfuse.memory_efficient_fusion(model)
    return torch.compile(model, backend="memfuse")


def _assert_like_eager(model: nn.Module, reference: nn.Module, step, steps: int = 2):
    """`steps` calls of step(model) and step(reference): losses, then the gradients (accumulated)
    and every buffer (running statistics, batches counted) against eager's; nothing ran through torch."""
    for _ in range(steps):
        ours, theirs = step(model), step(reference)
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    grads = {name: p.grad for name, p in model.named_parameters()}
    error, worst = grad_error(grads, {name: p.grad for name, p in reference.named_parameters()})
    assert error <= GRAD_RTOL, (worst, error)
    for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=name)
    stats = memfuse.stats()
    assert (stats["graph_fallbacks"], stats["eager_calls"]) == (0, 0), stats
    assert stats["compiles"] >= 1, stats


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("front", ["memory_efficient_fusion", "backend"])
def test_conv_batchnorm_block(front, training):
    """Conv2d + BatchNorm2d + ReLU: in training the per-channel sums of the backward (over N, H
    and W of [N, C, H, W]) compile, and the running statistics are written back; in eval the
    norm is pointwise over the running statistics, which stay as they were."""
    torch.manual_seed(0)
    reference = ConvBlock().train(training)
    if not training:
        reference.bn.running_mean.normal_()
        reference.bn.running_var.uniform_(0.5, 2.0)
    model = copy.deepcopy(reference)
    fused = _wrap(front, model)
    x = torch.randn(2, 3, 6, 5)
    before = reference.bn.running_mean.clone()
    _assert_like_eager(model, reference, lambda m: (fused if m is model else m)(x))
    assert int(model.bn.num_batches_tracked) == (2 if training else 0)
    assert training != torch.equal(model.bn.running_mean, before)


def _resnet(hidden_sizes=(8, 16), embedding_size=8, depths=(1, 1)):
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=embedding_size, hidden_sizes=list(hidden_sizes), depths=list(depths),
        layer_type="bottleneck", num_labels=3))


def _convnext(hidden_sizes=(8, 16), depths=(1, 1)):
    return transformers.ConvNextForImageClassification(transformers.ConvNextConfig(
        hidden_sizes=list(hidden_sizes), depths=list(depths), num_stages=len(depths), num_labels=3))


VISION = {   # family -> its tiny model
    "resnet": _resnet,          # BatchNorm2d after every conv
    "convnext": _convnext,      # ConvNextLayerNorm channels_first (a mean over dim 1) after the stem and downsamples
}


@pytest.mark.parametrize("front,family,training", [
    ("memory_efficient_fusion", "resnet", True), ("memory_efficient_fusion", "convnext", True),
    # 15-25 s each on two cores; the conv block covers the backend's BatchNorm in both modes
    pytest.param("backend", "resnet", False, marks=pytest.mark.slow),
    pytest.param("backend", "convnext", True, marks=pytest.mark.slow)])
def test_hf_vision_model(front, family, training):
    """The whole model from a tiny config, 32x32 images, labels given: loss, gradients and the
    BatchNorms' running statistics as eager's, no graph through torch."""
    torch.manual_seed(0)
    reference = VISION[family]().train(training)
    model = copy.deepcopy(reference)
    fused = _wrap(front, model)
    pixels, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    _assert_like_eager(model, reference,
                       lambda m: (fused if m is model else m)(pixel_values=pixels, labels=labels).loss)


@pytest.mark.slow
@pytest.mark.parametrize("family,training", [("resnet", True), ("resnet", False), ("convnext", True)])
def test_real_sizes_compile(family, training):
    """ResNet-50's widths and ConvNeXt-T's (one block a stage), batch 32 of 224x224 images: the
    whole model compiles (capture, plan, schedule, codegen; nothing runs), not a decision to run
    it through torch. Sizes select paths tiny configs do not (which sums aten takes, row lengths)."""
    torch.manual_seed(0)
    model = _resnet((256, 512, 1024, 2048), 64, (1, 1, 1, 1)) if family == "resnet" else \
        _convnext((96, 192, 384, 768), (1, 1, 1, 1))
    model.train(training)
    pixels, labels = torch.randn(32, 3, 224, 224), torch.randint(0, 3, (32,))
    entry = memfuse.memory_efficient_fusion(model).compiled_for(pixel_values=pixels, labels=labels)
    assert not isinstance(entry, EagerCall), entry


# more terms (N x H) than channels: aten finishes the sums of rows; fewer: a summed strided read
@pytest.mark.parametrize("shape", [(3, 4, 6, 5), (2, 12, 2, 3)], ids=["aten_finish", "strided_finish"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batchnorm_statistics_are_fused_sums(dtype, shape):
    """BatchNorm's statistics in training: var_mean over N, H and W of [N, C, H, W] (of the input's
    fp32 upcast under autocast). Two sums of rows in kernels that read the input as it is, each
    finished over the leading dims; no aten var_mean, and no forward kernel writes an fp32 copy of
    the activation for it to read. Output and gradients as eager's."""
    from helpers import compiled, rel_error

    def norm(x, weight):
        wide = x.float()
        var, mean = torch.var_mean(wide, dim=(0, 2, 3), correction=0, keepdim=True)
        return ((wide - mean) * torch.rsqrt(var + 1e-5) * weight.view(1, -1, 1, 1)).to(dtype)

    torch.manual_seed(0)
    x = (torch.randn(shape) * 2 + 1).to(dtype).requires_grad_()
    weight = torch.randn(shape[1], requires_grad=True)
    facts = compiled(norm, x, weight)
    assert not [t for t in facts.externs["forward"] if "var_mean" in t], facts.report
    graph = facts.report.entry.function.forward.schedule.graph
    written = [o for k in facts.report.entry.function.forward.schedule.kernels for o in k.outputs
               if graph[o].value.dtype == torch.float32 and tuple(graph[o].value.shape) == tuple(x.shape)]
    assert written == [] or dtype == torch.float32, (written, facts.report)
    fused = memfuse.memory_efficient_fusion(norm)
    out, ref = fused(x, weight), norm(x, weight)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert rel_error(out.float(), ref.float()) <= tolerance
    grad = torch.randn_like(ref)
    ours = torch.autograd.grad(out, (x, weight), grad)
    theirs = torch.autograd.grad(ref, (x, weight), grad)
    for got, want in zip(ours, theirs):
        assert rel_error(got.float(), want.float()) <= tolerance


def test_group_norm_backward_sums_rows_in_its_kernel():
    """wav2vec2's feature encoder: GroupNorm with a group per channel over [N, C, L]. Its backward
    sums over L into [N, C] (a sum over D whose result leaves the rows' place). Each row is summed
    in the kernel that computes it, and the [N, C] result read from those row sums: the backward's
    kernels write nothing the activation's size but the input gradient (aten's sum would read fp32
    copies of it, each written whole first). Gradients as eager's."""
    from helpers import compiled, rel_error
    from memfuse.ir.graph import Kind

    def norm(x, weight, bias):
        return torch.nn.functional.group_norm(x, x.shape[1], weight, bias).square()

    torch.manual_seed(0)
    x = torch.randn(2, 6, 20, requires_grad=True)
    weight, bias = torch.randn(6, requires_grad=True), torch.randn(6, requires_grad=True)
    facts = compiled(norm, x, weight, bias)
    backward = facts.report.entry.function.backward.schedule
    graph = backward.graph
    whole = [o for k in backward.kernels for o in k.outputs
             if graph[o].value.kind is Kind.FULL and graph[o].value.d == x.shape[-1]]
    # the input gradient, and the upstream gradient its kernel reads after the sums; no copy to sum
    assert len(whole) == 2, (whole, facts.report)
    fused = memfuse.memory_efficient_fusion(norm)
    out, ref = fused(x, weight, bias), norm(x, weight, bias)
    assert rel_error(out, ref) <= 1e-5
    grad = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (x, weight, bias), grad),
                         torch.autograd.grad(ref, (x, weight, bias), grad)):
        assert rel_error(got, want) <= 1e-5
