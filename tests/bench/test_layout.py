"""benchmarks/ is commands over a library: each module directly in benchmarks/ is a command
(`python -m benchmarks.<name>`), benchmarks/lib/ what they share. Read from the source with `ast`,
as tests/test_imports.py reads memfuse: imports inside functions count. The imports form no
cycle, the library imports no command, and no command imports another."""
import ast
import re
from pathlib import Path

import networkx as nx

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "benchmarks" / "lib").is_dir())  # tests/ or tests/<stage>/
BENCHMARKS = ROOT / "benchmarks"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict:
    return {module_name(p): p.read_text() for p in BENCHMARKS.rglob("*.py")}


def imported(tree: ast.AST, known: set) -> set:
    """The benchmarks modules `tree` imports, at any depth (benchmarks imports absolutely)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
    return found & known


def import_graph() -> nx.DiGraph:
    texts = sources()
    graph = nx.DiGraph()
    graph.add_nodes_from(texts)
    for name, text in texts.items():
        graph.add_edges_from((name, target) for target in imported(ast.parse(text), set(texts)) if target != name)
    return graph


def is_command(name: str) -> bool:
    """A module directly in benchmarks/ (not the package, not benchmarks.lib)."""
    return name.count(".") == 1 and (BENCHMARKS / f"{name.split('.')[1]}.py").exists()


def runs_as_main(text: str) -> bool:
    return any(isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'"
               for node in ast.parse(text).body)


def test_benchmarks_imports_are_acyclic():
    try:
        cycle = [a for a, _ in nx.find_cycle(import_graph())]
    except nx.NetworkXNoCycle:
        return
    raise AssertionError("import cycle: " + " -> ".join(cycle + cycle[:1]))


def test_the_library_imports_no_command_and_no_command_another():
    edges = [(a, b) for a, b in import_graph().edges if is_command(b)]
    assert edges == [], edges


def test_each_module_in_benchmarks_is_a_command_and_the_library_none():
    texts = sources()
    commands = {name for name, text in texts.items() if runs_as_main(text)}
    assert commands == {name for name in texts if is_command(name)}
    assert "benchmarks.models" in commands and "benchmarks.lib.hf_models" in texts


def test_the_makefile_runs_commands():
    named = set(re.findall(r"-m (benchmarks\.\w+)", (ROOT / "Makefile").read_text()))
    assert named == {"benchmarks.run", "benchmarks.models", "benchmarks.zoo", "benchmarks.budget", "benchmarks.loss_head",
                     "benchmarks.memory", "benchmarks.trainer"}
    assert all(runs_as_main((ROOT / (name.replace(".", "/") + ".py")).read_text()) for name in named)


def test_the_reader_sees_function_level_imports():
    """The tests above can fail: an import inside a function is an edge."""
    text = "import os\n\ndef f():\n    from benchmarks.lib import hf_models\n    from benchmarks.models import main\n"
    known = {"benchmarks.lib", "benchmarks.lib.hf_models", "benchmarks.models"}
    assert imported(ast.parse(text), known) == {"benchmarks.lib.hf_models", "benchmarks.models"}
