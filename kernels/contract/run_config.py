"""``RunConfig``: the typed, validated configuration of one training run on the ranks (torch-free).

Built once (by ``lab.run.experiment`` from ``lab.Parallel`` and the Experiment's arguments,
or by the torchrun CLI of ``kernels.train.entry``), validated once at construction against the
named rules of ``kernels.contract.config_rules`` (a ``ConfigError`` names every broken one), and sent
to the ranks as the plain dict ``to_dict()`` gives; each rank rebuilds it with
``from_dict``. Both come from ``kernels.contract.records.Record``, so an unknown key is refused by
name. The JSON round trip is exact: ``from_dict(json.loads(json.dumps(c.to_dict()))) == c``.

Run alone (prints a config's dict)::

    python -m kernels.contract.run_config
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kernels.contract import config_rules as rules
from kernels.contract import layout_rules
from kernels.contract.layout_combinations import combination_problems
from kernels.contract.records import Record

# The switches: each must be True or False.
FLAGS = ("sequence_parallel", "loss_parallel", "activation_checkpointing", "cpu_offload", "compile", "return_params",
         "record_grad_norm", "measure", "trace", "checkpoint_async", "progress", "watch_collectives")

@dataclass(frozen=True)
class RunConfig(Record):
    """One run: the model, the layout, the optimizer and data, and what to record."""

    model: dict[str, Any] = field(default_factory=dict)  # kernels.model.gpt.GPTConfig fields (not seed)
    # layout
    dp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int | None = None  # train on the first world_size ranks only (None: every rank)
    zero: int = 0
    fsdp_strategy: str | None = None  # no_shard, grad_op, full or hybrid (HSDP)
    dp_replicate: int | None = None  # HSDP replica groups; None: kernels.contract.layout_rules.hsdp_split's rule
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool = False
    mixed_precision: str | None = None
    cpu_offload: bool = False
    compile: bool = False  # torch.compile each block (kernels.parallel.compile_blocks)
    microbatches: int | None = None  # None: layout_rules.default_microbatches (1 without a pipeline)
    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # None: kernels.contract.layout_rules.default_stages_per_rank
    # optimizer and data
    optimizer: str = "adamw"  # or "sgd" (kernels.train.optimizer): AdamW's betas, eps and weight_decay apply to AdamW only
    global_batch: int = 8
    steps: int = 3
    lr: float = 1e-2
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    seed: int = 0
    data_seed: int | None = None  # None: seed
    # records and probes
    return_params: bool = True
    record_grad_norm: bool = True
    measure: bool = False
    trace: bool = False
    synthetic_forward_s: float | None = None
    ranks_per_host: tuple[int, ...] | None = None
    align_rounds: int = 4
    # checkpoints (kernels.train.run_checkpoints): save every checkpoint_every steps and after the last
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume_from: str | None = None  # a step directory, a checkpoint directory (its latest) or a .safetensors file
    checkpoint_async: bool = False
    progress: bool = False  # live per-step records and stop on request (kernels.watch.progress)
    # watching (kernels.watch.rank_watch): the collective log the driver reads, and faults on purpose (kernels.watch.faults)
    watch_collectives: bool = False
    faults: tuple[dict[str, Any], ...] = ()
    mesh_order: tuple[str, ...] = layout_rules.MESH_AXES  # rank order over the mesh axes, outermost first

    def __post_init__(self) -> None:
        problems = run_problems(self)
        if problems:
            raise rules.ConfigError(problems)
        # JSON gives lists; the record keeps tuples (and its own copy of the model dict).
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.ranks_per_host is not None:
            object.__setattr__(self, "ranks_per_host", tuple(self.ranks_per_host))
        object.__setattr__(self, "model", dict(self.model))
        object.__setattr__(self, "faults", tuple(dict(f) for f in self.faults))
        object.__setattr__(self, "mesh_order", tuple(self.mesh_order))

    @property
    def dataset_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def optimizer_kwargs(self, device_type: str = "cpu") -> dict[str, Any]:
        """The optimizer's hyper-parameters and kernel on ``device_type``, the same for the reference and every layout.

        AdamW on CUDA takes the fused kernel, as torch users set it; on CPU, and SGD
        everywhere, the per-parameter loop (foreach off), so the reference and the ranks
        run one kernel and match exactly.
        """
        if self.optimizer == "sgd":
            return {"lr": self.lr, "foreach": False}
        kernel = {"fused": True} if device_type == "cuda" else {"foreach": False}
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay, **kernel}


def run_problems(c: RunConfig) -> list[rules.Problem]:
    """Every named rule (``kernels.contract.config_rules``) that the run's fields break; empty when valid.

    The layout's combined fields are checked as ``lab.Parallel`` checks them
    (``kernels.contract.layout_combinations``). The rules that need the world and the model
    together are the driver's (``lab.Parallel.check``); the ranks check them again as they
    build the mesh and the TP plan.
    """
    out = rules.size_problems({"dp": c.dp, "tp": c.tp, "pp": c.pp, "global_batch": c.global_batch, "steps": c.steps,
                               "align_rounds": c.align_rounds},
                              {"world_size": c.world_size, "dp_replicate": c.dp_replicate,
                               "microbatches": c.microbatches, "stages_per_rank": c.stages_per_rank})
    out += rules.flag_problems({name: getattr(c, name) for name in FLAGS})
    out += rules.sharding_problems(c.zero, c.fsdp_strategy, c.mixed_precision)
    out += _schedule_problems(c.schedule)
    out += rules.model_problems(c.model)
    out += rules.data_problems(c.model.get("vocab") if isinstance(c.model, Mapping) else None)
    out += rules.seed_problems({"seed": c.seed}, {"data_seed": c.data_seed})
    out += rules.adamw_problems(c.lr, c.betas, c.eps, c.weight_decay)
    out += rules.optimizer_problems(c.optimizer)
    out += rules.measuring_problems(c.pp, c.trace, c.synthetic_forward_s)
    out += rules.checkpoint_problems(c.checkpoint_dir, c.checkpoint_every, c.resume_from, c.checkpoint_async)
    out += layout_rules.mesh_order_problems(c.mesh_order)
    hosts = c.ranks_per_host
    if hosts is not None and not (isinstance(hosts, (tuple, list)) and hosts):
        out.append(("positive-sizes", f"ranks_per_host must be None or a list of positive ints, got {hosts!r}"))
    elif hosts is not None:
        out += rules.size_problems({f"ranks_per_host[{i}]": n for i, n in enumerate(hosts)})
    if not out:  # the rules that combine the layout's fields, as lab.Parallel applies them
        out += combination_problems(dp=c.dp, tp=c.tp, pp=c.pp, zero=c.zero, fsdp_strategy=c.fsdp_strategy,
                                    dp_replicate=c.dp_replicate, cpu_offload=c.cpu_offload,
                                    loss_parallel=c.loss_parallel, schedule=layout_rules.canonical_schedule(c.schedule),
                                    stages_per_rank=c.stages_per_rank, microbatches=c.microbatches)
    return out


def _schedule_problems(schedule: Any) -> list[rules.Problem]:
    """[unknown-schedule]: the schedule is a known name in any spelling ``canonical_schedule`` reads."""
    if isinstance(schedule, str):
        try:
            layout_rules.canonical_schedule(schedule)
            return []
        except ValueError:
            pass
    return [("unknown-schedule", f"unknown schedule {schedule!r}; allowed: {', '.join(layout_rules.SCHEDULES)}")]


if __name__ == "__main__":
    print(RunConfig(model={"layers": 2}, dp=2, tp=2, zero=3).to_dict())
