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
from kernels.contract.layout_combinations import stage_split_problems, tp_split_problems
from kernels.contract.layout_rules import MESH_AXES, default_microbatches, default_stages_per_rank, hsdp_split, zero_stage
from kernels.contract.strategy import Strategy, layout_problems, resolve_strategy

RULES = {
    "mesh-order": "mesh_order names pp, dp and tp once each, outermost first",
    # The fields one at a time (kernels.contract.config_rules): Parallel, Experiment, RunConfig and GPTConfig.
    "positive-sizes": "sizes and counts (dp, tp, pp, microbatches, stages_per_rank, dp_replicate, global_batch, "
                      "steps, the model's layers, d_model, heads, vocab, seq_len, d_ff) must be ints >= 1, "
                      "not bools, floats or strings",
    "bool-flags": "switches (sequence_parallel, loss_parallel, cpu_offload, trace, "
                  "measure, compile, the model's bias) must be True or False, not 1 or 'yes'",
    "adamw": "AdamW needs a finite lr > 0, eps > 0, weight_decay >= 0 and betas two numbers in [0, 1)",
    "seed": "seeds must be ints in [0, 2**64), the range torch.Generator.manual_seed takes",
    "model-keys": "the model's fields are GPTConfig's (layers, d_model, heads, vocab, seq_len, d_ff, bias) or, for "
                  "lab.Llama, Llama 3's (layers, hidden, heads, kv_heads, ffn, vocab, seq_len, rope_theta, norm_eps)",
    "heads-d-model": "d_model (a Llama's hidden) must be divisible by heads, and a Llama's heads by kv_heads",
    "data-vocab": "the data's token ids must fit the model's vocab (the synthetic chain needs vocab >= 4: every "
                  "token has 4 distinct successors; bytes need the largest byte; modular addition mod p needs p + 2)",
    "data": "data= is None, lab.Text, lab.Tokens, lab.ModularAddition or lab.Batches (a path, a list of paths, "
            "a 1-D tensor of ids, a datasets.Dataset or an iterable of batches stand for them), with the fields "
            "its kind needs",
    "data-file": "the data's files exist where the ranks read them and hold text, or 1-D integer token ids",
    "data-length": "the data holds at least one sequence: seq_len + 1 tokens (your own batches: one per step)",
    "data-batch": "each of your own batches holds global_batch sequences",
    # A model the user brought (kernels.contract.model_rules, lab.run.own_models).
    "model-build": "the model builds from its factory or its Hugging Face config (transformers installed)",
    "model-pickle": "a lab.Model's factory and loss can be pickled (by value), so every rank can build it",
    "tp-plan": "tp > 1 needs a tensor-parallel plan whose every entry names a module (or parameter) of the model",
    "tp-style": "every style in the plan is one the lab applies (kernels.contract.model_rules.TP_STYLES)",
    "tp-width": "tp must divide each width the tensor-parallel plan splits",
    "measure-on-size": "lab.plan(..., measure_on=pool) runs the layout's tp and pp on the pool: tp*pp must divide "
                       "its ranks",
    "tp-sp-model": "sequence_parallel needs blocks of norms and column- then row-split regions, then norms and a head",
    "pp-blocks": "pp > 1 needs the model's block list: blocks= names a non-empty nn.ModuleList",
    "trace-pipeline": "trace=True times pipeline actions, so it needs pp > 1",
    "synthetic-cost": "synthetic_forward_s is a finite number of seconds > 0, and needs trace=True",
    "optimizer": "the optimizer must be one of kernels.contract.config_rules.OPTIMIZERS: adamw or sgd",
    "argument-types": "an Experiment's model is a lab.GPT, a lab.Llama, a Hugging Face config or a lab.Model, "
                      "and its parallel a lab.Parallel",
    "model-seed": "the Experiment's seed fixes the weights: lab.GPT's seed must be left at 0 or equal it",
    "checkpoint": "checkpoint_dir and resume_from are path strings, checkpoint_every an int >= 1; checkpoint_every "
                  "and checkpoint_async need checkpoint_dir; a resume needs steps beyond the checkpoint's step",
    "checkpoint-dir": "checkpoint_dir must be a directory this process can create and write into",
    "faults": "faults is a list of lab.Slow/Hang/Crash/Kill on ranks of the pool, at steps the run takes",
    "hang-after": "hang_after is None or a number of seconds > 0",
    "log-to": "log_to is 'tensorboard:DIR' or 'wandb', with that package installed",
    # A parameter server's arguments (lab.ParameterServer).
    "ps-servers": "servers is an int from 1 to world_size-1: at least one rank must be a worker",
    "ps-mode": "mode is 'sync', 'async' or 'bounded'",
    "ps-max-staleness": "max_staleness is an int >= 0 for mode 'bounded', and None otherwise",
    "ps-faults": "faults act on workers, not on server ranks",
    # The layout, and the layout against the model and the world.
    "world-size": "dp * tp * pp must equal the world size",
    "tp-heads": "the number of heads must be divisible by tp",
    "tp-d-model": "d_model must be divisible by tp",
    "tp-d-ff": "d_ff must be divisible by tp",
    "tp-kv-heads": "a Llama's kv_heads must be divisible by tp: each rank keeps whole key/value heads",
    "tp-ffn": "a Llama's ffn (its MLP width) must be divisible by tp",
    "tp-vocab": "vocab must be divisible by tp: the token embedding and the LM head are split over the vocab",
    "tp-seq-len": "seq_len must be divisible by tp: the position table is split over positions "
                  "(and sequence parallel splits the sequence)",
    "loss-parallel-pp": "loss_parallel needs pp == 1: a pipeline schedule computes the loss inside its last stage",
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
    "activation-checkpointing": "activation_checkpointing must be False, True (recompute each block in backward) "
                                "or 'selective' (recompute all but the matmuls and collectives)",
    "cpu-offload": "cpu_offload needs full sharding (zero 3 / FSDP full or hybrid)",
    "zero1-dtensor": "ZeRO-1 (ZeroRedundancyOptimizer) cannot shard DTensor parameters, so not with tp > 1",
    "zero3-split-backward": "ZeRO-3 (FSDP2 resharding after forward) gives wrong gradients under the "
                            "split-backward schedules interleaved_zero_bubble, zbv and dualpipev; use zero 2 there",
}


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
    zero: int = 0  # 0 plain DDP, 1 ZeroRedundancyOptimizer, 2/3 fully_shard without/with reshard
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

    def __post_init__(self) -> None:
        problems = self._field_problems()
        if problems:  # raised here, so a plain traceback shows one frame of the lab
            raise ParallelConfigError(problems)
        object.__setattr__(self, "mesh_order", tuple(self.mesh_order))  # from_dict of JSON gives a list

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
            out.append(("world-size", f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world_size} "
                        f"must equal the world size {world_size}"))
        # What tensor parallelism splits: a model config's own tp_sizes (lab.GPT, lab.Llama), which the
        # ranks check too; a bare description of a GPT (layers, d_model, heads, ...) gives its sizes.
        if hasattr(cfg, "tp_sizes"):
            sizes = cfg.tp_sizes(self.sequence_parallel)
        else:
            sizes = {"heads": cfg.heads, "d_model": cfg.d_model, "d_ff": getattr(cfg, "d_ff", None) or 4 * cfg.d_model,
                     "vocab": getattr(cfg, "vocab", None), "seq_len": getattr(cfg, "seq_len", None)}
        out += tp_split_problems(self.tp, sizes, self.sequence_parallel)
        if cfg.layers is not None:  # a model the user brought may have no block list ([pp-blocks] when pp > 1)
            out += stage_split_problems(cfg.layers, self.num_stages)
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
