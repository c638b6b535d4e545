"""The spike guard on a rank: judge each step's global loss before the update, and keep a record of what it did.

Algorithm: a running median over a window of recent losses. A loss that is NaN or inf, or
above ``factor`` times the median of the last ``window`` kept losses (judged once the window is
full), marks a bad batch: the step's update is skipped (no optimizer step; the gradients are
dropped with every step's ``zero_grad``) and training goes on with the next batch, as large runs
recover from a loss spike without stopping (the OPT-175B logbook; PaLM, Chowdhery et al. 2022). Skipped
losses stay out of the window, so one spike does not raise the bar for the next.

Every rank judges the same number: the global-batch loss, all-reduced over dp (and sent from
the last pipeline stage) before the optimizer step, so every rank reaches the same decision
without another collective; the one-process reference judges its own loss the same way
(``kernels.train.update_rules``). ``SpikeGuard`` and ``SpikeEvent`` are the records
(``kernels.contract.training_hygiene``).

The window is the guard's only state. A held training replays its losses so far into a new
guard (``catch_up``: after a relayout or a load its decisions go on as before); a run resumed
from an Experiment's checkpoint, which keeps no losses, starts with an empty window, and so
does its reference.

Run alone (a NaN and a spike among falling losses)::

    python -m kernels.train.spike_guard
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from kernels.contract.training_hygiene import SpikeEvent, SpikeGuard


class LossGuard:
    """``guard``'s window and events on this rank; ``judge`` says whether a step's update is skipped."""

    def __init__(self, guard: SpikeGuard) -> None:
        self.guard = guard
        self.kept: deque[float] = deque(maxlen=guard.window)
        self.judged = 0  # steps judged so far: what catch_up compares a held training's losses with
        self.events: list[dict] = []  # SpikeEvent dicts not yet taken

    def judge(self, step: int, loss: float) -> SpikeEvent | None:
        """The event when step ``step``'s global ``loss`` is skipped, else None (and the loss joins the window)."""
        self.judged += 1
        full = len(self.kept) == self.guard.window
        median = statistics.median(self.kept) if full else None
        reason = "nan" if math.isnan(loss) else "inf" if math.isinf(loss) else \
            "spike" if median is not None and loss > self.guard.factor * median else None
        if reason is None:
            self.kept.append(loss)
            return None
        event = SpikeEvent(step=step, loss=loss, median=median, reason=reason, action=self.guard.action)
        self.events.append(event.to_dict())
        return event

    def catch_up(self, losses: Sequence[float]) -> None:
        """Replay the run's ``losses`` so far (steps 0..) into an empty window, when this guard has not judged them."""
        if self.judged == len(losses):
            return
        self.kept.clear()
        self.judged = 0
        for step, loss in enumerate(losses):
            self.judge(step, float(loss))
        self.events = []  # those were recorded by the calls that judged them first

    def take(self) -> list[dict]:
        """The events since the last take (one call's, for its records)."""
        out, self.events = self.events, []
        return out


if __name__ == "__main__":
    watch = LossGuard(SpikeGuard(factor=3.0, window=3))
    for step, loss in enumerate([4.1, 3.9, 3.6, float("nan"), 3.4, 40.0, 3.2]):
        watch.judge(step, loss)
    for event in watch.take():
        print(event)
