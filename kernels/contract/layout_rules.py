"""The layout vocabulary: pipeline schedules, stage placement, micro-batch rules, bubble theory, ZeRO and HSDP.

One torch-free home for the rules that the driver (``lab``), the ranks (``kernels``) and the
views (``widgets``) must agree on. Standard library only, so every side may import it.

Pipeline schedules (all run by ``torch.distributed.pipelining``):

- GPipe (Huang et al., 2019, "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism"): every forward, then every backward; one stage per rank.
- 1F1B (Narayanan et al., 2019, "PipeDream: Generalized Pipeline Parallelism for DNN
  Training"): one forward, one backward in the steady state; one stage per rank.
- Interleaved 1F1B (Narayanan et al., 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM") and looped BFS (Lamy-Poirier, 2023, "Breadth-First
  Pipeline Parallelism"): v stages per rank placed in a loop, r, r+p, r+2p, ...
- Interleaved zero bubble and ZB-V (Qi et al., 2024, "Zero Bubble Pipeline Parallelism"):
  the backward split into input-gradient and weight-gradient passes; ZB-V places two
  stages per rank as a "V", r and 2p-1-r.
- DualPipeV (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report"): the same V placement,
  with forward and backward chunks of different micro-batches paired.

Mesh order: the ranks run row-major over the axes in ``MESH_AXES`` order, (pp, dp, tp)
with tp fastest (Megatron-LM's layout: a tp group is neighbouring ranks, one host); a
run may name another order, e.g. (pp, tp, dp) to spread each tp group over hosts.

Sharding: ZeRO stages (Rajbhandari et al., 2020, "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models") and the FSDP strategies that are them, and HSDP's
split of the dp ranks into replicate x shard groups (Zhao et al., 2023, "PyTorch FSDP").

Every rule that can fail returns ``(rule name, message)`` pairs; the names are the keys of
``lab.run.parallel.RULES``. Try it alone::

    python -m kernels.contract.layout_rules
"""
from __future__ import annotations

import enum

class Schedule(enum.StrEnum):
    """torch.distributed.pipelining's schedules, by the names the lab uses (a str: "1f1b" == Schedule.ONE_F_ONE_B)."""

    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    LOOPED_BFS = "looped_bfs"
    INTERLEAVED_ZERO_BUBBLE = "interleaved_zero_bubble"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


SCHEDULES: tuple[Schedule, ...] = tuple(Schedule)
SINGLE_STAGE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)  # one stage per rank (torch's PipelineScheduleSingle)
LOOPED_SCHEDULES = (Schedule.INTERLEAVED_1F1B, Schedule.LOOPED_BFS, Schedule.INTERLEAVED_ZERO_BUBBLE)  # stages r, r+p, ...
V_SCHEDULES = (Schedule.ZBV, Schedule.DUALPIPEV)  # stages r and 2p-1-r: rank 0 holds the first and the last stage
# torch runs these in rounds of max(1, m // p) micro-batches, and m must fill whole rounds.
ROUND_SCHEDULES = (Schedule.INTERLEAVED_1F1B, Schedule.INTERLEAVED_ZERO_BUBBLE)
# The bubble has the closed form (p-1)/(v*m+p-1) only for these (v = 1 for the single-stage two).
CLOSED_FORM_BUBBLE_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B, Schedule.LOOPED_BFS)

MESH_AXES = ("pp", "dp", "tp")  # the default rank order over the mesh axes, outermost first

FSDP_STRATEGIES = ("full", "grad_op", "no_shard", "hybrid")
# The ZeRO stages each FSDP strategy is: hybrid shards inside a group as ZeRO-2 or ZeRO-3 does.
FSDP_STRATEGY_ZERO: dict[str, tuple[int, ...]] = {"no_shard": (0,), "grad_op": (2,), "full": (3,),
                                                  "hybrid": (2, 3)}
# The fully_shard units, each with its own reshard_after_forward: the root (embeddings, final norm, head) and
# every block (the blocks share one setting).
FSDP_UNITS = ("root", "blocks")

