"""One compile per shape family: a whole HuggingFace model wrapped by memfuse and trained over six
sequence lengths and three batch sizes compiles once, and each step matches eager (the loss and
every gradient). The token ids and labels are integer tensors: their last dim, the sequence
length, is a size symbol of the trace (capture.trace.symbolic_last_dim), not a D."""
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
