"""The parameter server's plain records: one span of a rank's time (pull, compute, push, apply).

Standard library only, like ``kernels.records`` (whose ``Record`` mixin gives ``to_dict`` and a
strict ``from_dict``): the ranks write these as dicts (``kernels.ps_train``), the driver keeps
them in ``PSResult.ps`` and ``widgets.ps_timeline`` draws them without torch.

Run alone (one span through a dict and back)::

    python -m kernels.ps_records
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.records import Record

SPAN_KINDS = ("pull", "compute", "push", "apply")  # a worker's three, a server's one


@dataclass(frozen=True)
class PSSpan(Record):
    """Rank ``rank`` spent [start, end] (wall clock, seconds) on ``kind`` in its step (update, on a server) ``step``."""

    rank: int
    kind: str  # one of SPAN_KINDS
    step: int
    start: float
    end: float


if __name__ == "__main__":
    span = PSSpan(rank=1, kind="push", step=0, start=10.0, end=10.25)
    print(span, PSSpan.from_dict(span.to_dict()) == span)
