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

from collections.abc import Mapping, Sequence

from kernels.contract.config_rules import Problem
from kernels.contract.layout_rules import (FSDP_STRATEGY_ZERO, FSDP_UNITS, SCHEDULES, default_microbatches,
                                           default_stages_per_rank, microbatch_problems, reshard_units, stage_problems,
                                           zero_stage)

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
                         microbatches: int | None = None, ep: int = 1, cp: int = 1,
                         sequence_parallel: bool = False,
                         reshard_after_forward: bool | dict[str, bool] | None = None,
                         stage_layers: Sequence[int] | None = None) -> list[Problem]:
    """Every rule the layout's fields break together, as (rule, message) pairs; empty when it can run.

    ``stages_per_rank`` and ``microbatches`` default as ``lab.Parallel`` resolves them.
    """
    if schedule not in SCHEDULES:  # the defaults below depend on a known schedule
        return stage_problems(schedule, 1)
    v = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
    m = microbatches if microbatches is not None else default_microbatches(schedule, pp, v)
    out = stage_problems(schedule, v) + microbatch_problems(schedule, pp, v, m)
    out += stage_layers_problems(stage_layers, pp, pp * v)
    if fsdp_strategy is not None and zero != 0 and zero not in FSDP_STRATEGY_ZERO[fsdp_strategy]:
        out.append(("zero-fsdp-agree", f"zero={zero} disagrees with fsdp_strategy={fsdp_strategy!r} "
                    "(zero 2 is grad_op, zero 3 is full, hybrid is 2 or 3)"))
    # The ranks whose gradients meet: dp's, times cp's (context-parallel ranks share the weights).
    data, name = dp * cp, "dp" if cp == 1 else "dp*cp"
    if fsdp_strategy == "hybrid" and data < 2:
        out.append(("hybrid-dp", f"hybrid sharding splits dp into replicate x shard, needs {name} >= 2, "
                    f"got {name}={data}"))
    if dp_replicate is not None and (fsdp_strategy != "hybrid" or data % dp_replicate):
        out.append(("dp-replicate", f"dp_replicate={dp_replicate} needs fsdp_strategy 'hybrid' and must divide "
                    f"{name}={data} ({name} = dp_replicate * dp_shard); got fsdp_strategy={fsdp_strategy!r}"))
    stage = _zero_in_effect(zero, fsdp_strategy)
    if cpu_offload and stage != 3:
        out.append(("cpu-offload", "cpu_offload uses FSDP2's CPUOffloadPolicy, which this lab applies with full "
                    f"sharding only (zero 3 or fsdp_strategy 'full'/'hybrid'); got zero={zero}, "
                    f"fsdp_strategy={fsdp_strategy!r}"))
    out += reshard_combination_problems(reshard_after_forward, zero, fsdp_strategy, stage)
    resharding = stage in (2, 3) and any(reshard_units(stage, reshard_after_forward).values())
    if pp > 1 and schedule in SPLIT_BACKWARD_SCHEDULES and resharding:
        # Measured on torch 2.13 (gloo, tiny GPT): the first step's gradient norm is 5% (dualpipev) to
        # 38% (zbv) below the one-process reference, with dp = 1 too; ZeRO-2 matches it to 1e-7.
        out.append(("zero3-split-backward", f"zero 3 (FSDP2 resharding after forward; or reshard_after_forward "
                    f"True for a unit) with schedule {schedule!r} "
                    "trains with wrong gradients on the ranks (they differ from the one-process reference); use "
                    "zero 2 (fsdp_strategy 'grad_op') or a schedule without split backward (gpipe, 1f1b, "
                    "interleaved_1f1b, looped_bfs)"))
    out += expert_problems(ep, dp=dp, tp=tp, pp=pp, cp=cp, zero=zero, fsdp_strategy=fsdp_strategy,
                           cpu_offload=cpu_offload)
    out += context_problems(cp, sequence_parallel=sequence_parallel)
    if loss_parallel and pp > 1:
        out.append(("loss-parallel-pp", f"loss_parallel needs pp == 1, got pp={pp}: a pipeline schedule computes "
                    "the loss inside its last stage, outside torch's loss_parallel() context"))
    return out


def reshard_field_problems(value: object) -> list[Problem]:
    """[reshard-after-forward]: None (each unit follows the ZeRO stage), a bool for every unit, or a dict from
    unit names (``FSDP_UNITS``) to bools."""
    units = value if isinstance(value, dict) else {}
    if value is None or isinstance(value, bool) or (isinstance(value, dict) and set(units) <= set(FSDP_UNITS)
                                                    and all(isinstance(v, bool) for v in units.values())):
        return []
    return [("reshard-after-forward", "reshard_after_forward must be None (from zero), True or False, or a dict "
             f"from the FSDP units {', '.join(map(repr, FSDP_UNITS))} to True/False, e.g. "
             f"{{'root': False, 'blocks': True}}; got {value!r}")]


def reshard_combination_problems(value: object, zero: int, fsdp_strategy: str | None,
                                 stage: int | None) -> list[Problem]:
    """[reshard-fsdp]: reshard_after_forward says when FSDP2 frees each unit's gathered parameters, so it needs
    sharding FSDP2 (ZeRO-2/3); ``stage`` None (zero and fsdp_strategy disagree) is [zero-fsdp-agree]'s."""
    if value is None or stage is None or stage in (2, 3):
        return []
    return [("reshard-fsdp", f"reshard_after_forward={value!r} needs FSDP2 sharding (zero 2 or 3, or fsdp_strategy "
             f"'grad_op', 'full' or 'hybrid'): it says when each fully_shard unit frees its gathered parameters; "
             f"got zero={zero}, fsdp_strategy={fsdp_strategy!r}")]


