"""PipelineTimeline: one measured pipeline step per rank, replayed in event order beside the plan.

Inputs (``kernels.records`` records, or their ``to_dict()`` dicts, checked by ``from_dict``):

- ``events``: ``TraceEvent`` records in seconds on clocks aligned to rank 0, or the rank
  trace records ``{"events": [...], ...}`` that hold them. One step is shown (the
  bubble's, else the last).
- ``bubble``: a ``BubbleReport``, shown unchanged (docs/design.md#bubble-ratio: per-rank idle, mean,
  theory ``(p-1)/(m+p-1)`` and Megatron's ``(p-1)/m``; synthetic or real compute).
- ``planned``: ``{rank: [[stage, "F"|"B"|"I"|"W", microbatch], ...]}`` (``lab.timeline.planned_order``
  for GPipe/1F1B, torch's ``record["planned"]`` otherwise), laid out with the measured
  mean duration per letter, each action once its rank is free and its input exists.

State is columnar (``_columns``): ``{rank: [], stage: [], kind: [], mb: [], start: [], end: [],
peer: [], nbytes: []}`` plus ``step`` and ``t0_ms``; times in ms from the step's first event,
rounded to µs; ``kind`` is the letter F/B/I/W for compute, else the event kind (send, recv,
all_reduce, optimizer, ...).
"""
from __future__ import annotations

import pathlib
from typing import Any

import anywidget
import traitlets

from widgets._esm import view_module
from widgets._timeline import COLORS, KINDS, _timeline_state

_STATIC = pathlib.Path(__file__).parent / "static"


class PipelineTimeline(anywidget.AnyWidget):
    """Lanes of F/B/I/W boxes per rank (``.cl-lane`` / ``.cl-box``), p2p and collectives (``.cl-comm``),
    a play/scrub replay in event order, the bubble beside theory and a planned-order overlay."""

    _esm = view_module("pipeline_timeline.js")
    _css = _STATIC / "pipeline_timeline.css"

    ranks = traitlets.List().tag(sync=True)  # lane order
    events = traitlets.Dict().tag(sync=True)  # _columns(...): one step, columnar
    planned = traitlets.Dict().tag(sync=True)  # _planned_layout(...): {rank, stage, kind, mb, start, end}
    plan_match = traitlets.Dict().tag(sync=True)  # str(rank) -> measured order == planned order
    mean_ms = traitlets.Dict().tag(sync=True)  # letter -> measured mean duration, ms
    span_ms = traitlets.Float(0.0).tag(sync=True)  # the time axis runs 0..span_ms
    bubble = traitlets.Dict().tag(sync=True)  # BubbleReport.to_dict(), unchanged
    cursor_ms = traitlets.Float(-1.0).tag(sync=True)  # replay position; negative: the whole step
    show_planned = traitlets.Bool(False).tag(sync=True)
    play_seconds = traitlets.Float(6.0).tag(sync=True)  # wall time of one replay

    def __init__(self, events: Any = None, bubble: Any = None, planned: dict | None = None, *,
                 step: int | None = None, **kwargs: Any) -> None:
        super().__init__(**_timeline_state(events or [], bubble, planned, step), **kwargs)

    def update(self, events: Any, bubble: Any = None, planned: dict | None = None, *, step: int | None = None) -> None:
        """Show another step or run (one message)."""
        with self.hold_sync():
            for key, value in _timeline_state(events, bubble, planned, step).items():
                setattr(self, key, value)
            self.cursor_ms = -1.0

    def seek(self, ms: float) -> None:
        """Show only what started by ``ms`` (negative: everything)."""
        self.cursor_ms = float(ms)


def _bubble_text(b: dict[str, Any]) -> str:
    """One line: measured mean and per-rank idle beside theory and Megatron's form, and the cost mode."""
    if not b:
        return "no bubble report"
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    ranks = " ".join(f"r{r}={fmt(i)}" for r, i in zip(b.get("ranks", []), b.get("idle", [])))
    return (f"{b.get('schedule', '')} p={b.get('pp')} m={b.get('microbatches')}: measured bubble {fmt(b.get('mean'))}"
            f" ({ranks}) · theory {fmt(b.get('theory'))} · Megatron (p-1)/m {fmt(b.get('theory_megatron'))} · "
            + ("synthetic costs" if b.get("synthetic") else "real compute (per-action overhead included)"))


def plot_timeline(events: Any, bubble: Any = None, *, step: int | None = None):
    """Static fallback: a Gantt chart, one lane per rank; compute boxes (gid ``box:<letter>``), comm strips."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    state = _timeline_state(events, bubble, None, step)
    cols, lanes = state["events"], {r: i for i, r in enumerate(state["ranks"])}
    fig = Figure(figsize=(10, 0.45 * len(lanes) + 1.4))
    ax = fig.add_subplot()
    for rank, kind, mb, start, end in zip(*(cols[k] for k in ("rank", "kind", "mb", "start", "end"))):
        y, compute = lanes[rank], kind in KINDS
        ax.add_patch(Rectangle((start, y - 0.4 if compute else y + 0.28), end - start, 0.68 if compute else 0.12,
                               facecolor=COLORS.get(kind, "#888"), edgecolor="white" if compute else "none",
                               linewidth=0.4, gid=f"box:{kind}" if compute else "comm"))
        if compute and end - start > state["span_ms"] / 90:
            ax.text((start + end) / 2, y - 0.06, str(mb), ha="center", va="center", fontsize=6, color="white")
    idle = dict(zip(state["bubble"].get("ranks", []), state["bubble"].get("idle", [])))
    ax.set_yticks(range(len(lanes)), [f"rank {r}" + (f"\nidle {idle[r]:.2f}" if r in idle else "") for r in lanes],
                  fontsize=7)
    ax.set_xlim(0, state["span_ms"] or 1)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("ms from the step's first event")
    ax.set_title(_bubble_text(state["bubble"]), fontsize=8)
    return fig
