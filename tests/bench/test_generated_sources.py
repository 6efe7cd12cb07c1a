"""benchmarks/generated_sources.py, the before/after kernel identity check: its record of one tiny
family in both styles is the same in this process and in a fresh one (a hash that changed from
run to run would make the check useless), holds every kind of source it promises, and --compare
says when two records differ. The normalization itself runs without compiling."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks import generated_sources as sources  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAMILY = "gpt2"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the tiny step needs Triton's interpreter")
def test_record_is_the_same_in_a_fresh_process(tmp_path, capsys):
    fresh = tmp_path / "fresh.json"
    subprocess.run([sys.executable, "-m", "benchmarks.generated_sources", "--families", FAMILY,
                    "--sizes", "tiny", "--out", str(fresh)], cwd=ROOT, check=True, capture_output=True)
    here = sources.record([FAMILY], list(sources.STYLES), ["tiny"])
    there = json.loads(fresh.read_text())
    assert there["_tree"]["memfuse"] == here["_tree"]["memfuse"]       # the same tree's memfuse
    assert sources.compare(here, there) == [] and sources.compare(here, there, code_only=True) == []
    for style in sources.STYLES:
        files = here[f"{FAMILY}/{style}"]
        for kind in ("cache/kernels/", "/kernels/", "/forward.program.py", "/backward.program.py"):
            assert any(kind in f for f in files), (style, kind)
        assert len(here["_code"][f"{FAMILY}/{style}"]) == len(files)

    (tmp_path / "here.json").write_text(json.dumps(here))
    assert sources.main(["--compare", str(tmp_path / "here.json"), str(fresh)]) == 0
    file = next(f for f in here[f"{FAMILY}/whole"] if "/kernels/" in f and f.startswith("dump/"))
    there[f"{FAMILY}/whole"][file] = "0" * 64
    fresh.write_text(json.dumps(there))
    capsys.readouterr()
    assert sources.main(["--compare", str(tmp_path / "here.json"), str(fresh)]) == 1
    assert f"{FAMILY}/whole: {file}: differs in comments only" in capsys.readouterr().out


def test_sources_renumber_dump_folders_and_hide_the_run_folder(tmp_path):
    for folder, text in (("Model.3", "# a\n"), ("Model.7", f"x = '{tmp_path}/cache'\n"), ("dynamo_0_0.5", "y = 1\n")):
        (tmp_path / "dump" / folder / "kernels").mkdir(parents=True)
        (tmp_path / "dump" / folder / "kernels" / "k.py").write_text(text)
        (tmp_path / "dump" / folder / "forward.ir.txt").write_text("not a generated source")
    (tmp_path / "cache" / "kernels").mkdir(parents=True)
    (tmp_path / "cache" / "kernels" / "k_0123.py").write_text("z = 2\n")
    assert sources.sources(tmp_path) == {
        "dump/Model.0/kernels/k.py": "# a\n", "dump/Model.1/kernels/k.py": "x = '<run>/cache'\n",
        "dump/dynamo_0_0.0/kernels/k.py": "y = 1\n", "cache/kernels/k_0123.py": "z = 2\n"}
    assert sources.code("# a comment\nx  =  1  # another\n") == sources.code("x = 1\n")
    assert sources.code_name("cache/kernels/memfuse_forward_0_0123.py", "abcd" * 16) == \
        "cache/kernels/memfuse_forward_0_abcdabcdabcdabcd.py"
    assert sources.code_name("dump/Model.0/kernels/k.py", "abcd" * 16) == "dump/Model.0/kernels/k.py"
