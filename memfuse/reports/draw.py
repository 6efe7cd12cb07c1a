"""draw: the planner's min-cut, and one training step's memory, as pictures (PNG/SVG/PDF through
matplotlib); the min-cut also as DOT text.

    memfuse.draw_plan(fn, *example_args, path="plan.svg")   # explain.draw_plan; or report.draw("plan.png")
    memfuse.draw_memory(fn, *example_args, path="memory.png")   # explain.draw_memory

Every joint-graph node the forward or backward computes is drawn in one of three bands: the
forward on top (inputs, forward-only values), the values computed in both programs in the
middle (recomputed, regenerated from the seed), the backward below (tangents, gradients).
Saved values have a thick red ring, and the edges that carry them into the backward are red:
those edges are the cut. Columns are topological generations (networkx), so data flows left to
right. The layout is computed here and kept on the returned PlanDrawing, so tests and tools can
read what was drawn without looking at pixels. No graphviz binary or pydot is needed.

The memory picture is a bar per step of the forward program, then of the backward: the bytes the
program holds while the step runs (memfuse.buffers: inputs included, a reused storage once), the
saved tensors as their own band at the bottom, the peak step labelled with the largest buffers
held then. Its data is the returned MemoryDrawing.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import networkx as nx
import sympy

from memfuse.buffers import Origin, held_storages
from memfuse.base.debug import human_bytes
from memfuse.ir.graph import Op
from memfuse.plan import Decision

ROLES = {   # role -> (band, fill colour, legend text)
    "input": ("forward", "#d9d9d9", "input (primal)"),
    "seed": ("forward", "#dadaeb", "random seed (a Python int)"),
    "forward": ("forward", "#9ecae1", "forward only"),
    "recomputed": ("both", "#a1d99b", "recomputed in the backward"),
    "regenerated": ("both", "#bcbddc", "regenerated from the seed"),
    "tangent": ("backward", "#fdd0a2", "tangent (grad of an output)"),
    "backward": ("backward", "#fdae6b", "backward only"),
}
BANDS = ("forward", "both", "backward")
SAVED_RING = "#cb181d"
PLAIN_RING = "#525252"
FORMATS = (".png", ".svg", ".pdf", ".dot")


@dataclass(frozen=True)
class DrawnNode:
    name: str
    op: str
    role: str                      # a key of ROLES
    saved: bool                    # kept alive by the forward for the backward (highlighted)
    x: float
    y: float

    @property
    def fill(self) -> str:
        return ROLES[self.role][1]

    @property
    def ring(self) -> str:
        return SAVED_RING if self.saved else PLAIN_RING


@dataclass
class PlanDrawing:
    title: str
    nodes: dict                    # name -> DrawnNode, in graph order
    edges: list                    # (source, target)
    saved: tuple                   # names of the saved values, highlighted
    saved_bytes: int               # planned bytes beyond the inputs
    cut_edges: list = field(default_factory=list)   # edges from a saved value into the backward
    path: Optional[Path] = None    # where `save` last wrote it

    @property
    def highlighted(self) -> set:
        return {n for n, node in self.nodes.items() if node.saved}

    def save(self, path) -> Path:
        path = Path(path)
        if path.suffix.lower() not in FORMATS:
            raise ValueError(f"memfuse.reports.draw: cannot write {path.name}: use one of {', '.join(FORMATS)}")
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() == ".dot":
            path.write_text(self.to_dot())
        else:
            render(self, path)
        self.path = path
        return path

    def to_dot(self) -> str:
        """DOT text with one cluster per band; render it with `dot -Tsvg` where graphviz exists."""
        lines = ["digraph memfuse_plan {", f"  label={_quote(self.title)};", "  rankdir=LR;",
                 "  node [shape=box, style=filled, fontsize=10];"]
        for band in BANDS:
            members = [n for n in self.nodes.values() if ROLES[n.role][0] == band]
            if not members:
                continue
            lines.append(f"  subgraph cluster_{band} {{")
            lines.append(f"    label={_quote(band)};")
            for n in members:
                attrs = f'label={_quote(n.name + chr(10) + n.op)}, fillcolor="{n.fill}", color="{n.ring}"'
                if n.saved:
                    attrs += ", penwidth=3"
                lines.append(f"    {_quote(n.name)} [{attrs}];")
            lines.append("  }")
        cut = set(self.cut_edges)
        for a, b in self.edges:
            style = f' [color="{SAVED_RING}", penwidth=2]' if (a, b) in cut else ""
            lines.append(f"  {_quote(a)} -> {_quote(b)}{style};")
        lines.append("}")
        return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# -- roles and layout -----------------------------------------------------------------------------
def node_roles(captured, the_plan) -> dict:
    """name -> role for every joint node one of the two programs computes or reads."""
    joint = captured.joint
    tangents = set(joint.inputs[len(joint.inputs) - captured.num_tangents:]) if captured.num_tangents else set()
    backward = the_plan.backward.nodes if the_plan.backward is not None else {}
    roles = {}
    for name, node in joint.nodes.items():
        decision = the_plan.decisions.get(name, (None, ""))[0]
        if node.op in (Op.CONSTANT, Op.SYMBOL):
            continue
        if node.op is Op.SEED:
            roles[name] = "seed"
        elif node.op is Op.INPUT:
            roles[name] = "tangent" if name in tangents else "input"
        elif decision is Decision.RECOMPUTE:
            roles[name] = "recomputed"
        elif decision is Decision.REGENERATE:
            roles[name] = "regenerated"
        elif decision in (Decision.FORWARD, Decision.SAVE):
            roles[name] = "forward"
        elif name in backward:
            roles[name] = "backward"
    return roles


def plan_drawing(captured, the_plan, title: str = "") -> PlanDrawing:
    """The drawing data: roles, saved values, edges and positions (no rendering)."""
    joint = captured.joint
    roles = node_roles(captured, the_plan)
    graph = nx.DiGraph()
    graph.add_nodes_from(roles)
    graph.add_edges_from((i, name) for name in roles for i in joint[name].inputs if i in roles)
    saved = tuple(s.name for s in the_plan.saved if s.name in roles)
    backward = the_plan.backward.nodes if the_plan.backward is not None else {}
    cut = [(a, b) for a, b in graph.edges if a in saved and b in backward and roles[b] != "forward"]
    positions = _layout(graph, roles)
    nodes = {n: DrawnNode(n, joint[n].op.value, roles[n], n in saved, *positions[n]) for n in roles}
    heading = f"memfuse plan{': ' + title if title else ''}: saves {len(saved)} values, " \
              f"{human_bytes(the_plan.saved_bytes)} beyond the inputs"
    return PlanDrawing(heading, nodes, list(graph.edges), saved, the_plan.saved_bytes, cut)


def _layout(graph: nx.DiGraph, roles: dict) -> dict:
    """x: topological generation; y: the node's band, stacked within its column."""
    column = {n: x for x, generation in enumerate(nx.topological_generations(graph)) for n in generation}
    order = {n: i for i, n in enumerate(roles)}
    buckets: dict = {}
    for n in sorted(roles, key=order.__getitem__):
        buckets.setdefault((ROLES[roles[n]][0], column[n]), []).append(n)
    heights = {band: max([len(v) for (b, _), v in buckets.items() if b == band] + [0]) for band in BANDS}
    positions, top = {}, 0.0
    for band in BANDS:
        for (b, x), names in buckets.items():
            if b == band:
                for k, n in enumerate(names):
                    positions[n] = (float(x), -(top + k))
        top += heights[band] + (1.5 if heights[band] else 0)
    return positions


