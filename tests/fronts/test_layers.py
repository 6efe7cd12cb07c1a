"""fuse_layers: each layer fused, the rest of the model (embeddings, final norm, head and loss)
through the backend in place. The head's loss runs through memfuse's chunked loss head, so its
[tokens, vocab] logits are never whole (the per-layer style's peak stays at or below
torch.compile's); the model keeps its class, signature and keys; one step matches eager."""
import copy

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import memfuse
from memfuse.fronts import backend

transformers = pytest.importorskip("transformers")


def llama(hidden=32, vocab=64, ffn=64, heads=4, kv_heads=2, layers=2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                      num_hidden_layers=layers, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads, max_position_embeddings=4096, use_cache=False)
    return transformers.LlamaForCausalLM(config)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_head_and_loss_run_through_the_loss_head_and_match_eager():
    eager = llama()
    fused = copy.deepcopy(eager)
    keys = list(fused.state_dict())
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    before = memfuse.stats()
    assert memfuse.fuse_layers(fused, fused.model.layers) is fused
    assert type(fused) is transformers.LlamaForCausalLM and list(fused.state_dict()) == keys
    assert all(isinstance(layer, memfuse.FusedModule) for layer in fused.model.layers)
    expected = eager(input_ids=ids, labels=ids).loss
    expected.backward()
    loss = fused(input_ids=ids, labels=ids).loss
    loss.backward()
    after = memfuse.stats()
    assert after["loss_heads_chunked"] > before["loss_heads_chunked"], after   # the head: memfuse's loss head
    assert after["compiles"] - before["compiles"] > len(fused.model.layers)     # each layer, then the rest
    assert after["graph_fallbacks"] == before["graph_fallbacks"] and after["eager_calls"] == before["eager_calls"]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(fused.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_layers_must_be_the_models_module_list():
    model = llama()
    with pytest.raises(TypeError, match="ModuleList"):
        memfuse.fuse_layers(model, model.model.layers[0])
    with pytest.raises(ValueError, match="not a submodule"):
        memfuse.fuse_layers(model, torch.nn.ModuleList([torch.nn.Linear(2, 2)]))


def test_the_head_saves_no_tokens_by_vocab_tensor_at_a_real_size():
    """Compile only, on fake tensors: hidden 2048 and vocabulary 128256 (a 1B-class Llama's head,
    one layer), 8 x 2048 tokens. No graph of the step keeps a [tokens, vocab] tensor for the
    backward: the rest's graph saves less than one bf16 copy of the logits."""
    tokens, vocab = 8 * 2048, 128256
    config = memfuse.Config(compile_only=True)
    with FakeTensorMode():
        model = llama(hidden=2048, vocab=vocab, ffn=8192, heads=32, kv_heads=8, layers=1)
        ids = torch.randint(0, vocab, (8, 2048))
        memfuse.fuse_layers(model, model.model.layers, config=config)
        with backend.watch() as records:
            model(input_ids=ids, labels=ids).loss.backward()
    compiled = [r for r in records if r.plan is not None]
    assert compiled and all(r.through_torch is None for r in records)
    assert memfuse.stats()["loss_heads_chunked"] >= 1
    for record in compiled:
        assert record.plan.saved_bytes < tokens * vocab * 2, (record.name, record.plan.saved_bytes)
