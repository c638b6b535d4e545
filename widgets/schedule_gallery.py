"""ScheduleGallery: several pipeline schedules side by side on one time axis, replayed in lock-step.

Input: ``{name: run}`` in display order, each run's ``TraceEvent`` records and its
``BubbleReport`` (``{"events": ..., "bubble": ...}``, ``(events, bubble)`` or events alone);
``lab.compare_schedules`` builds it from ``RunResult``\\ s. Every panel shows one traced step's
compute boxes (``.cl-box``, shaded and labelled per chunk as in PipelineTimeline), timed from
its own first compute start, under one shared ``.cl-gallery-axis``; its header gives the
measured bubble beside the theory. ZBV and DualPipeV panels get the V guide (``.cl-vguide``,
``widgets._vshape``). One play button and scrub move a single cursor over every panel.

State (``widgets._gallery._gallery_state``): ``panels``: [{name, ranks, boxes: {rank, stage,
kind, mb, chunk, start, end}, chunks, span_ms, vguide: {rank, stage, mid}, bubble}], ``span_ms``.
"""
from __future__ import annotations

from typing import Any

import anywidget
import traitlets

from widgets._esm import STATIC, view_module
from widgets._gallery import _gallery_state, bubble_words
from widgets.static_figure import StaticFigure
from widgets._timeline import KINDS, LEGEND_ORDER, SHADES
from widgets.pipeline_timeline import _LEGEND_TEXT


class ScheduleGallery(StaticFigure, anywidget.AnyWidget):
    """One panel per schedule (``.cl-gallery-panel[data-name]``), one shared axis, one lock-step replay."""

    _esm = view_module("vguide.js", "box_label.js", "schedule_gallery.js")
    # the boxes, lanes and chunk shades are PipelineTimeline's, so both views read the same
    _css = (STATIC / "pipeline_timeline.css").read_text() + (STATIC / "schedule_gallery.css").read_text()

    panels = traitlets.List().tag(sync=True)
    span_ms = traitlets.Float(0.0).tag(sync=True)  # the shared axis runs 0..span_ms
    cursor_ms = traitlets.Float(-1.0).tag(sync=True)  # replay position on every panel; negative: everything
    play_seconds = traitlets.Float(8.0).tag(sync=True)  # wall time of one replay
    present = traitlets.Bool(False).tag(sync=True)  # larger fonts, colour-blind-safe high-contrast palette

    def __init__(self, runs: Any, **kwargs: Any) -> None:
        self._runs = runs  # what plot_gallery draws the static figure from
        super().__init__(**_gallery_state(runs), **kwargs)

    def seek(self, ms: float) -> None:
        """Show on every panel only what started by ``ms`` (negative: everything)."""
        self.cursor_ms = float(ms)

    def static_figure(self) -> Any:
        """``plot_gallery`` of the runs: every panel whole, whatever the replay cursor."""
        return plot_gallery(self._runs)

    def static_text(self) -> str:
        """One line per panel: the schedule, measured bubble beside theory."""
        return f"{len(self.panels)} schedules on one time axis\n" + "\n".join(
            f"{p['name']}: {bubble_words(p['bubble'])}" for p in self.panels)


def plot_gallery(runs: Any):
    """Static fallback: one Gantt panel per schedule on a shared x axis (ms from each run's first compute),
    boxes shaded and labelled per chunk, the V guide (gid ``vguide``), each title the measured bubble beside
    the theory, one legend in PipelineTimeline's order."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    state = _gallery_state(runs)
    panels, span = state["panels"], state["span_ms"] or 1.0
    heights = [max(1, len(p["ranks"])) for p in panels]
    fig = Figure(figsize=(10, 0.32 * sum(heights) + 0.75 * len(panels) + 0.8))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    present: set[str] = set()
    for ax, panel in zip(axes, panels):
        lanes = {r: i for i, r in enumerate(panel["ranks"])}
        b = panel["boxes"]
        for rank, kind, mb, chunk, start, end in zip(*(b[k] for k in ("rank", "kind", "mb", "chunk", "start", "end"))):
            present.add(kind)
            y = lanes[rank]
            ax.add_patch(Rectangle((start, y - 0.4), end - start, 0.8, facecolor=SHADES[kind][(chunk or 0) % 4],
                                   edgecolor="white", linewidth=0.4, gid=f"box:{kind}"))
            texts = [f"{mb}·c{chunk}", f"c{chunk}"] if panel["chunks"] > 1 and chunk is not None else [f"{mb}"]
            label = next((t for t in texts if end - start > span * (len(t) + 1) / 300), None)  # the browser's labels
            if label is not None:  # about 3 px per character at fontsize 5
                ax.text((start + end) / 2, y, label, ha="center", va="center", fontsize=5, color="white", gid="label")
        guide = panel["vguide"]
        if guide["rank"]:
            ax.plot(guide["mid"], [lanes[r] for r in guide["rank"]], color="black", linestyle="--", linewidth=0.8,
                    gid="vguide")
        ax.set_yticks(range(len(lanes)), [f"rank {r}" for r in lanes], fontsize=6)
        ax.set_ylim(len(lanes) - 0.5, -0.5)
        ax.set_title(f"{panel['name']}: {bubble_words(panel['bubble'])}", fontsize=7, loc="left")
    axes[-1].set_xlim(0, span)
    axes[-1].set_xlabel("ms from each run's first compute start (one shared axis)", fontsize=7)
    handles = [Patch(facecolor=SHADES[k][0], label=_LEGEND_TEXT[k])
               for k in LEGEND_ORDER if k in present and k in KINDS]
    handles.append(Patch(facecolor="none", edgecolor="#bbbbbb", label="blank: idle or communicating"))
    fig.legend(handles=handles, fontsize=6, ncol=len(handles), loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig
