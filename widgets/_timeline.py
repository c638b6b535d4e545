"""Pure transforms behind PipelineTimeline: trace events to columns, the planned overlay, plan checks,
which model chunk each box is, where a rank waited for a peer and where it sat idle.

Kept apart from the widget so each can be tested directly (see widgets/pipeline_timeline.py
for the record shapes).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernels.contract.measure_records import BubbleReport, TraceEvent
from kernels.contract.schedule_simulation import lay_out
from widgets._vshape import v_path

LETTERS = {"forward": "F", "backward": "B", "backward_weight": "W"}
KINDS = {"F": "forward", "B": "backward", "I": "backward", "W": "backward_weight"}
COLORS = {"F": "#4e79a7", "B": "#59a14f", "I": "#f28e2b", "W": "#b07aa1"}
# chunk 0..3 of a rank: the kind's hue, darker, lighter, darkest (as in static/pipeline_timeline.css)
SHADES = {"F": ("#4e79a7", "#27496d", "#8fb0d6", "#142a42"), "B": ("#59a14f", "#2f6a28", "#9ccf94", "#1b3f17"),
          "I": ("#f28e2b", "#a85a12", "#f7bd83", "#6a3809"), "W": ("#b07aa1", "#754a6a", "#d7b5cf", "#4a2d43")}
COLUMNS = ("rank", "stage", "kind", "mb", "start", "end", "peer", "nbytes")
# The legend's order, whatever order the kinds first appear in: compute, then the time a rank spends
# blocked in p2p/collectives (waiting for a peer, then moving data), then rank-wide work, then idle, then the V.
LEGEND_ORDER = ("F", "B", "I", "W", "wait", "transfer", "optimizer", "idle", "vguide")


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
    cols["chunk"] = _chunks(cols["rank"], cols["stage"], cols["kind"])
    cols["ready"] = _ready(cols)
    return {"step": chosen, "t0_ms": t0 * 1e3, **cols}


def _chunks(ranks: list[int], stages: list[int | None], kinds: list[str]) -> list[int | None]:
    """Which of its rank's stages each event belongs to (0 = the rank's lowest stage index), None for
    rank-wide events: interleaved and V schedules hold several model chunks per rank."""
    held: dict[int, set[int]] = {}
    for rank, stage, kind in zip(ranks, stages, kinds):
        if kind in KINDS and stage is not None:
            held.setdefault(rank, set()).add(stage)
    index = {r: {s: i for i, s in enumerate(sorted(ss))} for r, ss in held.items()}
    return [index.get(r, {}).get(s) if s is not None else None for r, s in zip(ranks, stages)]


def _ready(cols: dict[str, list]) -> list[float | None]:
    """Per communication event, when its data could start to move (ms); None for compute and rank-wide work.

    A traced send/recv spans the time its rank was blocked (kernels/measure/trace.py); nothing can move
    before the other side is in too, so up to the partner's start the rank was *waiting*, after it
    the message was in *transfer*. The partner of a recv is the peer's send to this rank with the
    same micro-batch from a neighbouring stage, paired in time order (and the other way round).
    A collective's k-th call on every rank that made it counts as one call: it moves data once
    the last of them has entered. Where disjoint groups run the same collective (dp groups of
    different stages), the wait is counted up to the last rank of all of them, an upper bound.
    """
    n = len(cols["rank"])
    partner: list[float | None] = [None] * n
    sends: dict[tuple, list[int]] = {}
    for i in range(n):
        if cols["kind"][i] == "send":
            sends.setdefault((cols["rank"][i], cols["peer"][i], cols["mb"][i]), []).append(i)
    for i in range(n):  # events are in start order, so each list is too
        if cols["kind"][i] != "recv":
            continue
        queue = sends.get((cols["peer"][i], cols["rank"][i], cols["mb"][i]), [])
        j = next((j for j in queue if cols["stage"][i] is None or cols["stage"][j] is None
                  or abs(cols["stage"][i] - cols["stage"][j]) == 1), None)
        if j is not None:
            queue.remove(j)
            partner[i], partner[j] = cols["start"][j], cols["start"][i]
    calls: dict[tuple, list[int]] = {}
    seen: dict[tuple, int] = {}
    for i, (rank, kind) in enumerate(zip(cols["rank"], cols["kind"])):
        if kind not in KINDS and kind not in ("send", "recv", "optimizer"):
            k = seen[(rank, kind)] = seen.get((rank, kind), -1) + 1
            calls.setdefault((kind, k), []).append(i)
    for members in calls.values():
        last = max(cols["start"][i] for i in members)
        for i in members:
            partner[i] = last
    return [None if p is None and (k in KINDS or k == "optimizer")
            else round(min(end, max(start, start if p is None else p)), 3)
            for k, start, end, p in zip(cols["kind"], cols["start"], cols["end"], partner)]


def _idle(cols: dict[str, Any]) -> dict[str, list]:
    """Per rank, the gaps between its compute actions within the makespan (first compute start to last
    compute end over all ranks): the time BubbleReport counts as idle, columnar {rank, start, end}."""
    spans: dict[int, list[tuple[float, float]]] = {}
    for rank, kind, start, end in zip(cols["rank"], cols["kind"], cols["start"], cols["end"]):
        if kind in KINDS:
            spans.setdefault(rank, []).append((start, end))
    out: dict[str, list] = {"rank": [], "start": [], "end": []}
    if not spans:
        return out
    first = min(s for v in spans.values() for s, _ in v)
    last = max(e for v in spans.values() for _, e in v)
    for rank in sorted(spans):
        free = first
        for start, end in sorted(spans[rank]) + [(last, last)]:
            if start > free:
                for key, value in zip(out, (rank, free, start)):
                    out[key].append(value)
            free = max(free, end)
    return out


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
    cols["chunk"] = _chunks(cols["rank"], cols["stage"], cols["kind"])
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
    """Everything PipelineTimeline syncs, JSON-only: ranks, events (columns), idle, vguide, planned, mean_ms,
    span_ms, bubble."""
    report = BubbleReport.coerce(bubble).to_dict() if bubble is not None else {}
    cols = _columns(events, report.get("step") if step is None else step)
    mean = _mean_ms(cols)
    origin = min((s for s, k in zip(cols["start"], cols["kind"]) if k in KINDS), default=0.0)
    plan = _planned_layout(planned, mean, origin)
    ranks = sorted(set(cols["rank"]) | set(plan["rank"]) | set(report.get("ranks", [])))
    return {"ranks": ranks, "events": cols, "idle": _idle(cols), "vguide": v_path(cols), "planned": plan,
            "plan_match": _plan_match(cols, planned),
            "mean_ms": {k: round(v, 3) for k, v in mean.items()},
            "span_ms": max(cols["end"] + plan["end"], default=0.0), "bubble": report}
