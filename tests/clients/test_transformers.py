"""HuggingFace Trainer and accelerate with a fused model: Trainer's default arguments keep the
dataset columns the model's forward names (the wrapper shows its signature), training and
evaluation match eager, the saved weights load into a plain model; accelerate's prepare takes a
fused or a compiled model."""
import copy

import pytest
import torch

import memfuse
from tests.clients.harness import fuse, tiny_llama

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")


def dataset():
    """Rows as a tokenizer's map makes them, with a column the model does not take (Trainer drops it)."""
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row, "text": "unused"} for row in ids]


def run_trainer(model, output_dir) -> tuple:
    args = transformers.TrainingArguments(output_dir=str(output_dir), max_steps=3, per_device_train_batch_size=4,
                                          per_device_eval_batch_size=4, learning_rate=1e-2, logging_steps=1,
                                          report_to="none", save_strategy="no", use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return trainer, losses, trainer.evaluate()["eval_loss"]


def test_trainer_trains_a_wrapped_model_with_default_arguments(tmp_path):
    plain = tiny_llama()
    fused = memfuse.memory_efficient_fusion(copy.deepcopy(plain))
    _, expected_losses, expected_eval = run_trainer(plain, tmp_path / "eager")
    before = memfuse.stats()
    trainer, losses, eval_loss = run_trainer(fused, tmp_path / "fused")
    assert memfuse.stats()["compiles"] > before["compiles"]
    assert memfuse.stats()["eager_calls"] == before["eager_calls"]
    assert len(losses) == 3
    torch.testing.assert_close(losses, expected_losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(eval_loss, expected_eval, rtol=1e-4, atol=1e-5)
    assert trainer.model.config.vocab_size == 64            # model.config through the wrapper

    trainer.save_model(str(tmp_path / "weights"))           # Trainer writes the state dict: the plain keys
    reloaded = tiny_llama()
    missing = reloaded.load_state_dict(_safetensors(tmp_path / "weights"), strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) <= {"lm_head.weight"}   # tied
    trainer.model.save_pretrained(str(tmp_path / "pretrained"))   # the original's: weights and config
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "pretrained"))
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, trainer.model.original.get_parameter(name))


def _safetensors(directory):
    from safetensors.torch import load_file
    return load_file(str(directory / "model.safetensors"))


@pytest.mark.parametrize("style", ["whole", "backend"])
def test_accelerate_prepares_a_fused_model(style):
    """`Accelerator(dynamo_plugin=...)` takes only accelerate's own backends; a model fused before
    `prepare` is its equivalent."""
    plain = tiny_llama()
    model = fuse(copy.deepcopy(plain), style, layers=None)
    accelerator = accelerate.Accelerator(cpu=True)
    batch = dataset()[0]["input_ids"][None]
    results = []
    for net in (plain, model):
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
        net, optimizer = accelerator.prepare(net, optimizer)
        losses = []
        for _ in range(2):
            loss = net(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        results.append(losses)
    torch.testing.assert_close(results[1], results[0], rtol=1e-4, atol=1e-5)


IN_PLACE = {"whole": lambda model: memfuse.memory_efficient_fusion(model, in_place=True),
            "layers": lambda model: memfuse.fuse_layers(model, model.model.layers),
            "backend": lambda model: model.compile(backend="memfuse")}


@pytest.mark.parametrize("style", list(IN_PLACE))
def test_trainer_saves_a_model_fused_in_place_like_the_original(style, tmp_path):
    """A model fused in place (`memory_efficient_fusion(model, in_place=True)`; `memfuse.fuse_layers`:
    each layer wrapped, the rest through the backend; `model.compile(backend="memfuse")`) is still
    the PreTrainedModel Trainer was given,
    so `save_model()` writes its configuration beside the weights and `from_pretrained` loads them
    back; training matches eager's with Trainer's default arguments."""
    torch._dynamo.reset()
    plain = tiny_llama()
    model = copy.deepcopy(plain)
    IN_PLACE[style](model)
    _, expected_losses, expected_eval = run_trainer(plain, tmp_path / "eager")
    before = memfuse.stats()
    trainer, losses, eval_loss = run_trainer(model, tmp_path / "fused")
    assert memfuse.stats()["loss_heads_chunked"] > before["loss_heads_chunked"]   # the head, fused
    assert memfuse.stats()["graph_fallbacks"] == before["graph_fallbacks"]
    torch.testing.assert_close(losses, expected_losses, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(eval_loss, expected_eval, rtol=1e-4, atol=1e-5)

    trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").exists()
    loaded = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    assert loaded.config.vocab_size == 64 and loaded.config.num_hidden_layers == 2
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(p, model.get_parameter(name), msg=name)