# -- rendering ------------------------------------------------------------------------------------
def render(drawing: PlanDrawing, path: Path) -> None:
    """matplotlib, without pyplot: no display and no global backend switch."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("memfuse.reports.draw: pictures need matplotlib (pip install matplotlib); "
                          "PlanDrawing.to_dot() or a .dot path needs nothing") from e
    nodes = list(drawing.nodes.values())
    columns = max([n.x for n in nodes] + [0]) + 1
    rows = -min([n.y for n in nodes] + [0]) + 1
    fig = Figure(figsize=(min(4 + 1.1 * columns, 120), min(2 + 0.55 * rows, 80)))
    ax = fig.add_subplot(1, 1, 1)
    graph = nx.DiGraph()
    graph.add_nodes_from(drawing.nodes)
    graph.add_edges_from(drawing.edges)
    pos = {n.name: (n.x, n.y) for n in nodes}
    cut = set(drawing.cut_edges)
    plain = [e for e in drawing.edges if e not in cut]
    nx.draw_networkx_edges(graph, pos, edgelist=plain, ax=ax, edge_color="#969696", width=0.6,
                           arrowsize=6, node_size=500)
    nx.draw_networkx_edges(graph, pos, edgelist=list(cut), ax=ax, edge_color=SAVED_RING, width=1.8,
                           arrowsize=9, node_size=500)
    for saved in (False, True):   # saved nodes in their own SVG group: <g id="memfuse_saved">
        chosen = [n for n in nodes if n.saved is saved]
        if chosen:
            drawn = nx.draw_networkx_nodes(graph, pos, nodelist=[n.name for n in chosen], ax=ax, node_size=500,
                                           node_color=[n.fill for n in chosen], edgecolors=[n.ring for n in chosen],
                                           linewidths=3.0 if saved else 0.8)
            drawn.set_gid("memfuse_saved" if saved else "memfuse_nodes")
    nx.draw_networkx_labels(graph, pos, labels={n.name: f"{n.name}\n{n.op}" for n in nodes}, ax=ax, font_size=5)
    _bands(ax, nodes)
    used = {n.role for n in nodes}
    handles = [Patch(facecolor=fill, edgecolor=PLAIN_RING, label=text)
               for role, (_, fill, text) in ROLES.items() if role in used]
    handles.append(Line2D([], [], marker="o", color="w", markeredgecolor=SAVED_RING, markeredgewidth=3,
                          markersize=10, label="saved for backward (the cut)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(drawing.title, fontsize=9)
    ax.set_axis_off()
    fig.tight_layout()
    fig.savefig(path, format=path.suffix.lower().lstrip("."))


BAND_TITLES = {"forward": "forward", "both": "both programs\n(recomputed)", "backward": "backward"}


def _bands(ax, nodes: list) -> None:
    """Band titles on the left, and a dashed line between bands: above the first line the
    forward, below it what the backward computes."""
    spans: dict = {}
    for n in nodes:
        low, high = spans.get(ROLES[n.role][0], (n.y, n.y))
        spans[ROLES[n.role][0]] = (min(low, n.y), max(high, n.y))
    present = [b for b in BANDS if b in spans]
    for band in present:
        ax.text(-0.9, (spans[band][0] + spans[band][1]) / 2, BAND_TITLES[band], ha="right", va="center",
                fontsize=8, color="#525252")
    for upper, lower in zip(present, present[1:]):
        ax.axhline((spans[upper][0] + spans[lower][1]) / 2, color="#bdbdbd", linestyle="--", linewidth=0.8)


# -- one training step's memory -------------------------------------------------------------------
BAND_FILLS = {"saved": "#fb6a4a", "inputs": "#bdbdbd", "other": "#6baed6"}
BAND_LEGEND = {"saved": "saved for backward (activations)", "inputs": "inputs (parameters, batch, tangents)",
               "other": "made by the step's program"}
PEAK_BUFFERS = 6         # buffers named at the peak, largest first


@dataclass(frozen=True)
class ProgramMemory:
    """One program of a step, as drawn: its buffer plan, the activations it keeps for (or receives
    from) the other program, and the sizes to evaluate its byte counts at."""
    label: str                     # "forward", "backward", or a graph's name and program
    plan: object                   # buffers.BufferPlan
    saved: frozenset               # names of the saved activations (saved values that are not inputs)
    sizes: dict                    # size symbol -> int
    saved_elsewhere: int = 0       # bytes other programs' saved activations hold meanwhile (other graphs)


@dataclass(frozen=True)
class MemoryStep:
    program: str                   # ProgramMemory.label
    name: str                      # buffers.ENTRY, a kernel's or an extern call's name
    saved: int                     # bytes of saved activations held while the step runs
    inputs: int                    # bytes of the program's other inputs held then
    other: int                     # bytes of everything else held then
    held: tuple                    # (buffer, bytes) held while it runs, largest first

    @property
    def total(self) -> int:
        return self.saved + self.inputs + self.other


@dataclass
class MemoryDrawing:
    title: str
    steps: list                    # MemoryStep: the forward program's steps, then the backward's
    path: Optional[Path] = None    # where `save` last wrote it

    @property
    def peak(self) -> MemoryStep:
        return max(self.steps, key=lambda s: s.total)

    def save(self, path) -> Path:
        path = Path(path)
        formats = [f for f in FORMATS if f != ".dot"]
        if path.suffix.lower() not in formats:
            raise ValueError(f"memfuse.draw_memory: cannot write {path.name}: use one of {', '.join(formats)}")
        path.parent.mkdir(parents=True, exist_ok=True)
        render_memory(self, path)
        self.path = path
        return path


def memory_drawing(programs: list, title: str = "") -> MemoryDrawing:
    """The bytes each ProgramMemory holds while each of its steps runs (memfuse.buffers), in three
    bands: saved activations, the other inputs, the rest. The drawing data, no rendering."""
    steps = [step for program in programs for step in _program_steps(program)]
    if not steps:
        raise ValueError(f"memfuse.draw_memory: {title or 'the call'} has no program steps to draw")
    peak = max(steps, key=lambda s: s.total)
    heading = f"memfuse memory{': ' + title if title else ''}: peak {human_bytes(peak.total)} " \
              f"while {peak.program} {peak.name} runs"
    return MemoryDrawing(heading, steps)


def _program_steps(program: ProgramMemory) -> list:
    buffers = program.plan.buffers
    saved = set().union(*(buffers[n].storage for n in program.saved if n in buffers))
    inputs = {n for n, b in buffers.items() if b.origin is Origin.INPUT} - saved
    steps = []
    for step, (during, _) in zip(program.plan.steps, held_storages(program.plan)):
        held = {n: int(sympy.sympify(buffers[n].nbytes).subs(program.sizes)) for n in during}
        band = {"saved": program.saved_elsewhere, "inputs": 0, "other": 0}
        for n, b in held.items():
            band["saved" if n in saved else "inputs" if n in inputs else "other"] += b
        steps.append(MemoryStep(program.label, step.name, band["saved"], band["inputs"], band["other"],
                                tuple(sorted(held.items(), key=lambda kv: -kv[1]))))
    return steps


def render_memory(drawing: MemoryDrawing, path: Path) -> None:
    """Stacked bars, one per step (saved activations at the bottom, then the inputs, then the rest);
    a dashed line where a program starts; the peak step labelled with the largest buffers held."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("memfuse.draw_memory: pictures need matplotlib (pip install matplotlib)") from e
    steps, peak = drawing.steps, drawing.peak
    unit, unit_name = _unit(peak.total)
    fig = Figure(figsize=(min(7 + 0.06 * len(steps), 40), 5))
    ax = fig.add_subplot(1, 1, 1)
    bottom = [0.0] * len(steps)
    for band in BAND_FILLS:
        heights = [getattr(s, band) / unit for s in steps]
        ax.bar(range(len(steps)), heights, width=1.0, bottom=bottom, color=BAND_FILLS[band], linewidth=0)
        bottom = [b + h for b, h in zip(bottom, heights)]
    top = peak.total / unit
    ax.set_ylim(0, top * 1.6)
    for x, step in enumerate(steps):
        if x == 0 or steps[x - 1].program != step.program:
            ax.axvline(x - 0.5, color="#525252", linestyle="--", linewidth=0.8)
            ax.text(x, top * 1.55, f" {step.program}", va="top", rotation=90, fontsize=7, color="#525252")
    at = steps.index(peak)
    held = "\n".join(f"{name}: {human_bytes(b)}" for name, b in peak.held[:PEAK_BUFFERS])
    ax.annotate(f"peak {human_bytes(peak.total)} while {peak.name} runs\n{held}", xy=(at, top),
                xytext=(at, top * 1.05), ha="left" if at < len(steps) / 2 else "right", fontsize=7,
                arrowprops={"arrowstyle": "->", "color": "#525252"})
    ax.legend(handles=[Patch(color=BAND_FILLS[b], label=BAND_LEGEND[b]) for b in BAND_FILLS],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_xlim(-0.5, len(steps) - 0.5)
    ax.set_xlabel("step of the program (kernel launches and aten calls)")
    ax.set_ylabel(f"held while the step runs ({unit_name})")
    ax.set_title(drawing.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format=path.suffix.lower().lstrip("."))


def _unit(largest: int) -> tuple:
    for unit, name in ((2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if largest >= unit:
            return unit, name
    return 1, "B"
