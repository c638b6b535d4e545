"""Errors the driver raises, each naming the ranks, hosts and remote tracebacks involved."""
from __future__ import annotations

from collections.abc import Sequence

from kernels.records import RankFailure


class LabError(RuntimeError):
    """Base class of the lab's own errors."""


class RankError(LabError):
    """A call failed on one or more ranks.

    ``failures`` lists every rank that failed; the first one is the cause. Ranks
    marked collateral only failed because the cause left a collective they were in.
    """

    def __init__(self, failures: Sequence[RankFailure], summary: str = "") -> None:
        self.failures = list(failures)
        cause = self.failures[0]
        head = summary or f"rank {cause.rank} on host {cause.host} raised {cause.ename}: {cause.evalue}"
        others = [f for f in self.failures[1:]]
        lines = [head]
        if others:
            lines.append("other ranks: " + "; ".join(
                f"rank {f.rank} ({f.host}) {f.ename}" + (" [collateral]" if f.collateral else "")
                for f in others))
        if cause.traceback:
            lines.append(f"--- remote traceback of rank {cause.rank} ({cause.host}) ---")
            lines.append(cause.traceback.rstrip())
        super().__init__("\n".join(lines))

    @property
    def rank(self) -> int:
        """The rank that caused the failure."""
        return self.failures[0].rank

    @property
    def host(self) -> str:
        """The host of the rank that caused the failure."""
        return self.failures[0].host


class RankTimeoutError(RankError, TimeoutError):
    """Some ranks did not finish within the call's timeout."""


class DeadRankError(RankError):
    """An engine process died; ``restart()`` brings the whole world back."""


class PoolStoppedError(LabError):
    """The pool was stopped (or never started); start a new one with ``lab.start()``."""
