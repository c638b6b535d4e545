"""Pipeline timelines on the driver: measured bubble, theory, planned order, Chrome trace.

Pure functions of records (no torch, no ranks), so a saved run replays the same.

- ``bubble(events)``: docs/design.md#bubble-ratio. For rank r,
  ``idle_r = 1 - busy_r / makespan``; ``busy_r`` sums r's compute actions (F, B/I, W);
  the makespan runs from the first compute start to the last compute end over all
  ranks, on clocks aligned to rank 0. Mean and per-rank values, beside the closed form
  of ``kernels.contract.layout_rules.bubble_theory``.
- ``planned_order``: our own compute order for GPipe and 1F1B (torch 2.8-2.13's
  ``pipeline_order`` is wrong for these, docs/design.md#planned-pipeline-order). Multi-stage schedules use the
  order torch plans, which the rank function returns as ``record["planned"]``;
  ``planned_orders`` picks one or the other for every rank of a run.
- ``simulate``: when each action starts if it waits only for its rank and its data
  (zero-latency p2p, ``kernels.contract.schedule_simulation``), giving the planned timeline and its bubble.
- ``to_chrome_trace``: Chrome/Perfetto JSON ("X" events, microseconds), one track per rank.
- ``stage_compute``: each stage's compute seconds in the traced step, which shows uneven stages.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from kernels.contract.layout_rules import SINGLE_STAGE_SCHEDULES, bubble_theory, bubble_theory_form
from kernels.contract.measure_records import BubbleReport, ClockSync, TraceEvent
from kernels.contract.schedule_simulation import Action, lay_out
from lab.measure.bubble_parts import COMPUTE_KINDS, bubble_parts, planned_bubble


def events_from(results: Any) -> list[TraceEvent]:
    """TraceEvents from rank records ({"events": [...]}, by rank or in a list) or event dicts."""
    items = results.values() if isinstance(results, dict) else results
    out: list[TraceEvent] = []
    for item in items:
        if isinstance(item, TraceEvent):
            out.append(item)
        elif isinstance(item, dict) and "events" in item:
            out.extend(TraceEvent.from_dict(e) for e in item["events"])
        else:
            out.append(TraceEvent.from_dict(item))
    return sorted(out, key=lambda e: (e.start, e.rank))


def _one_step(events: list[TraceEvent], step: int | None) -> tuple[list[TraceEvent], int]:
    steps = sorted({e.step for e in events})
    if not steps:
        raise ValueError("no events")
    chosen = steps[-1] if step is None else step
    return [e for e in events if e.step == chosen], chosen


def bubble(events: Iterable[Any], schedule: str = "", pp: int = 0, microbatches: int = 0,
           stages_per_rank: int = 1, *, step: int | None = None, synthetic: bool = False,
           clock_uncertainty: float = 0.0, planned: float | None = None) -> BubbleReport:
    """Measured idle share per rank of one traced step (the last one by default), taken apart
    (``lab.measure.bubble_parts``); ``planned`` is the planned order's own bubble, when known."""
    chosen, step_ = _one_step(events_from(events), step)
    compute = [e for e in chosen if e.kind in COMPUTE_KINDS]
    if not compute:
        raise ValueError("no compute events in this step")
    ranks = tuple(sorted({e.rank for e in chosen}))
    makespan = max(e.end for e in compute) - min(e.start for e in compute)
    busy = tuple(sum(e.duration for e in compute if e.rank == r) for r in ranks)
    idle = tuple(1 - b / makespan for b in busy)
    th, mega = bubble_theory(schedule, pp, microbatches, stages_per_rank) if pp else (None, None)
    by_rank = bubble_parts(chosen, makespan, dict(zip(ranks, busy)))
    return BubbleReport(schedule=schedule, pp=pp, microbatches=microbatches, stages_per_rank=stages_per_rank,
                        ranks=ranks, idle=idle, busy=busy, makespan=makespan, mean=sum(idle) / len(idle),
                        theory=th, theory_megatron=mega, synthetic=synthetic, step=step_,
                        clock_uncertainty=clock_uncertainty, planned=planned,
                        theory_form=bubble_theory_form(schedule, stages_per_rank) if pp else "",
                        parts={k: sum(v.values()) / len(v) for k, v in by_rank.items()},
                        rank_parts={k: [v[r] for r in ranks] for k, v in by_rank.items()})


def clock_syncs(records: Any) -> list[ClockSync]:
    """Each rank's clock alignment (offset to rank 0 and its uncertainty), in rank order."""
    recs = records.values() if isinstance(records, dict) else records
    return sorted((ClockSync.from_dict(r["clock"]) for r in recs), key=lambda c: c.rank)


def bubble_from_records(records: Any, *, step: int | None = None) -> BubbleReport:
    """``bubble`` with the schedule, sizes and clock uncertainty read from the rank records."""
    recs = list(records.values()) if isinstance(records, dict) else list(records)
    first = recs[0]
    return bubble(recs, first["schedule"], first["pp"], first["microbatches"], first["stages_per_rank"],
                  step=step, synthetic=bool(first["synthetic"]),
                  clock_uncertainty=max(c.uncertainty for c in clock_syncs(recs)),
                  planned=planned_bubble(planned_orders(recs)))


