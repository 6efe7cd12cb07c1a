"""PEFT LoRA on a Llama in each memfuse style: eager's losses and gradients; the frozen base gets
no gradient."""
import pytest
import torch

from tests.clients.harness import STYLES, assert_matches_eager, tiny_llama

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def lora_llama():
    model = tiny_llama()
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora)
    for name, p in model.named_parameters():   # LoRA's B starts at zero: give both factors a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def step(model, batch):
    return model(input_ids=batch, labels=batch).loss


@pytest.mark.parametrize("style", STYLES)
def test_lora_llama_matches_eager(style):
    batches = list(torch.randint(0, 64, (3, 2, 12), generator=torch.Generator().manual_seed(1)))
    grads = assert_matches_eager(lora_llama, step, batches, style,
                                 layers=lambda model: model.base_model.model.model.layers)
    assert grads and all("lora_" in name for name in grads)     # the frozen base: no gradient
