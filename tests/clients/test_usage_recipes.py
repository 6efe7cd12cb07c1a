"""Each recipe in docs/usage.md ("Where you train": a code block whose first line is
`# recipe: NAME`) runs as written, in a scratch directory; a recipe whose client is not installed
is skipped. The list of recipes is read from the doc, so a recipe added there runs here."""
import re
from pathlib import Path

import pytest

import memfuse

USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
RECIPE = re.compile(r"^```python\n# recipe: (?P<name>[^\n]+)\n(?P<code>.*?)^```", re.S | re.M)
CLIENTS = {"HF Trainer": ["transformers"], "accelerate": ["accelerate"], "PEFT": ["peft", "transformers"],
           "Lightning": ["lightning"], "timm": ["timm"], "plain loop": []}


def recipes() -> dict:
    return {m["name"]: m["code"] for m in RECIPE.finditer(USAGE.read_text())}


def test_every_client_has_a_recipe():
    assert set(recipes()) == set(CLIENTS)


@pytest.mark.parametrize("name", list(CLIENTS))
def test_recipe_runs(name, tmp_path, monkeypatch):
    for module in CLIENTS[name]:
        pytest.importorskip(module)
    monkeypatch.chdir(tmp_path)
    before = memfuse.stats()
    exec(compile(recipes()[name], f"docs/usage.md recipe {name!r}", "exec"), {"__name__": "recipe"})
    after = memfuse.stats()
    assert after["compiles"] > before["compiles"]
    assert after["eager_calls"] == before["eager_calls"]
