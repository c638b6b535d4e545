"""Reporting a failed call: who caused it, where they were, and what recovery did.

``FailureReporter`` is the part of ``lab.pool.cluster.Cluster`` that turns an unclean
outcome into the error the user sees, around ``WorldKeeper._recover``:

- after a timeout, before anything is interrupted, every rank still running is asked
  for its stack (``kernels.watch.stack_report``: a signal answered from C, even inside a
  collective). A rank waiting inside a torch.distributed call was kept waiting; a rank
  anywhere else is the one that never reached the collective, and is named first;
- after recovery, each rank that raised is asked for the frames of its exception, so
  the message can show the user's own frame with source lines read on the driver.
"""
from __future__ import annotations

import os
import time
from dataclasses import replace
from collections.abc import Collection, Iterable
from typing import Any, Callable, NoReturn

from kernels.watch import stack_report
from kernels.contract.pool_records import RankMap
from kernels.watch.stack_report import Frame
from lab.pool import frames as frame_view
from lab.errors import DeadRankError, HangError, RankError, RankTimeoutError, Recovery, rank_list
from lab.pool.supervise import Outcome, describe_failures

DUMP_WAIT_S = 0.5  # a signalled rank writes its stack from a C handler within milliseconds
ASK_WAIT_S = 3.0  # how long ranks get to hand over their failure frames after recovery


