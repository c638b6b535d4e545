"""``Strategy``: the one resolved layout the ranks run, derived from a layout's fields by ``resolve_strategy``.

``lab.Parallel`` is what the user writes; ``resolve_strategy`` turns its fields into this
frozen record (defaults filled in, the ZeRO stage and how gradients meet decided), and
``RunConfig`` carries it to the ranks, which build the mesh and ``parallelize`` from it
alone. One rule set decides which layouts exist (``layout_problems``: each field, then
``kernels.contract.layout_combinations``); the driver applies it before launching, and
each rank again as it reads the record back (``Strategy.__post_init__``).

The resolution follows torchtitan's ``parallelize`` (Megatron TP: Shoeybi et al., 2019;
ZeRO: Rajbhandari et al., 2020; FSDP: Zhao et al., 2023):

- ``zero`` (or an FSDP strategy name) picks how gradients meet over dp: DDP (0), ZeRO-1
  (1) or FSDP2 (2, 3; hybrid: HSDP);
- TP with dp > 1 and zero 0, outside a pipeline, replicates with FSDP2 on a (dp, 1) HSDP
  mesh, because DDP cannot take TP's DTensors; ``describe`` says so;
- inside a pipeline, zero 0 with dp > 1 all-reduces each gradient after the schedule.
- ZeRO-1 with TP or PP (``zero1_slices``, no DDP): each dp rank steps a 1/dp slice of every local
  shard (``kernels.parallel.zero1_slices``); flat DP keeps DDP and ZeroRedundancyOptimizer.
- ``reshard_after_forward`` given (FSDP2 only) is filled in per unit, root and blocks, from the stage
  (``layout_rules.reshard_units``); {"root": False, "blocks": True} keeps the root whole, since backward
  would gather it again at once, and frees each block.

``describe()`` is the one sentence for a layout that the views, errors, CLI and notebooks
print: what was chosen and what it runs as. Standard library only.

Try it alone::

    python -m kernels.contract.strategy
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kernels.contract import config_rules
from kernels.contract.config_rules import ConfigError, Problem
from kernels.contract.layout_combinations import combination_problems, reshard_field_problems
from kernels.contract.records import Record
from kernels.contract.layout_rules import (MESH_AXES, Schedule, canonical_schedule, default_microbatches,
                                           default_stages_per_rank, hsdp_split, mesh_order_problems, reshard_units,
                                           zero_stage)

FLAGS = ("sequence_parallel", "loss_parallel", "activation_checkpointing", "cpu_offload", "compile")


class GradSync(enum.StrEnum):
    """How the dp replicas' gradients meet."""

    NONE = "none"  # dp == 1
    DDP = "ddp"  # torch DDP, bucketed all-reduce overlapped with backward
    ZERO1 = "zero1"  # DDP's all-reduce and ZeroRedundancyOptimizer, or (TP, PP) the hand's and zero1_slices
    FSDP = "fsdp"  # FSDP2: reduce-scatter (ZeRO-2/3), HSDP adds an all-reduce over replicas
    ALLREDUCE = "allreduce"  # pipeline only: one all_reduce per gradient after the schedule


