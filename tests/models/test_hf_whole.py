"""Whole HuggingFace models wrapped with transformers' defaults (tiny configs, fp32 on CPU): a model
that returns its KV cache (`use_cache` on, also in training) compiles, and the cache it returns
holds eager's keys and values, good to generate from."""
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import memfuse  # noqa: E402
from benchmarks.lib import hf_models as bench  # noqa: E402


def _layers(cache) -> list:
    """(keys, values) of every layer of a Cache (an EncoderDecoderCache's two caches in turn)."""
    if hasattr(cache, "self_attention_cache"):
        return _layers(cache.self_attention_cache) + _layers(cache.cross_attention_cache)
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_a_model_returning_its_kv_cache_compiles_whole_and_returns_eager_s_cache():
    spec = bench.FAMILIES["llama"]
    plain = bench.build(spec, spec.tiny, 0.0, use_cache=True)
    fused = memfuse.memory_efficient_fusion(bench.build(spec, spec.tiny, 0.0, plain.state_dict(), use_cache=True))
    batch = bench.make_batch(spec.tiny, torch.device("cpu"))
    got, want = fused(**batch), plain(**batch)
    assert (memfuse.stats()["compiles"], memfuse.stats()["eager_calls"]) == (1, 0), memfuse.stats()
    assert type(got.past_key_values) is type(want.past_key_values)
    for (keys, values), (want_keys, want_values) in zip(_layers(got.past_key_values), _layers(want.past_key_values),
                                                         strict=True):
        torch.testing.assert_close(keys, want_keys)
        torch.testing.assert_close(values, want_values)
    got.loss.backward()
    want.loss.backward()
    for (name, p), q in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # the returned cache is a working Cache: one more token generated from it as from eager's
    step = torch.randint(0, spec.tiny.vocab, (spec.tiny.batch, 1))
    with torch.no_grad():
        after = plain.eval()(input_ids=step, past_key_values=got.past_key_values).logits
        expected = plain(input_ids=step, past_key_values=want.past_key_values).logits
    torch.testing.assert_close(after, expected)