# Spellings people use for the schedules (torch's class names, dashes, short forms).
_SCHEDULE_ALIASES = {"interleaved": "interleaved_1f1b", "schedule1f1b": "1f1b", "schedulegpipe": "gpipe",
                     "scheduleinterleaved1f1b": "interleaved_1f1b", "scheduleloopedbfs": "looped_bfs",
                     "zerobubble": "interleaved_zero_bubble",
                     "scheduleinterleavedzerobubble": "interleaved_zero_bubble",
                     "zbvzerobubble": "zbv", "schedulezbvzerobubble": "zbv", "scheduledualpipev": "dualpipev"}


def _key(name: str) -> str:
    return "".join(c for c in str(name).lower() if c.isalnum())


_SCHEDULE_KEYS = {**{_key(s): s for s in SCHEDULES}, **_SCHEDULE_ALIASES}


def canonical_schedule(name: str) -> Schedule:
    """The ``Schedule`` any spelling names ("Interleaved1F1B", "ScheduleGPipe", "zbv")."""
    key = _key(name)
    if key not in _SCHEDULE_KEYS:
        raise ValueError(f"unknown schedule {name!r}; allowed: {', '.join(SCHEDULES)}")
    return Schedule(_SCHEDULE_KEYS[key])


def default_stages_per_rank(schedule: str) -> int:
    """Stages per pipeline rank when none is given: 1 for GPipe/1F1B, else 2."""
    return 1 if canonical_schedule(schedule) in SINGLE_STAGE_SCHEDULES else 2


def stage_problems(schedule: str, stages_per_rank: int) -> list[tuple[str, str]]:
    """The placement rules: a known schedule, and the stage count per rank it can run."""
    if schedule not in SCHEDULES:
        return [("unknown-schedule", f"unknown schedule {schedule!r}; allowed: {', '.join(SCHEDULES)}")]
    v = stages_per_rank
    if schedule in SINGLE_STAGE_SCHEDULES and v != 1:
        return [("single-stage-schedule", f"{schedule} runs one stage per rank, got stages_per_rank={v}")]
    if schedule in ROUND_SCHEDULES and v < 2:
        return [("interleaved-stages-per-rank", f"{schedule} needs stages_per_rank >= 2, got {v}")]
    if schedule in V_SCHEDULES and v != 2:
        return [("v-schedule-stages", f"{schedule} needs exactly 2 stages per rank, got stages_per_rank={v}")]
    return []


def stage_ids(schedule: str, pp_rank: int, pp: int, stages_per_rank: int) -> tuple[int, ...]:
    """Global stage indices on ``pp_rank``: (r,), looped (r, r+p, ...), or the V (r, 2p-1-r).

    Raises ValueError, in words, for an unknown schedule or a stage count it cannot run.
    """
    problems = stage_problems(schedule, stages_per_rank)
    if problems:
        raise ValueError(problems[0][1])
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} must be in 0..{pp - 1}")
    if schedule in V_SCHEDULES:
        # The V turns round on rank p-1, so rank 0 holds both the first and the last stage.
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + k * pp for k in range(stages_per_rank))


def layer_split(layers: int, num_stages: int, stage: int,
                stage_layers: tuple[int, ...] | list[int] | None = None) -> range:
    """The contiguous blocks of pipeline stage ``stage``: equal runs, the first ``layers % num_stages`` one longer;
    or, given ``stage_layers`` (blocks per stage, in stage order), stage s holds the next ``stage_layers[s]``.

    126 layers on 16 stages: stages 0-13 hold 8 blocks, stages 14-15 hold 7. 8 layers as
    ``stage_layers=(3, 5)``: stage 0 holds blocks 0-2, stage 1 blocks 3-7.
    """
    if not 0 <= stage < num_stages or layers < num_stages:
        raise ValueError(f"stage {stage} of {num_stages} needs 0 <= stage < num_stages <= layers={layers}")
    if stage_layers is not None:
        if len(stage_layers) != num_stages or sum(stage_layers) != layers or min(stage_layers) < 1:
            raise ValueError(f"stage_layers={list(stage_layers)} must give each of the {num_stages} stages at least "
                             f"one block, {layers} in all")
        start = sum(stage_layers[:stage])
        return range(start, start + stage_layers[stage])
    per, extra = divmod(layers, num_stages)
    start = stage * per + min(stage, extra)
    return range(start, start + per + (1 if stage < extra else 0))


