"""PipelineTimeline: one measured pipeline step per rank, replayed in event order beside the plan.

Inputs (``kernels.contract.records`` records, or their ``to_dict()`` dicts, checked by ``from_dict``):

- ``events``: ``TraceEvent`` records in seconds on clocks aligned to rank 0, or the rank
  trace records ``{"events": [...], ...}`` that hold them. One step is shown (the
  bubble's, else the last).
- ``bubble``: a ``BubbleReport``, shown unchanged (docs/design.md#bubble-ratio: per-rank idle, mean,
  theory ``(p-1)/(m+p-1)`` and Megatron's ``(p-1)/m``; synthetic or real compute).
- ``planned``: ``{rank: [[stage, "F"|"B"|"I"|"W", microbatch], ...]}`` (``lab.measure.timeline.planned_order``
  for GPipe/1F1B, torch's ``record["planned"]`` otherwise), laid out with the measured
  mean duration per letter, each action once its rank is free and its input exists.

State is columnar (``_columns``): ``{rank: [], stage: [], kind: [], mb: [], start: [], end: [],
peer: [], nbytes: []}`` plus ``step`` and ``t0_ms``; times in ms from the step's first event,
rounded to µs; ``kind`` is the letter F/B/I/W for compute, else the event kind (send, recv,
all_reduce, optimizer, ...); ``chunk`` says which of its rank's stages an event belongs to and
``ready`` where a communication event stops waiting for its peer and starts moving data
(``widgets._timeline._ready``). ``idle`` holds each rank's gaps between compute actions; ``vguide``
the first micro-batch's forwards in stage order where the stages sit as a V (``widgets._vshape``).
"""
from __future__ import annotations

import pathlib
from typing import Any

import anywidget
import traitlets

from widgets._esm import view_module
from widgets._gallery import parts_words
from widgets.static_figure import StaticFigure
from widgets._timeline import KINDS, LEGEND_ORDER, SHADES, _timeline_state

_STATIC = pathlib.Path(__file__).parent / "static"


class PipelineTimeline(StaticFigure, anywidget.AnyWidget):
    """Lanes of F/B/I/W boxes per rank (``.cl-lane`` / ``.cl-box``, labelled with micro-batch and chunk),
    idle gaps (``.cl-idle``), p2p and collectives cut into waiting (``.cl-wait``) and moving data
    (``.cl-transfer``), a play/scrub replay in event order, the bubble beside theory and a planned overlay."""

    _esm = view_module("vguide.js", "box_label.js", "pipeline_timeline.js")
    _css = _STATIC / "pipeline_timeline.css"

    ranks = traitlets.List().tag(sync=True)  # lane order
    events = traitlets.Dict().tag(sync=True)  # _columns(...): one step, columnar
    idle = traitlets.Dict().tag(sync=True)  # _idle(...): {rank, start, end} gaps between compute actions
    vguide = traitlets.Dict().tag(sync=True)  # _vshape.v_path(...): the V of ZBV/DualPipeV, empty otherwise
    planned = traitlets.Dict().tag(sync=True)  # _planned_layout(...): {rank, stage, kind, mb, start, end}
    plan_match = traitlets.Dict().tag(sync=True)  # str(rank) -> measured order == planned order
    mean_ms = traitlets.Dict().tag(sync=True)  # letter -> measured mean duration, ms
    span_ms = traitlets.Float(0.0).tag(sync=True)  # the time axis runs 0..span_ms
    bubble = traitlets.Dict().tag(sync=True)  # BubbleReport.to_dict(), unchanged
    cursor_ms = traitlets.Float(-1.0).tag(sync=True)  # replay position; negative: the whole step
    show_planned = traitlets.Bool(False).tag(sync=True)
    play_seconds = traitlets.Float(6.0).tag(sync=True)  # wall time of one replay
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts, colour-blind-safe high-contrast palette

    def __init__(self, events: Any = None, bubble: Any = None, planned: dict | None = None, *,
                 step: int | None = None, **kwargs: Any) -> None:
        self._drawn = (events or [], bubble, step)  # what plot_timeline draws the static figure from
        super().__init__(**_timeline_state(events or [], bubble, planned, step), **kwargs)

    def update(self, events: Any, bubble: Any = None, planned: dict | None = None, *, step: int | None = None) -> None:
        """Show another step or run (one message)."""
        self._drawn = (events, bubble, step)
        with self.hold_sync():
            for key, value in _timeline_state(events, bubble, planned, step).items():
                setattr(self, key, value)
            self.cursor_ms = -1.0

    def seek(self, ms: float) -> None:
        """Show only what started by ``ms`` (negative: everything)."""
        self.cursor_ms = float(ms)

    def static_figure(self) -> Any:
        """``plot_timeline`` of the step shown (the whole step, whatever the replay cursor)."""
        events, bubble, step = self._drawn
        return plot_timeline(events, bubble, step=step) if self.events.get("rank") else None

    def static_text(self) -> str:
        """The ranks and the bubble line: measured beside theory."""
        if not self.events.get("rank"):
            return "no trace events"
        return f"{len(self.ranks)} ranks, one traced step: " + _bubble_text(self.bubble, self.span_ms).split("\n")[0]