class FailureReporter:
    """Raises the error for a failed call once the world is recovered (mixed into ``lab.pool.cluster.Cluster``)."""

    def _raise_after_recovery(self, out: Outcome, *, timeout: float | None, hang_watch: Any = None) -> NoReturn:
        timed_out = out.deadline_hit
        report = None
        # First, before anything is signalled or torn down; also on a failure, where a death may be told
        # as the engine's failed task and counted as a death only during recovery.
        if hang_watch is not None:
            report = hang_watch.capture(f"no progress for {hang_watch.hang_after:g} s (hang_after)" if out.stalled
                                        else f"the {timeout:g} s timeout" if timed_out else "a failed call")
        rank_map = self._rank_map  # the PIDs that failed, before recovery replaces any
        at_deadline = self._stacks_now(set(out.pending)) if timed_out else {}
        skipped = set(out.results) if timed_out else set()  # returned while others still ran
        recovery = self._recover(out, interrupt=timed_out)
        at_deadline.update(self._ask(stack_report.read_dump, {r for r, f in at_deadline.items() if f is None},
                                     recovery))
        # Dumped stacks, read here or asked for, name notebook frames by what the driver sent.
        at_deadline = {r: (self._sent_code.restore(f) if f else f) for r, f in at_deadline.items()}
        raised = self._failure_frames(out, recovery)
        late = {r: (frame_view.collective_of(f) if f else None) for r, f in at_deadline.items()}
        if report is not None:  # a rank blocked in C++ (DDP's reducer) has no dist frame; its log says where
            late.update({r: report.rank(r).collective for r, c in late.items() if c is None and report.rank(r).op})
        if report is not None and report.never_arrived:  # the report's verdict: the others were held up by these
            late.update({r: report.rank(r).action for r, c in late.items()
                         if c is None and r not in report.never_arrived and report.rank(r).action})
        where = {r: frame_view.render(frame_view.user_frame(f)) for r, f in {**raised, **at_deadline}.items() if f}
        stacks = {r: frame_view.plain_traceback(f) for r, f in at_deadline.items() if f}
        late_ranks, skipped = _culprits(late, skipped)
        failures = describe_failures(out, rank_map, interrupted=set(recovery.interrupted) - set(late),
                                     killed=set(recovery.killed), late=late, skipped=skipped, where=where,
                                     stacks=stacks)
        failures = [replace(f, traceback=self._sent_code.restore_text(f.traceback)) for f in failures]
        self._states = {r: ("dead", "engine process is gone") for r in self._dead}
        cause = failures[0]
        if cause.rank not in self._dead and cause.rank not in recovery.replaced:
            self._states[cause.rank] = ("failed", f"{cause.ename}: {cause.evalue}"[:200])
        if out.dead:
            raise DeadRankError(failures, _dead_summary(out.dead, rank_map), recovery, report=report)
        if timed_out:
            waiting = {r: c for r, c in late.items() if c}
            if out.stalled:
                raise HangError(failures, f"no rank made progress for {hang_watch.hang_after:g} s (hang_after): "
                                + "; ".join(report.findings), recovery, late=late_ranks, waiting=waiting,
                                report=report)
            summary = _timeout_summary(late_ranks, waiting, skipped, rank_map, timeout)
            raise RankTimeoutError(failures, summary + (f"\n{report}" if report else ""), recovery, late=late_ranks,
                                   waiting=waiting, report=report)
        raise RankError(failures, recovery=recovery, report=report)

    def _stacks_now(self, ranks: set[int]) -> dict[int, list[Frame] | None]:
        """Every rank's main-thread stack at this moment, read here when its dump file is (others: None, asked later)."""
        pids = {r: self._rank_map.ranks[r].pid for r in ranks}
        directory = self._dump_dir()
        paths = {r: stack_report.dump_path(pids[r], directory) for r in ranks
                 if directory and pids[r] in self._local_pids}
        sizes = {r: _size(path) for r, path in paths.items()}
        self.signal_ranks(ranks, stack_report.DUMP_SIGNAL)
        deadline = time.monotonic() + DUMP_WAIT_S
        while any(_size(path) <= sizes[r] for r, path in paths.items()) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.02)  # the handler writes thread by thread; let it finish
        return {r: (stack_report.read_dump(pids[r], directory) if r in paths else None) for r in ranks}

    def _failure_frames(self, out: Outcome, recovery: Recovery) -> dict[int, list[Frame]]:
        """The frames of each rank's exception, from the rank itself, when it is the exception the driver got."""
        answers = self._ask(stack_report.last_failure, set(out.errors), recovery)
        frames = {}
        for rank, answer in answers.items():
            ename = getattr(out.errors[rank], "ename", None) or type(out.errors[rank]).__name__
            if answer and answer.get("ename") == ename:
                frames[rank] = self._sent_code.restore([tuple(f) for f in answer["frames"]], answer.get("codes"))
        return frames

    def _ask(self, fn: Callable[[], Any], ranks: set[int], recovery: Recovery) -> dict[int, Any]:
        """``fn()`` on each of ``ranks`` still in its own engine; answers that came within ASK_WAIT_S."""
        ranks = {r for r in ranks if r not in recovery.replaced and r not in self._dead}
        pending = {r: self._views[r].apply_async(fn) for r in ranks}
        deadline = time.monotonic() + ASK_WAIT_S
        answers = {}
        for rank, answer in pending.items():
            try:
                answers[rank] = answer.get(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # a rank that cannot answer only costs the message its source lines
                pass
        return answers


def _culprits(late: dict[int, str | None], returned: set[int]) -> tuple[list[int], set[int]]:
    """(the ranks that kept the others waiting, those of them that had returned) after a timeout.

    A rank still running outside any collective kept the others waiting. When every
    rank still running waited in a collective, the ones that had already returned
    never joined it; if none had, it is a deadlock and nobody is singled out.
    """
    outside = sorted(r for r, c in late.items() if c is None)
    if outside or not late:
        return outside, set()
    return sorted(returned), set(returned)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _named(ranks: Iterable[int], rank_map: RankMap) -> str:
    hosts = sorted({rank_map.ranks[r].host for r in ranks})
    return f"{rank_list(ranks)} (host {', '.join(hosts)})"


def _dead_summary(dead: set[int], rank_map: RankMap) -> str:
    pids = ", ".join(str(rank_map.ranks[r].pid) for r in sorted(dead))
    return (f"{_named(dead, rank_map)} died: {'its engine process' if len(dead) == 1 else 'their engine processes'} "
            f"(pid {pids}) {'is' if len(dead) == 1 else 'are'} gone")


def _timeout_summary(late: list[int], waiting: dict[int, str], skipped: set[int], rank_map: RankMap,
                     timeout: float) -> str:
    calls = ", ".join(sorted(set(waiting.values())))
    if skipped:
        return (f"{_named(waiting, rank_map)} waited in {calls} for {_named(skipped, rank_map)} until the "
                f"{timeout:g} s timeout: {_it(skipped)} had returned without joining")
    if late and waiting:
        return (f"{_named(late, rank_map)} did not reach the {calls} within the {timeout:g} s timeout; "
                f"{_named(waiting, rank_map)} waited there for {_it(late, 'them')}")
    if late:
        return f"{_named(late, rank_map)} did not finish within the {timeout:g} s timeout"
    each = "; ".join(f"rank {r} in {c}" for r, c in sorted(waiting.items()))
    return (f"{_named(waiting, rank_map)} were all waiting in collectives when the {timeout:g} s timeout passed "
            f"({each}): none could go on, a deadlock or mismatched collectives")


def _it(ranks: Collection[int], plural: str = "they") -> str:
    return "it" if len(ranks) == 1 else plural
