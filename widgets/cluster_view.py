"""ClusterView: the ranks as a live grid, one card per rank, grouped by host.

Input: ``kernels.contract.pool_records.RankStatus`` records or their ``to_dict()`` dicts (checked by
``RankStatus.from_dict``), with state one of idle | busy | failed | dead (failed and dead
are drawn red). ``update(ranks)`` replaces the trait, so the view redraws live.
"""
from __future__ import annotations

import pathlib
from typing import Any

import anywidget
import traitlets

from kernels.contract.pool_records import RankStatus
from widgets._esm import view_module
from widgets.static_figure import StaticFigure

_STATIC = pathlib.Path(__file__).parent / "static"
STATES = ("idle", "busy", "failed", "dead")
_COLORS = {"idle": "#9e9e9e", "busy": "#2f6fd0", "failed": "#c62828", "dead": "#7f0000"}


def _cluster_state(ranks: list[Any]) -> list[dict[str, Any]]:
    """RankStatus records (or their dicts) -> plain dicts with every field, in rank order."""
    out = []
    for r in ranks:
        row = RankStatus.coerce(r).to_dict()
        if row["state"] not in STATES:
            raise ValueError(f"rank {row['rank']}: state {row['state']!r} is not one of {STATES}")
        out.append(row)
    return sorted(out, key=lambda row: row["rank"])


def _summary(ranks: list[dict[str, Any]]) -> str:
    """e.g. "4 ranks on 1 host: 3 idle, 1 busy"."""
    hosts = {r["host"] for r in ranks}
    counts = [f"{sum(r['state'] == s for r in ranks)} {s}" for s in STATES if any(r["state"] == s for r in ranks)]
    return f"{len(ranks)} ranks on {len(hosts)} host{'s' if len(hosts) != 1 else ''}: " + ", ".join(counts)


class ClusterView(StaticFigure, anywidget.AnyWidget):
    """A grid of rank cards: ``.cl-rank`` per rank with ``data-state``; red when failed or dead."""

    _esm = view_module("cluster_view.js")
    _css = _STATIC / "cluster_view.css"

    ranks = traitlets.List().tag(sync=True)  # _cluster_state(...) rows
    summary = traitlets.Unicode("").tag(sync=True)
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts, colour-blind-safe high-contrast palette

    def __init__(self, ranks: list[Any] | None = None, **kwargs: Any) -> None:
        rows = _cluster_state(ranks or [])
        super().__init__(ranks=rows, summary=_summary(rows), **kwargs)  # the comm opens with the full state

    def update(self, ranks: list[Any]) -> None:
        """Show a new snapshot of the ranks (e.g. after a call failed)."""
        rows = _cluster_state(ranks)
        with self.hold_sync():  # one update message
            self.summary = _summary(rows)
            self.ranks = rows

    def static_figure(self) -> Any:
        """``plot_cluster`` of the ranks shown."""
        return plot_cluster(self.ranks) if self.ranks else None

    def static_text(self) -> str:
        """e.g. "4 ranks on 1 host: 3 idle, 1 busy"."""
        return self.summary if self.ranks else "no ranks"


def plot_cluster(ranks: list[Any]):
    """Static fallback: one bar per rank, coloured by state, grouped by host along x."""
    from matplotlib.figure import Figure

    rows = _cluster_state(ranks)
    fig = Figure(figsize=(max(3.0, 0.9 * len(rows) + 1), 1.8))
    ax = fig.add_subplot()
    for i, r in enumerate(rows):
        ax.bar(i, 1, color=_COLORS[r["state"]], edgecolor="black", gid=f"rank{r['rank']}")
        ax.text(i, 0.5, f"{r['rank']}\n{r['state']}\n{r['device']}", ha="center", va="center", fontsize=7,
                color="white")
    ax.set_xticks(range(len(rows)), [r["host"] for r in rows], fontsize=7, rotation=20)
    ax.set_yticks([])
    ax.set_title(_summary(rows) if rows else "no ranks", fontsize=9)
    return fig
