"""ShardingView: which slice of every parameter each rank really holds, as built by the ranks.

Input: the per-rank layout records ``kernels.train.entry.train_rank`` returns (``RunResult.layout``,
or the whole ``RunResult`` dict, or ``{"ranks": [...]}``); the schema is in
``widgets._layout``. One ``.cl-shard-row`` per rank, with three layers: parameters,
gradients (laid out as the parameters at rest) and optimizer state (ZeRO-1: only
the parameters this rank's optimizer owns). Each tensor is a box; the held slice is a
``.cl-shard`` inside it (dim 0 across, dim 1 down). ``set_layout`` moves the slices
with CSS transitions. For FSDP, ``phase`` steps through all-gather -> free ->
reduce-scatter per unit (``-1``: the layout at rest).
"""
from __future__ import annotations

import pathlib
from typing import Any

import anywidget
import traitlets

from widgets._esm import view_module
from widgets._layout import _sharding_view
from widgets.static_figure import StaticFigure

_STATIC = pathlib.Path(__file__).parent / "static"
LAYERS = ("params", "grads", "optim")


class ShardingView(StaticFigure, anywidget.AnyWidget):
    """Per-rank rows of tensor slices for one built layout; set a new layout to animate the change."""

    _esm = view_module("sharding_view.js")
    _css = _STATIC / "sharding_view.css"

    strategy = traitlets.Unicode("").tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)  # strategy, mesh sizes, dp split and placements (_layout._title)
    zero = traitlets.Int(0).tag(sync=True)
    sizes = traitlets.Dict().tag(sync=True)  # mesh axis -> size
    tensors = traitlets.List().tag(sync=True)  # [{name, shape, unit, placements, mesh_axes, dtype}]
    rows = traitlets.List().tag(sync=True)  # per rank, extents per tensor: widgets._layout._sharding_view
    phases = traitlets.List().tag(sync=True)  # FSDP step-through (empty otherwise)
    phase = traitlets.Int(-1).tag(sync=True)  # -1: at rest; else an index into phases
    interval_ms = traitlets.Int(700).tag(sync=True)
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts, colour-blind-safe high-contrast palette

    def __init__(self, layout: Any = None, **kwargs: Any) -> None:
        self._layout = layout if layout is not None else []  # kept for the static figure (plot_sharding)
        view = _sharding_view(self._layout)
        super().__init__(strategy=view["strategy"], title=view["title"], zero=view["zero"], sizes=view["sizes"],
                         tensors=view["tensors"],
                         rows=view["rows"], phases=view["phases"], **kwargs)  # the comm opens with the full state

    def set_layout(self, layout: Any) -> None:
        """Show another built layout (one message; the browser animates the slices to their new places)."""
        view = _sharding_view(layout)
        self._layout = layout
        with self.hold_sync():
            self.phase = -1
            self.strategy, self.title, self.zero, self.sizes = view["strategy"], view["title"], view["zero"], view["sizes"]
            self.tensors, self.rows, self.phases = view["tensors"], view["rows"], view["phases"]

    def step(self, n: int = 1) -> int:
        """Move ``n`` FSDP phases (from -1, at rest), clamped; returns the new phase."""
        self.phase = max(-1, min(len(self.phases) - 1, self.phase + n))
        return self.phase

    def held(self, rank: int, layer: str = "params", phase: int | None = None) -> list[list[int] | None]:
        """The extents ``rank`` holds in ``layer`` (per tensor, None = not held), as the view draws them."""
        return _layer_extents(self.rows[[r["rank"] for r in self.rows].index(rank)], layer,
                              self.phases[phase] if phase is not None and phase >= 0 else None)

    def static_figure(self) -> Any:
        """``plot_sharding`` of the parameters at rest."""
        return plot_sharding(self._layout) if self.rows else None

    def static_text(self) -> str:
        """The layout's title and what each rank holds, in words."""
        return (f"{self.title}: the slice of each of {len(self.tensors)} parameters that each of {len(self.rows)} "
                "ranks holds at rest") if self.rows else "no layout"


def _layer_extents(row: dict[str, Any], layer: str, phase: dict[str, Any] | None) -> list[list[int] | None]:
    """One layer of one row, at rest (phase None) or inside an FSDP phase; mirrors sharding_view.js."""
    if layer not in LAYERS:
        raise ValueError(f"layer must be one of {LAYERS}, got {layer!r}")
    if layer == "optim":
        return row["optim"]
    if phase is None:
        return row["params"]
    if layer == "params":
        whole = set(phase["whole"])
        return [row["gathered"][i] if i in whole and e else e for i, e in enumerate(row["params"])]
    g_whole, g_shard = set(phase["grads_whole"]), set(phase["grads_shard"])
    return [row["gathered"][i] if i in g_whole and e else (e if i in g_shard else None)
            for i, e in enumerate(row["params"])]


def plot_sharding(layout: Any, layer: str = "params"):
    """Static fallback: one lane per rank; each tensor a grey box of equal width, the held dim-0 slice in colour."""
    from matplotlib.figure import Figure

    view = _sharding_view(layout)
    tensors, rows = view["tensors"], view["rows"]
    fig = Figure(figsize=(min(16, max(7, 2 + 0.3 * len(tensors))), 0.5 * len(rows) + 1.4))  # 7: the title fits
    ax = fig.add_subplot()
    for lane, row in enumerate(rows):
        for i, (t, ext) in enumerate(zip(tensors, _layer_extents(row, layer, None))):
            ax.barh(lane, 0.9, left=i, height=0.7, color="#eeeeee", edgecolor="#999999", gid="tensor")
            if ext:
                n = t["shape"][0] if t["shape"] else 1
                ax.barh(lane, 0.9 * (ext[1] - ext[0]) / n, left=i + 0.9 * ext[0] / n, height=0.7,
                        color="#2f6fd0", gid="held")
    ax.set_yticks(range(len(rows)), [f"rank {r['rank']} " + " ".join(f"{k}{v}" for k, v in r["coords"].items())
                                      for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xticks([i + 0.45 for i in range(len(tensors))], [t["name"] for t in tensors], rotation=90, fontsize=5)
    ax.set_title(f"{view['title']}\n{layer}: one box = one whole tensor (same width whatever its size), "
                 "blue = the dim-0 slice this rank holds", fontsize=7)
    fig.tight_layout()
    return fig
