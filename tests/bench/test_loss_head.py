"""benchmarks/loss_head.py: its tiny run (CPU, the Triton interpreter) end to end, a row for every
form x peer with a time or the reason it is missing, small errors against the fp64 reference;
the issue's target line; how explain's text is read."""
import json
import os

import pytest

from benchmarks import loss_head as bench
from benchmarks.loss_head import Row


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_tiny_run(tmp_path, capsys):
    bench.main(["--tiny", "--ignore-fraction", "0.25", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "loss-head-tiny-float32.json").read_text())
    assert result["metadata"]["tiny"] and result["metadata"]["workload"]["ignore_fraction"] == 0.25
    rows = {(r["form"], r["peer"]): r for r in result["rows"]}
    assert list(rows) == [(form, peer) for form in bench.FORMS for peer in bench.PEERS]
    for key, row in rows.items():
        assert row["error"] is None, (key, row["error"])
        if row["missing"]:
            assert row["step_s"] is None, key
            continue
        assert row["step_s"] > 0 and row["first_call_s"] > 0 and row["peak_bytes"] is None, key  # memory n/a on CPU
        assert row["loss_error"] < 1e-5 and row["grad_error"] < 1e-5, (key, row["loss_error"], row["grad_error"])
    for form in bench.FORMS:
        assert rows[form, "eager"]["missing"] is None
        for peer in bench.MEMFUSE_PEERS:
            assert rows[form, peer]["missing"] is None and rows[form, peer]["chunked_loss_head"] is not None
            assert rows[form, peer]["explain"]
        for peer in bench.COMPILE_PEERS:
            assert "--tiny" in rows[form, peer]["missing"]
    assert len(result["targets"]) == len(bench.FORMS) * len(bench.MEMFUSE_PEERS)
    markdown = (tmp_path / "loss-head-tiny-float32.md").read_text()
    assert "TINY RUN" in markdown and markdown.count("| function |") == len(bench.PEERS)
    assert "TINY RUN" in capsys.readouterr().out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_chunk_mib_and_rows_reach_the_memfuse_peers_only(tmp_path):
    """--chunk-mib and --chunk-rows set memfuse's loss-head chunk (explain says the size it chunked
    with: here the bytes, the fewer), are recorded with the workload and name the result's files
    apart from a default run's."""
    bench.main(["--tiny", "--forms", "function", "--peers", "eager,memfuse,memfuse_backend", "--chunk-mib", "3",
                "--chunk-rows", "100000", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "loss-head-tiny-float32-chunk3mib-rows100000.json").read_text())
    assert result["metadata"]["workload"]["chunk_mib"] == 3
    assert result["metadata"]["workload"]["chunk_rows"] == 100000
    rows = {r["peer"]: r for r in result["rows"]}
    for peer in bench.MEMFUSE_PEERS:
        assert rows[peer]["error"] is None and rows[peer]["chunked_loss_head"], rows[peer]
        assert any("(3 MiB of logits)" in line for line in rows[peer]["explain"]), rows[peer]["explain"]
    assert rows["eager"]["error"] is None and not rows["eager"]["explain"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny run needs Triton's interpreter")
def test_a_soft_capped_head_is_chunked_through_its_cap(tmp_path):
    """--soft-cap: both forms soft-cap their logits (as Gemma 2), the reference too; memfuse chunks
    the head through the cap (explain names it) within the fp64 reference's reach; the files say so."""
    bench.main(["--tiny", "--peers", "eager,liger,memfuse,memfuse_backend", "--soft-cap", "2", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "loss-head-tiny-float32-softcap2.json").read_text())
    assert result["metadata"]["workload"]["soft_cap"] == 2.0
    for row in result["rows"]:
        assert row["error"] is None, row
        if row["missing"]:
            continue
        assert row["loss_error"] < 1e-5 and row["grad_error"] < 1e-5, row
        if row["peer"] in bench.MEMFUSE_PEERS:
            assert any("through / 2.0 then tanh then * 2.0" in line for line in row["explain"]), row["explain"]


def _row(peer, ms, mb):
    return Row("function", peer, step_s=ms * 1e-3, peak_bytes=int(mb * bench.MB))


def test_target_line_needs_least_memory_and_time_within_the_ratio():
    rows = [_row("eager", 100, 9000), _row("liger", 50, 2000), _row("torch_compile", 40, 8000),
            _row("memfuse", 44, 2000), _row("memfuse_backend", 45, 1900)]
    met, slow = bench.target_lines(rows)
    assert met.startswith("function memfuse: MET") and "(liger)" in met and "(torch_compile)" in met
    assert slow.startswith("function memfuse_backend: NOT MET") and "1.12x the fastest" in slow


def test_target_line_without_memory_is_not_judged():
    line, = bench.target_lines([Row("module", "eager", step_s=1.0), Row("module", "memfuse", step_s=2.0)])
    assert "not judged" in line and "2.00x" in line


@pytest.mark.parametrize("text, chunked", [
    ("graphs\n  loss head loss: chunked linear + cross-entropy over vocab 101, chunks of 8 rows", True),
    ("  loss head loss: not chunked: the logits are returned", False),
    ("kernels\n  forward: 7 generated kernel(s)", False),
])
def test_explain_text_is_read_for_a_chunked_loss_head(text, chunked):
    found, lines = bench.read_loss_head(text)
    assert found is chunked and lines and all("loss head" in line for line in lines)


@pytest.mark.parametrize("argv, named", [(["--ignore-fraction", "1"], "--ignore-fraction"),
                                          (["--vocab", "0"], "--vocab"), (["--soft-cap", "0"], "--soft-cap")])
def test_bad_arguments_are_named(argv, named, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert named in capsys.readouterr().err


# -- the peers of issue 52: the auto-chunker, Cut Cross-Entropy, F.linear_cross_entropy ----------------
def _tiny_case(form="function", soft_cap=None):
    workload = bench.workload_of(bench.parse_args(["--tiny"]), tiny=True)
    workload = bench.dataclasses.replace(workload, soft_cap=soft_cap)
    device = bench.torch.device("cpu")
    setup = bench.models.Setup(device, True, bench.models.TINY_SETTINGS)
    inputs = bench.make_inputs(workload, device)
    return bench.Case(workload, setup, bench.FORMS[form](inputs, soft_cap), bench.reference(inputs, device, soft_cap))


@pytest.mark.parametrize("peer, ratio", [("torch_compile_chunker", 1), ("torch_compile_chunker_default", None)])
def test_chunker_peers_compile_with_the_chunker_on_and_the_caches_off(peer, ratio):
    """Inside the peer's context Inductor's config has the chunker on (its amplification threshold
    lowered for the chunker peer, Inductor's own for _default) and no cache that would skip its pass."""
    config = bench.torch._inductor.config
    default_ratio = config.auto_chunker.amplify_ratio_threshold
    with bench.peer_context(peer):
        assert config.auto_chunker.enable and not config.fx_graph_cache
        assert not bench.torch._functorch.config.enable_autograd_cache
        assert config.auto_chunker.amplify_ratio_threshold == (ratio if ratio is not None else default_ratio)
    assert not config.auto_chunker.enable


@pytest.mark.parametrize("fires", [True, False])
def test_a_chunker_row_says_whether_the_chunker_fired(fires, monkeypatch):
    """The row reads torch._inductor.metrics.num_auto_chunking for this peer's compile alone (a
    count left by an earlier compile does not count) and says when the chunker did not fire."""
    metrics = bench.torch._inductor.metrics

    def wrap(fn, options):
        def call(*args):
            if fires:
                metrics.num_auto_chunking += 1
            return fn(*args)
        return call

    monkeypatch.setitem(bench.WRAPPERS, "torch_compile_chunker", wrap)
    metrics.num_auto_chunking = 5  # an earlier compile's
    row = bench.run_peer(_tiny_case(), "torch_compile_chunker", None)
    assert row.error is None and row.auto_chunkings == (1 if fires else 0)
    assert row.chunked_loss_head is fires
    line, = row.explain
    assert ("fired: num_auto_chunking = 1" in line) if fires else ("DID NOT FIRE" in line)
    assert "amplify_ratio_threshold 1" in line


@pytest.mark.slow
def test_the_auto_chunker_fires_on_a_head_only_below_its_default_threshold(tmp_path):
    """Inductor's compile on CPU (tens of seconds each): a head whose logits outweigh its inputs
    5.3x (an LLM head's: 1.9x at 8192 tokens x 4096 -> 128256) chunks under the chunker peer
    and not at Inductor's default threshold (8); both within the fp64 reference's reach."""
    bench.main(["--tiny", "--tokens", "1024", "--hidden", "64", "--vocab", "512", "--forms", "function",
                "--peers", "torch_compile_chunker,torch_compile_chunker_default", "--out", str(tmp_path)])
    rows = {r["peer"]: r for r in json.loads((tmp_path / "loss-head-tiny-float32.json").read_text())["rows"]}
    assert rows["torch_compile_chunker"]["auto_chunkings"] == 1, rows["torch_compile_chunker"]
    assert rows["torch_compile_chunker_default"]["auto_chunkings"] == 0
    for row in rows.values():
        assert row["error"] is None and row["loss_error"] < 1e-5 and row["grad_error"] < 1e-5, row


@pytest.mark.skipif(not hasattr(bench.torch.nn, "LinearCrossEntropyOptions"), reason="torch < 2.13")
@pytest.mark.parametrize("form", list(bench.FORMS))
def test_torch_linear_cross_entropy_peers_match_the_reference(form):
    """Each of F.linear_cross_entropy's chunking options runs the head (ignored targets included)
    within the fp64 reference's reach, in eager, on CPU."""
    case = _tiny_case(form)
    for peer in bench.TORCH_LCE_OPTIONS:
        assert bench.missing_reason(peer, tiny=True, named=False) is None
        row = bench.run_peer(case, peer, None)
        assert row.error is None and row.loss_error < 1e-5 and row.grad_error < 1e-5, row


def test_missing_peers_say_why(monkeypatch):
    monkeypatch.setitem(bench.sys.modules, "cut_cross_entropy", None)  # import fails: not installed
    assert bench.missing_reason("cce", tiny=False, named=False).startswith("not installed")
    assert "interpreter" in bench.missing_reason("cce_exact", tiny=True, named=True)
    assert "soft cap" in bench.missing_reason("torch_lce", tiny=True, named=False, soft_cap=30.0)
    monkeypatch.delattr(bench.torch.nn, "LinearCrossEntropyOptions", raising=False)
    assert "torch >= 2.13" in bench.missing_reason("torch_lce_rows1024", tiny=False, named=False)
    monkeypatch.setattr(bench, "chunker_config_name", lambda: None)
    assert "no auto-chunker" in bench.missing_reason("torch_compile_chunker", tiny=False, named=True)


@pytest.mark.parametrize("form", list(bench.FORMS))
@pytest.mark.parametrize("peer, filter_eps", list(bench.CCE_FILTERS.items()))
def test_cce_gets_the_users_weight_ignore_index_soft_cap_and_filter(form, peer, filter_eps, monkeypatch):
    """Cut Cross-Entropy's kernels need a GPU: a stand-in with its signature checks what the rewrite
    passes (the module's own weight for the module form) and computes the head, so the row matches."""
    calls = []

    def linear_cross_entropy(e, c, targets, ignore_index=-100, softcap=None, reduction="mean", shift=False,
                             filter_eps="high"):
        calls.append((c, ignore_index, softcap, filter_eps))
        logits = e @ c.T
        logits = logits if softcap is None else bench.torch.tanh(logits / softcap) * softcap
        return bench.F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)

    monkeypatch.setitem(bench.sys.modules, "cut_cross_entropy",
                        type(bench.sys)("cut_cross_entropy"))
    monkeypatch.setattr(bench.sys.modules["cut_cross_entropy"], "linear_cross_entropy", linear_cross_entropy,
                        raising=False)
    case = _tiny_case(form, soft_cap=2.0)
    row = bench.run_peer(case, peer, None)
    assert row.error is None and row.loss_error < 1e-5 and row.grad_error < 1e-5, row
    weight, ignore_index, softcap, eps = calls[0]
    assert weight is case.head.leaves[1] and ignore_index == bench.IGNORE_INDEX and softcap == 2.0
    assert eps == filter_eps


def test_liger_peer_matches_the_reference_in_the_interpreter():
    pytest.importorskip("liger_kernel.transformers")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Liger's kernels on CPU need Triton's interpreter")
    for form in bench.FORMS:
        row = bench.run_peer(_tiny_case(form), "liger", None)
        assert row.error is None and row.loss_error < 1e-5 and row.grad_error < 1e-5, row