def expert_problems(ep: int, *, dp: int, tp: int, pp: int, cp: int, zero: int, fsdp_strategy: str | None,
                    cpu_offload: bool) -> list[Problem]:
    """[ep-dp], [ep-combination], [ep-sharding]: expert parallelism lives inside the data-parallel ranks.

    The experts of each MoE layer are split over groups of ``ep`` dp ranks (EP inside DP, as
    DeepSpeed-MoE and torchtitan place it); the dense parts stay data-parallel over all dp ranks.
    """
    if ep == 1:
        return []
    out = []
    if dp % ep:
        out.append(("ep-dp", f"ep={ep} must divide dp={dp}: the experts are split over groups of ep data-parallel "
                    f"ranks (expert parallelism inside data parallelism), so use dp={ep} or a multiple"))
    others = [f"{name}={n}" for name, n in (("tp", tp), ("pp", pp), ("cp", cp)) if n > 1]
    if others:
        out.append(("ep-combination", f"ep={ep} with {', '.join(others)} is not built in this lab: expert "
                    "parallelism runs beside data parallelism (and ZeRO/FSDP on the dense parts) only. With tp every "
                    "tp rank routes the same tokens, so the all-to-all would carry each copy tp times unless the experts "
                    "were split over tp too (Megatron's expert TP); a pipeline stage or a cp shard would need its own "
                    "expert groups per stage or per sequence chunk"))
    if zero == 1 or fsdp_strategy in ("hybrid", "no_shard") or cpu_offload:
        out.append(("ep-sharding", f"ep={ep} shards the experts as DTensors on the expert mesh, so the dense parts "
                    "may use DDP (zero 0) or FSDP2 (zero 2/3) but not ZeroRedundancyOptimizer (zero 1, no "
                    "DTensors), hybrid or no_shard FSDP, or CPU offload; got "
                    f"zero={zero}, fsdp_strategy={fsdp_strategy!r}, cpu_offload={cpu_offload}"))
    return out


def context_problems(cp: int, *, sequence_parallel: bool) -> list[Problem]:
    """[cp-combination]: context parallelism (ring attention over a cp axis) and sequence parallelism both split
    the sequence, so they do not run together."""
    if cp > 1 and sequence_parallel:
        return [("cp-combination", f"cp={cp} cannot run with sequence_parallel: both split the sequence, and CP "
                 "already holds a sequence shard per rank (its norms and MLP run on s/cp tokens)")]
    return []


def cp_chunk_problems(cp: int, seq_len: int | None) -> list[Problem]:
    """[cp-chunks]: the zig-zag layout cuts each sequence into 2*cp equal chunks, two per rank."""
    if cp > 1 and seq_len is not None and seq_len % (2 * cp):
        return [("cp-chunks", f"seq_len={seq_len} must be divisible by 2*cp = {2 * cp}: each context-parallel rank "
                 "holds two equal chunks, one from each end of the sequence (load-balanced causal attention)")]
    return []


def expert_split_problems(ep: int, experts: int | None) -> list[Problem]:
    """[ep-experts]: each of the ep ranks of an expert group holds experts/ep whole experts."""
    if ep == 1:
        return []
    if not experts:
        return [("ep-experts", f"ep={ep} splits a mixture of experts, but the model has none: give it experts=E "
                 "(lab.GPT(..., experts=8, top_k=2))")]
    if experts % ep:
        return [("ep-experts", f"experts={experts} must be divisible by ep={ep}: each rank of an expert group holds "
                 "experts/ep whole experts")]
    return []


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


def stage_layers_problems(stage_layers: object, pp: int, num_stages: int) -> list[Problem]:
    """[stage-layers]: ``stage_layers`` is None (equal stages) or, for a pipeline, one block count >= 1 per stage,
    pp * stages_per_rank of them in stage order (stage s holds the blocks after those of stages 0..s-1)."""
    if stage_layers is None:
        return []
    counts = list(stage_layers) if isinstance(stage_layers, (list, tuple)) else None
    if counts is None or not all(type(n) is int and n >= 1 for n in counts):
        return [("stage-layers", f"stage_layers must be a list of ints >= 1, the blocks of each pipeline stage; "
                 f"got {stage_layers!r}")]
    if pp == 1:
        return [("stage-layers", f"stage_layers={counts} splits a pipeline's blocks, but pp=1 runs no pipeline")]
    if len(counts) != num_stages:
        return [("stage-layers", f"stage_layers={counts} has {len(counts)} entries; it needs one per pipeline stage, "
                 f"pp*stages_per_rank = {num_stages}")]
    return []


def stage_split_problems(layers: int, num_stages: int, stage_layers: Sequence[int] | None = None) -> list[Problem]:
    """[pp-layers], [stage-layers-sum]: the stages' blocks add up to the model's layers.

    Without ``stage_layers`` the stages are of equal depth, so layers divides by the stage count (each
    stage's cost, and the bubble, is then what the theory assumes); with it, its counts sum to layers.
    """
    if stage_layers is not None:
        if sum(stage_layers) != layers:
            return [("stage-layers-sum", f"stage_layers={list(stage_layers)} holds {sum(stage_layers)} blocks in "
                     f"all, but the model has layers={layers}: the stages must hold every block once")]
        return []
    if layers % num_stages:
        return [("pp-layers", f"layers={layers} must be divisible by the number of stages "
                 f"pp*stages_per_rank = {num_stages}, or stage_layers must give each stage's blocks")]
    return []


def _zero_in_effect(zero: int, fsdp_strategy: str | None) -> int | None:
    """The ZeRO stage, or None while zero and fsdp_strategy disagree (reported by their own rule)."""
    try:
        return zero_stage(zero, fsdp_strategy)
    except ValueError:
        return None
