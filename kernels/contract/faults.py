"""``Fault``: a fault on purpose as the ranks receive it (``lab.Slow``, ``lab.Hang``, ``lab.Crash``, ``lab.Kill``).

The driver checks each fault against the pool and the run (``lab.run.faults.fault_problems``)
and turns it into this record at the edge; below it the ranks switch on ``FaultKind``
(``kernels.watch.faults``), never on a string. Standard library only.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from kernels.contract.records import Record, RecordShapeError


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
        try:
            object.__setattr__(self, "kind", FaultKind(self.kind))
        except ValueError:
            raise RecordShapeError(f"Fault: kind {self.kind!r} is not one of {', '.join(FaultKind)}") from None

    def describe(self) -> str:
        """ "Slow(rank=2, factor=2.0)", "Hang(rank=1, at_step=2)": as the user wrote it."""
        arg = f"factor={self.factor}" if self.kind is FaultKind.SLOW else f"at_step={self.at_step}"
        return f"{self.kind.value.capitalize()}(rank={self.rank}, {arg})"
