"""``Fault``: a fault on purpose as the ranks receive it (``lab.Slow``, ``lab.Hang``, ``lab.Crash``, ``lab.Kill``),
and ``Poison``: a step whose loss is poisoned on every rank and in the reference (``lab.PoisonBatch``).

The driver checks each fault against the pool and the run (``lab.run.faults.fault_problems``)
and turns it into this record at the edge; below it the ranks switch on ``FaultKind``
(``kernels.watch.faults``), never on a string. Standard library only.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kernels.contract.records import Record


class FaultKind(enum.StrEnum):
    """What a fault does to its rank."""

    SLOW = "slow"  # every forward and backward takes ``factor`` times as long
    HANG = "hang"  # stops in the first forward of ``at_step`` and never returns
    CRASH = "crash"  # raises there
    KILL = "kill"  # SIGKILLs its own engine there


@dataclass(frozen=True)
class Fault(Record):
    """One fault on rank ``rank``: slow by ``factor`` from the start, or striking at step ``at_step``."""

    kind: FaultKind
    rank: int
    factor: float = 1.0  # SLOW only
    at_step: int | None = None  # HANG, CRASH and KILL: the step (from 0) whose first forward it strikes in

    def __post_init__(self) -> None:
        self._enum_field("kind", FaultKind)

    def describe(self) -> str:
        """ "Slow(rank=2, factor=2.0)", "Hang(rank=1, at_step=2)": as the user wrote it."""
        arg = f"factor={self.factor}" if self.kind is FaultKind.SLOW else f"at_step={self.at_step}"
        return f"{self.kind.value.capitalize()}(rank={self.rank}, {arg})"


class PoisonKind(enum.StrEnum):
    """What a poisoned step's loss becomes, on every rank and in the one-process reference alike."""

    NAN = "nan"  # the loss times NaN: every gradient NaN, as after an overflow
    SPIKE = "spike"  # the loss times ``scale``: a loss spike, and gradients ``scale`` times too large


@dataclass(frozen=True)
class Poison(Record):
    """The loss of step ``step`` (counted from 0 over the run) poisoned: ``lab.PoisonBatch`` as the ranks receive it.

    Not a rank's fault but the run's: every micro-batch's loss of that step is multiplied (by NaN, or by
    ``scale``) on every rank, and in the reference, so a run with a ``SpikeGuard`` still equals one process.
    """

    step: int
    kind: PoisonKind = PoisonKind.SPIKE
    scale: float = 100.0  # SPIKE only

    def __post_init__(self) -> None:
        self._enum_field("kind", PoisonKind)

    @property
    def multiplier(self) -> float:
        """What the step's loss is multiplied by."""
        return float("nan") if self.kind is PoisonKind.NAN else float(self.scale)
