"""The training hygiene of a run as the ranks receive it: a learning-rate schedule, a spike guard and its events.

Three options of ``RunConfig`` beside the optimizer's own, each checked here by a named rule,
before any rank starts (``lab.Experiment`` and ``lab.Training`` build them):

- ``grad_clip``: clip the whole gradient to this global L2 norm before each optimizer step, as
  ``torch.nn.utils.clip_grad_norm_`` does in one process ([grad-clip]);
- ``lr_schedule``: an ``LRSchedule``, the learning rate's factor per step: a linear warm-up then a
  cosine decay, torch's ``StepLR``, or the user's own function of the step, sent pickled by value
  ([lr-schedule]; built on the ranks by ``kernels.train.lr_schedule``);
- ``shuffle``: the order of a dataset of finite size, epoch by epoch, as
  ``DistributedSampler(shuffle=...)`` with ``set_epoch`` orders it ([shuffle]);
- ``spike_guard``: a ``SpikeGuard``; a non-finite loss, or one above ``factor`` times the median of
  the last ``window`` kept losses, skips that step's update, and each skip is a ``SpikeEvent``
  ([spike-guard]; applied on the ranks by ``kernels.train.spike_guard``).

Standard library only: the driver, the ranks and the views import it.

Try it alone (the records of a schedule and a guard, and what a bad one breaks)::

    python -m kernels.contract.training_hygiene
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kernels.contract.config_rules import Problem, is_int, is_real
from kernels.contract.data_spec import DataKind
from kernels.contract.records import Record

# Data kinds with a finite number of samples, which epochs permute (or keep in order).
FINITE_DATA = (DataKind.TOKENS, DataKind.TEXT)
GUARD_ACTIONS = ("skip",)  # what a SpikeGuard does; "rollback" (to the last checkpoint) is not built


class ScheduleKind(enum.StrEnum):
    """How the learning rate changes with the step."""

    WARMUP_COSINE = "warmup_cosine"  # linear warm-up over warmup_steps, then a cosine down to min_factor at total_steps
    STEP = "step"  # torch's StepLR: times gamma every step_size steps
    FUNCTION = "function"  # the user's function step -> factor, pickled by value (code)


@dataclass(frozen=True)
class LRSchedule(Record):
    """A learning-rate schedule: the factor of the run's ``lr`` at each step (counted from 0 over the whole run)."""

    kind: ScheduleKind
    warmup_steps: int = 0  # warmup_cosine: the factor rises linearly to 1 at this step
    total_steps: int | None = None  # warmup_cosine: the step the cosine reaches min_factor (then it stays there)
    min_factor: float = 0.0  # warmup_cosine: the last factor
    step_size: int | None = None  # step: the factor is gamma ** (step // step_size)
    gamma: float = 0.1  # step
    code: str | None = None  # function: the callable, cloudpickled by value, base64

    def __post_init__(self) -> None:
        self._enum_field("kind", ScheduleKind)

    def describe(self) -> str:
        """One line: "warm-up 2 steps, cosine to 0.1 at step 10", "StepLR(step_size=2, gamma=0.5)", "your function"."""
        if self.kind is ScheduleKind.WARMUP_COSINE:
            return f"warm-up {self.warmup_steps} steps, cosine to {self.min_factor} at step {self.total_steps}"
        if self.kind is ScheduleKind.STEP:
            return f"StepLR(step_size={self.step_size}, gamma={self.gamma})"
        return "your function of the step"


@dataclass(frozen=True)
class SpikeGuard(Record):
    """Skip the update of a step whose global loss is NaN or inf, or above ``factor`` x the median of the last
    ``window`` kept losses (judged once ``window`` are kept). Every rank holds the same global loss, so all agree."""

    factor: float = 3.0
    window: int = 5
    action: str = "skip"  # no optimizer step, gradients dropped; the schedule still counts the step


@dataclass(frozen=True)
class SpikeEvent(Record):
    """One step the guard acted on: its global loss, the median it was judged against, why and what it did."""

    step: int  # counted from 0 over the whole run
    loss: float
    median: float | None  # of the window before this step (None while it held fewer than window losses)
    reason: str  # "nan", "inf" or "spike"
    action: str  # "skip"


def grad_clip_problems(grad_clip: Any) -> list[Problem]:
    """[grad-clip]: None (no clipping) or a finite number > 0, the largest global L2 norm a step may apply."""
    if grad_clip is None or (is_real(grad_clip) and grad_clip > 0):
        return []
    return [("grad-clip", f"grad_clip must be None or a finite number > 0 (the global gradient norm to clip to), "
             f"got {grad_clip!r}")]


