"""A LightningModule whose model is fused (each memfuse style), trained by lightning.Trainer on CPU
for a few steps: eager's losses per step and gradients."""
import copy

import pytest
import torch

import memfuse
from tests.clients.harness import STYLES, fuse
from tests.clients.test_nanogpt import gpt, step

L = pytest.importorskip("lightning")


class LitGPT(L.LightningModule):
    """Records each step's loss and the gradients before each optimizer step."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.losses, self.grads = [], {}

    def training_step(self, batch, batch_idx):
        loss = step(self.model, batch)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.grads = {name: p.grad.clone() for name, p in self.named_parameters() if p.grad is not None}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def fit(module: LitGPT, batches: list) -> LitGPT:
    trainer = L.Trainer(max_steps=len(batches), accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return module


@pytest.mark.parametrize("style", STYLES)
def test_lightning_trainer_matches_eager(style):
    batches = list(torch.randint(0, 64, (3, 2, 13), generator=torch.Generator().manual_seed(1)))
    model = gpt()
    eager = fit(LitGPT(copy.deepcopy(model)), batches)
    before = memfuse.stats()["compiles"]
    fused = fit(LitGPT(fuse(model, style, layers=lambda m: m.transformer.h)), batches)
    assert memfuse.stats()["compiles"] > before
    torch.testing.assert_close(fused.losses, eager.losses, rtol=1e-4, atol=1e-5)
    grads = {name.replace("_orig_mod.", ""): g for name, g in fused.grads.items()}
    assert grads.keys() == eager.grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager.grads[name], rtol=1e-3, atol=1e-5, msg=name)
