"""Waiting on ranks without hanging: results, remote failures, dead engines and deadlines.

The driver never blocks on one rank. It waits on all of them at once, in short
slices, and between slices asks whether any engine process has died, so a dead
rank is noticed within a slice rather than after ipyparallel's heartbeat timeout.
(ipyparallel's own notice usually comes first: the engine's nanny tells the hub at
once, and the client fails the dead engine's task, which ends the wait.)
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from ipyparallel import AsyncResult
from ipyparallel.error import RemoteError

from kernels.contract.pool_records import RankFailure, RankMap

# Messages of errors a rank gets only because a peer left the collective it was in.
_PEER_LEFT = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "NCCL communicator was aborted", "Socket Timeout", "Connection refused",
              # kernels.ps.ps_train.PEER_FAILED (a parameter server stopped for a failed worker), and TensorPipe's
              # (torch.distributed.rpc) words for a peer that closed its connection
              "a peer rank failed", "eof (this error originated at tensorpipe",
              "pipe closed (this error originated at tensorpipe")

POLL_S = 0.25
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Outcome:
    """What became of a call's per-rank futures so far."""

    results: dict[int, Any] = field(default_factory=dict)
    errors: dict[int, BaseException] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    pending: dict[int, AsyncResult] = field(default_factory=dict)
    finished_at: dict[int, float] = field(default_factory=dict)
    deadline_hit: bool = False  # the wait ended because the deadline passed
    stalled: bool = False  # ... or because no rank made progress (``stalled`` said so)

    @property
    def clean(self) -> bool:
        """True when every rank returned a result."""
        return not (self.pending or self.errors or self.dead)


def call_metadata(client: Any, pending: dict[int, AsyncResult]) -> dict[int, dict[str, Any]]:
    """Each rank's metadata of its call in ``client``; ``["data"]`` gathers what the rank published, as it arrives."""
    return {rank: client.metadata[ar.msg_ids[0]] for rank, ar in pending.items()}


def wait_ranks(pending: dict[int, AsyncResult], is_dead: Callable[[int], bool], *,
               deadline: float | None = None, stop_on_failure: bool = True,
               outcome: Outcome | None = None, on_slice: Callable[[], None] | None = None,
               stalled: Callable[[], bool] | None = None) -> Outcome:
    """Wait until every rank is done, one fails or dies (if ``stop_on_failure``), or the deadline.

    ``deadline`` is a ``time.monotonic()`` value. Ranks still running on return stay
    in ``outcome.pending``. ``on_slice`` is called after each wait slice while ranks run;
    when ``stalled()`` says so, the wait ends as at a deadline (``outcome.stalled``).
    """
    out = outcome or Outcome()
    out.pending.update(pending)
    by_future = {id(ar): rank for rank, ar in out.pending.items()}
    while out.pending:
        slice_s = POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))
        # FIRST_EXCEPTION returns once everything is done (one wake-up on the happy path)
        # or as soon as a rank fails; the slice bounds how late a death is noticed.
        done, _ = futures.wait(list(out.pending.values()), timeout=slice_s,
                               return_when=futures.FIRST_EXCEPTION)
        for ar in done:
            _collect(out, by_future[id(ar)], ar)
        out.dead.update(r for r in list(out.pending) if is_dead(r))
        for rank in out.dead:
            out.pending.pop(rank, None)
        if stop_on_failure and (out.errors or out.dead):
            break
        if on_slice is not None and out.pending:
            on_slice()  # e.g. a live view's refresh while ranks are still busy
        if deadline is not None and time.monotonic() >= deadline:
            out.deadline_hit = bool(out.pending)
            break
        if stalled is not None and out.pending and stalled():
            out.deadline_hit = out.stalled = True
            break
    return out


def _collect(out: Outcome, rank: int, ar: AsyncResult) -> None:
    out.pending.pop(rank, None)
    out.finished_at[rank] = time.monotonic()
    error = ar.exception()
    if error is None:
        out.results[rank] = ar.result()
    else:
        out.errors[rank] = error