def _bubble_text(b: dict[str, Any], step_ms: float) -> str:
    """Three lines: measured bubble beside the theory's fraction and Megatron's ratio, each said in words,
    and what the makespan and the whole step are."""
    if not b:
        return "no bubble report"
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    mode = "synthetic costs" if b.get("synthetic") else "real compute (per-action overhead included)"
    return (f"{b.get('schedule', '')} p={b.get('pp')} m={b.get('microbatches')}, {mode}: measured bubble "
            f"(mean idle share of the makespan) {fmt(b.get('mean'))} = {parts_words(b)}\n"
            f"theory: bubble fraction {b.get('theory_form') or '(no closed form)'} = {fmt(b.get('theory'))} · "
            f"bubble time / ideal time = {fmt(b.get('theory_megatron'))} (not a fraction) · "
            f"planned order {fmt(b.get('planned'))}\n"
            f"makespan {b.get('makespan', 0) * 1e3:.1f} ms = first compute start to last compute end · whole step "
            f"{step_ms:.1f} ms = first to last traced event, incl. p2p, all-reduce, optimizer")


_LEGEND_TEXT = {"F": "F forward", "B": "B backward (full)", "I": "I backward, input grad",
                "W": "W backward, weight grad", "wait": "waiting for the peer (hatched)",
                "transfer": "transfer: data moving (solid)", "optimizer": "optimizer step", "idle": "idle (blank)",
                "vguide": "V: first micro-batch's forwards (dashed)"}
_STYLE = {"wait": {"facecolor": "white", "edgecolor": "#c0392b", "hatch": "////", "linewidth": 0.3},
          "transfer": {"facecolor": "#c0392b", "edgecolor": "none"},
          "optimizer": {"facecolor": "#9c755f", "edgecolor": "none"},
          "idle": {"facecolor": "none", "edgecolor": "#bbbbbb", "linestyle": ":", "linewidth": 0.5},
          "vguide": {"facecolor": "none", "edgecolor": "black", "linestyle": "--", "linewidth": 0.8}}


def _box_label(mb: Any, chunk: int | None, chunks: int, width: float = float("inf"), span: float = 1.0) -> str | None:
    """What a compute box says, as in the browser: the micro-batch, and the chunk where a rank holds several;
    shortened to "3·c1", then "c1" (or "3") where the long form would not fit the box's ``width`` (of ``span``),
    None where none fits. At the figure's 5 pt labels one character takes about 1/600 of the 10-inch axes."""
    many = chunks > 1 and chunk is not None
    for text in ([f"mb {mb} · chunk {chunk}", f"{mb}·c{chunk}", f"c{chunk}"] if many else [f"mb {mb}", f"{mb}"]):
        if width > span * len(text) / 600:
            return text
    return None


