"""PSTimeline: each rank's pull / compute / push (workers) and apply (servers) spans on one time axis.

Input: ``kernels.contract.ps_records.PSSpan`` records or their dicts (``PSResult.ps_events()``), checked
by ``from_dict``. A sibling of ``PipelineTimeline`` for the parameter server: one lane per rank,
time from the first span. The matplotlib twins draw the same lanes (``plot_ps_timeline``), the
staleness histogram (``plot_staleness``) and loss curves against step or seconds (``plot_losses``).
"""
from __future__ import annotations

import pathlib
from typing import Any

import anywidget
import traitlets

from kernels.contract.ps_records import SPAN_KINDS, PSSpan
from widgets._esm import view_module
from widgets.static_figure import StaticFigure

_STATIC = pathlib.Path(__file__).parent / "static"
COLOURS = {"pull": "#4c78a8", "compute": "#54a24b", "push": "#f58518", "apply": "#b279a2"}


def _lanes(spans: list[Any]) -> list[dict[str, Any]]:
    """One lane per rank: its spans in seconds from the earliest span of all."""
    checked = [PSSpan.coerce(s) for s in spans]
    bad = sorted({s.kind for s in checked} - set(SPAN_KINDS))
    if bad:
        raise ValueError(f"unknown span kinds {bad}; a PSSpan is one of {SPAN_KINDS}")
    t0 = min((s.start for s in checked), default=0.0)
    lanes: dict[int, list[dict[str, Any]]] = {}
    for s in sorted(checked, key=lambda s: (s.rank, s.start)):
        lanes.setdefault(s.rank, []).append({"kind": s.kind, "step": s.step, "start": s.start - t0,
                                             "end": s.end - t0})
    return [{"rank": rank, "spans": spans} for rank, spans in sorted(lanes.items())]


class PSTimeline(StaticFigure, anywidget.AnyWidget):
    """One lane per rank; hover a span for its kind, step and duration."""

    _esm = view_module("ps_timeline.js")
    _css = _STATIC / "ps_timeline.css"

    lanes = traitlets.List().tag(sync=True)  # derived: _lanes(spans)
    colours = traitlets.Dict(COLOURS).tag(sync=True)
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts

    def __init__(self, spans: list[Any] | None = None, **kwargs: Any) -> None:
        self._spans = spans or []  # what plot_ps_timeline draws the static figure from
        super().__init__(lanes=_lanes(self._spans), **kwargs)

    def static_figure(self) -> Any:
        """``plot_ps_timeline`` of the spans."""
        return plot_ps_timeline(self._spans) if self.lanes else None

    def static_text(self) -> str:
        """How many ranks and spans, over how long."""
        end = max((s["end"] for lane in self.lanes for s in lane["spans"]), default=0.0)
        spans = sum(len(lane["spans"]) for lane in self.lanes)
        if not spans:
            return "no parameter-server spans"
        return f"pull / compute / push / apply of {len(self.lanes)} ranks: {spans} spans over {end:.2f} s"


def plot_ps_timeline(spans: list[Any]):
    """Static twin of PSTimeline: one row per rank, a bar per span coloured by kind."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = _lanes(spans)
    fig = Figure(figsize=(9, 0.6 * len(lanes) + 1.2))
    ax = fig.add_subplot()
    for row, lane in enumerate(lanes):
        for s in lane["spans"]:
            ax.barh(row, s["end"] - s["start"], left=s["start"], color=COLOURS[s["kind"]], height=0.7)
    ax.set_yticks(range(len(lanes)), [f"rank {lane['rank']}" for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], ncol=4, loc="upper right", fontsize=8)
    return fig


def plot_staleness(histograms: dict[str, dict[int, int]]):
    """Bars of how many applied gradients had each staleness, one group per run name."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3))
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(histograms))
    for i, (name, hist) in enumerate(histograms.items()):
        ax.bar([int(k) + i * width for k in hist], list(hist.values()), width=width, label=name)
    ax.set_xlabel("staleness (server version - version read)")
    ax.set_ylabel("applied gradients")
    ax.legend()
    return fig


def plot_losses(by_step: dict[str, list[float]], by_time: dict[str, list[tuple[float, float]]]):
    """Loss against step (left) and against seconds (right), one line per run name."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.5))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for name, losses in by_step.items():
        left.plot(range(1, len(losses) + 1), losses, marker=".", label=name)
    for name, points in by_time.items():
        right.plot([t for t, _ in points], [loss for _, loss in points], marker=".", label=name)
    left.set_xlabel("step")
    right.set_xlabel("seconds")
    for ax in (left, right):
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    return fig