def describe_failures(out: Outcome, rank_map: RankMap, *, interrupted: set[int] = frozenset(),
                      killed: set[int] = frozenset(), late: dict[int, str | None] | None = None,
                      skipped: set[int] = frozenset(), where: dict[int, str] | None = None,
                      stacks: dict[int, str] | None = None) -> list[RankFailure]:
    """Turn an outcome into failures, the cause first.

    The cause is the earliest failure that is not collateral; a rank is collateral
    when its error says a peer left, when the lab itself interrupted or killed it,
    or, after a timeout, when it was waiting in a collective for a late rank.
    ``late`` maps each rank still running at a timeout to the collective it was
    waiting in (None: in none); ``skipped`` are ranks that had returned while the
    others waited in a collective for them. ``where`` holds each rank's rendered
    user frame, ``stacks`` the plain stack of late ranks without a traceback.
    """
    late, where, stacks = late or {}, where or {}, stacks or {}
    hosts = {r.rank: r.host for r in rank_map.ranks}
    pids = {r.rank: r.pid for r in rank_map.ranks}
    rows = _late_rows(out, hosts, late, skipped, where, stacks)
    for rank in sorted(out.dead - set(late)):
        rows.append((0.0, RankFailure(rank, hosts[rank], "EngineDied",
                                      f"the engine process (pid {pids[rank]}) on {hosts[rank]} is gone", "")))
    for rank, error in out.errors.items():
        if rank in late:
            continue
        ename, evalue, tb = _remote_parts(error)
        # The peer-left message may sit in the chained context that the traceback prints.
        collateral = rank in interrupted or rank in killed or any(m in evalue or m in tb for m in _PEER_LEFT)
        rows.append((out.finished_at.get(rank, 0.0),
                     RankFailure(rank, hosts[rank], ename, evalue, tb, collateral, where.get(rank, ""))))
    for rank in sorted(killed - set(late) - set(out.errors) - out.dead):
        rows.append((float("inf"), RankFailure(rank, hosts[rank], "Killed",
                                               "still blocked after SIGINT, so its engine was killed", "", True)))
    rows.sort(key=lambda pair: (pair[1].collateral, pair[0], pair[1].rank))
    return [f for _, f in rows]


def _late_rows(out: Outcome, hosts: dict[int, str], late: dict[int, str | None], skipped: set[int],
               where: dict[int, str], stacks: dict[int, str]) -> list[tuple[float, RankFailure]]:
    """A timeout's failures: ranks waiting in a collective are collateral when someone kept them waiting."""
    held_up = bool(skipped) or any(c is None for c in late.values())
    rows = []
    for rank, collective in sorted(late.items()):
        tb = _remote_parts(out.errors[rank])[2] if rank in out.errors else stacks.get(rank, "")
        evalue = (f"waited in {collective} until the timeout" if collective
                  else "did not finish within the timeout, outside any collective")
        rows.append((float("inf"), RankFailure(rank, hosts[rank], "Timeout", evalue, tb,
                                               collateral=bool(collective) and held_up, where=where.get(rank, ""))))
    for rank in sorted(skipped):
        rows.append((float("inf"), RankFailure(rank, hosts[rank], "Timeout",
                                               "returned while its peers still waited in a collective for it", "")))
    return rows


def _remote_parts(error: BaseException) -> tuple[str, str, str]:
    """(type name, message, plain traceback) of a rank's error; never "None" where a part is missing."""
    if isinstance(error, RemoteError):
        # Engines format tracebacks for a colour terminal; records and messages keep plain text.
        tb = _ANSI.sub("", error.traceback or "")
        ename = error.ename or type(error).__name__
        evalue = "" if error.evalue is None else str(error.evalue)
        if not evalue:  # say what the reply did carry, so the message never reads "None: None"
            known = {k: v for k, v in (error.engine_info or {}).items() if v is not None}
            evalue = (f"the engine's reply carried no exception type or message (engine info: {known or 'none'}; "
                      f"traceback: {'below' if tb.strip() else 'none'})")
        return ename, evalue, tb
    return type(error).__name__, str(error) or repr(error), ""
