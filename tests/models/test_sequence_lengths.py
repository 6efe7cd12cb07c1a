"""One compile per shape family: a whole HuggingFace model wrapped by memfuse and trained over six
sequence lengths and three batch sizes compiles once, and each step matches eager (the loss and
every gradient). The token ids and labels are integer tensors: their last dim, the sequence
length, is a size symbol of the trace (capture.trace.symbolic_last_dim), not a D
(Config.symbolic_token_dims, on by default). The loss head stays chunked in that one program: the
labels' tokens are the logits' rows at every length."""
import dataclasses

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import memfuse  # noqa: E402
from benchmarks.lib import hf_models as bench  # noqa: E402

# (batch, sequence) pairs: six lengths, three batch sizes, no length equal to a batch size (equal
# sizes share a symbol, a family of their own)
STEPS = [(2, 5), (3, 6), (4, 7), (2, 9), (3, 11), (4, 13)]
CPU = bench.Setup(torch.device("cpu"), tiny=True, settings=bench.TINY_SETTINGS)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_whole_model_compiles_once_over_sequence_lengths_and_batch_sizes(family):
    spec = bench.FAMILIES[family]
    size = dataclasses.replace(spec.tiny, seq=max(s for _, s in STEPS))   # the position table's length
    model = bench.build(spec, size, 0.0)
    eager = bench.build(spec, size, 0.0, model.state_dict())
    fused = memfuse.memory_efficient_fusion(model)
    for batch, seq in STEPS:
        batch_size = dataclasses.replace(size, batch=batch, seq=seq)
        inputs = bench.make_batch(batch_size, CPU.device)
        model.zero_grad(), eager.zero_grad()
        loss = bench.train_step(fused, inputs, CPU)
        expected = bench.train_step(eager, inputs, CPU)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        error, where = bench.grad_error(bench.gradients(model), bench.gradients(eager))
        assert error <= 1e-4, (batch, seq, where, error)
    stats = memfuse.stats()
    assert (stats["compiles"], stats["recompiles"], stats["eager_calls"]) == (1, 0, 0), stats
    assert stats["loss_heads_chunked"] == 1, stats      # the one program's, run at every length


def test_the_backend_compiles_the_graphs_dynamo_makes_and_no_more():
    """torch.compile(backend="memfuse") over the same steps: Dynamo traces the first length
    static, and at the second marks the sizes dynamic (automatic_dynamic_shapes): two graphs, the
    same two as with backend="eager". memfuse compiles each once and adds no guard of its own that
    would make a third; the losses match eager's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    spec = bench.FAMILIES["gpt2"]
    size = dataclasses.replace(spec.tiny, seq=max(s for _, s in STEPS))
    model = bench.build(spec, size, 0.0)
    eager = bench.build(spec, size, 0.0, model.state_dict())
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="memfuse")
    for batch, seq in STEPS:
        inputs = bench.make_batch(dataclasses.replace(size, batch=batch, seq=seq), CPU.device)
        torch.testing.assert_close(bench.train_step(compiled, inputs, CPU), bench.train_step(eager, inputs, CPU),
                                   rtol=1e-5, atol=1e-6)
    stats = memfuse.stats()
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert (stats["compiles"], stats["graph_fallbacks"]) == (2, 0), stats
    torch._dynamo.reset()
