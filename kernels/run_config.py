"""``RunConfig``: the typed, validated configuration of one training run on the ranks (torch-free).

Built once (by ``lab.experiment`` from ``lab.Parallel`` and the Experiment's arguments,
or by the torchrun CLI of ``kernels.train``), validated once at construction, and sent
to the ranks as the plain dict ``to_dict()`` gives; each rank rebuilds it with
``from_dict``. Both come from ``kernels.records.Record``, so an unknown key is refused by name. The JSON round trip is exact: ``from_dict(json.loads(json.dumps(c.to_dict()))) == c``.

Run alone (prints a config's dict)::

    python -m kernels.run_config
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kernels import layout_rules
from kernels.records import Record

MODEL_KEYS = ("layers", "d_model", "heads", "vocab", "seq_len", "d_ff", "bias")
MIXED_PRECISION = (None, "bf16")


@dataclass(frozen=True)
class RunConfig(Record):
    """One run: the model, the layout, the optimizer and data, and what to record."""

    model: dict[str, Any] = field(default_factory=dict)  # kernels.model.GPTConfig fields (not seed)
    # layout
    dp: int = 1
    tp: int = 1
    pp: int = 1
    world_size: int | None = None  # train on the first world_size ranks only (None: every rank)
    zero: int = 0
    fsdp_strategy: str | None = None  # no_shard, grad_op, full or hybrid (HSDP)
    dp_replicate: int | None = None  # HSDP replica groups; None: kernels.layout_rules.hsdp_split's rule
    sequence_parallel: bool = False
    loss_parallel: bool = False
    activation_checkpointing: bool = False
    mixed_precision: str | None = None
    cpu_offload: bool = False
    compile: bool = False  # torch.compile each block (kernels.parallel.compile_blocks)
    microbatches: int | None = None  # None: 1, or pp with a pipeline
    schedule: str = "1f1b"
    stages_per_rank: int | None = None  # None: kernels.layout_rules.default_stages_per_rank
    # optimizer and data
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.ranks_per_host is not None:
            object.__setattr__(self, "ranks_per_host", tuple(self.ranks_per_host))
        object.__setattr__(self, "model", dict(self.model))
        _validate(self)

    @property
    def dataset_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed

    def adamw_kwargs(self, device_type: str = "cpu") -> dict[str, Any]:
        """AdamW's hyper-parameters and kernel on ``device_type``, the same for the reference and every layout.

        CUDA takes the fused kernel, as torch users set it; CPU keeps the per-parameter loop
        (foreach off), so the reference and the ranks run one kernel and match exactly.
        """
        kernel = {"fused": True} if device_type == "cuda" else {"foreach": False}
        return {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay, **kernel}


def _validate(c: RunConfig) -> None:
    for name in ("dp", "tp", "pp", "steps", "global_batch", "align_rounds"):
        _positive(name, getattr(c, name))
    for name in ("world_size", "dp_replicate", "microbatches", "stages_per_rank"):
        if getattr(c, name) is not None:
            _positive(name, getattr(c, name))
    if c.zero not in (0, 1, 2, 3) or isinstance(c.zero, bool):
        raise ValueError(f"RunConfig: zero must be 0, 1, 2 or 3, got {c.zero!r}")
    if c.fsdp_strategy is not None and c.fsdp_strategy not in layout_rules.FSDP_STRATEGY_ZERO:
        raise ValueError(f"RunConfig: fsdp_strategy must be None or one of "
                         f"{tuple(layout_rules.FSDP_STRATEGY_ZERO)}, got {c.fsdp_strategy!r}")
    if not isinstance(c.compile, bool):
        raise ValueError(f"RunConfig: compile must be True or False, got {c.compile!r}")
    if c.mixed_precision not in MIXED_PRECISION:
        raise ValueError(f"RunConfig: mixed_precision must be None or 'bf16', got {c.mixed_precision!r}")
    layout_rules.canonical_schedule(c.schedule)
    bad = sorted(set(c.model) - set(MODEL_KEYS))
    if bad:
        raise ValueError(f"RunConfig: unknown model keys {bad}; known: {list(MODEL_KEYS)}")
    if c.synthetic_forward_s is not None and c.synthetic_forward_s <= 0:
        raise ValueError(f"RunConfig: synthetic_forward_s must be positive seconds, got {c.synthetic_forward_s}")
    if len(c.betas) != 2:
        raise ValueError(f"RunConfig: betas must be two floats, got {c.betas!r}")


def _positive(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"RunConfig: {name} must be a positive int, got {value!r}")


if __name__ == "__main__":
    print(RunConfig(model={"layers": 2}, dp=2, tp=2, zero=3).to_dict())
