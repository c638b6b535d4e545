"""The layout vocabulary shared by the driver and the ranks (torch-free, stdlib only).

Schedules and their families, the FSDP strategy -> ZeRO stage map, stage placement,
the layer split, the micro-batch rules torch's pipeline schedules enforce, the bubble
of the closed-form schedules (GPipe: Huang et al., 2019; interleaved: Narayanan et
al., 2021) and the HSDP split of dp into (dp_replicate, dp_shard).

Run alone (prints the stage placement of every schedule on 4 ranks)::

    python -m kernels.layout_rules
"""
from __future__ import annotations

SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")
LOOPED_SCHEDULES = ("interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble")
V_SCHEDULES = ("zbv", "dualpipev")
SCHEDULES = SINGLE_STAGE_SCHEDULES + LOOPED_SCHEDULES + V_SCHEDULES
FSDP_STRATEGY_ZERO: dict[str, tuple[int, ...]] = {"no_shard": (0,), "grad_op": (2,), "full": (3,), "hybrid": (2, 3)}
_ALIASES = {"interleaved": "interleaved_1f1b", "zero_bubble": "interleaved_zero_bubble", "zb": "interleaved_zero_bubble"}


def canonical_schedule(name: str) -> str:
    """The schedule's canonical name (lower case, aliases resolved); ValueError naming SCHEDULES."""
    key = str(name).strip().lower().replace("-", "_")
    key = _ALIASES.get(key, key)
    if key not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    return key


def default_stages_per_rank(schedule: str) -> int:
    """1 for the single-stage schedules, else 2."""
    return 1 if canonical_schedule(schedule) in SINGLE_STAGE_SCHEDULES else 2


def stage_ids(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """Global stage indices on ``pp_rank``: r alone, looped r, r+p, ..., or the V r and 2p-1-r."""
    schedule = canonical_schedule(schedule)
    if schedule in SINGLE_STAGE_SCHEDULES:
        if stages_per_rank != 1:
            raise ValueError(f"{schedule} runs one stage per rank, got stages_per_rank={stages_per_rank}")
        return (pp_rank,)
    if schedule in V_SCHEDULES:
        if stages_per_rank != 2:
            raise ValueError(f"{schedule} needs exactly 2 stages per rank, got {stages_per_rank}")
        return (pp_rank, 2 * pp - 1 - pp_rank)  # rank 0 holds the first and the last stage
    return tuple(pp_rank + k * pp for k in range(stages_per_rank))


def layer_split(layers: int, num_stages: int, stage: int) -> range:
    """The blocks of ``stage``: contiguous, sizes differing by at most one, the first stages larger."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    base, extra = divmod(layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def microbatch_problems(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> list[tuple[str, str]]:
    """[(rule name, message)] for the schedule rules a (pp, stages_per_rank, microbatches) breaks; empty when valid."""
    try:
        s = canonical_schedule(schedule)
    except ValueError as e:
        return [("unknown-schedule", str(e))]
    p, v, m, n = pp, stages_per_rank, microbatches, pp * stages_per_rank
    out = []
    if m < 1:
        out.append(("positive-sizes", f"microbatches={m} must be positive"))
    if s in SINGLE_STAGE_SCHEDULES and v != 1:
        out.append(("single-stage-schedule", f"{s} runs one stage per rank, got stages_per_rank={v}"))
    if s in ("1f1b", "dualpipev") and m < n:
        out.append((f"{s}-microbatches", f"{s} needs microbatches={m} >= number of stages={n}"))
    if s in ("interleaved_1f1b", "interleaved_zero_bubble"):
        if v < 2:
            out.append(("interleaved-stages-per-rank", f"{s} needs stages_per_rank >= 2, got {v}"))
        rounds = max(1, m // p)
        if m % rounds:
            out.append(("interleaved-rounds", f"{s} needs microbatches={m} to be a multiple of "
                        f"the number of rounds max(1, m // pp)={rounds}"))
    if s in V_SCHEDULES and v != 2:
        out.append(("v-schedule-stages", f"{s} needs exactly 2 stages per rank, got stages_per_rank={v}"))
    return out


def bubble_theory(schedule: str, pp: int, microbatches: int,
                  stages_per_rank: int = 1) -> tuple[float | None, float | None]:
    """((p-1)/(v*m+p-1), (p-1)/(v*m)) for GPipe/1F1B/interleaved; (None, None) without a closed form."""
    s = canonical_schedule(schedule)
    if s not in SINGLE_STAGE_SCHEDULES + ("interleaved_1f1b",):
        return None, None
    p, v, m = pp, stages_per_rank, microbatches
    return (p - 1) / (v * m + p - 1), (p - 1) / (v * m)


def zero_stage(zero: int, fsdp_strategy: str | None) -> int:
    """The ZeRO stage a (zero, fsdp_strategy) pair means: zero when given, else the strategy's (hybrid: 3)."""
    if zero or fsdp_strategy is None:
        return int(zero)
    return FSDP_STRATEGY_ZERO[fsdp_strategy][-1]


def hsdp_split(dp: int, dp_replicate: int | None = None) -> tuple[int, int]:
    """(dp_replicate, dp_shard) with dp_replicate * dp_shard == dp; by default the largest divisor <= sqrt(dp)."""
    if dp_replicate is None:
        dp_replicate = max(k for k in range(1, dp + 1) if dp % k == 0 and k * k <= dp)
    if dp_replicate < 1 or dp % dp_replicate:
        raise ValueError(f"HSDP: dp_replicate={dp_replicate} must divide dp={dp}")
    return dp_replicate, dp // dp_replicate


if __name__ == "__main__":
    for name in SCHEDULES:
        v = default_stages_per_rank(name)
        print(f"{name:24s}", [stage_ids(name, r, 4, v) for r in range(4)])
