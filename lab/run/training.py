"""A training that keeps its weights on a warm pool: ``lab.Training(cluster, model, parallel, ...)``.

An ``Experiment`` builds its layout, trains and frees everything in one ``run()``. A
``Training`` builds the layout once on the ranks (``kernels.train.live_training``) and holds
the model, the optimizer and the data position there between cells:

- ``step(n)`` trains n more steps and returns their ``RunResult`` (measured as an
  Experiment with the same ``trace``/``measure`` options measures its run: the last step
  of the call). Steps continue exactly: ``step(3)`` then ``step(3)`` computes what one
  ``Experiment(steps=6).run()`` computes, bit for bit;
- ``losses`` is every step's loss so far (loaded from an Experiment's checkpoint: the
  steps after it, as that checkpoint keeps only its last loss);
- ``relayout(parallel)`` moves the live weights and optimizer state to another layout
  (and world size) on the same engines: the old layout writes them with DCP, the new one
  reads its own pieces back (``kernels.train.live_training.relayout_training``); training then
  goes on from the same step as if the layout had never changed (within the parity
  tolerance: another layout sums in another order);
- ``checkpoint_dir``/``checkpoint_every=K``: ``step()`` saves after every global step that
  is a multiple of K and after its last step, so a run a failure stops resumes from the
  last complete save with ``Training.load``; ``checkpoint_async=True`` writes them in the
  background (as ``dcp.async_save`` does, as an Experiment's), and ``step()`` returns once the last
  one is complete;
- ``grad_clip``, ``lr_schedule``, ``shuffle``, ``spike_guard`` (``lab.run.training_hygiene``) and ``watch``
  as an Experiment's: the schedule goes on at the global step, and the guard's window lives on the
  ranks between calls;
- ``save(path)`` writes a checkpoint (``kernels.checkpoint.save_load``: any layout loads it, an
  ``Experiment(resume_from=...)`` too); ``Training.load(cluster, path, parallel=...)``
  builds a Training from one, under the saved layout or another;
- ``close()`` frees the ranks' objects and groups (so does any failure that rebuilds
  the world; a later call then says the training is gone);
- ``auto_resume=True`` (with ``checkpoint_dir``/``checkpoint_every``): after a death or a hang
  (``hang_after=``) in ``step()``, the pool's spare takes the lost rank's place and the training goes
  on from its last complete checkpoint (``lab.run.auto_resume``); ``faults=`` strike at global steps;
  ``on_event=`` hears of hangs, deaths, spikes, resumes and finishes (``lab.run.events``).

The layout may use fewer ranks than the pool has (``parallel.world_size`` of them, the
first ones); the others hold nothing.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kernels.train import live_training
from kernels.checkpoint.files import read_meta, resolve, step_dir
from kernels.model.family import ModelConfig, model_config
from kernels.contract.run_config import RunConfig
from lab.pool.cluster import Cluster
from lab.errors import LabError, RankError
from lab.pool.hang_report import HangWatch
from lab.run.auto_resume import AutoResume, resume_problems, split_options
from lab.run.experiment import Experiment
from lab.run.faults import fault_records, poison_records
from lab.run.parallel import Parallel, ParallelConfigError
from lab.run.run_result import RunResult
from lab.run.training_hygiene import saved_hygiene


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

    def __init__(self, cluster: Cluster, model: ModelConfig, parallel: Parallel, *, global_batch: int = 8,
                 lr: float = 1e-2, optimizer: str = "adamw", seed: int = 0, trace: bool = False,
                 synthetic_forward_s: float | None = None, measure: bool = False, compile: bool = False,
                 checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
                 checkpoint_async: bool = False, data: Any = None, auto_resume: bool = False,
                 faults: Sequence[Any] = (), hang_after: float | None = None, on_event: Any = None,
                 grad_clip: float | None = None, lr_schedule: Any = None, shuffle: bool | None = None,
                 spike_guard: Any = None, watch: bool = True) -> None:
        self._setup(cluster, model, parallel, dict(global_batch=global_batch, lr=lr, optimizer=optimizer, seed=seed,
                                                   data=data, auto_resume=auto_resume, faults=faults,
                                                   grad_clip=grad_clip, lr_schedule=lr_schedule, shuffle=shuffle,
                                                   spike_guard=spike_guard, watch=watch,
                                                   hang_after=hang_after, on_event=on_event,
                                                   trace=trace, synthetic_forward_s=synthetic_forward_s,
                                                   measure=measure, compile=compile,
                                                   checkpoint_dir=_absolute(checkpoint_dir),
                                                   checkpoint_every=checkpoint_every,
                                                   checkpoint_async=checkpoint_async))
        self._open(self._run_config(1))  # with the layout's world size when it is smaller than the pool

    def _setup(self, cluster: Cluster, model: ModelConfig, parallel: Parallel, options: dict[str, Any]) -> None:
        """The driver's side: checked (nothing reaches the ranks when a rule is broken), at step 0."""
        options, own = split_options(options)  # auto_resume and faults: the Training's, not its runs'
        self.cluster, self._options = cluster, options
        self.key = f"training-{uuid.uuid4().hex[:12]}"  # the ranks' registry key of this training
        self.losses: list[float] = []  # every step's, as far as known (an Experiment's checkpoint keeps none)
        self.steps_done = 0  # optimizer steps taken so far: the next step() trains global step steps_done first
        problems = resume_problems(own, options, parallel.world_size if isinstance(parallel, Parallel) else None)
        try:
            self.experiment = self._experiment(model, parallel, options)
        except ParallelConfigError as error:  # one error naming every rule broken
            raise ParallelConfigError(error.problems + problems) from None
        if problems:
            raise ParallelConfigError(problems)
        self._resume = AutoResume(**own)  # lab.run.auto_resume: its faults, its known checkpoint

    @property
    def model(self) -> ModelConfig:
        return self.experiment.model

    @property
    def parallel(self) -> Parallel:
        return self.experiment.parallel

    def _experiment(self, model: ModelConfig, parallel: Parallel, options: dict[str, Any]) -> Experiment:
        """The Experiment whose checks and run config this layout gets; refused before anything reaches the ranks."""
        pool_size = self.cluster.world_size
        size = parallel.world_size if isinstance(parallel, Parallel) else pool_size
        if size > pool_size:
            raise ParallelConfigError([("world-size", f"dp*tp*pp = {size} is more than the pool's "
                                        f"{pool_size} ranks")])
        return Experiment(_RanksOfLayout(self.cluster, size) if size < pool_size else self.cluster, model, parallel,
                          steps=1, **options)

    def _run_config(self, steps: int) -> RunConfig:
        run = self.experiment.run_config()
        size = self.parallel.world_size
        return replace(run, steps=steps, world_size=size if size < self.cluster.world_size else None,
                       faults=fault_records(self._resume.faults), poison=poison_records(self._resume.faults))

    def _open(self, run: RunConfig) -> None:
        self.cluster.run(live_training.open_training, self.key, run.to_dict(), next_step=self.steps_done,
                         losses=self.losses)

    def relayout(self, parallel: Parallel, *, through: str | os.PathLike | None = None, **options: Any) -> "Training":
        """Reshard the live model and optimizer to ``parallel`` (another layout, another world size) in place.

        Checked like a new Experiment before anything moves; ``options`` change the measuring
        options (``trace``, ``synthetic_forward_s``, ``measure``) from here on. ``through`` is the directory the
        state passes through (default: a temporary one in memory-backed /dev/shm where there is
        one, removed after); a pool on several hosts needs one every host can read.
        """
        unknown = set(options) - {"trace", "synthetic_forward_s", "measure"}
        if unknown:
            raise TypeError(f"relayout() changes only the measuring options, not {', '.join(sorted(unknown))}")
        new_options = {**self._options, **options}
        experiment = self._experiment(self.model, parallel, new_options)
        hosts = getattr(self.cluster, "rank_map", None)
        if through is None and hosts is not None and len(hosts.hosts()) > 1:
            raise ValueError("this pool spans several hosts: pass relayout(..., through=PATH) on a filesystem "
                             "every host shares")
        base = Path(through) if through is not None else Path(tempfile.mkdtemp(
            prefix="lab-relayout-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
        old = self.experiment, self._options
        self.experiment, self._options = experiment, new_options
        try:
            cfg = self._run_config(1).to_dict()
            self._call(live_training.relayout_training, self.key, cfg, str(step_dir(base, self.steps_done)))
        except BaseException:
            self.experiment, self._options = old  # the ranks hold the old layout still, or nothing (the error says)
            raise
        finally:
            if through is None:
                shutil.rmtree(base, ignore_errors=True)
        return self

    def save(self, path: str | os.PathLike) -> Path:
        """Save the live state as a checkpoint directory ``path/step_NNNNNN``; returns that directory."""
        target = step_dir(path, self.steps_done)
        Path(path).mkdir(parents=True, exist_ok=True)
        self._call(live_training.save_training, self.key, str(target))
        return target

    @classmethod
    def load(cls, cluster: Cluster, path: str | os.PathLike, *, parallel: Parallel | None = None,
             checkpoint_dir: str | os.PathLike | None = None, checkpoint_every: int | None = None,
             checkpoint_async: bool = False, **options: Any) -> "Training":
        """A Training from a checkpoint (a step directory, or the latest complete one under ``path``).

        ``parallel`` defaults to the saved layout; any other valid layout of the same model
        loads it too. The model, seed, batch size, optimizer and learning rate are the saved run's;
        ``checkpoint_dir``/``checkpoint_every``/``checkpoint_async`` and ``options`` (``trace``, ``measure``, ...) are as for a
        new Training.
        """
        found = resolve(path)
        saved = RunConfig.from_dict(read_meta(found)["config"])
        training = cls.__new__(cls)  # built on the ranks by the load itself, not twice
        training._setup(cluster, model_config(saved), parallel or saved_layout(saved),
                        dict(global_batch=saved.global_batch, lr=saved.lr, optimizer=str(saved.optimizer),
                             seed=saved.seed, data=saved.data,
                             checkpoint_dir=_absolute(checkpoint_dir), checkpoint_every=checkpoint_every,
                             checkpoint_async=checkpoint_async,
                             **{**saved_hygiene(saved), **options}))
        training._reload(found)
        training._resume.point = (training.steps_done, found)  # auto_resume can go back to it
        return training

    def _reload(self, path: Path | None) -> None:
        """Build this training on the ranks from checkpoint ``path`` (None: afresh, at step 0), standing there."""
        if path is None:
            self.losses, self.steps_done = [], 0
            return self._open(self._run_config(1))
        meta = self._call(live_training.load_training, self.key, self._run_config(1).to_dict(), str(path))[0]
        self.losses, self.steps_done = list(meta.get("losses", [])), int(meta["step"])

    def step(self, n: int = 1, *, timeout: float | None = None, return_params: bool = False,
             wait: bool = True) -> RunResult:
        """Train ``n`` more steps on the held state; returns those steps' RunResult (losses of these steps only).

        ``wait=False`` raises ``lab.PoolBusyError`` while a started run trains, instead of waiting for it.
        With ``auto_resume``, a death or hang goes back to the last complete checkpoint and trains on
        (``lab.run.auto_resume``); the result then holds the steps after the last resume.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be a positive int (steps to train), got {n!r}")
        call = dict(timeout=timeout, return_params=return_params, wait=wait)
        result = self._resume.step(self, n, **call) if self._resume.enabled else self._advance(n, **call)
        self.experiment.events.finished(result)
        return result

    def _advance(self, n: int, *, timeout: float | None, return_params: bool, wait: bool) -> RunResult:
        """Train ``n`` steps on the ranks, watched (``hang_after``); a failure is told to ``on_event`` and raised."""
        cfg = self._run_config(n).to_dict()
        try:
            per_rank = self._call(live_training.advance, self.key, n, return_params=return_params, timeout=timeout,
                                  wait=wait, hang_watch=HangWatch(self.cluster, self.experiment.hang_after))
        except RankError as error:
            self.experiment.events.failure(error)
            raise
        first = per_rank[0]["first_step"]
        if first != self.steps_done:
            raise LabError(f"the ranks stood at step {first}, the driver at {self.steps_done}: the training was "
                           "stepped from elsewhere")
        self.losses += per_rank[0]["losses"]
        self.steps_done += n
        return self.experiment.result_from_ranks(per_rank, cfg, return_params)

    def _call(self, fn: Any, *args: Any, timeout: float | None = None, wait: bool = True,
              **kwargs: Any) -> list[Any]:
        try:
            return self.cluster.run(fn, *args, timeout=timeout, wait=wait, **kwargs)
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


def _absolute(path: str | os.PathLike | None) -> str | None:
    # The ranks' working directory may differ from the notebook's.
    return None if path is None else os.path.abspath(os.fspath(path))


def saved_layout(run: RunConfig) -> Parallel:
    """A lab.Parallel that resolves to the run's Strategy, its defaults left unset.

    FSDP2's replication of TP x DP is what ZeRO 0 resolves to, so only a chosen ZeRO-2/3 is hybrid.
    """
    s = run.strategy
    hybrid = s.hybrid and s.requested_zero >= 2
    parallel = Parallel(dp=s.dp, tp=s.tp, pp=s.pp, zero=s.requested_zero, fsdp_strategy="hybrid" if hybrid else None,
                        dp_replicate=s.dp_replicate if hybrid else None, schedule=s.schedule or "1f1b",
                        sequence_parallel=s.sequence_parallel, loss_parallel=s.loss_parallel,
                        activation_checkpointing=s.activation_checkpointing, mixed_precision=s.mixed_precision,
                        cpu_offload=s.cpu_offload, mesh_order=s.mesh_order)
    if s.microbatches != parallel.num_microbatches:
        parallel = replace(parallel, microbatches=s.microbatches)
    if s.pp > 1 and s.stages_per_rank != parallel.num_stages_per_rank:
        parallel = replace(parallel, stages_per_rank=s.stages_per_rank)
    if s.stage_layers is not None:  # last: its length is checked against the stage count set above
        parallel = replace(parallel, stage_layers=s.stage_layers)
    return parallel