def microbatch_problems(schedule: str, pp: int, stages_per_rank: int, microbatches: int) -> list[tuple[str, str]]:
    """The micro-batch rules of a pipeline layout, as (rule name, message) pairs; empty when valid.

    "1f1b-microbatches", "dualpipev-microbatches" and "interleaved-rounds" are the checks
    torch's schedules make when they are built; "pp-microbatches" is this lab's own: fewer
    micro-batches than ranks leaves a rank with nothing to do, except one micro-batch
    through GPipe, which is naive model parallelism, kept to show the bubble.
    """
    p, v, m, s = pp, stages_per_rank, microbatches, schedule
    if m < 1:
        return [("positive-sizes", f"microbatches={m} must be positive")]
    out = []
    if m < p and not (s == Schedule.GPIPE and m == 1):
        out.append(("pp-microbatches", f"microbatches={m} must be at least pp={p} "
                    "(or exactly 1 with gpipe: naive model parallelism)"))
    if s in (Schedule.ONE_F_ONE_B, Schedule.DUALPIPEV) and m < p * v:
        out.append((f"{s}-microbatches", f"{s} needs microbatches={m} >= number of stages={p * v}"))
    if s in ROUND_SCHEDULES and m % max(1, m // p):
        out.append(("interleaved-rounds", f"{s} needs microbatches={m} to be a multiple "
                    f"of the number of rounds max(1, m // pp)={max(1, m // p)}"))
    return out


def default_microbatches(schedule: str, pp: int, stages_per_rank: int) -> int:
    """Micro-batches when none is given: pp (1 without a pipeline), the stage count for DualPipeV."""
    return pp * stages_per_rank if schedule == Schedule.DUALPIPEV else pp


def bubble_theory(schedule: str, pp: int, microbatches: int,
                  stages_per_rank: int = 1) -> tuple[float | None, float | None]:
    """(bubble share of the step, Megatron's bubble-to-ideal ratio) of a schedule, or (None, None).

    The share is ratio / (1 + ratio). GPipe and 1F1B: ratio (p-1)/m; interleaved and looped with
    v stages per rank: (p-1)/(v*m) (Narayanan et al., 2021). The zero-bubble family (Qi et al.,
    2024), with T_F = T_B = T_W as the paper assumes (the lab's synthetic F = I = W): ZB-H1 has
    (p-1)/(3m), which for torch's interleaved zero bubble, v stages per rank, we take as
    (p-1)/(3*v*m) (our extension: each stage's actions last 1/v); ZB-V has 0. DualPipeV's bubble
    depends on how much a fused forward-backward overlaps, so it has no closed form here:
    compare it with its planned order (``BubbleReport.planned``).
    """
    p, m = pp, microbatches
    v = 1 if schedule in SINGLE_STAGE_SCHEDULES else stages_per_rank
    if min(p, m, v) < 1:
        raise ValueError(f"pp, microbatches and stages_per_rank must be >= 1, got {p}, {m}, {v}")
    if schedule in CLOSED_FORM_BUBBLE_SCHEDULES:
        ratio = (p - 1) / (v * m)
    elif schedule == Schedule.INTERLEAVED_ZERO_BUBBLE:
        ratio = (p - 1) / (3 * v * m)
    elif schedule == Schedule.ZBV:
        ratio = 0.0
    else:
        return None, None
    return ratio / (1 + ratio), ratio


def bubble_theory_form(schedule: str, stages_per_rank: int = 1) -> str:
    """The closed form ``bubble_theory`` uses for a schedule, as the views print it ("" where there is none)."""
    vm = "m" if schedule in SINGLE_STAGE_SCHEDULES or stages_per_rank == 1 else "v·m"
    if schedule in CLOSED_FORM_BUBBLE_SCHEDULES:
        return f"(p-1)/({vm}+p-1)"
    if schedule == Schedule.INTERLEAVED_ZERO_BUBBLE:
        return f"ZB-H1: ratio (p-1)/(3·{vm}), T_F = T_B = T_W"
    if schedule == Schedule.ZBV:
        return "ZB-V: 0 at T_F = T_B = T_W"
    return ""


def mesh_order_problems(order: object) -> list[tuple[str, str]]:
    """[mesh-order]: ``order`` is a tuple or list naming pp, dp and tp once each."""
    if isinstance(order, (tuple, list)) and all(isinstance(a, str) for a in order) \
            and sorted(order) == sorted(MESH_AXES):
        return []
    return [("mesh-order", f"mesh_order must name pp, dp and tp once each (outermost first), got {order!r}")]


def coords(rank: int, dims: dict[str, int], order: tuple[str, ...] | list[str] = MESH_AXES) -> dict[str, int]:
    """A rank's index on each axis when ranks run row-major over ``order`` (``kernels.parallel.mesh.rank_grid``)."""
    out = {}
    for axis in reversed(tuple(order)):
        out[axis], rank = rank % dims[axis], rank // dims[axis]
    return out


def zero_stage(zero: int, fsdp_strategy: str | None) -> int:
    """The ZeRO stage a (zero, fsdp_strategy) pair means: ``zero``, or the strategy's when zero is 0.

    Raises ValueError for an unknown strategy or a pair that disagrees (zero=1 with "full").
    """
    if fsdp_strategy is None:
        return zero
    if fsdp_strategy not in FSDP_STRATEGY_ZERO:
        raise ValueError(f"unknown fsdp_strategy {fsdp_strategy!r}; allowed: None, {', '.join(FSDP_STRATEGIES)}")
    stages = FSDP_STRATEGY_ZERO[fsdp_strategy]
    if zero == 0:
        return max(stages)
    if zero not in stages:
        raise ValueError(f"zero={zero} disagrees with fsdp_strategy={fsdp_strategy!r} "
                         "(zero 2 is grad_op, zero 3 is full, hybrid is 2 or 3)")
    return zero


def reshard_units(zero: int, reshard_after_forward: bool | dict[str, bool] | None) -> dict[str, bool]:
    """Per FSDP unit (``FSDP_UNITS``), whether it frees its gathered parameters after its forward.

    ``reshard_after_forward``: a bool for every unit, a dict naming some units, or None; a unit it
    does not name follows the ZeRO stage (3: True, freed and gathered again in backward; 2: False,
    kept whole until backward ends).
    """
    value = reshard_after_forward
    given = value if isinstance(value, dict) else {} if value is None else dict.fromkeys(FSDP_UNITS, value)
    return {unit: given.get(unit, zero >= 3) for unit in FSDP_UNITS}


def hsdp_split(dp: int, dp_replicate: int | None = None) -> tuple[int, int]:
    """HSDP's (dp_replicate, dp_shard) with dp == dp_replicate * dp_shard; ``dp_replicate`` None: the default.

    The default is the most even split with shard groups at least as large as replicate
    groups (the largest divisor k of dp with k*k <= dp replicates): dp=4 is 2x2, dp=8 is
    2x4, dp=32 is 4x8, and a prime dp is 1 x dp (no replication). It depends on dp alone,
    not on the node size, so the driver's plan, the ranks and a saved config all agree; to
    keep shard groups inside a node, pass dp_replicate = dp / ranks-per-node.
    """
    if dp_replicate is None:
        dp_replicate = max((k for k in range(1, dp + 1) if dp % k == 0 and k * k <= dp), default=1)
    if not 1 <= dp_replicate <= dp or dp % dp_replicate:
        raise ValueError(f"HSDP: dp_replicate={dp_replicate} must divide dp={dp}")
    return dp_replicate, dp // dp_replicate


if __name__ == "__main__":
    for name in SCHEDULES:
        v = default_stages_per_rank(name)
        print(f"{name:24s} v={v} stages on 4 ranks {[stage_ids(name, r, 4, v) for r in range(4)]} "
              f"bubble(m=8) {bubble_theory(name, 4, 8, v)}")
    print("HSDP splits:", {dp: hsdp_split(dp) for dp in (2, 4, 8, 16, 32)})
