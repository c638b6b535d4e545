"""Pure transforms behind PipelineTimeline: trace events to columns, the planned overlay, plan checks.

Kept apart from the widget so each can be tested directly (see widgets/pipeline_timeline.py
for the record shapes).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernels.records import BubbleReport, TraceEvent
from kernels.schedule_simulation import lay_out

LETTERS = {"forward": "F", "backward": "B", "backward_weight": "W"}
KINDS = {"F": "forward", "B": "backward", "I": "backward", "W": "backward_weight"}
COLORS = {"F": "#4e79a7", "B": "#59a14f", "I": "#f28e2b", "W": "#b07aa1"}
COLUMNS = ("rank", "stage", "kind", "mb", "start", "end", "peer", "nbytes")


def _event_dicts(events: Any) -> list[dict[str, Any]]:
    """TraceEvent dicts from TraceEvents (or their dicts), or from rank trace records holding ``"events"``
    (a list of them or {rank: record}); each event is checked by ``TraceEvent.from_dict``."""
    out: list[dict[str, Any]] = []
    for item in (events.values() if isinstance(events, dict) else events):
        inner = item["events"] if isinstance(item, Mapping) and "events" in item else [item]
        out.extend(TraceEvent.coerce(e).to_dict() for e in inner)
    return out


def _columns(events: Any, step: int | None = None) -> dict[str, Any]:
    """One step's events as columns in start order, ms from the step's first event (µs precision)."""
    evs = _event_dicts(events)
    steps = sorted({e.get("step", 0) for e in evs})
    chosen = step if step is not None else (steps[-1] if steps else 0)
    evs = sorted((e for e in evs if e.get("step", 0) == chosen), key=lambda e: (e["start"], e["rank"]))
    t0 = min((e["start"] for e in evs), default=0.0)
    cols: dict[str, Any] = {k: [] for k in COLUMNS}
    for e in evs:
        kind = (e.get("action") or LETTERS[e["kind"]]) if e["kind"] in LETTERS else e["kind"]
        for key, value in zip(COLUMNS, (e["rank"], e.get("stage"), kind, e.get("microbatch"),
                                        round((e["start"] - t0) * 1e3, 3), round((e["end"] - t0) * 1e3, 3),
                                        e.get("peer"), e.get("nbytes", 0))):
            cols[key].append(value)
    return {"step": chosen, "t0_ms": t0 * 1e3, **cols}


def _rows(cols: dict[str, Any]) -> list[dict[str, Any]]:
    """Inverse of ``_columns``: TraceEvent-shaped dicts, seconds since rank 0's epoch again."""
    out = []
    for rank, stage, kind, mb, start, end, peer, nbytes in zip(*(cols[k] for k in COLUMNS)):
        out.append({"rank": rank, "stage": stage, "kind": KINDS.get(kind, kind), "microbatch": mb,
                    "start": (start + cols["t0_ms"]) / 1e3, "end": (end + cols["t0_ms"]) / 1e3,
                    "action": kind if kind in KINDS else "", "step": cols["step"], "peer": peer, "nbytes": nbytes})
    return out


def _mean_ms(cols: dict[str, Any]) -> dict[str, float]:
    """Measured mean duration per compute letter, ms (unrounded: the planned layout adds many of them)."""
    spans: dict[str, list[float]] = {}
    for kind, start, end in zip(cols["kind"], cols["start"], cols["end"]):
        if kind in KINDS:
            spans.setdefault(kind, []).append(end - start)
    return {k: sum(v) / len(v) for k, v in spans.items()}


def _planned_layout(planned: dict | None, mean: dict[str, float], origin: float = 0.0) -> dict[str, list]:
    """The planned order per rank laid out from ``origin`` with the measured mean duration per letter.

    A plan that would wait forever under these data dependencies still gets drawn: its
    stuck rank with the earliest free time places its next action as soon as it is free.
    """
    orders = {int(r): [tuple(a) for a in acts] for r, acts in (planned or {}).items() if acts}
    fallback = sum(mean.values()) / len(mean) if mean else 1.0
    costs = {letter: mean.get(letter, fallback) for letter in KINDS}
    cols: dict[str, list] = {k: [] for k in ("rank", "stage", "kind", "mb", "start", "end")}
    for p in lay_out(orders, costs, force_when_stuck=True):
        for key, value in zip(cols, (p.rank, p.stage, p.letter, p.microbatch,
                                     round(origin + p.start, 3), round(origin + p.end, 3))):
            cols[key].append(value)
    return cols


def _plan_match(cols: dict[str, Any], planned: dict | None) -> dict[str, bool]:
    """Per rank (str key): does the measured compute order equal the planned one?"""
    out = {}
    for r, acts in (planned or {}).items():
        ran = [[s, k, m] for rank, s, k, m in zip(cols["rank"], cols["stage"], cols["kind"], cols["mb"])
               if rank == int(r) and k in KINDS]
        out[str(r)] = ran == [list(a) for a in acts]
    return out


def _timeline_state(events: Any, bubble: Any = None, planned: dict | None = None,
                    step: int | None = None) -> dict[str, Any]:
    """Everything PipelineTimeline syncs, JSON-only: ranks, events (columns), planned, mean_ms, span_ms, bubble."""
    report = BubbleReport.coerce(bubble).to_dict() if bubble is not None else {}
    cols = _columns(events, report.get("step") if step is None else step)
    mean = _mean_ms(cols)
    origin = min((s for s, k in zip(cols["start"], cols["kind"]) if k in KINDS), default=0.0)
    plan = _planned_layout(planned, mean, origin)
    ranks = sorted(set(cols["rank"]) | set(plan["rank"]) | set(report.get("ranks", [])))
    return {"ranks": ranks, "events": cols, "planned": plan, "plan_match": _plan_match(cols, planned),
            "mean_ms": {k: round(v, 3) for k, v in mean.items()},
            "span_ms": max(cols["end"] + plan["end"], default=0.0), "bubble": report}
