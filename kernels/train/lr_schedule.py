"""The run's learning-rate schedule on its optimizer: torch's ``LambdaLR`` or ``StepLR``, at the run's step.

Algorithm: the schedules of ``torch.optim.lr_scheduler``. ``RunConfig.lr_schedule``
(``kernels.contract.training_hygiene.LRSchedule``) names one:

- ``warmup_cosine``: ``LambdaLR`` with the factor ``warmup_cosine_factor`` gives: a linear warm-up
  ((step + 1) / (warmup_steps + 1): the first step already moves, and step warmup_steps is the peak,
  as ``LinearLR(start_factor=1 / (warmup_steps + 1), total_iters=warmup_steps)``), then a half cosine from 1 down to
  ``min_factor`` at ``total_steps`` (Loshchilov & Hutter, 2017, "SGDR", without restarts), then flat.
  The factor is a closed form of the step, as ``transformers``' cosine-with-warm-up schedule is;
  its cosine part equals ``CosineAnnealingLR``'s closed form (tests/test_training_hygiene.py);
- ``step``: torch's ``StepLR(step_size, gamma)``, the textbook's;
- ``function``: ``LambdaLR`` with the user's own function of the step, sent pickled by value
  (cloudpickle, as ``lab.Model`` sends a factory) and unpickled here.

The schedule counts the steps of the run, updated or not: a step the spike guard skips still
moves it on, so the learning rate at a step is a function of that step alone. Every rank and the
one-process reference build the same scheduler over their optimizers (``ZeroRedundancyOptimizer``
passes its groups' lr on to its local optimizer at each step). A run that starts at step k (a
checkpoint, a held training's next call, a new layout) calls ``seek(k)``: the optimizer's lr is set
back to the run's and a new scheduler steps k times, the very float operations the uninterrupted
run made, so the lr goes on exactly where it was. The optimizer's settings stay those of a run
without a schedule (the scheduler's ``initial_lr`` is not left in them), so any checkpoint loads
into any run, scheduled or not.

Run alone (the factors of a warm-up + cosine and of StepLR over 8 steps)::

    python -m kernels.train.lr_schedule
"""
from __future__ import annotations

import base64
import math
import pickle
import re
import warnings
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, StepLR

from kernels.contract.training_hygiene import LRSchedule, ScheduleKind

# torch warns when a scheduler steps before its optimizer; a fast-forward and a skipped step do so on purpose.
_ORDER_WARNING = re.escape("Detected call of `lr_scheduler.step()` before `optimizer.step()`")


def warmup_cosine_factor(step: int, warmup_steps: int, total_steps: int, min_factor: float) -> float:
    """The lr factor at ``step``: linear warm-up, then a half cosine to ``min_factor`` at ``total_steps``, then flat."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_factor + (1.0 - min_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def decode_function(code: str) -> Callable[[int], float]:
    """The user's step -> factor function that ``lab.run.training_hygiene`` pickled (cloudpickle, base64)."""
    return pickle.loads(base64.b64decode(code))


def build_scheduler(optimizer: torch.optim.Optimizer, spec: LRSchedule) -> LRScheduler:
    """torch's scheduler for ``spec`` over ``optimizer`` (module docstring)."""
    if spec.kind is ScheduleKind.STEP:
        return StepLR(optimizer, step_size=spec.step_size, gamma=spec.gamma)
    if spec.kind is ScheduleKind.WARMUP_COSINE:
        def factor(step: int) -> float:
            return warmup_cosine_factor(step, spec.warmup_steps, spec.total_steps, spec.min_factor)
    else:
        function = decode_function(spec.code)

        def factor(step: int) -> float:
            return float(function(step))
    return LambdaLR(optimizer, factor)


class ScheduledLR:
    """``spec``'s scheduler over ``optimizer``, whose base lr is ``base_lr``: ``seek(step)`` places it, ``step()``
    moves it on."""

    def __init__(self, optimizer: torch.optim.Optimizer, spec: LRSchedule, base_lr: float) -> None:
        self.optimizer, self.spec, self.base_lr = optimizer, spec, base_lr
        self.scheduler: LRScheduler | None = None
        self.at = -1  # the step whose lr the optimizer holds (-1: not placed yet)

    def seek(self, step: int) -> None:
        """Give the optimizer the lr of ``step``: a new scheduler from the run's lr, stepped ``step`` times."""
        if step == self.at:
            return
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr
        self.scheduler = build_scheduler(self.optimizer, self.spec)
        for group in self.optimizer.param_groups:
            # LambdaLR and StepLR read it once, into base_lrs; left in the groups it would be one more optimizer
            # setting in every checkpoint, which a run saved without a schedule does not hold.
            group.pop("initial_lr", None)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ORDER_WARNING)
            for _ in range(step):
                self.scheduler.step()
        self.at = step

    def step(self) -> None:
        """After a step, updated or skipped: the next step's lr."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_ORDER_WARNING)
            self.scheduler.step()
        self.at += 1

    @property
    def lr(self) -> float:
        """The lr the optimizer applies at the current step."""
        return float(self.optimizer.param_groups[0]["lr"])


if __name__ == "__main__":
    params = [torch.nn.Parameter(torch.zeros(1))]
    for spec in (LRSchedule(ScheduleKind.WARMUP_COSINE, warmup_steps=2, total_steps=6, min_factor=0.1),
                 LRSchedule(ScheduleKind.STEP, step_size=3, gamma=0.5)):
        scheduled = ScheduledLR(torch.optim.SGD(params, lr=1.0), spec, 1.0)
        scheduled.seek(0)
        lrs = []
        for _ in range(8):
            lrs.append(round(scheduled.lr, 4))
            scheduled.step()
        print(spec.describe(), lrs)
