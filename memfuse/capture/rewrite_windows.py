"""Rewrite: a slice of a windowed read (a pad, a cat) is the same reads with their windows moved.

The rule: slicing (step 1) a value that is a windowed read of a source over a fill, or a chain of
such reads (a cat's parts), reads the sources again with the window moved by the slice's start,
instead of writing the padded or concatenated value for the slice to read. (Labels shifted by
one for a causal language model's loss, `pad(labels, (0, 1), -100)[..., 1:]`, and torch.diff's
prepend are such slices.)"""
from __future__ import annotations

from typing import Optional

from memfuse.ir import views
from memfuse.ir.graph import Op, Value


class SlicesOfWindows:
    """A mixin of memfuse.capture.lower.Lowering."""

    def windowed_read(self, name: str) -> Optional[str]:
        """The windowed read `name` is, through register copies of it (a whole slice: `x[:, 1:-1]`
        slices dim 0 whole first), or None."""
        while self.movable_read(name) is None and self.graph[name].op is Op.VIEW \
                and self.graph[self.graph[name].inputs[0]].value.shape == self.graph[name].value.shape:
            name = self.graph[name].inputs[0]
        return name if self.movable_read(name) is not None else None

    def lower_slice_of_windowed(self, node, name: str, value: Value) -> str:
        """A slice (step 1) of a windowed read (a pad, a cat): the same reads of the sources, their
        windows moved by the slice's start, the parts before a cat's part sliced alike. Labels
        shifted for a causal LM's loss, `pad(labels, (0, 1), -100)[..., 1:]`, are one read of the labels, and
        torch.diff's `cat([first, x])[..., 1:] - cat(...)[..., :-1]` two reads of each part, not a
        padded or concatenated copy written and read again."""
        rank = len(value.shape)
        dim = node.args[1] % rank
        start = self.index_expr((list(node.args[2:3]) + [None])[0] or 0, self.graph[name].value.shape[dim])
        return self.sliced_window(name, node.name, dim, start, value)

    def sliced_window(self, name: str, label: str, dim: int, start, value: Value) -> str:
        """`name` sliced from `start` along `dim`, its fallback chain (a cat's earlier parts) first."""
        read = self.movable_read(name)
        access, window, fallback = read.access, read.window, read.fallback
        if self.movable_read(fallback) is not None:
            fallback = self.sliced_window(fallback, f"{label}_{fallback}", dim, start, value)
        step = views.slice_(access.shape, dim, start, 1, value.shape[dim])
        moved = tuple(w if w is None or j != dim else (w[0] - start, w[1] - start) for j, w in enumerate(window))
        return self.strided(label, access.then(*step), value, f"slice(dim={dim}) of {name}", moved, fallback,
                            movable=True)
