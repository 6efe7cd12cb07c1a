"""Every relative link in the user docs resolves: the file exists and an #anchor names one of its
headings (GitHub's slugs). Until docs/results.md exists, links to it may use only its agreed anchors."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/usage.md", "docs/debugging.md", "docs/distributed.md", "docs/architecture.md"]
RESULTS = ROOT / "docs" / "results.md"
RESULTS_ANCHORS = {"blocks-make-bench", "models-make-bench-models", "memory-budgets-make-bench-budget",
                   "loss-head-make-bench-loss-head", "distributed-ddp-and-fsdp2", "first-call"}
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set:
    text = FENCE.sub("", path.read_text())
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def links(path: Path) -> list:
    return [t for t in LINK.findall(FENCE.sub("", path.read_text())) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_resolve(doc):
    source = ROOT / doc
    broken = []
    for target in links(source):
        file, _, anchor = target.partition("#")
        dest = (source.parent / file).resolve() if file else source
        if dest == RESULTS and not dest.exists():
            known = RESULTS_ANCHORS
        elif not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        else:
            known = anchors(dest)
        if anchor and anchor not in known:
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, f"{doc}: " + "; ".join(broken)


def test_slugs_follow_github():
    assert slug(" Models (make bench-models)") == "models-make-bench-models"
    assert slug(" Distributed (DDP and FSDP2)") == "distributed-ddp-and-fsdp2"
    assert slug(" The IR (`ir/`)") == "the-ir-ir"
