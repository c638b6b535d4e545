"""The ``Strategy`` a run resolves to: which parallelisms ``parallelize`` applies, and how.

Algorithm: none of its own; it names the composition torchtitan's ``parallelize``
applies (Megatron TP: Shoeybi et al., 2019; ZeRO: Rajbhandari et al., 2020; FSDP:
Zhao et al., 2023) and the rules for combining them:

- ``zero`` (or an FSDP strategy name, ``kernels.contract.layout_rules.zero_stage``) picks how
  gradients meet over dp: DDP (0), ZeRO-1 (1) or FSDP2 (2, 3; hybrid: HSDP);
- TP with dp > 1 and zero < 2, outside a pipeline, replicates with FSDP2 on a
  (dp, 1) HSDP mesh: DDP cannot take TP's DTensors;
- inside a pipeline, zero 0 with dp > 1 averages gradients by hand after the schedule
  (one all_reduce per gradient, shard by shard for TP DTensors);
- which combinations can run is ``kernels.contract.layout_combinations``' (the rules ``lab.Parallel``
  applies too): ZeRO-1 cannot shard DTensors, CPU offload needs full sharding (zero 3), ...;
- bf16 is FSDP2's MixedPrecisionPolicy where FSDP2 syncs gradients, and
  ``torch.autocast`` around each module's forward everywhere else (``Strategy.autocast``);

Run alone (prints the strategy of a few layouts)::

    python -m kernels.parallel.strategy
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kernels.contract import layout_rules
from kernels.contract.config_rules import ConfigError
from kernels.contract.layout_combinations import combination_problems
from kernels.parallel.mesh import ParallelDims
from kernels.contract.run_config import RunConfig


class GradSync(enum.Enum):
    """How the dp replicas' gradients meet."""

    NONE = "none"  # dp == 1
    DDP = "ddp"  # torch DDP, bucketed all-reduce overlapped with backward
    ZERO1 = "zero1"  # DDP's (or, in a pipeline, the hand) all-reduce, then a ZeroRedundancyOptimizer
    FSDP = "fsdp"  # FSDP2: reduce-scatter (ZeRO-2/3), HSDP adds an all-reduce over replicas
    ALLREDUCE = "allreduce"  # pipeline only: one all_reduce per gradient after the schedule


@dataclass(frozen=True)
class Strategy:
    """What ``parallelize`` applies and the loop runs; built by ``resolve_strategy``."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    grad_sync: GradSync = GradSync.NONE
    zero: int = 0  # the ZeRO stage (0-3)
    hybrid: bool = False  # FSDP on the 2D (dp_replicate, dp_shard) mesh
    dp_replicate: int = 1  # HSDP replica groups (1 without HSDP)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool = False
    mixed_precision: str | None = None  # "bf16": FSDP2's MixedPrecisionPolicy, or autocast without FSDP2
    cpu_offload: bool = False
    compile: bool = False  # torch.compile each block
    schedule: str | None = None  # pipeline schedule (pp > 1)
    stages_per_rank: int = 1
    microbatches: int = 1

    @property
    def autocast(self) -> bool:
        """bf16 through ``torch.autocast`` (``kernels.parallel.autocast``): every bf16 layout FSDP2 does not sync."""
        return self.mixed_precision == "bf16" and self.grad_sync is not GradSync.FSDP

    @property
    def kind(self) -> str:
        """The name the records carry: single/tp/ddp/zero1/fsdp, or with pp pp/allreduce/zero1/fsdp."""
        if self.grad_sync is GradSync.NONE:
            return "pp" if self.pp > 1 else ("tp" if self.tp > 1 else "single")
        return self.grad_sync.value

    def describe(self) -> str:
        """One line: the mesh sizes and how the dp replicas' gradients meet (the torchrun CLI prints it)."""
        sizes = f"pp {self.pp} x dp {self.dp} x tp {self.tp}"
        if self.grad_sync is not GradSync.FSDP:
            return f"{sizes}: {_SYNC_WORDS[self.grad_sync]}"
        if self.hybrid and self.dp_replicate == self.dp:  # one shard per replica: replication
            why = "; DDP itself cannot take TP's DTensors" if self.tp > 1 else ""
            return (f"{sizes}: FSDP2 replicating over dp (HSDP, {self.dp} replicas of 1 shard): whole parameters, "
                    f"gradients all-reduced as under DDP{why}")
        shards = self.dp // self.dp_replicate
        hsdp = f" as HSDP ({self.dp_replicate} replicas of {shards} shards)" if self.hybrid else ""
        return f"{sizes}: FSDP2 ZeRO-{self.zero}{hsdp}"