@dataclass(frozen=True)
class Strategy(Record):
    """A layout resolved: every default filled in, the ZeRO stage in effect and how gradients meet."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert parallelism: each MoE layer's experts split over groups of ep dp ranks
    cp: int = 1  # context parallelism: each sequence split over cp ranks, attention as a ring
    requested_zero: int = 0  # the stage the user chose (fsdp_strategy folded in)
    zero: int = 0  # the stage it runs at: FSDP2 replication of TP x DP runs zero 0 as 2 over one shard
    grad_sync: GradSync = GradSync.NONE
    hybrid: bool = False  # FSDP on the 2D (dp_replicate, dp_shard) mesh
    dp_replicate: int = 1  # HSDP replica groups (1 without HSDP)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool | str = False  # True: each block recomputed; "selective": all but its matmuls
    mixed_precision: str | None = None  # "bf16": FSDP2's MixedPrecisionPolicy, or autocast without FSDP2
    cpu_offload: bool = False
    compile: bool = False  # torch.compile each block
    schedule: Schedule | None = None  # pipeline schedule (pp > 1 only)
    stages_per_rank: int = 1
    microbatches: int = 1
    mesh_order: tuple[str, ...] = MESH_AXES  # rank order over the mesh axes, outermost first
    # Per FSDP unit ({"root": bool, "blocks": bool}, layout_rules.FSDP_UNITS): free its gathered parameters after
    # forward? None: every unit as the stage says (zero 3 frees, zero 2 keeps).
    reshard_after_forward: dict[str, bool] | None = field(default=None, hash=False)  # a dict has no hash
    # Blocks per pipeline stage, pp·stages_per_rank counts in stage order; None: equal runs (layout_rules.layer_split).
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # A record read back from JSON has strings and lists; the ranks check it as the driver did.
        self._enum_field("grad_sync", GradSync)
        if self.schedule is not None:
            object.__setattr__(self, "schedule", _schedule(self.schedule))
        object.__setattr__(self, "mesh_order", tuple(self.mesh_order))
        if isinstance(self.stage_layers, list):  # JSON gives a list
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        problems = layout_problems(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, zero=self.zero,
                                   fsdp_strategy="hybrid" if self.hybrid else None,
                                   dp_replicate=self.dp_replicate if self.hybrid else None,
                                   schedule=self.schedule or Schedule.ONE_F_ONE_B, microbatches=self.microbatches,
                                   stages_per_rank=self.stages_per_rank, mixed_precision=self.mixed_precision,
                                   mesh_order=self.mesh_order, reshard_after_forward=self.reshard_after_forward,
                                   stage_layers=self.stage_layers, **{name: getattr(self, name) for name in FLAGS})
        if problems:
            raise ConfigError(problems)

    @property
    def reshard_units(self) -> dict[str, bool]:
        """Per FSDP unit, whether FSDP2 frees its gathered parameters after forward (under FSDP2 only)."""
        return reshard_units(self.zero, self.reshard_after_forward)

    @property
    def world(self) -> int:
        """dp · cp · tp · pp."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def zero1_slices(self) -> bool:
        """ZeRO-1 where no DDP wraps the model (TP's DTensors, or a pipeline): a 1/dp slice of every local shard
        (``kernels.parallel.zero1_slices``); flat DP keeps DDP's overlapped all-reduce and ZeroRedundancyOptimizer."""
        return self.grad_sync is GradSync.ZERO1 and (self.tp > 1 or self.pp > 1)

    @property
    def data_ranks(self) -> int:
        """Ranks whose gradients meet (dp · cp): context-parallel ranks hold the same weights and different tokens."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks one parameter is sharded over: dp · cp / dp_replicate."""
        return self.data_ranks // self.dp_replicate

    @property
    def num_stages(self) -> int:
        """Pipeline stages in all: pp · stages_per_rank."""
        return self.pp * self.stages_per_rank

    @property
    def autocast(self) -> bool:
        """bf16 through ``torch.autocast``: every bf16 layout whose gradients FSDP2 does not sync."""
        return self.mixed_precision == "bf16" and self.grad_sync is not GradSync.FSDP

    @property
    def kind(self) -> str:
        """The name the records carry: single/tp/ddp/zero1/fsdp, or with pp pp/allreduce/zero1/fsdp."""
        if self.grad_sync is GradSync.NONE:
            return "pp" if self.pp > 1 else ("tp" if self.tp > 1 else "single")
        return self.grad_sync.value

    def describe(self) -> str:
        """What was chosen and what it runs as, e.g. "TP2×DP2, ZeRO-0 (DP through FSDP2 replicate: ...)"."""
        sizes = "×".join(f"{axis.upper()}{n}" for axis, n in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp),
                                                               ("dp", self.dp))
                         if n > 1) or "one rank"
        parts = [sizes]
        if self.data_ranks > 1 or self.requested_zero:
            parts.append(f"ZeRO-{self.requested_zero} ({self._how_dp()})")
        if self.ep > 1:
            parts.append(f"EP{self.ep} inside DP{self.dp}: each MoE layer's experts split over groups of {self.ep} "
                         "dp ranks, tokens sent by all-to-all")
        if self.cp > 1:
            parts.append(f"each sequence split over {self.cp} ranks in zig-zag chunks, ring attention")
        if self.pp > 1:
            v = f", {self.stages_per_rank} stages per rank" if self.stages_per_rank > 1 else ""
            uneven = f", stages of {'/'.join(map(str, self.stage_layers))} blocks" if self.stage_layers else ""
            parts.append(f"{self.schedule} with {self.microbatches} micro-batches{v}{uneven}")
        elif self.microbatches > 1:
            parts.append(f"{self.microbatches} accumulated micro-batches")
        selective = self.activation_checkpointing == "selective"
        parts += [f"selective {words}" if name == "activation_checkpointing" and selective else words
                  for name, words in _FLAG_WORDS if getattr(self, name) and (name != "loss_parallel" or self.tp > 1)]
        parts += [self.mixed_precision] if self.mixed_precision else []
        if self.mesh_order != MESH_AXES:
            parts.append("rank order " + ",".join(self.mesh_order))
        return ", ".join(parts)

    def _how_dp(self) -> str:
        if self.grad_sync is not GradSync.FSDP:
            return _ZERO1_SLICE_WORDS if self.zero1_slices else _SYNC_WORDS[self.grad_sync]
        if self.hybrid and self.dp_shard == 1:
            why = "; DDP cannot take TP's DTensors" if self.tp > 1 else ""
            return f"DP through FSDP2 replicate: whole parameters, all-reduced gradients, as DDP{why}"
        units = {unit: "freed after forward" if free else "kept until backward ends"
                 for unit, free in self.reshard_units.items()}
        when = f"per block and {units['blocks']}" if len(set(units.values())) == 1 else \
            "per unit, " + " and ".join(f"the {unit}' {words}" if unit == "blocks" else f"the {unit}'s {words}"
                                        for unit, words in units.items())
        hsdp = f"; HSDP: {self.dp_replicate} replicas of {self.dp_shard} shards" if self.hybrid else ""
        return f"FSDP2: sharded parameters gathered {when}; gradients reduce-scattered{hsdp}"