def plot_timeline(events: Any, bubble: Any = None, *, step: int | None = None):
    """Static fallback: a Gantt chart, one lane per rank; compute boxes (gid ``box:<letter>``) shaded and
    labelled per chunk, idle gaps (gid ``idle``), comm strips cut into ``wait`` (hatched) and ``transfer``
    (solid), the optimizer (``comm``), the V guide of ZBV/DualPipeV (gid ``vguide``), and a legend in the fixed order
    F, B, I, W, wait, transfer, ..."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    state = _timeline_state(events, bubble, None, step)
    cols, lanes = state["events"], {r: i for i, r in enumerate(state["ranks"])}
    chunks = 1 + max((c for c in cols["chunk"] if c is not None), default=0)
    fig = Figure(figsize=(10, 0.45 * len(lanes) + 2.2))
    ax = fig.add_subplot()
    present: set[str] = set()

    def strip(y: float, start: float, end: float, what: str) -> None:
        present.add(what)
        ax.add_patch(Rectangle((start, y + 0.26), end - start, 0.16, gid="comm" if what == "optimizer" else what,
                               **_STYLE[what]))

    for rank, kind, mb, start, end, chunk, ready in zip(
            *(cols[k] for k in ("rank", "kind", "mb", "start", "end", "chunk", "ready"))):
        y = lanes[rank]
        if kind in KINDS:
            present.add(kind)
            ax.add_patch(Rectangle((start, y - 0.4), end - start, 0.62, facecolor=SHADES[kind][(chunk or 0) % 4],
                                   edgecolor="white", linewidth=0.4, gid=f"box:{kind}"))
            label = _box_label(mb, chunk, chunks, end - start, state["span_ms"])
            if label is not None:
                ax.text((start + end) / 2, y - 0.09, label, ha="center", va="center", fontsize=5, color="white",
                        gid="label")
        elif ready is None:
            strip(y, start, end, "optimizer")
        else:
            if ready > start:
                strip(y, start, ready, "wait")
            if end > ready:
                strip(y, ready, end, "transfer")
    for rank, start, end in zip(state["idle"]["rank"], state["idle"]["start"], state["idle"]["end"]):
        present.add("idle")
        ax.add_patch(Rectangle((start, lanes[rank] - 0.4), end - start, 0.62, gid="idle", **_STYLE["idle"]))
    guide = state["vguide"]
    if guide["rank"]:
        present.add("vguide")
        ax.plot(guide["mid"], [lanes[r] - 0.09 for r in guide["rank"]], color="black", linestyle="--", linewidth=0.8,
                gid="vguide")
    handles = [Patch(label=_LEGEND_TEXT[k], **({"facecolor": SHADES[k][0]} if k in KINDS else _STYLE[k]))
               for k in LEGEND_ORDER if k in present]
    handles += [Patch(facecolor=SHADES["F"][c], label=f"chunk {c} (shade)") for c in range(chunks if chunks > 1 else 0)]
    if handles:
        ax.legend(handles=handles, fontsize=6, ncol=min(5, len(handles)), loc="upper center",
                  bbox_to_anchor=(0.5, -0.18), frameon=False)
    idle = dict(zip(state["bubble"].get("ranks", []), state["bubble"].get("idle", [])))
    ax.set_yticks(range(len(lanes)), [f"rank {r}" + (f"\nidle {idle[r]:.2f}" if r in idle else "") for r in lanes],
                  fontsize=7)
    ax.set_xlim(0, state["span_ms"] or 1)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_xlabel("ms from the step's first event", fontsize=7)
    ax.set_title(_bubble_text(state["bubble"], max(cols["end"], default=0.0)), fontsize=7)
    fig.tight_layout()
    return fig