_SYNC_WORDS = {GradSync.NONE: "no gradient sync (dp 1)", GradSync.DDP: "DDP (bucketed gradient all-reduce)",
               GradSync.ZERO1: "ZeRO-1 (gradient all-reduce, sharded optimizer state)",
               GradSync.ALLREDUCE: "one all_reduce per gradient after the schedule"}


def resolve_strategy(dims: ParallelDims, *, zero: int = 0, fsdp_strategy: str | None = None, dp_replicate: int | None = None,
                     sequence_parallel: bool = False, loss_parallel: bool = False,
                     activation_checkpointing: bool = False, mixed_precision: str | None = None,
                     cpu_offload: bool = False, compile: bool = False, schedule: str | None = None,
                     stages_per_rank: int | None = None, microbatches: int | None = None) -> Strategy:
    """The one Strategy these options mean on ``dims``.

    Raises ``ConfigError`` (a ValueError) naming the rules a combination breaks.
    """
    schedule = layout_rules.canonical_schedule(schedule or "1f1b")
    problems = combination_problems(dp=dims.dp, tp=dims.tp, pp=dims.pp, zero=zero, fsdp_strategy=fsdp_strategy,
                                    dp_replicate=dp_replicate, cpu_offload=cpu_offload, loss_parallel=loss_parallel,
                                    schedule=schedule, stages_per_rank=stages_per_rank,
                                    microbatches=microbatches if dims.pp > 1 else None)
    if problems:  # the same rules lab.Parallel applies on the driver
        raise ConfigError(problems)
    zero = layout_rules.zero_stage(zero, fsdp_strategy)
    hybrid = fsdp_strategy == "hybrid"
    replicate = layout_rules.hsdp_split(dims.dp, dp_replicate)[0] if hybrid else 1
    if dims.pp > 1:
        sync = (GradSync.FSDP if zero >= 2 else GradSync.ZERO1 if zero == 1
                else GradSync.ALLREDUCE if dims.dp > 1 else GradSync.NONE)
        hybrid = hybrid and zero >= 2
        v = int(stages_per_rank or layout_rules.default_stages_per_rank(schedule))
        pipeline = {"schedule": schedule, "stages_per_rank": v,
                    "microbatches": int(microbatches or layout_rules.default_microbatches(schedule, dims.pp, v))}
    else:
        if dims.tp > 1 and dims.dp > 1 and zero < 2:  # DDP cannot take TP DTensors: FSDP2 replication
            zero, hybrid, replicate = 2, True, dims.dp
        sync = (GradSync.FSDP if zero >= 2 else GradSync.ZERO1 if zero == 1
                else GradSync.DDP if dims.dp > 1 else GradSync.NONE)
        pipeline = {"microbatches": int(microbatches or 1)}
    return Strategy(dp=dims.dp, tp=dims.tp, pp=dims.pp, grad_sync=sync, zero=zero, hybrid=hybrid,
                    dp_replicate=replicate if hybrid else 1, sequence_parallel=bool(sequence_parallel),
                    loss_parallel=bool(loss_parallel) and dims.tp > 1,
                    activation_checkpointing=bool(activation_checkpointing), mixed_precision=mixed_precision,
                    cpu_offload=bool(cpu_offload), compile=bool(compile), **pipeline)


def run_strategy(run: RunConfig, world_size: int | None = None) -> tuple[ParallelDims, Strategy]:
    """The mesh sizes and the Strategy ``run`` means on ``world_size`` ranks (default: dp * tp * pp)."""
    probe = ParallelDims(dp=run.dp, tp=run.tp, pp=run.pp, world_size=world_size or run.dp * run.tp * run.pp)
    strategy = resolve_strategy(
        probe, zero=run.zero, fsdp_strategy=run.fsdp_strategy, dp_replicate=run.dp_replicate,
        sequence_parallel=run.sequence_parallel, loss_parallel=run.loss_parallel,
        activation_checkpointing=run.activation_checkpointing, mixed_precision=run.mixed_precision,
        cpu_offload=run.cpu_offload, compile=run.compile, schedule=run.schedule if run.pp > 1 else None,
        stages_per_rank=run.stages_per_rank, microbatches=run.microbatches)
    return ParallelDims(dp=run.dp, tp=run.tp, pp=run.pp, world_size=probe.world_size,
                        dp_replicate=strategy.dp_replicate, order=tuple(run.mesh_order)), strategy


if __name__ == "__main__":
    for sizes, opts in (({"dp": 4}, {}), ({"dp": 2, "tp": 2}, {}), ({"dp": 4}, {"fsdp_strategy": "hybrid"}),
                        ({"pp": 2, "dp": 2}, {"schedule": "zbv"})):
        dims = ParallelDims(world_size=sizes.get("dp", 1) * sizes.get("tp", 1) * sizes.get("pp", 1), **sizes)
        print(sizes, opts, "->", resolve_strategy(dims, **opts).describe())
