"""The parameter server's spans of a rank's time (``kernels.ps.ps_train``, ``kernels.ps.parameter_server``).

Shapes and rules of every record: ``kernels.contract.records``. Standard library only: the widgets import it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.contract.records import Record


SPAN_KINDS = ("pull", "compute", "push", "apply")  # a worker's three, a server's one


@dataclass(frozen=True)
class PSSpan(Record):
    """Rank ``rank`` spent [start, end] (wall clock, seconds) on ``kind`` in its step (update, on a server) ``step``."""

    rank: int
    kind: str  # one of SPAN_KINDS
    step: int
    start: float
    end: float
