"""CollectiveView: the ranks' real collective results, stepped through as a ring animation.

Input: the records ``kernels.engine.collectives.run_collectives()`` returns on every rank:
``kernels.contract.measure_records.CollectiveRecord`` dicts (checked by its ``from_dict``) or records, a
flat list or one list per rank as ``cluster.run`` gives them. ``widgets._ring`` replays
the ring algorithm on the real inputs; a twin whose final values differ from the real
outputs is shown in red (``.cl-mismatch``), never hidden.
"""
from __future__ import annotations

import pathlib
from typing import Any

import anywidget
import traitlets

from widgets._esm import view_module
from widgets._ring import _cells_at, _collective_view, _flat
from widgets.static_figure import StaticFigure

_STATIC = pathlib.Path(__file__).parent / "static"


class CollectiveView(StaticFigure, anywidget.AnyWidget):
    """Play/step through all_reduce, all_gather, reduce_scatter, broadcast and send/recv."""

    _esm = view_module("collective_view.js")
    _css = _STATIC / "collective_view.css"

    records = traitlets.List().tag(sync=True)  # CollectiveRecord dicts, one flat list
    ops = traitlets.List().tag(sync=True)  # derived: _ring._collective_view(records)
    op = traitlets.Unicode("").tag(sync=True)  # the op on screen
    frame = traitlets.Int(0).tag(sync=True)  # the step on screen (0 = inputs)
    interval_ms = traitlets.Int(900).tag(sync=True)  # play speed
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts, colour-blind-safe high-contrast palette

    def __init__(self, records: list[Any] | None = None, **kwargs: Any) -> None:
        records = _flat(records or [])
        super().__init__(records=records, **kwargs)  # the observer derives ops before the comm opens

    @traitlets.observe("records")
    def _records_changed(self, change: dict) -> None:
        with self.hold_sync():
            self.ops = _collective_view(change["new"])
            names = [v["op"] for v in self.ops]
            bad = [v["op"] for v in self.ops if not v["ok"]]
            if bad or self.op not in names:  # open on the first disagreement, never hide it
                self.op = (bad or names or [""])[0]
            self.frame = 0

    def show(self, op: str) -> None:
        """Put ``op`` on screen from its first frame."""
        if op not in [v["op"] for v in self.ops]:
            raise ValueError(f"no records for {op!r}; have {[v['op'] for v in self.ops]}")
        self.op, self.frame = op, 0

    def step(self, n: int = 1) -> int:
        """Move ``n`` frames (negative: back), clamped; returns the new frame."""
        frames = self.current().get("frames", [])
        self.frame = max(0, min(len(frames) - 1, self.frame + n))
        return self.frame

    def current(self) -> dict[str, Any]:
        """The view entry of the op on screen."""
        return next((v for v in self.ops if v["op"] == self.op), {})

    @property
    def ok(self) -> bool:
        """True when every op's ring twin ends with the ranks' real outputs."""
        return all(v["ok"] for v in self.ops)

    def static_figure(self) -> Any:
        """``plot_collective`` of the op on screen, every ring step at once."""
        return plot_collective(self.records, self.op) if self.ops else None

    def static_text(self) -> str:
        """The op on screen, its ranks, and whether the ring twin ends with the real outputs."""
        view = self.current()
        if not view:
            return "no collective records"
        check = "the ring twin ends with the real outputs" if view["ok"] else "MISMATCH: " + view["mismatch"]
        return f"{self.op} on {view['world']} ranks, ring step by step ({check}); ops recorded: " + \
            ", ".join(v["op"] for v in self.ops)


def plot_collective(records: list[Any], op: str = "all_reduce"):
    """Static fallback: one lane per rank, one column per ring step; cells shaded by how many ranks are summed in."""
    from matplotlib.figure import Figure

    view = next(v for v in _collective_view(records) if v["op"] == op)
    frames, n = view["frames"], view["world"]
    chunks = len(frames[0]["cells"][0])
    fig = Figure(figsize=(1.6 * len(frames) + 1, 0.6 * n + 1.2))
    ax = fig.add_subplot()
    for x, f in enumerate(frames):
        for lane, row in enumerate(_cells_at(frames, x)):
            for c, cell in enumerate(row):
                share = len(cell["from"]) / n if cell else 0.0
                ax.add_patch(_rect(x + c / chunks, lane, 0.9 / chunks, 0.8, share, gid="cell"))
                if cell and cell["v"]:
                    ax.text(x + (c + 0.45) / chunks, lane + 0.4, "\n".join(f"{v:g}" for v in cell["v"]),
                            ha="center", va="center", fontsize=6)
    ax.set_xlim(0, len(frames))
    ax.set_ylim(n, -0.2)
    ax.set_yticks([lane + 0.4 for lane in range(n)], [f"rank {r}" for r in view["ranks"]])
    ax.set_xticks([x + 0.45 for x in range(len(frames))],
                  [f"{f['phase']} {f['step']}" if f["phase"] != "input" else "input" for f in frames],
                  rotation=30, fontsize=7)
    status = "twin = real outputs" if view["ok"] else "MISMATCH: " + view["mismatch"]
    ax.set_title(f"{op} on {n} ranks (ring): {status}", color="black" if view["ok"] else "red", fontsize=9)
    return fig


def _rect(x: float, y: float, w: float, h: float, share: float, gid: str):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=(0.2, 0.45, 0.8, 0.15 + 0.85 * share), edgecolor="grey", gid=gid)