def lr_schedule_problems(schedule: Any) -> list[Problem]:
    """[lr-schedule]: None or an LRSchedule whose kind has the fields it needs, each in range."""
    if schedule is None:
        return []
    if not isinstance(schedule, LRSchedule):
        return [("lr-schedule", f"lr_schedule must be None or an LRSchedule, got {type(schedule).__name__}")]
    s = schedule
    if s.kind is ScheduleKind.WARMUP_COSINE:
        ok = (is_int(s.warmup_steps) and s.warmup_steps >= 0
              and is_int(s.total_steps) and s.total_steps > s.warmup_steps
              and is_real(s.min_factor) and 0 <= s.min_factor <= 1)
        need = "warmup_steps an int >= 0, total_steps an int > warmup_steps, min_factor a number in [0, 1]"
    elif s.kind is ScheduleKind.STEP:
        ok = is_int(s.step_size) and s.step_size >= 1 and is_real(s.gamma) and s.gamma > 0
        need = "step_size an int >= 1 and gamma a finite number > 0"
    else:
        ok, need = isinstance(s.code, str) and bool(s.code), "the function's pickled code"
    return [] if ok else [("lr-schedule", f"{s.kind.value} needs {need}; got {s}")]


def shuffle_problems(shuffle: Any, data: DataKind) -> list[Problem]:
    """[shuffle]: None (the data's own order), or True/False for data of finite size (token ids, text), and False
    for your own batches (trained in the order given).

    The synthetic chain and the task draw every step's batch afresh from (seed, step): a stream without end
    and without epochs, already in random order, so there is nothing to permute or to keep in order.
    """
    if shuffle is None:
        return []
    if not isinstance(shuffle, bool):
        return [("shuffle", f"shuffle must be None, True or False, got {shuffle!r}")]
    if data in FINITE_DATA or (data is DataKind.BATCHES and not shuffle):
        return []
    if data is DataKind.BATCHES:
        return [("shuffle", "your own batches (lab.Batches) are trained in the order given, one per step: "
                 "shuffle=True is not built for them; shuffle them before you pass them")]
    return [("shuffle", f"shuffle={shuffle} orders a dataset of finite size epoch by epoch (text or token ids); "
             f"the {data.value} data draws every step's batch afresh from (seed, step), with no epochs to permute "
             "or keep in order: leave shuffle=None")]


def spike_guard_problems(guard: Any) -> list[Problem]:
    """[spike-guard]: None or a SpikeGuard with factor a finite number > 1, window an int >= 1 and action "skip"."""
    if guard is None:
        return []
    if not isinstance(guard, SpikeGuard):
        return [("spike-guard", f"spike_guard must be None or a lab.SpikeGuard, got {type(guard).__name__}")]
    out = []
    if not (is_real(guard.factor) and guard.factor > 1):
        out.append(("spike-guard", f"SpikeGuard factor must be a finite number > 1, got {guard.factor!r}"))
    if not (is_int(guard.window) and guard.window >= 1):
        out.append(("spike-guard", f"SpikeGuard window must be an int >= 1, got {guard.window!r}"))
    if guard.action == "rollback":
        out.append(("spike-guard", "SpikeGuard action='rollback' (back to the last checkpoint) is not built: use "
                    "action='skip', which drops the step's update and goes on"))
    elif guard.action not in GUARD_ACTIONS:
        out.append(("spike-guard", f"SpikeGuard action must be one of {', '.join(GUARD_ACTIONS)}, "
                    f"got {guard.action!r}"))
    return out


def hygiene_problems(grad_clip: Any, schedule: Any, shuffle: Any, data: DataKind, guard: Any) -> list[Problem]:
    """Every hygiene rule the four options break (each function above)."""
    return (grad_clip_problems(grad_clip) + lr_schedule_problems(schedule) + shuffle_problems(shuffle, data)
            + spike_guard_problems(guard))


if __name__ == "__main__":
    print(LRSchedule(ScheduleKind.WARMUP_COSINE, warmup_steps=2, total_steps=10, min_factor=0.1).to_dict())
    print(SpikeGuard(factor=3.0, window=5).to_dict())
    print(hygiene_problems(0, LRSchedule(ScheduleKind.STEP), True, DataKind.SYNTHETIC, SpikeGuard(action="rollback")))
