"""Faults on purpose, for teaching and for tests: ``lab.Slow``, ``lab.Hang``, ``lab.Crash``, ``lab.Kill``.

Pass them as ``lab.Experiment(..., faults=[lab.Slow(2, 2.0), lab.Hang(1, at_step=2)])``.
Each is checked against the pool and the run before anything is launched
(``fault_problems``: the rank exists, the step is one the run takes, the factor is at
least 1); the ranks receive them as ``kernels.contract.faults.Fault`` records and act on
them (``kernels.watch.faults``).
What each one shows:

- ``Slow(rank, factor)``: that rank's compute takes ``factor`` times as long, so under DP
  the others wait for it in the gradient all-reduce (``RunResult.step_waits``);
- ``Hang(rank, at_step)``: the rank stops in the first forward of that step; with
  ``hang_after=`` the run raises ``lab.HangError`` whose report names it;
- ``Crash(rank, at_step)``: the rank raises there, a ``lab.RankError`` naming it;
- ``Kill(rank, at_step)``: the rank SIGKILLs its own engine, a ``lab.DeadRankError``;
- ``PoisonBatch(step, kind="nan"|"spike")``: not a rank's fault but the run's: that step's loss is
  NaN or ``scale`` times too large on every rank and in the reference (``RunConfig.poison``), the
  bad batch a ``lab.SpikeGuard`` skips.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, ClassVar

from kernels.contract.config_rules import Problem
from kernels.contract.faults import Fault, FaultKind, Poison, PoisonKind


@dataclass(frozen=True)
class Slow:
    """Rank ``rank``'s compute (forward and backward) takes ``factor`` times as long, every step."""

    rank: int
    factor: float

    def record(self) -> Fault:
        """What the ranks receive."""
        return Fault(FaultKind.SLOW, self.rank, factor=float(self.factor))


@dataclass(frozen=True)
class _AtStep:
    rank: int
    at_step: int

    kind: ClassVar[FaultKind]

    def record(self) -> Fault:
        """What the ranks receive."""
        return Fault(self.kind, self.rank, at_step=self.at_step)


@dataclass(frozen=True)
class Hang(_AtStep):
    """Rank ``rank`` stops in the first forward of step ``at_step`` (counted from 0) and never returns."""

    kind = FaultKind.HANG


@dataclass(frozen=True)
class Crash(_AtStep):
    """Rank ``rank`` raises in the first forward of step ``at_step``."""

    kind = FaultKind.CRASH


@dataclass(frozen=True)
class Kill(_AtStep):
    """Rank ``rank`` SIGKILLs its own engine in the first forward of step ``at_step``."""

    kind = FaultKind.KILL


FAULTS = (Slow, Hang, Crash, Kill)


@dataclass(frozen=True)
class PoisonBatch:
    """The loss of step ``step`` poisoned on every rank, and in the reference: times NaN (``kind="nan"``) or times
    ``scale`` (``kind="spike"``), as a bad batch would (``kernels.train.poisoned_loss``); a ``lab.SpikeGuard``
    skips it."""

    step: int
    kind: str = "spike"
    scale: float = 100.0

    def record(self) -> Poison:
        """What the ranks receive (``RunConfig.poison``)."""
        return Poison(self.step, self.kind, self.scale)


def fault_records(faults: Any) -> tuple[Fault, ...]:
    """The records the ranks receive; anything not a lab fault is left to ``fault_problems`` to name."""
    return tuple(f.record() for f in faults if isinstance(f, FAULTS)) if isinstance(faults, (list, tuple)) else ()


def poison_records(faults: Any) -> tuple[Poison, ...]:
    """The poisoned steps among ``faults`` (``lab.PoisonBatch``), as the ranks receive them; one of an unknown kind
    is left to ``fault_problems`` to name."""
    if not isinstance(faults, (list, tuple)):
        return ()
    return tuple(f.record() for f in faults if isinstance(f, PoisonBatch) and f.kind in tuple(PoisonKind))


def _poison_problems(name: str, poison: PoisonBatch, steps: Any) -> list[Problem]:
    """A poisoned step is one the run takes (any step >= 0 for a Training), its kind nan or spike, its scale > 1."""
    out = []
    if not (_is_int(poison.step) and poison.step >= 0 and (steps is None or (_is_int(steps) and poison.step < steps))):
        out.append(("faults", f"{name} {poison!r}: step must be a step the run takes (steps={steps})"))
    if poison.kind not in tuple(PoisonKind):
        out.append(("faults", f"{name} {poison!r}: kind must be one of {', '.join(PoisonKind)}"))
    scale = poison.scale
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 1):
        out.append(("faults", f"{name} {poison!r}: scale must be a finite number > 1"))
    return out


def fault_problems(faults: Any, world_size: int, steps: Any) -> list[Problem]:
    """[faults]: every fault is a lab fault on a rank of the pool, at a step the run takes, slow by >= 1.

    ``steps=None``: a ``lab.Training``, which has no last step: any global step from 0.
    """
    if not isinstance(faults, (list, tuple)):
        return [("faults", f"faults must be a list of lab.Slow/Hang/Crash/Kill, got {type(faults).__name__}")]
    out = []
    for i, f in enumerate(faults):
        name = f"faults[{i}]"
        if isinstance(f, PoisonBatch):  # the run's, not a rank's
            out += _poison_problems(name, f, steps)
            continue
        if not isinstance(f, FAULTS):
            out.append(("faults", f"{name} must be lab.Slow, lab.Hang, lab.Crash or lab.Kill (or lab.PoisonBatch), "
                        f"got {f!r}"))
            continue
        if not (_is_int(f.rank) and 0 <= f.rank < world_size):
            out.append(("faults", f"{name} {f!r}: rank must be one of the pool's ranks 0..{world_size - 1}"))
        if isinstance(f, Slow):
            if not (isinstance(f.factor, (int, float)) and not isinstance(f.factor, bool)
                    and math.isfinite(f.factor) and f.factor >= 1):
                out.append(("faults", f"{name} {f!r}: factor must be a finite number >= 1 (1: not slow)"))
        elif steps is None and not (_is_int(f.at_step) and f.at_step >= 0):
            out.append(("faults", f"{name} {f!r}: at_step must be a global step of the training, an int >= 0"))
        elif steps is not None and not (_is_int(f.at_step) and _is_int(steps) and 0 <= f.at_step < steps):
            last = steps - 1 if _is_int(steps) else "steps-1"
            out.append(("faults", f"{name} {f!r}: at_step must be a step the run takes, 0..{last} (steps={steps})"))
    return out


def hang_after_problems(hang_after: Any) -> list[Problem]:
    """[hang-after]: None, or a finite number of seconds > 0 (a bool is not one)."""
    if hang_after is None or (isinstance(hang_after, (int, float)) and not isinstance(hang_after, bool)
                              and math.isfinite(hang_after) and hang_after > 0):
        return []
    return [("hang-after", f"hang_after must be None or a number of seconds > 0, got {hang_after!r}")]


def unwatched_problems(watch: Any, hang_after: Any, faults: Sequence[Any]) -> list[Problem]:
    """[watch]: unwatched, no ``hang_after`` (its report reads the watch) and no faults (the watch strikes them).

    That ``watch`` is a bool is RunConfig's [bool-flags] rule (``watch_collectives``)."""
    if watch is not False:
        return []
    return ([("watch", "hang_after needs watch=True: a hang report names what each rank's watch published")]
            * (hang_after is not None)
            + [("watch", "faults need watch=True: the rank's watch strikes them")] * bool(faults))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
