"""docs/coverage.md is generated from the lowering tables: regenerate it when they change."""
from pathlib import Path

from memfuse.capture import EXTERN_REASONS, lowering_table
from memfuse.reports.coverage import coverage_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "coverage.md"


def test_coverage_doc_is_current():
    assert DOC.read_text() == coverage_markdown(), \
        "docs/coverage.md is stale: run `python -m memfuse.reports.coverage > docs/coverage.md`"


def test_every_table_entry_is_in_the_doc():
    text = DOC.read_text()
    missing = [str(t) for t in list(lowering_table()) + list(EXTERN_REASONS) if f"`{t}`" not in text]
    assert not missing, f"not in docs/coverage.md: {missing}"
