"""Errors the driver raises, each naming the ranks and hosts involved and what the lab did to recover.

A ``RankError`` reads top down: which rank failed, on which host, with which exception;
the user's own frame with its source lines (``lab.pool.frames``); the other ranks in one line;
what recovery did (ranks interrupted, killed or replaced, with their new PIDs) and
whether the next call just works. Library and lab frames are left out; the full remote
traceback is ``err.remote_traceback``, and every rank's is ``err.failures[i].traceback``.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kernels.contract.pool_records import RankFailure


_SAID_BY_LAB = ("Timeout", "Killed", "EngineDied")  # failures the lab describes itself: their message says more


class LabError(RuntimeError):
    """Base class of the lab's own errors."""


@dataclass(frozen=True)
class Recovery:
    """What the lab did after a failed call to bring every rank back to idle and the world back whole."""

    interrupted: tuple[int, ...] = ()  # ranks sent SIGINT because they were still running
    killed: tuple[int, ...] = ()  # ranks wedged even after SIGINT, whose engines the lab killed
    replaced: dict[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (old pid, new pid)
    waiting_for_engines: tuple[int, ...] = ()  # lost ranks whose new engines are still starting
    rebuilt: bool = True  # the world is whole again: the next call works at once
    why_not: str = ""  # when not rebuilt and nothing is starting: why, and what to do

    def summary(self) -> str:
        """One or two sentences for the error message."""
        parts = []
        if self.killed:
            parts.append(f"{rank_list(self.killed)} stayed blocked even after SIGINT, so the lab killed "
                         f"{'its engine' if len(self.killed) == 1 else 'their engines'}.")
        if self.replaced:
            moves = ", ".join(f"rank {r} now runs in pid {new} (was {old})"
                              for r, (old, new) in sorted(self.replaced.items()))
            parts.append(f"Replaced: {moves}.")
        if self.waiting_for_engines:
            one = len(self.waiting_for_engines) == 1
            parts.append(f"{rank_list(self.waiting_for_engines)} {'has' if one else 'have'} no engine yet: "
                         f"{'a new one is' if one else 'new ones are'} starting, and the next call waits for "
                         f"{'it' if one else 'them'} and rebuilds the world; no restart needed.")
        elif self.rebuilt:
            parts.append("The world is rebuilt: the next call works, no restart needed.")
        else:
            parts.append(f"The world is not rebuilt: {self.why_not}")
        return " ".join(parts)


class RankError(LabError):
    """A call failed on one or more ranks.

    ``failures`` lists every rank that failed; the first one is the cause. Ranks
    marked collateral only failed because the cause left a collective they were in
    (or, after a timeout, were waiting for a late rank). ``recovery`` says what the
    lab did afterwards and whether the world is whole again.
    """

    def __init__(self, failures: Sequence[RankFailure], summary: str = "",
                 recovery: Recovery | None = None, *, report: Any = None) -> None:
        self.failures = list(failures)
        self.recovery = recovery or Recovery()
        self.report = report  # the lab.HangReport taken when the call failed (None: the call was not watched)
        cause = self.failures[0]
        lines = [summary or f"rank {cause.rank} on host {cause.host} raised {cause.ename}: {cause.evalue}"]
        if cause.where:
            lines.append(cause.where)
        others = self.failures[1:]
        if others:
            lines.append("other ranks: " + _group(others))
        lines.append(self.recovery.summary())
        if cause.traceback:
            lines.append(f"(rank {cause.rank}'s full remote traceback: err.remote_traceback; "
                         "every rank's: err.failures[i].traceback)")
        super().__init__("\n".join(lines))

    @property
    def rank(self) -> int:
        """The rank that caused the failure."""
        return self.failures[0].rank

    @property
    def host(self) -> str:
        """The host of the rank that caused the failure."""
        return self.failures[0].host

    @property
    def remote_traceback(self) -> str:
        """The cause's whole traceback as the rank printed it, library frames included."""
        return self.failures[0].traceback

    def _render_traceback_(self) -> list[str]:
        # IPython shows these lines instead of the driver-side traceback, whose frames are
        # all the lab's own (cluster.run, recovery); the user's cell is named in the message.
        return [f"{type(self).__name__}: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


class RankTimeoutError(RankError, TimeoutError):
    """Some ranks did not finish within the call's timeout.

    ``late`` are the ranks that never reached the collective (or step) the others were
    waiting in; ``waiting`` maps each rank that waited to the collective it waited in.
    ``report`` is the ``lab.HangReport`` taken at the deadline, when the run was watched.
    """

    def __init__(self, failures: Sequence[RankFailure], summary: str = "", recovery: Recovery | None = None,
                 *, late: Sequence[int] = (), waiting: dict[int, str] | None = None, report: Any = None) -> None:
        self.late = list(late)
        self.waiting = dict(waiting or {})
        super().__init__(failures, summary, recovery, report=report)


class HangError(RankTimeoutError):
    """No rank made progress for ``hang_after`` seconds; ``report`` (a ``lab.HangReport``) says where each one was."""


class DeadRankError(RankError):
    """An engine process died; ``recovery`` says whether the lab already replaced it.

    ``report`` (when the run was watched) says what every rank was doing then, the dead one's last step included.
    """


class PoolStoppedError(LabError):
    """The pool was stopped (or never started); start a new one with ``lab.start()``."""


class PoolBusyError(LabError):
    """A call asked not to wait (``wait=False``) found the pool training a run started with ``.start()``."""

    def __init__(self, message: str, run: Any) -> None:
        super().__init__(message)
        self.run = run  # the RunHandle of the run that holds the pool


def _group(failures: Sequence[RankFailure]) -> str:
    """ "ranks 0, 2 (vm) RuntimeError [collateral]; rank 3 (vm) Killed ...": ranks that failed alike, together."""
    groups: dict[tuple[str, str, bool], list[int]] = {}
    for f in failures:
        said = f.evalue if f.ename in _SAID_BY_LAB else f.ename
        groups.setdefault((f.host, said, f.collateral), []).append(f.rank)
    return "; ".join(f"{rank_list(ranks)} ({host}) {said}" + (" [collateral]" if collateral else "")
                     for (host, said, collateral), ranks in groups.items())


def rank_list(ranks: Iterable[int]) -> str:
    """ "rank 3", "ranks 0, 1, 3"."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
