"""The parallel layout of one experiment, checked on the driver before any rank runs.

``Parallel`` is a frozen dataclass in the spirit of torchtitan's ``ParallelDims``: it
is passed explicitly, checks itself, and says what is wrong in words. The mesh
order is ``(pp, dp, tp)`` with tp varying fastest (docs/design.md#mesh-order).

Two kinds of checks:

- ``validate_fields`` (run on construction) needs only the fields: known schedule
  names, ZeRO stage, how ZeRO and the FSDP strategy agree, the pipeline schedules'
  micro-batch rules, and so on.
- ``check(model_cfg, world_size, global_batch)`` adds the rules that need the model
  and the world, raises one ``ParallelConfigError`` naming every violated rule, and
  returns warnings for layouts that are valid but wasteful.

Every rule has a short name (the keys of ``RULES``); error messages start with
``[name]`` so tests, widgets and users can tell them apart. The schedule, placement,
micro-batch, ZeRO and HSDP rules come from ``kernels.layout_rules``, which the ranks
use too (its micro-batch rules are torch 2.13's own checks). No torch here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kernels.layout_rules import (FSDP_STRATEGIES, FSDP_STRATEGY_ZERO, SCHEDULES, default_microbatches,
                                  default_stages_per_rank, hsdp_split, microbatch_problems, stage_problems,
                                  zero_stage)

MIXED_PRECISION = (None, "bf16")

RULES = {
    "positive-sizes": "dp, tp, pp, microbatches, stages_per_rank and dp_replicate must be positive ints",
    "world-size": "dp * tp * pp must equal the world size",
    "tp-heads": "the number of heads must be divisible by tp",
    "tp-d-model": "d_model must be divisible by tp",
    "tp-d-ff": "d_ff must be divisible by tp",
    "pp-layers": "layers must be divisible by the number of stages pp * stages_per_rank",
    "pp-microbatches": "microbatches must be at least pp (gpipe with 1 is naive model parallelism)",
    "unknown-schedule": "the schedule must be one of SCHEDULES",
    "single-stage-schedule": "gpipe and 1f1b run exactly one stage per rank (stages_per_rank == 1)",
    "1f1b-microbatches": "Schedule1F1B needs microbatches >= the number of stages",
    "interleaved-stages-per-rank": "interleaved schedules need stages_per_rank >= 2",
    "interleaved-rounds": "interleaved schedules need microbatches % max(1, microbatches // pp) == 0",
    "v-schedule-stages": "zbv and dualpipev need exactly 2 stages per rank (stages_per_rank == 2)",
    "dualpipev-microbatches": "DualPipeV needs microbatches >= the number of stages",
    "global-batch": "global_batch must be divisible by dp * microbatches",
    "zero-stage": "zero must be 0, 1, 2 or 3",
    "fsdp-strategy": "fsdp_strategy must be None or one of FSDP_STRATEGIES",
    "zero-fsdp-agree": "zero and fsdp_strategy given together must agree (2: grad_op, 3: full)",
    "hybrid-dp": "hybrid sharding needs dp >= 2 to split into replicate x shard",
    "dp-replicate": "dp_replicate is for fsdp_strategy 'hybrid' only, and must divide dp",
    "mixed-precision": "mixed_precision must be None or 'bf16'",
    "cpu-offload": "cpu_offload needs full sharding (zero 3 / FSDP full or hybrid)",
    "zero1-dtensor": "ZeRO-1 (ZeroRedundancyOptimizer) cannot shard DTensor parameters, so not with tp > 1",
}


class ParallelConfigError(ValueError):
    """A layout breaks one or more rules; ``rules`` names them (keys of ``RULES``)."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.rules = tuple(rule for rule, _ in problems)
        self.problems = list(problems)
        lines = [f"[{rule}] {msg}" for rule, msg in problems]
        super().__init__("invalid parallel layout:\n  " + "\n  ".join(lines))


@dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel degree (replicas, or shards under ZeRO/FSDP)
    tp: int = 1  # tensor-parallel degree (Megatron column/row split inside a block)
    pp: int = 1  # pipeline-parallel degree (ranks along the pipeline)
    zero: int = 0  # 0 plain DDP, 1 ZeroRedundancyOptimizer, 2/3 fully_shard without/with reshard
    fsdp_strategy: str | None = None  # "full" | "grad_op" | "no_shard" | "hybrid"; None: from zero
    schedule: str = "1f1b"  # pipeline schedule, one of SCHEDULES
    microbatches: int | None = None  # per step and dp rank; None: see num_microbatches
    stages_per_rank: int | None = None  # pipeline stages on each pp rank; None: see num_stages_per_rank
    dp_replicate: int | None = None  # HSDP: dp = dp_replicate * dp_shard; None: see hsdp_sizes
    sequence_parallel: bool = False  # shard norms/dropout over the sequence dim on the tp axis
    activation_checkpointing: bool = False  # recompute each block in backward
    mixed_precision: str | None = None  # None (fp32) or "bf16" (FSDP2's MixedPrecisionPolicy, else torch.autocast)
    cpu_offload: bool = False  # keep sharded params/grads/optimizer on CPU (CPUOffloadPolicy)

    def __post_init__(self) -> None:
        self.validate_fields()

    # --- resolved values --------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def num_stages_per_rank(self) -> int:
        """stages_per_rank, or its default: 2 for multi-stage schedules, 1 for gpipe/1f1b."""
        if self.stages_per_rank is not None:
            return self.stages_per_rank
        return default_stages_per_rank(self.schedule)

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp * num_stages_per_rank."""
        return self.pp * self.num_stages_per_rank

    @property
    def num_microbatches(self) -> int:
        """microbatches, or its default: pp (1 without PP), and the stage count for dualpipev."""
        if self.microbatches is not None:
            return self.microbatches
        return default_microbatches(self.schedule, self.pp, self.num_stages_per_rank)

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in effect: zero, or the one fsdp_strategy implies when zero is 0."""
        return zero_stage(self.zero, self.fsdp_strategy)

    @property
    def hsdp_sizes(self) -> tuple[int, int]:
        """(dp_replicate, dp_shard) under hybrid sharding (dp_replicate or the default split); (1, dp) otherwise."""
        return hsdp_split(self.dp, self.dp_replicate) if self.fsdp_strategy == "hybrid" else (1, self.dp)

    @property
    def uses_fsdp(self) -> bool:
        """True when parameters are wrapped by ``fully_shard`` (ZeRO-2/3 or an FSDP strategy)."""
        return self.fsdp_strategy is not None or self.zero in (2, 3)

    # --- rules --------------------------------------------------------------------
    def validate_fields(self) -> None:
        """Raise ParallelConfigError for every rule the fields alone break."""
        problems = self._field_problems()
        if problems:
            raise ParallelConfigError(problems)

    def check(self, model_cfg: Any, world_size: int, global_batch: int) -> list[str]:
        """Check against a model (layers/d_model/heads/d_ff), a world and a global batch.

        Raises ParallelConfigError naming every violated rule; returns warnings.
        """
        problems = self._field_problems()
        if not problems:  # the rules below assume sane sizes
            problems += self._model_problems(model_cfg, world_size, global_batch)
        if problems:
            raise ParallelConfigError(problems)
        return self._warnings()

    def _field_problems(self) -> list[tuple[str, str]]:
        sizes = {"dp": self.dp, "tp": self.tp, "pp": self.pp, "microbatches": self.microbatches,
                 "stages_per_rank": self.stages_per_rank, "dp_replicate": self.dp_replicate}
        bad = [f"{k}={v!r}" for k, v in sizes.items()
               if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1)]
        if bad:
            return [("positive-sizes", f"sizes must be positive ints: {', '.join(bad)}")]
        if self.schedule not in SCHEDULES:  # the defaults below depend on a known schedule
            return stage_problems(self.schedule, 1)
        return self._schedule_problems() + self._sharding_problems()

    def _schedule_problems(self) -> list[tuple[str, str]]:
        v = self.num_stages_per_rank
        return stage_problems(self.schedule, v) + microbatch_problems(self.schedule, self.pp, v,
                                                                      self.num_microbatches)

    def _sharding_problems(self) -> list[tuple[str, str]]:
        out = []
        if self.zero not in (0, 1, 2, 3) or isinstance(self.zero, bool):
            out.append(("zero-stage", f"zero must be 0, 1, 2 or 3, got {self.zero!r}"))
        if self.fsdp_strategy is not None and self.fsdp_strategy not in FSDP_STRATEGIES:
            out.append(("fsdp-strategy", f"unknown fsdp_strategy {self.fsdp_strategy!r}; "
                        f"allowed: None, {', '.join(FSDP_STRATEGIES)}"))
        elif self.fsdp_strategy is not None and self.zero != 0 \
                and self.zero not in FSDP_STRATEGY_ZERO[self.fsdp_strategy]:
            out.append(("zero-fsdp-agree", f"zero={self.zero} disagrees with fsdp_strategy="
                        f"{self.fsdp_strategy!r} (zero 2 is grad_op, zero 3 is full, hybrid is 2 or 3)"))
        if self.fsdp_strategy == "hybrid" and self.dp < 2:
            out.append(("hybrid-dp", f"hybrid sharding splits dp into replicate x shard, needs dp >= 2, got dp={self.dp}"))
        if self.dp_replicate is not None and (self.fsdp_strategy != "hybrid" or self.dp % self.dp_replicate):
            out.append(("dp-replicate", f"dp_replicate={self.dp_replicate} needs fsdp_strategy 'hybrid' and "
                        f"must divide dp={self.dp} (dp = dp_replicate * dp_shard); "
                        f"got fsdp_strategy={self.fsdp_strategy!r}"))
        if self.mixed_precision not in MIXED_PRECISION:
            out.append(("mixed-precision", f"mixed_precision must be None or 'bf16', got {self.mixed_precision!r}"))
        if self.cpu_offload and self._zero_in_effect() != 3:
            out.append(("cpu-offload", "cpu_offload uses FSDP2's CPUOffloadPolicy, which this lab applies "
                        f"with full sharding only (zero 3 or fsdp_strategy 'full'/'hybrid'); got zero={self.zero}, "
                        f"fsdp_strategy={self.fsdp_strategy!r}"))
        if self.zero == 1 and self.tp > 1:
            out.append(("zero1-dtensor", "zero=1 uses ZeroRedundancyOptimizer, which does not support "
                        f"DTensor parameters, and tp={self.tp} makes them DTensors; use zero 2/3 (FSDP2) with TP"))
        return out

    def _zero_in_effect(self) -> int | None:
        """zero_stage, or None while zero and fsdp_strategy disagree (reported by their own rules)."""
        try:
            return self.zero_stage
        except ValueError:
            return None

    def _model_problems(self, cfg: Any, world_size: int, global_batch: int) -> list[tuple[str, str]]:
        d_ff = getattr(cfg, "d_ff", None) or 4 * cfg.d_model
        out = []
        if self.world_size != world_size:
            out.append(("world-size", f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world_size} "
                        f"must equal the world size {world_size}"))
        for rule, name, value in (("tp-heads", "heads", cfg.heads), ("tp-d-model", "d_model", cfg.d_model),
                                  ("tp-d-ff", "d_ff", d_ff)):
            if value % self.tp:
                out.append((rule, f"{name}={value} must be divisible by tp={self.tp}"))
        if cfg.layers % self.num_stages:
            out.append(("pp-layers", f"layers={cfg.layers} must be divisible by the number of stages "
                        f"pp*stages_per_rank = {self.pp}*{self.num_stages_per_rank} = {self.num_stages}"))
        per_step = self.dp * self.num_microbatches
        if global_batch % per_step:
            out.append(("global-batch", f"global_batch={global_batch} must be divisible by "
                        f"dp*microbatches = {self.dp}*{self.num_microbatches} = {per_step}"))
        return out

    def _warnings(self) -> list[str]:
        out = []
        if self.zero_stage in (2, 3) and self.pp > 1:
            out.append(f"ZeRO-{self.zero_stage} with pp={self.pp} is wasteful: parameters are all-gathered "
                       "(and gradients reduce-scattered) for every micro-batch")
        if self.zero_stage in (1, 2, 3) and self.dp == 1:
            out.append(f"ZeRO-{self.zero_stage} with dp=1 has nothing to shard over")
        if self.fsdp_strategy == "hybrid" and 1 in self.hsdp_sizes:
            replicate, shard = self.hsdp_sizes
            out.append(f"hybrid with dp={self.dp} splits into {replicate} replicate x {shard} shard, "
                       "so it equals plain replication or full sharding")
        if self.pp > 1 and self.schedule == "gpipe" and self.num_microbatches == 1:
            out.append(f"one micro-batch on pp={self.pp} is naive model parallelism: one rank works at a time, "
                       f"the bubble is (p-1)/p = {(self.pp - 1) / self.pp:.0%}")
        if self.sequence_parallel and self.tp == 1:
            out.append("sequence_parallel has no effect with tp=1")
        if self.pp == 1 and (self.schedule != "1f1b" or self.num_stages_per_rank > 1):
            out.append(f"pp=1 runs no pipeline between ranks; schedule {self.schedule!r} "
                       f"with {self.num_stages_per_rank} stage(s) per rank only adds overhead")
        return out

    # --- conversion -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict (unresolved: None stays None)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Parallel":
        """Build from ``to_dict`` output; unknown keys are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown Parallel fields: {', '.join(unknown)}")
        return cls(**data)

    def describe(self) -> str:
        """One line, e.g. "PP2×DP2×TP2 zero=0 1f1b m=4"."""
        parts = [f"PP{self.pp}×DP{self.dp}×TP{self.tp}", f"zero={self.zero_stage}"]
        if self.fsdp_strategy is not None:
            parts[-1] += f"({self.fsdp_strategy})"
        parts += [self.schedule, f"m={self.num_microbatches}"]
        if self.num_stages_per_rank > 1:
            parts.append(f"v={self.num_stages_per_rank}")
        if self.fsdp_strategy == "hybrid":
            parts.append("{}x{}".format(*self.hsdp_sizes))
        flags = [("sp", self.sequence_parallel), ("ac", self.activation_checkpointing),
                 ("offload", self.cpu_offload)]
        parts += [name for name, on in flags if on]
        if self.mixed_precision:
            parts.append(self.mixed_precision)
        return " ".join(parts)
