"""capture's dispatch: one table of rules (memfuse.capture.lower.RULES) that agrees with the coverage
table the docs print, and the stages after capture reading capture's products from the IR only."""
import ast
import operator
from pathlib import Path

import torch

import memfuse
from memfuse.capture import lowering_table
from memfuse.capture.lower import RULES, default_rule
from memfuse.capture.tables import NotFusible

PACKAGE = Path(memfuse.__file__).resolve().parent


def test_every_target_with_a_rule_is_documented_and_every_documented_target_has_one():
    assert set(RULES) - {operator.getitem} == set(lowering_table())


def test_a_target_without_a_rule_becomes_an_extern_with_its_reason():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8)
    flip = graph.call_function(torch.ops.aten.flip.default, (x, [0]))
    try:
        RULES.get(flip.target, default_rule)(None, flip, torch.empty(4, 8))
    except NotFusible as reason:
        assert str(reason) == "flip reverses element order"
    else:
        raise AssertionError("flip has no lowering rule: it must stay an aten call")


def test_the_stages_after_capture_import_no_capture_module():
    """They read what capture produces (Captured, extern targets, access maps) from memfuse.ir."""
    for stage in ("plan.py", "buffers.py", "schedule/padding.py", "driver/fallback.py"):
        tree = ast.parse((PACKAGE / stage).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | \
            {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not {m for m in imported if m.startswith("memfuse.capture")}, stage
