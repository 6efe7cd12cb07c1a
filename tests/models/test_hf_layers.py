"""HuggingFace layers wrapped one by one inside tiny models (2 layers, width 64, dropout off):
`model.model.layers[i] = memfuse.memory_efficient_fusion(model.model.layers[i])` matches eager
in loss and gradients. Llama passes its rotary (cos, sin) pair as a tuple; GPT-2 and Llama pass a
KV cache object while `use_cache` is on, which runs each layer through torch with the reason."""
import copy
import re

import pytest
import torch

import memfuse

transformers = pytest.importorskip("transformers")

VOCAB = 100
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4    # of each gradient's norm, floored at GRAD_FLOOR of the largest gradient norm
GRAD_FLOOR = 1e-3   # BERT's attention key bias has a gradient of ~0: its own norm is no scale


def tiny(family: str):
    torch.manual_seed(0)
    if family == "bert":
        config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForMaskedLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                      max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def layer_list(model):
    return {"bert": lambda: model.bert.encoder.layer, "gpt2": lambda: model.transformer.h,
            "llama": lambda: model.model.layers}[model.config.model_type]()


def wrapped_pair(family: str):
    """(eager model, a copy with every layer wrapped)."""
    plain = tiny(family)
    fused = copy.deepcopy(plain)
    layers = layer_list(fused)
    for i in range(len(layers)):
        layers[i] = memfuse.memory_efficient_fusion(layers[i])
    return plain, fused


def step(model, ids, **kwargs):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids, **kwargs).loss
    loss.backward()
    return loss.detach()


def assert_matches(plain, fused, ids, **kwargs):
    loss, want = step(fused, ids, **kwargs), step(plain, ids, **kwargs)
    assert abs(loss - want) <= LOSS_RTOL * abs(want), (loss, want)
    grads = {name: p.grad for name, p in plain.named_parameters() if p.grad is not None}
    floor = GRAD_FLOOR * max(g.norm() for g in grads.values())
    for name, p in fused.named_parameters():
        if name in grads:
            error = (p.grad - grads[name]).norm() / torch.maximum(grads[name].norm(), floor)
            assert error <= GRAD_RTOL, (name, error.item())


def ids():
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["bert", "gpt2", "llama"])
def test_layers_compile_and_match_eager(family):
    plain, fused = wrapped_pair(family)
    keywords = {} if family == "bert" else {"use_cache": False}   # BERT's layers take no cache
    assert_matches(plain, fused, ids(), **keywords)
    stats = memfuse.stats()
    assert (stats["compiles"], stats["eager_calls"]) == (2, 0), "one program per layer, none run through torch"
    if family == "gpt2":   # the next step finds each layer's program
        assert_matches(plain, fused, ids(), **keywords)
        assert memfuse.stats()["compiles"] == 2 and memfuse.stats()["cache_hits"] == 2


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_kv_cache_runs_the_layers_through_torch_and_says_how_to_compile(family, caplog):
    plain, fused = wrapped_pair(family)
    assert fused.config.use_cache      # the default, also in training
    assert_matches(plain, fused, ids())
    said = [r.getMessage() for r in caplog.records if r.name == "memfuse.fallbacks"]
    assert len(said) == 1, "said once for both layers"
    # transformers 5.24 renamed the layers' `past_key_values` argument to `cache`
    assert re.search(r"argument '(past_key_values|cache)' is a DynamicCache", said[0]) and "use_cache=False" in said[0]
    assert (memfuse.stats()["eager_calls"], memfuse.stats()["compiles"]) == (2, 0)
