"""Which layouts can run: the rules that combine a layout's fields, and the sizes tensor parallelism splits.

One rule set for both sides. ``lab.Parallel`` checks a layout with these before anything
is launched; the ranks check the same ones as they read a run config
(``kernels.contract.run_config.run_problems``) and as they resolve it to a strategy
(``kernels.contract.strategy``), and ``apply_tp`` checks the model's
sizes with ``tp_split_problems``. So a layout is accepted by both sides or refused by
both, under one rule name (tests/test_layout_agreement.py walks a grid of layouts).
Each function assumes the fields are each sane (``kernels.contract.config_rules``).
Standard library only.
"""
from __future__ import annotations

from collections.abc import Mapping

from kernels.contract.config_rules import Problem
from kernels.contract.layout_rules import (FSDP_STRATEGY_ZERO, SCHEDULES, default_microbatches, default_stages_per_rank,
                                           microbatch_problems, stage_problems, zero_stage)

# Pipeline schedules that split each backward into an input-gradient and a weight-gradient pass.
SPLIT_BACKWARD_SCHEDULES = ("interleaved_zero_bubble", "zbv", "dualpipev")
# What tensor parallelism splits in the lab's models, and why each must divide by tp.
TP_SPLIT = {"heads": ("tp-heads", ""), "d_model": ("tp-d-model", ""), "d_ff": ("tp-d-ff", ""),
            "kv_heads": ("tp-kv-heads", ": each rank keeps whole key/value heads"), "ffn": ("tp-ffn", ""),
            "vocab": ("tp-vocab", ": the token embedding and the LM head are split over the vocab"),
            "seq_len": ("tp-seq-len", ": the position table is split over positions")}


def combination_problems(*, dp: int, tp: int, pp: int, zero: int = 0, fsdp_strategy: str | None = None,
                         dp_replicate: int | None = None, cpu_offload: bool = False, loss_parallel: bool = False,
                         schedule: str = "1f1b", stages_per_rank: int | None = None,
                         microbatches: int | None = None) -> list[Problem]:
    """Every rule the layout's fields break together, as (rule, message) pairs; empty when it can run.

    ``stages_per_rank`` and ``microbatches`` default as ``lab.Parallel`` resolves them.
    """
    if schedule not in SCHEDULES:  # the defaults below depend on a known schedule
        return stage_problems(schedule, 1)
    v = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
    m = microbatches if microbatches is not None else default_microbatches(schedule, pp, v)
    out = stage_problems(schedule, v) + microbatch_problems(schedule, pp, v, m)
    if fsdp_strategy is not None and zero != 0 and zero not in FSDP_STRATEGY_ZERO[fsdp_strategy]:
        out.append(("zero-fsdp-agree", f"zero={zero} disagrees with fsdp_strategy={fsdp_strategy!r} "
                    "(zero 2 is grad_op, zero 3 is full, hybrid is 2 or 3)"))
    if fsdp_strategy == "hybrid" and dp < 2:
        out.append(("hybrid-dp", f"hybrid sharding splits dp into replicate x shard, needs dp >= 2, got dp={dp}"))
    if dp_replicate is not None and (fsdp_strategy != "hybrid" or dp % dp_replicate):
        out.append(("dp-replicate", f"dp_replicate={dp_replicate} needs fsdp_strategy 'hybrid' and must divide "
                    f"dp={dp} (dp = dp_replicate * dp_shard); got fsdp_strategy={fsdp_strategy!r}"))
    stage = _zero_in_effect(zero, fsdp_strategy)
    if cpu_offload and stage != 3:
        out.append(("cpu-offload", "cpu_offload uses FSDP2's CPUOffloadPolicy, which this lab applies with full "
                    f"sharding only (zero 3 or fsdp_strategy 'full'/'hybrid'); got zero={zero}, "
                    f"fsdp_strategy={fsdp_strategy!r}"))
    if zero == 1 and tp > 1:
        out.append(("zero1-dtensor", "zero=1 uses ZeroRedundancyOptimizer, which does not support DTensor "
                    f"parameters, and tp={tp} makes them DTensors; use zero 2/3 (FSDP2) with TP"))
    if pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES and stage == 3:
        # Measured on torch 2.13 (gloo, tiny GPT): the first step's gradient norm is 5% (dualpipev) to
        # 38% (zbv) below the one-process reference, with dp = 1 too; ZeRO-2 matches it to 1e-7.
        out.append(("zero3-split-backward", f"zero 3 (FSDP2 resharding after forward) with schedule {schedule!r} "
                    "trains with wrong gradients on the ranks (they differ from the one-process reference); use "
                    "zero 2 (fsdp_strategy 'grad_op') or a schedule without split backward (gpipe, 1f1b, "
                    "interleaved_1f1b, looped_bfs)"))
    if loss_parallel and pp > 1:
        out.append(("loss-parallel-pp", f"loss_parallel needs pp == 1, got pp={pp}: a pipeline schedule computes "
                    "the loss inside its last stage, outside torch's loss_parallel() context"))
    return out


def tp_split_problems(tp: int, sizes: Mapping[str, int | None], sequence_parallel: bool = False) -> list[Problem]:
    """[tp-*]: each size tensor parallelism splits (``TP_SPLIT``; a model's ``tp_sizes()``) divides by tp."""
    out = []
    for name, value in sizes.items():
        # "width of <module pattern>": a width a model's own plan splits (kernels.contract.model_rules).
        rule, why = ("tp-width", ": the tensor-parallel plan splits this module there") if name.startswith("width of ") \
            else TP_SPLIT.get(name, (f"tp-{name.replace('_', '-')}", ""))
        if name == "seq_len" and sequence_parallel:
            why += ", and sequence parallel splits the sequence"
        if value is not None and value % tp:
            out.append((rule, f"{name}={value} must be divisible by tp={tp}{why}"))
    return out


def stage_split_problems(layers: int, num_stages: int) -> list[Problem]:
    """[pp-layers]: the lab's GPT is cut into pipeline stages of equal depth, so layers divides by the stage count.

    (``layout_rules.layer_split`` can cut unevenly, as a Llama's dry run needs; the GPT's stages
    stay equal, so each stage's cost, and the bubble, is what the theory assumes.)
    """
    if layers % num_stages:
        return [("pp-layers", f"layers={layers} must be divisible by the number of stages "
                 f"pp*stages_per_rank = {num_stages}")]
    return []


def _zero_in_effect(zero: int, fsdp_strategy: str | None) -> int | None:
    """The ZeRO stage, or None while zero and fsdp_strategy disagree (reported by their own rule)."""
    try:
        return zero_stage(zero, fsdp_strategy)
    except ValueError:
        return None