_ZERO1_SLICE_WORDS = ("ZeRO-1 by slices: gradients all-reduced, each dp rank steps 1/dp of every local tensor, "
                      "then all-gathers")
_SYNC_WORDS = {GradSync.NONE: "nothing to shard over with one dp rank",
               GradSync.DDP: "DDP: whole parameters, gradients all-reduced in buckets during backward",
               GradSync.ZERO1: "ZeroRedundancyOptimizer: gradients all-reduced, optimizer state split over dp",
               GradSync.ALLREDUCE: "whole parameters, one all-reduce per gradient after the schedule"}
_FLAG_WORDS = (("sequence_parallel", "sequence parallel"), ("loss_parallel", "loss parallel"),
               ("activation_checkpointing", "activation checkpointing"), ("cpu_offload", "CPU offload"),
               ("compile", "torch.compile"))


def layout_problems(*, dp: Any = 1, tp: Any = 1, pp: Any = 1, ep: Any = 1, cp: Any = 1, zero: Any = 0, fsdp_strategy: Any = None,
                    dp_replicate: Any = None, schedule: Any = Schedule.ONE_F_ONE_B, microbatches: Any = None,
                    stages_per_rank: Any = None, sequence_parallel: Any = False, loss_parallel: Any = False,
                    activation_checkpointing: Any = False, mixed_precision: Any = None, cpu_offload: Any = False,
                    compile: Any = False, mesh_order: Any = MESH_AXES,
                    reshard_after_forward: Any = None, stage_layers: Any = None) -> list[Problem]:
    """Every named rule a layout's fields break, each alone and then together; empty when it can run.

    ``lab.Parallel`` and ``resolve_strategy`` call this, and a ``Strategy`` read back on a rank
    checks itself with it, so all three accept and refuse the same layouts.
    """
    out = config_rules.size_problems({"dp": dp, "tp": tp, "pp": pp, "ep": ep, "cp": cp},
                                     {"microbatches": microbatches, "stages_per_rank": stages_per_rank,
                                      "dp_replicate": dp_replicate})
    out += config_rules.flag_problems({"sequence_parallel": sequence_parallel, "loss_parallel": loss_parallel,
                                       "cpu_offload": cpu_offload, "compile": compile})
    out += config_rules.checkpointing_problems(activation_checkpointing)
    out += config_rules.sharding_problems(zero, fsdp_strategy, mixed_precision)
    out += mesh_order_problems(mesh_order)
    out += reshard_field_problems(reshard_after_forward)
    schedule = _schedule(schedule)
    if out:  # the combined rules assume each field is sane
        return out
    return combination_problems(dp=dp, tp=tp, pp=pp, zero=zero, fsdp_strategy=fsdp_strategy,
                                dp_replicate=dp_replicate, cpu_offload=cpu_offload, loss_parallel=loss_parallel,
                                schedule=schedule, stages_per_rank=stages_per_rank, microbatches=microbatches,
                                ep=ep, cp=cp, sequence_parallel=sequence_parallel,
                                reshard_after_forward=reshard_after_forward, stage_layers=stage_layers)


