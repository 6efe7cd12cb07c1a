"""memfuse's imports flow one way, down the layers of the tree: the ground floor (base: config, counters
and logging, launching) at the bottom, the IR, the pipeline's stages in order above it, the patterns,
the driver and the fronts above them, the reports (explain, draw) on top. Read from the source with
`ast`: imports inside functions count, `if TYPE_CHECKING:` blocks do not."""
import ast
import textwrap
from pathlib import Path

import networkx as nx

import memfuse

PACKAGE = Path(memfuse.__file__).resolve().parent

# The layers, bottom to top: a module imports its own layer and those below it, never one above.
# memfuse/__init__.py (the public names) sits above them all.
LAYERS = ("base", "ir", "capture", "plan", "schedule", "buffers", "codegen", "runtime", "patterns", "driver",
          "fronts", "reports")

# The imports that go up today, (importer, imported): none since the patterns register what capture,
# reinplace and the runtime need in memfuse.ir.patterns' table. The layer test fails on an upward
# import not listed, and on a listed one that no longer exists, so this set cannot go stale.
KNOWN_VIOLATIONS: set = set()      # none: the patterns register in memfuse.ir.patterns' table instead


def module_name(path: Path) -> str:
    parts = ("memfuse",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, name: str, is_package: bool, known: set) -> set:
    """The memfuse modules `tree` (module `name`) imports, at any depth, outside TYPE_CHECKING."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in _reachable(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                submodule = f"{target}.{alias.name}"
                if submodule in known:
                    found.add(submodule)
                elif target in known:
                    found.add(target)
    return found


def _reachable(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(sources: dict) -> nx.DiGraph:
    """sources: module name -> (source text, is a package)."""
    graph = nx.DiGraph()
    graph.add_nodes_from(sources)
    for name, (text, is_package) in sources.items():
        for target in imported(ast.parse(text), name, is_package, set(sources)):
            if target != name:
                graph.add_edge(name, target)
    return graph


def memfuse_graph() -> nx.DiGraph:
    return import_graph({module_name(p): (p.read_text(), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")})


def cycle_of(graph: nx.DiGraph):
    try:
        return [a for a, _ in nx.find_cycle(graph)]
    except nx.NetworkXNoCycle:
        return None


def layer(module: str) -> int:
    """The layer of a memfuse module (its folder or top-level module, in LAYERS); the package on top."""
    if module == "memfuse":
        return len(LAYERS)
    place = module.split(".")[1]
    assert place in LAYERS, f"{module} is in no layer: place memfuse/{place} in tests/test_imports.py's LAYERS"
    return LAYERS.index(place)


def upward_imports(graph: nx.DiGraph) -> set:
    return {(a, b) for a, b in graph.edges if layer(a) < layer(b)}


def _named(edges) -> str:
    return "; ".join(f"{a} ({LAYERS[layer(a)]}) imports {b} ({LAYERS[layer(b)]})" for a, b in sorted(edges))


def test_a_lower_layer_never_imports_a_higher_one():
    found = upward_imports(memfuse_graph())
    assert not found - KNOWN_VIOLATIONS, "a lower layer imports a higher one: " + _named(found - KNOWN_VIOLATIONS)
    assert not KNOWN_VIOLATIONS - found, "no longer imported, remove from KNOWN_VIOLATIONS: " + \
        _named(KNOWN_VIOLATIONS - found)


def test_every_module_is_in_a_layer():
    assert {layer(module) for module in memfuse_graph()} <= set(range(len(LAYERS) + 1))


def test_the_layer_check_sees_an_upward_import():
    """The test above can fail: an IR module importing a front door is named, the other way is not."""
    graph = import_graph({"memfuse": ("from memfuse.fronts import wrap\n", True),
                          "memfuse.ir.graph": ("def f():\n    from memfuse.fronts.wrap import g\n", False),
                          "memfuse.fronts.wrap": ("from memfuse.ir import graph\n", False)})
    assert upward_imports(graph) == {("memfuse.ir.graph", "memfuse.fronts.wrap")}
    assert _named(upward_imports(graph)) == "memfuse.ir.graph (ir) imports memfuse.fronts.wrap (fronts)"


def test_memfuse_imports_are_acyclic():
    cycle = cycle_of(memfuse_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle + cycle[:1])


def test_counters_and_logging_import_no_memfuse_module():
    assert list(memfuse_graph().successors("memfuse.base.debug")) == []


def test_only_the_package_imports_the_reports():
    graph = memfuse_graph()
    assert nx.ancestors(graph, "memfuse.reports.explain") == {"memfuse"}
    assert nx.ancestors(graph, "memfuse.reports.draw") == {"memfuse", "memfuse.reports.explain"}


def test_the_reader_sees_lazy_imports_and_skips_type_checking():
    """The test above can fail: a function-level import closes a cycle, TYPE_CHECKING does not."""
    a = textwrap.dedent("""
        from typing import TYPE_CHECKING
        from . import b
        if TYPE_CHECKING:
            from .c import Thing
    """)
    b = "def f():\n    from .a import g\n"
    c = "from ..pkg import a\n"
    graph = import_graph({"pkg": ("", True), "pkg.a": (a, False), "pkg.b": (b, False), "pkg.c": (c, False)})
    assert set(graph.edges) == {("pkg.a", "pkg.b"), ("pkg.b", "pkg.a"), ("pkg.c", "pkg.a")}
    assert cycle_of(graph) in (["pkg.a", "pkg.b"], ["pkg.b", "pkg.a"])


def test_imports_resolve_inside_subpackages():
    edges = set(memfuse_graph().edges)
    assert {("memfuse.codegen.row_kernel", "memfuse.ir.graph"), ("memfuse.codegen", "memfuse.codegen.cache"),
            ("memfuse.capture.rules_views", "memfuse.ir.views"), ("memfuse", "memfuse.fronts.backend")} <= edges
