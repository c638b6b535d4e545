"""The measured bubble taken apart: the schedule's own idle time, transfer on the critical path, other overhead.

docs/design.md#bubble-parts. For one traced step with makespan ``M`` (first compute start to last
compute end, all ranks) rank r is idle ``M - busy_r``. Two replays of the step with
``kernels.contract.schedule_simulation.lay_out``, each rank running the actions it really ran,
in the order it ran them, for as long as each really took, split that time in three:

- ``schedule``: replayed with zero-latency transfers, the step would end at ``S0``; rank r's
  idle share there, ``(S0 - busy_r) / M``, is what the order itself costs: what the
  closed-form theory counts;
- ``transfer``: replayed again with each hop's measured latency added, the step ends at
  ``S1 >= S0``; ``(S1 - S0) / M`` is what point-to-point transfer (and waiting for it beyond the
  schedule) adds on the critical path. A hop's latency is the part of the consumer's recv wait
  after both the producer had finished and the consumer was waiting: ``recv end - max(producer
  end, recv start)``, zero when the data was there first;
- ``other``: ``(M - S1) / M``, everything else between actions: Python in the schedule loop,
  sleep wake-ups, instrumentation, replicas starting apart.

The three sum to rank r's measured idle share exactly (up to float rounding). Pipelines that run side
by side (dp or tp replicas) are replayed apart: the i-th rank of every stage set is replica i, which
is how the mesh lays ranks out whatever the axis order. Torch-free.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from kernels.contract.measure_records import TraceEvent
from kernels.contract.schedule_simulation import Action, lay_out

COMPUTE_KINDS = ("forward", "backward", "backward_weight")


def replicas(compute: list[TraceEvent]) -> list[list[int]]:
    """Ranks grouped into pipelines running side by side: the i-th rank of each stage set is replica i."""
    ranks = {e.rank for e in compute}
    return _replicas_by_stages({rank: {e.stage for e in compute if e.rank == rank} for rank in ranks})


def _replicas_by_stages(stages_of: dict[int, set[int]]) -> list[list[int]]:
    """``replicas`` from each rank's set of stages."""
    by_stages: dict[frozenset, list[int]] = defaultdict(list)
    for rank in sorted(stages_of):
        by_stages[frozenset(stages_of[rank])].append(rank)
    count = max(len(ranks) for ranks in by_stages.values())
    return [[ranks[i] for ranks in by_stages.values() if i < len(ranks)] for i in range(count)]


def _producer(action: Action, last_stage: int) -> tuple[int, str] | None:
    """(stage, "F" or "G") whose output ``action`` consumes from another stage; None for a stage's own input."""
    stage, letter, _ = action
    if letter == "F":
        return (stage - 1, "F") if stage > 0 else None
    if letter in ("B", "I") and stage < last_stage:
        return stage + 1, "G"
    return None


def hop_latencies(events: list[TraceEvent], last_stage: int) -> dict[Action, float]:
    """Per consuming action, the measured latency of the hop that fed it (module docstring); 0 where none."""
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    ends: dict[tuple[int, str, int], tuple[int, float]] = {}
    for e in compute:
        ends[(e.stage, "G" if e.action in ("B", "I") else e.action, e.microbatch)] = (e.rank, e.end)
    recvs: dict[tuple[int, int, int], list[TraceEvent]] = defaultdict(list)
    for e in events:
        if e.kind == "recv":
            recvs[(e.rank, e.stage, e.microbatch)].append(e)
    out: dict[Action, float] = {}
    for e in compute:
        action = (e.stage, e.action, e.microbatch)
        source = _producer(action, last_stage)
        if source is None or (source[0], source[1], e.microbatch) not in ends:
            continue
        producer_rank, produced = ends[(source[0], source[1], e.microbatch)]
        waits = [r for r in recvs[(e.rank, e.stage, e.microbatch)] if r.end <= e.start + 1e-9]
        if producer_rank == e.rank or not waits:  # a local hand-over, or no recv timed for it
            continue
        recv = max(waits, key=lambda r: r.end)  # the forward's or the backward's recv: the latest before it
        out[action] = max(0.0, recv.end - max(produced, recv.start))
    return out


def _replayed_end(compute: list[TraceEvent], latency: dict[Action, float] | None) -> float:
    """When one replica's step would end if each rank ran its measured actions as early as its inputs allow."""
    start = min(e.start for e in compute)
    orders: dict[int, list[Action]] = defaultdict(list)
    for e in sorted(compute, key=lambda e: e.start):
        orders[e.rank].append((e.stage, e.action, e.microbatch))
    durations = {(e.stage, e.action, e.microbatch): e.duration for e in compute}
    placed = lay_out(orders, {}, action_costs=durations, latency=latency or {})
    return start + max(p.end for p in placed)


def bubble_parts(events: Iterable[TraceEvent], makespan: float, busy: dict[int, float]) -> dict[str, dict[int, float]]:
    """``{part: {rank: share of the makespan}}`` for one step's events (module docstring); sums to each rank's idle."""
    events = list(events)
    compute = [e for e in events if e.kind in COMPUTE_KINDS]
    begin = min(e.start for e in compute)
    last_stage = max(e.stage for e in compute)
    ideal = transferred = begin
    for ranks in replicas(compute):
        mine = [e for e in compute if e.rank in ranks]
        ideal = max(ideal, _replayed_end(mine, None))
        hops = hop_latencies([e for e in events if e.rank in ranks], last_stage)
        transferred = max(transferred, _replayed_end(mine, hops))
    s0, s1 = ideal - begin, transferred - begin
    return {"schedule": {r: (s0 - b) / makespan for r, b in busy.items()},
            "transfer": {r: (s1 - s0) / makespan for r in busy},
            "other": {r: (makespan - s1) / makespan for r in busy}}


THEORY_UNITS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # the theories' costs: T_F = T_B = T_W, a full backward B = I + W


def planned_bubble(orders: list[list]) -> float | None:
    """Mean idle share of one pipeline replica running the planned orders (index = rank) at the theories' costs.

    The closed forms assume an ideal order; this is the order torch (or the lab, for GPipe and 1F1B)
    actually plans, so a schedule whose implementation differs from its paper shows it here. None
    when no rank has a planned order.
    """
    by_rank = {rank: [tuple(a) for a in acts] for rank, acts in enumerate(orders) if acts}
    if not by_rank:
        return None
    replica = _replicas_by_stages({rank: {a[0] for a in acts} for rank, acts in by_rank.items()})[0]
    first = {rank: by_rank[rank] for rank in replica}  # replica 0: one rank per stage set
    placed = lay_out(first, THEORY_UNITS)
    span = max(p.end for p in placed)
    busy = [sum(p.end - p.start for p in placed if p.rank == r) for r in first]
    return sum(1 - b / span for b in busy) / len(busy)
