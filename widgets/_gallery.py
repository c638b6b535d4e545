"""Pure transform behind ScheduleGallery: several traced steps as compute boxes on one shared time axis.

Each panel is one run's step (``_timeline._columns``), compute actions only, timed from its
own first compute start, so every schedule starts at 0 and the panels' lengths compare
directly. Communication and idle time are left blank: the gallery compares schedules; a
PipelineTimeline of one run tells waiting from transfer.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernels.contract.measure_records import BUBBLE_PARTS, BubbleReport
from widgets._timeline import KINDS, _columns
from widgets._vshape import v_path

BOX_COLUMNS = ("rank", "stage", "kind", "mb", "chunk", "start", "end")
BUBBLE_KEYS = ("schedule", "pp", "microbatches", "stages_per_rank", "mean", "theory", "makespan", "synthetic", "parts",
               "planned", "theory_form")


def _panel_inputs(runs: Any) -> list[tuple[str, Any, Any]]:
    """(name, events, bubble) per run, from ``{name: {"events": ..., "bubble": ...}}``,
    ``{name: (events, bubble)}``, ``{name: events}`` or a list of ``(name, events, bubble)``."""
    items = runs.items() if isinstance(runs, Mapping) else [(name, (events, bubble)) for name, events, bubble in runs]
    out = []
    for name, value in items:
        if isinstance(value, Mapping):
            events, bubble = value.get("events"), value.get("bubble")
        elif isinstance(value, tuple):
            events, bubble = value
        else:
            events, bubble = value, None
        if not events:
            raise ValueError(f"run {name!r} has no trace events: run its Experiment with trace=True (pp > 1)")
        out.append((str(name), events, bubble))
    if not out:
        raise ValueError("no runs to compare: pass {name: run} with at least one traced run")
    return out


def _panel(name: str, events: Any, bubble: Any) -> dict[str, Any]:
    """One run's compute boxes from its first compute start (ms, µs precision), its bubble beside the theory,
    and the V guide where its stages sit as a V."""
    report = BubbleReport.coerce(bubble).to_dict() if bubble else {}
    cols = _columns(events, report.get("step"))
    keep = [i for i, k in enumerate(cols["kind"]) if k in KINDS]
    origin = min((cols["start"][i] for i in keep), default=0.0)
    boxes = {key: [cols[key][i] for i in keep] for key in BOX_COLUMNS}
    boxes["start"] = [round(t - origin, 3) for t in boxes["start"]]
    boxes["end"] = [round(t - origin, 3) for t in boxes["end"]]
    guide = v_path(boxes)
    return {"name": name, "ranks": sorted(set(boxes["rank"]) | set(report.get("ranks", []))), "boxes": boxes,
            "chunks": 1 + max((c for c in boxes["chunk"] if c is not None), default=0),
            "span_ms": max(boxes["end"], default=0.0), "vguide": guide,
            "bubble": {k: report[k] for k in BUBBLE_KEYS if k in report}}


def _gallery_state(runs: Any) -> dict[str, Any]:
    """Everything ScheduleGallery syncs: the panels in the order given and the shared axis length."""
    panels = [_panel(*item) for item in _panel_inputs(runs)]
    return {"panels": panels, "span_ms": max(p["span_ms"] for p in panels)}


def bubble_words(b: dict[str, Any]) -> str:
    """One line per panel, as in the browser: the schedule, p and m, measured bubble beside the theory."""
    if not b:
        return "no bubble report"
    fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    return (f"{b.get('schedule')} p={b.get('pp')} m={b.get('microbatches')}: measured bubble {fmt(b.get('mean'))}"
            f" = {parts_words(b)} · theory {b.get('theory_form') or ''} {fmt(b.get('theory'))}"
            f" · makespan {b.get('makespan', 0) * 1e3:.0f} ms" + ("" if b.get("synthetic") else " · real compute"))


def parts_words(b: dict[str, Any]) -> str:
    """The measured bubble's parts in a line: "schedule 0.321 + transfer 0.012 + other 0.020"."""
    parts = b.get("parts") or {}
    return " + ".join(f"{name} {parts[name]:.3f}" for name in BUBBLE_PARTS if name in parts) or "(not taken apart)"