def resolve_strategy(*, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, zero: int = 0, fsdp_strategy: str | None = None,
                     dp_replicate: int | None = None, schedule: str = "1f1b", microbatches: int | None = None,
                     stages_per_rank: int | None = None, sequence_parallel: bool = False,
                     loss_parallel: bool = False, activation_checkpointing: bool | str = False,
                     mixed_precision: str | None = None, cpu_offload: bool = False, compile: bool = False,
                     mesh_order: tuple[str, ...] = MESH_AXES,
                     reshard_after_forward: bool | dict[str, bool] | None = None,
                     stage_layers: Sequence[int] | None = None) -> Strategy:
    """The one Strategy a layout's fields (``lab.Parallel``'s, plus ``compile``) mean.

    ``microbatches`` and ``stages_per_rank`` default as ``lab.Parallel`` resolves them.
    Raises ``ConfigError`` (a ValueError) naming every rule the layout breaks.
    """
    fields = dict(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, zero=zero, fsdp_strategy=fsdp_strategy, dp_replicate=dp_replicate,
                  schedule=schedule, microbatches=microbatches, stages_per_rank=stages_per_rank,
                  sequence_parallel=sequence_parallel, loss_parallel=loss_parallel,
                  activation_checkpointing=activation_checkpointing, mixed_precision=mixed_precision,
                  cpu_offload=cpu_offload, compile=compile, mesh_order=tuple(mesh_order),
                  reshard_after_forward=reshard_after_forward, stage_layers=stage_layers)
    problems = layout_problems(**fields)
    if problems:
        raise ConfigError(problems)
    schedule = canonical_schedule(schedule)
    v = stages_per_rank if stages_per_rank is not None else default_stages_per_rank(schedule)
    m = microbatches if microbatches is not None else default_microbatches(schedule, pp, v)
    requested = run_zero = zero_stage(zero, fsdp_strategy)
    hybrid = fsdp_strategy == "hybrid" and run_zero >= 2
    data_ranks = dp * cp  # context-parallel ranks share the weights: their gradients meet as dp's do
    replicate = hsdp_split(data_ranks, dp_replicate)[0] if hybrid else 1
    if pp == 1 and tp > 1 and data_ranks > 1 and run_zero == 0:  # DDP cannot take TP DTensors: FSDP2 replication
        run_zero, hybrid, replicate = 2, True, data_ranks
    if run_zero >= 2:
        sync = GradSync.FSDP
    elif run_zero == 1:
        sync = GradSync.ZERO1
    elif data_ranks > 1:
        sync = GradSync.ALLREDUCE if pp > 1 else GradSync.DDP
    else:
        sync = GradSync.NONE
    return Strategy(dp=dp, tp=tp, pp=pp, ep=ep, cp=cp, requested_zero=requested, zero=run_zero, grad_sync=sync, hybrid=hybrid,
                    dp_replicate=replicate, sequence_parallel=sequence_parallel,
                    loss_parallel=loss_parallel and tp > 1, activation_checkpointing=activation_checkpointing,
                    mixed_precision=mixed_precision, cpu_offload=cpu_offload, compile=compile,
                    schedule=schedule if pp > 1 else None, stages_per_rank=v if pp > 1 else 1, microbatches=m,
                    mesh_order=tuple(mesh_order), stage_layers=None if stage_layers is None else tuple(stage_layers),
                    reshard_after_forward=None if reshard_after_forward is None
                    else reshard_units(run_zero, reshard_after_forward))


def _schedule(value: Any) -> Any:
    """The Schedule ``value`` names in any spelling; an unknown one is left for [unknown-schedule] to name."""
    try:
        return canonical_schedule(value)
    except (TypeError, ValueError):
        return value


if __name__ == "__main__":
    for layout in ({"dp": 4}, {"dp": 2, "tp": 2}, {"dp": 4, "fsdp_strategy": "hybrid"},
                   {"pp": 2, "dp": 2, "schedule": "zbv", "zero": 2}):
        print(layout, "->", resolve_strategy(**layout).describe())
