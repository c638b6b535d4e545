"""An experiment: one model, one parallel layout, real training on the pool's ranks.

``Experiment(cluster, model, parallel, ...)`` checks the layout against the model and
the world before anything runs (``Parallel.check``), then ``run()`` sends one config
dict to ``kernels.train.train_rank`` on every rank and gathers plain records. The
same config trains in one process with ``reference()``, which is the ground truth.
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any

from kernels.model import GPTConfig
from kernels.reference import train_reference
from kernels.train import train_rank
from lab.cluster import Cluster
from lab.parallel import Parallel
from lab.run_result import RunResult

OPTIMIZERS = ("adamw",)


class LayoutWarning(UserWarning):
    """The layout runs, but is known to be wasteful."""


class Experiment:
    """Train ``model`` under ``parallel`` on ``cluster``; see ``run()`` and ``reference()``."""

    def __init__(self, cluster: Cluster, model: GPTConfig, parallel: Parallel, *, global_batch: int = 8,
                 steps: int = 3, lr: float = 1e-2, optimizer: str = "adamw", seed: int = 0) -> None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {optimizer!r} is not supported; choose one of {OPTIMIZERS}")
        if steps < 1 or global_batch < 1:
            raise ValueError(f"steps and global_batch must be positive, got steps={steps}, global_batch={global_batch}")
        self.cluster, self.model, self.parallel = cluster, model, parallel
        self.global_batch, self.steps, self.lr, self.seed = global_batch, steps, lr, seed
        self.warnings = parallel.check(model, cluster.world_size, global_batch)
        for message in self.warnings:
            warnings.warn(message, LayoutWarning, stacklevel=2)

    def config(self, *, return_params: bool = False) -> dict[str, Any]:
        """The plain config dict every rank (and the reference) receives."""
        p = self.parallel
        model = {k: v for k, v in dataclasses.asdict(self.model).items() if k != "seed"}
        return {
            "model": model, "seed": self.seed, "global_batch": self.global_batch, "steps": self.steps,
            "lr": self.lr, "dp": p.dp, "tp": p.tp, "pp": p.pp, "zero": p.zero, "fsdp_strategy": p.fsdp_strategy,
            "schedule": p.schedule, "microbatches": p.num_microbatches, "virtual_stages": p.stages_per_rank,
            "sequence_parallel": p.sequence_parallel, "activation_checkpointing": p.activation_checkpointing,
            "mixed_precision": p.mixed_precision, "cpu_offload": p.cpu_offload, "return_params": return_params,
        }

    def run(self, *, timeout: float | None = None, return_params: bool = False) -> RunResult:
        """Train on every rank; raises ``lab.RankError`` (with the rank's traceback) on failure."""
        cfg = self.config(return_params=return_params)
        per_rank = self.cluster.run(train_rank, cfg, timeout=timeout)
        return RunResult(
            config=cfg, losses=list(per_rank[0]["losses"]), grad_norms=list(per_rank[0].get("grad_norms", [])),
            step_times=[list(r["step_times"]) for r in per_rank], layout=[r["layout"] for r in per_rank],
            warnings=list(self.warnings),
            params={rank: r["params"] for rank, r in enumerate(per_rank)} if return_params else {})

    def reference(self, *, return_params: bool = False) -> RunResult:
        """The same training in this process: same init, same global batch per step, same AdamW."""
        cfg = self.config(return_params=return_params)
        began = time.perf_counter()
        out = train_reference(cfg)
        per_step = (time.perf_counter() - began) / self.steps
        params = {0: {k: v.tolist() for k, v in out["params"].items()}} if return_params else {}
        return RunResult(config=cfg, losses=list(out["losses"]), grad_norms=list(out["grad_norms"]),
                         step_times=[[per_step] * self.steps], layout=[{"rank": 0, "strategy": "reference"}],
                         params=params)
