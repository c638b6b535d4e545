"""The parallel layout of one experiment, checked on the driver before any rank runs.

``Parallel`` is a frozen dataclass in the spirit of torchtitan's ``ParallelDims``: it
is passed explicitly, checks itself, and says what is wrong in words. The mesh
order is ``(pp, dp, tp)`` with tp varying fastest unless ``mesh_order`` names another
(docs/design.md#mesh-order).

Two kinds of checks:

- on construction, the rules that need only the fields: each field's type (real ints,
  real bools: ``2.0`` or ``"yes"`` are refused, never coerced), known schedule names,
  ZeRO stage, how ZeRO and the FSDP strategy agree, the pipeline schedules'
  micro-batch rules, and so on.
- ``check(model_cfg, world_size, global_batch)`` adds the rules that need the model
  and the world (``problems`` lists them without raising), raises one
  ``ParallelConfigError`` naming every violated rule, and returns warnings for
  layouts that are valid but wasteful.

Every rule has a short name (the keys of ``RULES``); error messages start with
``[name]`` so tests, widgets and users can tell them apart. The rules that combine a
layout's fields (schedule, placement, micro-batches, ZeRO, HSDP, CPU offload, loss
parallel) and the sizes tensor parallelism and the stages split are
``kernels.contract.layout_combinations``, which the ranks apply too, so both sides accept
and refuse the same layouts (its micro-batch rules are torch 2.13's own checks); the rules
on each field's type and range come from ``kernels.contract.config_rules``, which
``RunConfig`` and ``GPTConfig`` apply too. No torch here.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kernels.contract import config_rules
from kernels.contract.config_rules import ConfigError, Problem
from kernels.contract.layout_combinations import (cp_chunk_problems, expert_split_problems, stage_split_problems,
                                                  tp_split_problems)
from kernels.contract.layout_rules import MESH_AXES, default_microbatches, default_stages_per_rank, hsdp_split, zero_stage
from kernels.contract.strategy import Strategy, layout_problems, resolve_strategy
from lab.run.parallel_rules import RULES  # re-exported: lab.run.parallel.RULES is the name the docs give



class ParallelConfigError(ConfigError):
    """A layout or an experiment breaks one or more rules; ``rules`` names them (keys of ``RULES``).

    A ``kernels.contract.config_rules.ConfigError`` (which ``RunConfig`` and ``lab.GPT`` raise), so
    ``except ConfigError`` catches both; IPython and Jupyter show it without the lab's frames.
    """


@dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel degree (replicas, or shards under ZeRO/FSDP)
    tp: int = 1  # tensor-parallel degree (Megatron column/row split inside a block)
    pp: int = 1  # pipeline-parallel degree (ranks along the pipeline)
    zero: int = 0  # 0 plain DDP, 1 ZeRO-1 (ZeroRedundancyOptimizer; by slices with tp/pp), 2/3 fully_shard
    fsdp_strategy: str | None = None  # "full" | "grad_op" | "no_shard" | "hybrid"; None: from zero
    schedule: str = "1f1b"  # pipeline schedule, one of SCHEDULES
    microbatches: int | None = None  # per step and dp rank; None: see num_microbatches
    stages_per_rank: int | None = None  # pipeline stages on each pp rank; None: see num_stages_per_rank
    dp_replicate: int | None = None  # HSDP: dp = dp_replicate * dp_shard; None: see hsdp_sizes
    sequence_parallel: bool = False  # shard norms/dropout over the sequence dim on the tp axis
    loss_parallel: bool = False  # cross-entropy on vocab-sharded logits, never gathered (tp > 1, pp == 1)
    activation_checkpointing: bool | str = False  # True: recompute each block; "selective": all but its matmuls
    mixed_precision: str | None = None  # None (fp32) or "bf16" (FSDP2's MixedPrecisionPolicy, else torch.autocast)
    cpu_offload: bool = False  # keep sharded params/grads/optimizer on CPU (CPUOffloadPolicy)
    # Rank order over the mesh axes, outermost first: the default keeps each tp group on
    # neighbouring ranks (one host); ("pp", "tp", "dp") spreads it over hosts, to see what that costs.
    mesh_order: tuple[str, ...] = MESH_AXES
    ep: int = 1  # expert parallelism: each MoE layer's experts split over groups of ep dp ranks (ep divides dp)
    cp: int = 1  # context parallelism: each sequence split over cp more ranks, attention as a ring
    # FSDP2 per unit: free a unit's gathered parameters after its forward? A bool for every unit, or a dict
    # naming "root" and/or "blocks" ({"root": False, "blocks": True}); None: from zero (3 frees, 2 keeps).
    reshard_after_forward: bool | dict[str, bool] | None = dataclasses.field(default=None, hash=False)  # dicts: no hash
    # Blocks per pipeline stage, one count per stage (pp * stages_per_rank, in stage order), e.g. (5, 3) to spare
    # the last stage its head; None: equal stages. lab.balance_stages proposes one.
    stage_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problems = self._field_problems()
        if problems:  # raised here, so a plain traceback shows one frame of the lab
            raise ParallelConfigError(problems)
        object.__setattr__(self, "mesh_order", tuple(self.mesh_order))  # from_dict of JSON gives a list
        if isinstance(self.reshard_after_forward, dict):  # our own copy: the caller's dict may change later
            object.__setattr__(self, "reshard_after_forward", dict(self.reshard_after_forward))
        if isinstance(self.stage_layers, list):  # a tuple, as mesh_order: from_dict of JSON gives a list
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))

    # --- resolved values --------------------------------------------------------
    @property
    def world_size(self) -> int:
        """dp · cp · tp · pp: ep splits the dp ranks' experts and adds no ranks."""
        return self.dp * self.cp * self.tp * self.pp

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
        data = self.dp * self.cp  # context-parallel ranks share the weights: FSDP shards over dp · cp ranks
        return hsdp_split(data, self.dp_replicate) if self.fsdp_strategy == "hybrid" else (1, data)

    @property
    def uses_fsdp(self) -> bool:
        """True when parameters are wrapped by ``fully_shard`` (ZeRO-2/3 or an FSDP strategy)."""
        return self.fsdp_strategy is not None or self.zero in (2, 3)

    # --- rules --------------------------------------------------------------------
    def problems(self, model_cfg: Any, world_size: int, global_batch: Any) -> list[Problem]:
        """Every rule broken against a model (layers/d_model/heads/d_ff, and vocab/seq_len if it has them),
        a world and a global batch, as (rule, message) pairs; empty when the layout runs."""
        problems = self._field_problems()
        if not problems:  # the rules below assume sane sizes
            problems += self._model_problems(model_cfg, world_size, global_batch)
        return problems

    def check(self, model_cfg: Any, world_size: int, global_batch: Any) -> list[str]:
        """Check against a model, a world and a global batch (see ``problems``).

        Raises ParallelConfigError naming every violated rule; returns warnings.
        """
        problems = self.problems(model_cfg, world_size, global_batch)
        if problems:
            raise ParallelConfigError(problems)
        return self.layout_warnings()

    def _field_problems(self) -> list[Problem]:
        return layout_problems(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def strategy(self, *, compile: bool = False) -> Strategy:
        """What the ranks run: this layout resolved (``kernels.contract.strategy.resolve_strategy``)."""
        return resolve_strategy(compile=compile, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    def _model_problems(self, cfg: Any, world_size: int, global_batch: Any) -> list[Problem]:
        out = []
        if self.world_size != world_size:
            out.append(("world-size", f"dp*cp*tp*pp = {self.dp}*{self.cp}*{self.tp}*{self.pp} = {self.world_size} "
                        f"must equal the world size {world_size}"))
        out += cp_chunk_problems(self.cp, getattr(cfg, "seq_len", None))
        # A model the user brought says what ep needs of the experts its ep plan names (OwnConfig.expert_problems).
        out += cfg.expert_problems(self.ep) if hasattr(cfg, "expert_problems") else \
            expert_split_problems(self.ep, getattr(cfg, "experts", None))
        # What tensor parallelism splits: a model config's own tp_sizes (lab.GPT, lab.Llama), which the
        # ranks check too; a bare description of a GPT (layers, d_model, heads, ...) gives its sizes.
        if hasattr(cfg, "tp_sizes"):
            sizes = cfg.tp_sizes(self.sequence_parallel)
        else:
            sizes = {"heads": cfg.heads, "d_model": cfg.d_model, "d_ff": getattr(cfg, "d_ff", None) or 4 * cfg.d_model,
                     "vocab": getattr(cfg, "vocab", None), "seq_len": getattr(cfg, "seq_len", None)}
        out += tp_split_problems(self.tp, sizes, self.sequence_parallel)
        out += config_rules.moe_layout_problems(getattr(cfg, "experts", 0), self.sequence_parallel)
        if cfg.layers is not None:  # a model the user brought may have no block list ([pp-blocks] when pp > 1)
            out += stage_split_problems(cfg.layers, self.num_stages, self.stage_layers)
        per_step = self.dp * self.num_microbatches
        # A global_batch that is no positive int is [positive-sizes], the Experiment's own rule.
        if config_rules.is_int(global_batch) and global_batch % per_step:
            out.append(("global-batch", f"global_batch={global_batch} must be divisible by "
                        f"dp*microbatches = {self.dp}*{self.num_microbatches} = {per_step}"))
        return out

    def layout_warnings(self) -> list[str]:
        """Why a valid layout is wasteful, in plain strings (empty when it is not)."""
        out = []
        if self.zero_stage in (2, 3) and self.pp > 1:
            out.append(f"ZeRO-{self.zero_stage} with pp={self.pp} is wasteful: torch's schedule keeps each stage's "
                       "parameters and a whole gradient from its first backward to its last, so little stays sharded")
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
        if self.loss_parallel and self.tp == 1:
            out.append("loss_parallel has no effect with tp=1: the logits are whole on every rank")
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
        """What was chosen and what it runs as (``Strategy.describe``), e.g.
        "TP2×DP2, ZeRO-0 (DP through FSDP2 replicate: whole parameters, all-reduced gradients, as DDP; ...)"."""
        return self.strategy().describe()
