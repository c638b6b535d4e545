"""Between the gradients and the weights: the spike guard, gradient clipping, the optimizer step, the lr schedule.

One ``UpdateRules`` per run, on every rank and in the one-process reference, applies the run's
training hygiene (``kernels.contract.training_hygiene``) around each optimizer step, in this order:

1. the spike guard (``kernels.train.spike_guard``) judges the step's global loss: a skipped step
   takes no optimizer step (its gradients are dropped by the loop's ``zero_grad``);
2. clipping by the global norm, as ``torch.nn.utils.clip_grad_norm_`` does: the whole gradient's
   L2 norm (on the ranks ``kernels.train.train_loop.grad_norm``, summed over every shard, stage and
   mesh), then every gradient times ``min(1, max_norm / (norm + 1e-6))``. On a rank each local shard
   is scaled: a shard of the whole gradient scaled is the scaled gradient's shard, for any placement,
   a Partial one too. The reference calls ``clip_grad_norm_`` itself;
3. ``optimizer.step()``;
4. the lr schedule (``kernels.train.lr_schedule``) moves to the next step, updated or skipped.

The step fed to ``PoisonedLoss`` (``lab.PoisonBatch``) is set here before each step's forward.

Run alone (the rank clipping against torch's ``clip_grad_norm_`` on one process; tests/test_training_hygiene.py
checks it with the ranks' norm, ``kernels.train.train_loop.grad_norm``)::

    python -m kernels.train.update_rules
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from kernels.contract.run_config import RunConfig
from kernels.parallel.mesh import local_part
from kernels.train.lr_schedule import ScheduledLR
from kernels.train.poisoned_loss import PoisonedLoss
from kernels.train.spike_guard import LossGuard

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: the norm's denominator never zero


def clip_to_norm(module: nn.Module, norm: torch.Tensor, max_norm: float) -> None:
    """Scale this rank's gradients (local shards) by ``min(1, max_norm / (norm + 1e-6))``; ``norm`` is the whole's.

    The coefficient is taken in float32, the gradients' dtype, as ``clip_grad_norm_`` takes it from
    its float32 norm, so each element gets the same one multiplication.
    """
    coef = torch.clamp(max_norm / (norm.float() + CLIP_EPS), max=1.0)
    with torch.no_grad():
        for p in module.parameters():
            if p.grad is not None:  # outside grad mode to_local() is the shard itself: scaled in place
                grad = local_part(p.grad)
                grad.mul_(coef.to(grad.device, grad.dtype))


class UpdateRules:
    """The run's guard, clipping and schedule around ``optimizer`` (module docstring).

    ``clip(max_norm)`` clips the gradients and returns the whole gradient's norm before clipping;
    ``before_update()`` runs right before the parameters change (an asynchronous save's copy must be
    done then: ``RunCheckpoints.before_update``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, run: RunConfig, clip: Callable[[float], torch.Tensor],
                 poison: PoisonedLoss | None = None, before_update: Callable[[], None] = lambda: None) -> None:
        self.optimizer, self.max_norm, self.clip, self.poison = optimizer, run.grad_clip, clip, poison
        self.before_update = before_update
        self.schedule = ScheduledLR(optimizer, run.lr_schedule, run.lr) if run.lr_schedule is not None else None
        self.guard = LossGuard(run.spike_guard) if run.spike_guard is not None else None
        self.step = 0  # the run's step the next update is
        self.lrs: list[float] = []  # the lr of each step applied since the last take

    @property
    def needs_loss(self) -> bool:
        """The guard judges the global loss before the update, so the loop reduces it first."""
        return self.guard is not None

    def seek(self, step: int, losses: Sequence[float] = ()) -> None:
        """The next update is the run's step ``step``; ``losses`` are the run's so far, when known (a held training)."""
        self.step = step
        if self.schedule is not None:
            self.schedule.seek(step)
        if self.guard is not None:
            self.guard.catch_up(losses)

    def begin(self) -> None:
        """Before the step's forward: a poisoned loss learns which step it is."""
        if self.poison is not None:
            self.poison.step = self.step

    def apply(self, loss: torch.Tensor | float | None) -> torch.Tensor | None:
        """Guard, clip, step, schedule; returns the norm before clipping when clipping computed it, else None.

        ``loss`` is the step's global loss (None when no guard reads it).
        """
        norm = None
        self.before_update()
        self.lrs.append(float(self.optimizer.param_groups[0]["lr"]))
        skipped = self.guard is not None and self.guard.judge(self.step, float(loss)) is not None
        if not skipped:
            if self.max_norm is not None:
                norm = self.clip(self.max_norm)
            self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()
        self.step += 1
        return norm

    def take(self) -> dict[str, list]:
        """The records of the steps since the last take: ``lrs`` and, with a guard, ``spikes`` (SpikeEvent dicts)."""
        out = {"lrs": self.lrs, "spikes": self.guard.take() if self.guard is not None else []}
        self.lrs = []
        return out


def torch_clip(parameters: Sequence[nn.Parameter]) -> Callable[[float], torch.Tensor]:
    """The reference's ``clip``: ``torch.nn.utils.clip_grad_norm_`` over every parameter of one process."""
    return lambda max_norm: torch.nn.utils.clip_grad_norm_(parameters, max_norm)


if __name__ == "__main__":
    torch.manual_seed(0)
    ours, theirs = nn.Linear(8, 8), nn.Linear(8, 8)
    theirs.load_state_dict(ours.state_dict())
    ours(torch.randn(4, 8)).pow(2).sum().backward()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        q.grad = p.grad.clone()
    whole = torch.nn.utils.get_total_norm([p.grad for p in ours.parameters()])  # one process: the whole gradient
    clip_to_norm(ours, whole, 0.5)
    torch_clip(list(theirs.parameters()))(0.5)
    print("largest difference from clip_grad_norm_:",
          max(float((p.grad - q.grad).abs().max()) for p, q in zip(ours.parameters(), theirs.parameters())))
