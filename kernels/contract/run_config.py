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

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kernels.contract import config_rules as rules
from kernels.contract.data_spec import DataSpec, data_spec_problems
from kernels.contract.faults import Fault, Poison
from kernels.contract.model_rules import is_own_model, own_layout_problems, own_model_problems
from kernels.contract.records import Record
from kernels.contract.strategy import Strategy, resolve_strategy
from kernels.contract.training_hygiene import LRSchedule, SpikeGuard, hygiene_problems

# The switches: each must be True or False.
# The flat options that make the layout: resolve_strategy's keywords.
LAYOUT_OPTIONS = tuple(inspect.signature(resolve_strategy).parameters)
FLAGS = ("return_params", "record_grad_norm", "measure", "trace", "checkpoint_async", "progress", "watch_collectives")


@dataclass(frozen=True)
class RunConfig(Record):
    """One run: the model, the layout, the optimizer and data, and what to record."""

    model: dict[str, Any] = field(default_factory=dict)  # kernels.model.family: a GPT's fields (not seed), or a family's
    strategy: Strategy = field(default_factory=Strategy)  # the layout, resolved (kernels.contract.strategy)
    world_size: int | None = None  # train on the first world_size ranks only (None: every rank)
    # optimizer and data
    optimizer: rules.Optimizer = rules.Optimizer.ADAMW  # AdamW's betas, eps and weight_decay apply to AdamW only
    global_batch: int = 8
    steps: int = 3
    lr: float = 1e-2
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    seed: int = 0
    data_seed: int | None = None  # None: seed
    data: DataSpec = field(default_factory=DataSpec)  # the tokens (kernels.contract.data_spec); default: synthetic
    # training hygiene (kernels.contract.training_hygiene): global-norm clipping, the lr's factor per step,
    # the order of finite data (None: the data's own), and skipping the update of a step whose loss spikes
    grad_clip: float | None = None
    lr_schedule: LRSchedule | None = None
    shuffle: bool | None = None
    spike_guard: SpikeGuard | None = None
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
    faults: tuple[Fault, ...] = ()
    poison: tuple[Poison, ...] = ()  # steps whose loss is poisoned, here and in the reference (lab.PoisonBatch)

    _nested: ClassVar[dict[str, type[Record]]] = {"faults": Fault, "poison": Poison}

    def __post_init__(self) -> None:
        # Read back from JSON, each nested record is a dict: rebuilt here, it checks itself (the Strategy on the rank).
        for name, record in (("strategy", Strategy), ("data", DataSpec), ("lr_schedule", LRSchedule),
                             ("spike_guard", SpikeGuard)):
            if isinstance(getattr(self, name), Mapping):
                object.__setattr__(self, name, record.from_dict(getattr(self, name)))
        problems = run_problems(self)
        if problems:
            raise rules.ConfigError(problems)
        # JSON gives lists; the record keeps tuples (and its own copy of the model dict).
        object.__setattr__(self, "optimizer", rules.Optimizer(self.optimizer))  # a name from JSON or a person
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.ranks_per_host is not None:
            object.__setattr__(self, "ranks_per_host", tuple(self.ranks_per_host))
        object.__setattr__(self, "model", dict(self.model))
        object.__setattr__(self, "faults", tuple(Fault.coerce(f) for f in self.faults))
        object.__setattr__(self, "poison", tuple(Poison.coerce(p) for p in self.poison))

    @classmethod
    def from_options(cls, options: "RunConfig | Mapping[str, Any]") -> "RunConfig":
        """The RunConfig of ``options``: a RunConfig, its ``to_dict()``, or flat options.

        Flat options name the layout's fields beside the run's (``{"dp": 2, "tp": 2, "steps": 4}``),
        as a person writes them; the layout's (``LAYOUT_OPTIONS``) are resolved to the one
        ``Strategy`` here, and every other key must be a RunConfig field.
        """
        if isinstance(options, RunConfig):
            return options
        if "strategy" in options:
            return cls.from_dict(options)
        layout = {k: v for k, v in options.items() if k in LAYOUT_OPTIONS}
        rest = {k: v for k, v in options.items() if k not in LAYOUT_OPTIONS}
        return cls.from_dict({**rest, "strategy": resolve_strategy(**layout)})

    @property
    def dataset_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def optimizer_kwargs(self, device_type: str = "cpu") -> dict[str, Any]:
        """The optimizer's hyper-parameters and kernel on ``device_type``, the same for the reference and every layout.

        AdamW on CUDA takes the fused kernel, as torch users set it; on CPU, and SGD
        everywhere, the per-parameter loop (foreach off), so the reference and the ranks
        run one kernel and match exactly.
        """
        if self.optimizer is rules.Optimizer.SGD:
            return {"lr": self.lr, "foreach": False}
        kernel = {"fused": True} if device_type == "cuda" else {"foreach": False}
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay, **kernel}


def run_problems(c: RunConfig) -> list[rules.Problem]:
    """Every named rule (``kernels.contract.config_rules``) that the run's fields break; empty when valid.

    The layout checked itself as a ``Strategy`` (the rules ``lab.Parallel`` applies). The rules
    that need the world and the model together are the driver's (``lab.Parallel.check``); the
    ranks check them again as they build the mesh and the TP plan.
    """
    s = c.strategy
    if not isinstance(s, Strategy):
        return [("argument-types", f"RunConfig.strategy must be a Strategy, got {type(s).__name__}")]
    out = rules.size_problems({"global_batch": c.global_batch, "steps": c.steps, "align_rounds": c.align_rounds},
                              {"world_size": c.world_size})
    out += rules.flag_problems({name: getattr(c, name) for name in FLAGS})
    if is_own_model(c.model):  # a model the user brought, and the layout against it
        out += own_model_problems(c.model) or own_layout_problems(c.model, tp=s.tp, pp=s.pp,
                                                                  sequence_parallel=s.sequence_parallel, cp=s.cp)
    else:
        out += rules.model_problems(c.model)
    out += data_spec_problems(c.data)
    out += hygiene_problems(c.grad_clip, c.lr_schedule, c.shuffle, c.data.kind, c.spike_guard) \
        if isinstance(c.data, DataSpec) else []
    if c.data == DataSpec():  # the synthetic chain's own need; what other data needs is checked where it is read
        out += rules.data_problems(c.model.get("vocab") if isinstance(c.model, Mapping) else None)
    out += rules.seed_problems({"seed": c.seed}, {"data_seed": c.data_seed})
    out += rules.adamw_problems(c.lr, c.betas, c.eps, c.weight_decay)
    out += rules.optimizer_problems(c.optimizer)
    out += rules.measuring_problems(s.pp, c.trace, c.synthetic_forward_s)
    out += rules.checkpoint_problems(c.checkpoint_dir, c.checkpoint_every, c.resume_from, c.checkpoint_async)
    hosts = c.ranks_per_host
    if hosts is not None and not (isinstance(hosts, (tuple, list)) and hosts):
        out.append(("positive-sizes", f"ranks_per_host must be None or a list of positive ints, got {hosts!r}"))
    elif hosts is not None:
        out += rules.size_problems({f"ranks_per_host[{i}]": n for i, n in enumerate(hosts)})
    return out


if __name__ == "__main__":
    print(RunConfig(model={"layers": 2}, strategy=resolve_strategy(dp=2, tp=2, zero=3)).to_dict())
