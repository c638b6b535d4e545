"""A loss poisoned at chosen steps, on every rank and in the one-process reference: what ``lab.PoisonBatch`` does.

A teaching fault, for the spike guard (``kernels.train.spike_guard``): at each poisoned step every
micro-batch's loss is multiplied by NaN (every gradient becomes NaN, as after an overflow) or by
a scale (a loss spike, with gradients that much larger). The poison acts on the loss function the
layout already calls, so it reaches every layout alike, a pipeline's last stage included, and the
reference multiplies the same losses: a guarded run still equals one process step by step.

Run alone (the loss of one batch, plain and poisoned)::

    python -m kernels.train.poisoned_loss
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.contract.faults import Poison, PoisonKind


class PoisonedLoss:
    """``loss(logits, targets)``, multiplied at the poisoned steps; the training loop sets ``step`` before each step."""

    def __init__(self, loss: Callable[..., torch.Tensor], poison: tuple[Poison, ...]) -> None:
        self.loss = loss
        self.multipliers = {p.step: p.multiplier for p in poison}
        self.step = -1  # counted from 0 over the whole run

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        value = self.loss(logits, targets)
        multiplier = self.multipliers.get(self.step)
        return value if multiplier is None else value * multiplier


def poisoned(loss: Callable[..., torch.Tensor],
             poison: tuple[Poison, ...]) -> tuple[Callable[..., torch.Tensor], PoisonedLoss | None]:
    """(the loss a run calls, its ``PoisonedLoss`` or None): ``loss`` itself when no step is poisoned."""
    if not poison:
        return loss, None
    wrapped = PoisonedLoss(loss, poison)
    return wrapped, wrapped


if __name__ == "__main__":
    logits, targets = torch.randn(2, 4, 8), torch.randint(0, 8, (2, 4))

    def cross_entropy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(x.flatten(0, 1), y.flatten())

    poisoned = PoisonedLoss(cross_entropy, (Poison(1, PoisonKind.NAN), Poison(2, PoisonKind.SPIKE, scale=10.0)))
    for step in range(3):
        poisoned.step = step
        print(step, float(poisoned(logits, targets)))
