"""A training that keeps its weights on a warm pool: ``lab.Training(cluster, model, parallel, ...)``.

An ``Experiment`` builds its layout, trains and frees everything in one ``run()``. A
``Training`` builds the layout once on the ranks (``kernels.live_training``) and holds
the model, the optimizer and the data position there between cells:

- ``step(n)`` trains n more steps and returns their ``RunResult`` (measured as an
  Experiment with the same ``trace``/``measure`` options measures its run: the last step
  of the call). Steps continue exactly: ``step(3)`` then ``step(3)`` computes what one
  ``Experiment(steps=6).run()`` computes, bit for bit;
- ``losses`` is every step's loss so far;
- ``close()`` frees the ranks' objects and groups (so does any failure that rebuilds
  the world; a later call then says the training is gone).

The layout may use fewer ranks than the pool has (``parallel.world_size`` of them, the
first ones); the others hold nothing.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, replace
from typing import Any

from kernels import live_training
from kernels.model import GPTConfig
from kernels.run_config import RunConfig
from lab.cluster import Cluster
from lab.errors import LabError, RankError
from lab.experiment import Experiment, measurements
from lab.parallel import Parallel, ParallelConfigError
from lab.run_result import RunResult


@dataclass(frozen=True)
class _RanksOfLayout:
    """The pool as an Experiment sees it when the layout trains on its first ``world_size`` ranks only."""

    pool: Cluster
    world_size: int

    @property
    def rank_map(self) -> Any:
        return getattr(self.pool, "rank_map", None)


class Training:
    """Train ``model`` under ``parallel`` on ``cluster``, holding the state on the ranks between calls (module doc)."""

    def __init__(self, cluster: Cluster, model: GPTConfig, parallel: Parallel, *, global_batch: int = 8,
                 lr: float = 1e-2, optimizer: str = "adamw", seed: int = 0, trace: bool = False,
                 synthetic_forward_s: float | None = None, measure: bool = False, compile: bool = False) -> None:
        self.cluster = cluster
        self._options = dict(global_batch=global_batch, lr=lr, optimizer=optimizer, seed=seed, trace=trace,
                             synthetic_forward_s=synthetic_forward_s, measure=measure, compile=compile)
        self.key = f"training-{uuid.uuid4().hex[:12]}"
        self.losses: list[float] = []
        self.experiment = self._experiment(model, parallel)
        self._open(self.experiment.run_config())

    @property
    def model(self) -> GPTConfig:
        return self.experiment.model

    @property
    def parallel(self) -> Parallel:
        return self.experiment.parallel

    @property
    def steps_done(self) -> int:
        """Optimizer steps taken so far: the next ``step()`` trains global step ``steps_done`` first."""
        return len(self.losses)

    def _experiment(self, model: GPTConfig, parallel: Parallel) -> Experiment:
        """The Experiment whose checks and run config this layout gets; refused before anything reaches the ranks."""
        pool_size = self.cluster.world_size
        size = parallel.world_size if isinstance(parallel, Parallel) else pool_size
        if size > pool_size:
            raise ParallelConfigError([("world-size", f"dp*tp*pp = {size} is more than the pool's "
                                        f"{pool_size} ranks")])
        return Experiment(_RanksOfLayout(self.cluster, size) if size < pool_size else self.cluster, model, parallel,
                          steps=1, **self._options)

    def _run_config(self, steps: int) -> RunConfig:
        run = self.experiment.run_config()
        size = self.parallel.world_size
        return replace(run, steps=steps, world_size=size if size < self.cluster.world_size else None)

    def _open(self, run: RunConfig) -> None:
        self.cluster.run(live_training.open_training, self.key, run.to_dict(), next_step=self.steps_done,
                         losses=self.losses)

    def step(self, n: int = 1, *, timeout: float | None = None, return_params: bool = False) -> RunResult:
        """Train ``n`` more steps on the held state; returns those steps' RunResult (losses of these steps only)."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int (steps to train), got {n!r}")
        cfg = self._run_config(n).to_dict()
        per_rank = self._call(live_training.advance, self.key, n, return_params=return_params, timeout=timeout)
        first = per_rank[0]["first_step"]
        if first != self.steps_done:
            raise LabError(f"the ranks stood at step {first}, the driver at {self.steps_done}: the training was "
                           "stepped from elsewhere")
        self.losses += per_rank[0]["losses"]
        found = measurements(per_rank, cfg)
        return RunResult(
            config=cfg, losses=list(per_rank[0]["losses"]), grad_norms=list(per_rank[0]["grad_norms"]),
            step_times=[list(r["step_times"]) for r in per_rank], layout=[r["layout"] for r in per_rank],
            warnings=list(self.experiment.warnings) + found.pop("warnings"),
            params={rank: r["params"] for rank, r in enumerate(per_rank)} if return_params else {}, **found)

    def _call(self, fn: Any, *args: Any, timeout: float | None = None, **kwargs: Any) -> list[Any]:
        try:
            return self.cluster.run(fn, *args, timeout=timeout, **kwargs)
        except RankError as error:
            if any(f.ename == "TrainingGoneError" for f in error.failures):
                raise LabError(f"the training {self.key} is no longer on the ranks (closed, or its world was "
                               "rebuilt after a failure): load it from a checkpoint with lab.Training.load") from error
            raise

    def close(self) -> None:
        """Free the model, optimizer and mesh groups on the ranks (a stopped pool has nothing left to free)."""
        if not self.cluster.stopped:
            self.cluster.run(live_training.close_training, self.key)

    def __enter__(self) -> "Training":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<Training {self.parallel.describe()} on {self.parallel.world_size} ranks, "
                f"{self.steps_done} steps done>")