def planned_order(schedule: str, pp: int, microbatches: int, pp_rank: int) -> list[Action]:
    """Our compute order for GPipe or 1F1B on pipeline rank ``pp_rank`` (stage = pp_rank)."""
    s, m = pp_rank, microbatches
    if schedule == "gpipe":  # all forwards, then all backwards, both in micro-batch order
        return [(s, "F", i) for i in range(m)] + [(s, "B", i) for i in range(m)]
    if schedule != "1f1b":
        raise ValueError(f"no planned order of ours for {schedule!r}; use torch's (record['planned'])")
    warmup = min(m, pp - s)  # stage s runs p-s forwards before its first backward
    order: list[Action] = [(s, "F", i) for i in range(warmup)]
    fwd = warmup
    for bwd in range(m):  # steady state: one backward, then one forward, while forwards remain
        order.append((s, "B", bwd))
        if fwd < m:
            order.append((s, "F", fwd))
            fwd += 1
    return order


def planned_orders(records: Any) -> list[list[list]]:
    """Per rank (index = rank) the planned compute order to overlay, as [[stage, letter, micro-batch], ...].

    Ours for GPipe and 1F1B (``planned_order``, from each record's pp rank); torch's
    ``record["planned"]`` for the other schedules ([] where torch has none).
    """
    recs = sorted(records.values() if isinstance(records, dict) else records, key=lambda r: r["rank"])
    out: list[list[list]] = []
    for rec in recs:
        if rec["schedule"] in SINGLE_STAGE_SCHEDULES:
            acts = planned_order(rec["schedule"], rec["pp"], rec["microbatches"], rec["pp_rank"])
        else:
            acts = rec.get("planned") or []
        out.append([list(a) for a in acts])
    return out


def stage_compute(events: Iterable[Any], *, step: int | None = None) -> dict[int, float]:
    """Seconds each pipeline stage computed (F, B, I, W) in one traced step (the last by default), per replica:
    a stage that several dp or tp ranks hold counts their mean. Uneven stages, or a heavy head, show here as
    one stage's compute above the others' (``lab.planning.stage_balance.measured_costs`` fits costs to it)."""
    chosen, _ = _one_step(events_from(events), step)
    busy: dict[int, float] = {}
    ranks: dict[int, set[int]] = {}
    for e in chosen:
        if e.kind in COMPUTE_KINDS:
            busy[e.stage] = busy.get(e.stage, 0.0) + e.duration
            ranks.setdefault(e.stage, set()).add(e.rank)
    return {stage: busy[stage] / len(ranks[stage]) for stage in sorted(busy)}


def measured_order(events: Iterable[Any], rank: int, *, step: int | None = None) -> list[Action]:
    """The compute actions one rank ran, in start order, as (stage, letter, micro-batch)."""
    chosen, _ = _one_step(events_from(events), step)
    return [(e.stage, e.action, e.microbatch) for e in chosen
            if e.rank == rank and e.kind in COMPUTE_KINDS]


def simulate(orders: dict[int, list[Action]], costs: dict[str, float]) -> list[TraceEvent]:
    """The planned timeline of ``orders`` (``kernels.contract.schedule_simulation.lay_out``) as TraceEvents in start order."""
    kinds = {"F": "forward", "W": "backward_weight"}
    return sorted((TraceEvent(p.rank, p.stage, kinds.get(p.letter, "backward"), p.microbatch, p.start, p.end,
                              action=p.letter) for p in lay_out(orders, costs)),
                  key=lambda e: (e.start, e.rank))


def _label(e: TraceEvent) -> str:
    if e.kind in COMPUTE_KINDS:
        return f"{e.stage}{e.action}{e.microbatch}"  # torch's action notation, e.g. 1F3
    if e.kind in ("send", "recv"):
        return f"{e.kind} {e.stage}:{e.microbatch} {'to' if e.kind == 'send' else 'from'} {e.peer}"
    return e.kind


def to_chrome_trace(events: Iterable[Any], path: str | Path | None = None) -> dict:
    """Chrome/Perfetto trace JSON: pid = rank, one thread per rank; written to ``path`` if given."""
    evs = events_from(events)
    trace: list[dict] = []
    for r in sorted({e.rank for e in evs}):
        trace.append({"name": "process_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        trace.append({"name": "thread_name", "ph": "M", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
    for e in evs:
        args = {k: v for k, v in e.to_dict().items() if k not in ("start", "end") and v not in (None, "")}
        trace.append({"name": _label(e), "cat": e.kind, "ph": "X", "pid": e.rank, "tid": 0,
                      "ts": e.start * 1e6, "dur": max(e.duration, 0.0) * 1e6, "args": args})
    doc = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(doc))
    return doc
