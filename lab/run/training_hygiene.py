"""What an Experiment or a Training takes for training hygiene: ``grad_clip``, ``lr_schedule``, ``shuffle``, ``spike_guard``.

::

    lab.Experiment(cluster, model, lab.Parallel(dp=4), steps=20, data=lab.Text(path),
                   grad_clip=1.0,                                         # global L2 norm, as clip_grad_norm_
                   lr_schedule=lab.WarmupCosine(warmup_steps=2, total_steps=20, min_factor=0.1),
                   shuffle=True,                                          # a new permutation each epoch
                   spike_guard=lab.SpikeGuard(factor=3.0, window=5),      # skip the update of a bad batch
                   faults=[lab.PoisonBatch(step=8, kind="nan")])          # a bad batch on purpose

- ``lr_schedule`` is ``lab.WarmupCosine(warmup_steps, total_steps, min_factor=0.0)``,
  ``lab.StepLR(step_size, gamma=0.1)`` (torch's), or your own function ``step -> factor`` of the
  run's lr, pickled by value with cloudpickle as ``lab.Model`` sends a factory (a lambda or a
  notebook function works; it is tried on the run's steps here, before anything launches);
- ``shuffle``: None keeps the data's own order; True/False order text and token ids epoch by epoch
  (``kernels.contract.training_hygiene`` says which data takes which);
- ``spike_guard``: ``lab.SpikeGuard`` (``kernels.contract.training_hygiene.SpikeGuard``); the steps it
  skipped are ``RunResult.spikes``.

The ranks receive them as ``RunConfig`` fields, checked by their named rules ([grad-clip],
[lr-schedule], [shuffle], [spike-guard]); the one-process reference applies them alike.
"""
from __future__ import annotations

import base64
import math
from dataclasses import dataclass
from typing import Any

from kernels.contract.config_rules import ConfigError
from kernels.contract.run_config import RunConfig
from kernels.contract.training_hygiene import LRSchedule, ScheduleKind


@dataclass(frozen=True)
class WarmupCosine:
    """The lr rises linearly over ``warmup_steps`` steps, then falls along a half cosine to ``min_factor`` x lr at
    ``total_steps`` and stays there (``kernels.train.lr_schedule``)."""

    warmup_steps: int
    total_steps: int
    min_factor: float = 0.0

    def record(self) -> LRSchedule:
        """What the ranks receive."""
        return LRSchedule(ScheduleKind.WARMUP_COSINE, warmup_steps=self.warmup_steps, total_steps=self.total_steps,
                          min_factor=self.min_factor)


@dataclass(frozen=True)
class StepLR:
    """torch's ``StepLR``: the lr times ``gamma`` every ``step_size`` steps."""

    step_size: int
    gamma: float = 0.1

    def record(self) -> LRSchedule:
        """What the ranks receive."""
        return LRSchedule(ScheduleKind.STEP, step_size=self.step_size, gamma=self.gamma)


def schedule_record(lr_schedule: Any, steps: Any = 1) -> LRSchedule | None:
    """The ``LRSchedule`` the ranks receive for ``lr_schedule=``; ConfigError [lr-schedule] for what cannot be one.

    A function is called on steps 0..steps-1 here (a Training: on step 0) and must give finite factors >= 0.
    """
    if lr_schedule is None or isinstance(lr_schedule, LRSchedule):  # a saved run's record (Training.load)
        return lr_schedule
    if isinstance(lr_schedule, (WarmupCosine, StepLR)):
        return lr_schedule.record()
    if not callable(lr_schedule):
        raise ConfigError([("lr-schedule", "lr_schedule is None, lab.WarmupCosine, lab.StepLR or a function "
                            f"step -> factor of the lr, got {type(lr_schedule).__name__}")])
    for step in range(steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 1):
        try:
            factor = float(lr_schedule(step))
        except Exception as error:  # whatever the user's function raises, named before any rank calls it
            raise ConfigError([("lr-schedule", f"lr_schedule({step}) failed: {type(error).__name__}: {error}")]) \
                from error
        if not (math.isfinite(factor) and factor >= 0):
            raise ConfigError([("lr-schedule", f"lr_schedule({step}) = {factor}: a factor of the lr must be a "
                                "finite number >= 0")])
    return LRSchedule(ScheduleKind.FUNCTION, code=_pickled(lr_schedule))


def saved_hygiene(run: RunConfig) -> dict[str, Any]:
    """A saved run's clipping, lr schedule, data order and spike guard: what ``lab.Training.load`` keeps unless told."""
    return {"grad_clip": run.grad_clip, "lr_schedule": run.lr_schedule, "shuffle": run.shuffle,
            "spike_guard": run.spike_guard}


def _pickled(function: Any) -> str:
    import cloudpickle

    try:
        return base64.b64encode(cloudpickle.dumps(function)).decode("ascii")
    except Exception as error:  # cloudpickle raises what the unpicklable object raises
        raise ConfigError([("lr-schedule", f"lr_schedule cannot be pickled, so no rank can call it: "
                            f"{type(error).__name__}: {error}")]) from error
