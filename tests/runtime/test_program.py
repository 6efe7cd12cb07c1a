"""A compiled program (memfuse.runtime.program): the Python function written for each direction, read
from its MEMFUSE_DUMP_DIR dump, and the launches it makes, read from launch_log. Each program takes
over its inputs, launches explain's kernels by name, drops what it read last and returns the
forward's output with what the backward needs (one gradient per input from the backward); the
launches carry their sizes and the content-addressed kernel source, and one program serves every
leading size."""
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import memfuse
from memfuse.runtime.launchers import launch_log

D = 40


def norm_block(x, residual, weight, bias):
    return F.layer_norm(x + residual, (D,), weight, bias)


def block_args(batch=3, time=5):
    torch.manual_seed(0)
    return [torch.randn(batch, time, D, requires_grad=True), torch.randn(batch, time, D, requires_grad=True),
            torch.randn(D, requires_grad=True), torch.randn(D, requires_grad=True)]


@pytest.fixture
def dumped(tmp_path, monkeypatch, capsys):
    """(FusedFunction, explain's Report, dump folder) of norm_block compiled once with MEMFUSE_DUMP_DIR on.
    Its own kernel cache: a kernel of the same structure compiled earlier in this process (by another
    test) would otherwise be launched as its twin, under that kernel's file."""
    monkeypatch.setenv("MEMFUSE_DUMP_DIR", str(tmp_path / "dump"))
    fused = memfuse.memory_efficient_fusion(norm_block, config=memfuse.Config(cache_dir=tmp_path / "cache"))
    report = memfuse.explain(fused, *block_args())
    capsys.readouterr()
    folder, = (tmp_path / "dump").iterdir()
    return fused, report, folder


def unpacked(source: str) -> list:
    """The names the program's first line binds from mf_inputs."""
    line = re.search(r"^    (.*), = mf_inputs$", source, re.M).group(1)
    return [name.strip() for name in line.split(",")]


def dropped(source: str) -> set:
    return {name.strip() for line in re.findall(r"^    del (.*)$", source, re.M) for name in line.split(",")}


def returned(source: str) -> list:
    return [name.strip() for name in re.search(r"^    return \[(.*)\]$", source, re.M).group(1).split(",")]


def launched(source: str) -> list:
    return re.findall(r"^    (memfuse_\w+)\(device,", source, re.M)


def test_a_program_takes_over_its_inputs_and_launches_explains_kernels_by_name(dumped):
    _, report, folder = dumped
    for program in ("forward", "backward"):
        source = (folder / f"{program}.program.py").read_text()
        assert source.startswith("def run(mf_inputs, mf_sizes, device):\n"), source
        assert "    mf_inputs.clear()\n" in source, "it holds its inputs alone, to free each after its last reader"
        assert re.search(r"^    mf_s0, mf_s1, = mf_sizes$", source, re.M), "two leading sizes, read per call"
        assert launched(source) == [k.name for k in report.kernels_of(program)], source


def test_the_forward_returns_its_output_and_what_it_saved_and_drops_the_rest(dumped):
    _, report, folder = dumped
    source = (folder / "forward.program.py").read_text()
    inputs, saved = unpacked(source), [s.name for s in report.saved]
    assert len(inputs) == 4 and set(saved) <= set(inputs), "a layer norm block saves inputs only"
    output, *kept = returned(source)
    assert kept == saved, "after the output, what the backward reads, in explain's order"
    assert dropped(source) == set(inputs) - set(saved), "an input the backward does not read is dropped"


def test_the_backward_returns_a_gradient_per_input_and_drops_all_it_read(dumped):
    _, report, folder = dumped
    source = (folder / "backward.program.py").read_text()
    assert len(returned(source)) == 4, source
    assert set(unpacked(source)) <= dropped(source), "saved values and tangents are freed before the return"


def test_the_launch_log_records_each_launch_with_its_sizes_and_source(dumped):
    fused, report, folder = dumped
    args = block_args()
    with launch_log() as records:
        fused(*args).backward(torch.ones(3, 5, D))
    kernels = report.kernels_of("forward") + report.kernels_of("backward")
    assert [r.kernel for r in records] == [k.name for k in kernels]
    for record, kernel in zip(records, kernels):
        assert (record.rows, record.d) == (15, D)
        assert Path(record.path).read_text() == (folder / "kernels" / f"{kernel.name}.py").read_text()
    forward, backward = records
    assert forward.partials == 0, "the forward sums along rows only"
    assert backward.partials > 0, "the weight and bias gradients are sums over M: fp32 partials per program"


def test_one_program_serves_other_leading_sizes(dumped):
    fused, _, folder = dumped
    with launch_log() as first:
        fused(*block_args(3, 5)).sum().backward()
    compiles = memfuse.stats()["compiles"]
    with launch_log() as other:
        fused(*block_args(2, 7)).sum().backward()
    assert memfuse.stats()["compiles"] == compiles and len(list(folder.parent.iterdir())) == 1, "no recompile"
    assert [r.rows for r in other] == [14, 14]
    assert [r.path for r in other] == [r.path for r in first], "the same kernels"


def test_the_program_text_is_deterministic(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMFUSE_DUMP_DIR", str(tmp_path))
    for _ in range(2):
        memfuse.explain(memfuse.memory_efficient_fusion(norm_block), *block_args())
    first, second = sorted(tmp_path.iterdir())
    for name in ("forward.program.py", "backward.program.py"):
        assert (first / name).read_text() == (second / name).read_text(), name
