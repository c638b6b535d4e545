"""Hang diagnosis: what every rank was doing when a run stopped making progress, read before anything is torn down.

Each training rank publishes its state to a small file (``kernels.watch.collective_log``,
written by ``kernels.watch.rank_watch`` at every collective entry and exit and every traced
action), which the driver reads even while the rank is blocked inside a collective.
``HangWatch`` follows those files while ``Cluster.run`` waits:

- ``stalled()``: True once no rank's state has changed for ``hang_after`` seconds
  (counted from the first change this run, so building the model is not watched);
  the call then ends as a timeout would, and raises ``lab.HangError``;
- ``capture(reason)``: a ``HangReport`` taken on a stall, a timeout or an interrupt,
  before recovery interrupts or kills a rank.

A ``HangReport`` gives each rank's last collective (op, group and its ranks, sequence
number in that group, bytes, how long it has waited) or "in compute" with the last
traced action, and names the ranks that never arrived, e.g. "ranks 0, 1, 3 wait in
all_reduce #3 of group dp=[0,1,2,3] (for 6.0 s); rank 2 never entered it (last seen in
forward, step 1, micro-batch 0)". The files are read on the driver's host; for a rank
on another host (or whose file cannot be read) the watch uses the state that rank's
beacon last sent over ipyparallel (``kernels.watch.flight_recorder.WatchBeacon``, every half
second while it changes), which ``Cluster.run`` hands over through ``follow``.

The same beacons carry torch's own flight recorder, summed up per process group, so the
report also says what c10d itself recorded (``HangReport.flight``): e.g. "torch flight
recorder: gloo:all_reduce #9 of group dp=[0,1,2,3]: ranks 0, 1, 3 entered it and have
not finished; rank 2 never entered it (its last was #8, finished)". Its sequence
numbers count every collective of the group, the lab's own included, so they differ from
the collective log's; who never arrived must agree.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from kernels.watch.collective_log import BEACON_KEY
from kernels.watch.state_file import log_path, read_state
from kernels.contract.watch_records import RankActivity
from kernels.contract.watch_records import FlightGroup
from lab.errors import rank_list
from lab.pool.supervise import call_metadata


@dataclass(frozen=True)
class RankDoing:
    """What one rank was doing when the report was taken."""

    rank: int
    state: str  # "in collective", "in compute", "done", "not started" or "unknown"
    action: str = ""  # the last traced action, e.g. "forward, step 1, micro-batch 0"
    op: str = ""  # in a collective: its op, group (mesh axis), the group's ranks, sequence number, payload
    group: str = ""
    group_ranks: tuple[int, ...] = ()
    seq: int = 0
    nbytes: int = 0
    waited_s: float = 0.0
    faults: tuple[str, ...] = ()  # faults injected on this rank (lab.Slow/Hang/Crash/Kill)
    silent_s: float = 0.0  # seconds since the rank last changed its state (last heard from)
    step: int = -1  # the global step it was in (-1: not known, or before its first step)

    @property
    def collective(self) -> str:
        """ "all_reduce #3 of group dp=[0,1,2,3]" ("" outside any collective)."""
        return f"{self.op} #{self.seq} of group {self.group}=[{','.join(map(str, self.group_ranks))}]" if self.op else ""

    def describe(self) -> str:
        if self.op:
            return f"waits in {self.collective} ({self.nbytes} bytes) for {self.waited_s:.1f} s"
        if self.state == "in compute":
            return f"in compute, last seen in {self.action} ({self.silent_s:.1f} s ago)"
        return self.state


@dataclass(frozen=True)
class HangReport:
    """Every rank's state at a stall, a timeout or an interrupt, and who kept whom waiting."""

    reason: str  # e.g. "no progress for 5 s (hang_after=5)", "the 30 s timeout", "an interrupt"
    ranks: tuple[RankDoing, ...]
    findings: tuple[str, ...]  # one line per collective that ranks wait in
    never_arrived: tuple[int, ...]  # ranks outside the collective their group waits in
    flight: tuple[str, ...] = ()  # what torch's flight recorder says, one line per group with a collective open
    flight_never_arrived: tuple[int, ...] = ()  # the ranks it says never entered that collective

    def rank(self, rank: int) -> RankDoing:
        return self.ranks[rank]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        lines = [f"HangReport ({self.reason}):", *self.findings]
        lines += [f"  rank {r.rank}: {r.describe()}" + (f" [{'; '.join(r.faults)}]" if r.faults else "")
                  for r in self.ranks]
        return "\n".join(lines + [f"torch flight recorder: {line}" for line in self.flight])


def doing(rank: int, state: RankActivity | None, *, fresh: bool, now: float) -> RankDoing:
    """One rank's ``RankDoing`` from its published state (``fresh``: written during this run)."""
    if state is None:
        return RankDoing(rank, "unknown", "no state: no file on this host and no beacon heard (or the watch is off)")
    if not fresh:
        return RankDoing(rank, "not started", "still building the model or its groups")
    faults, silent = tuple(state.faults), max(0.0, now - state.updated)
    if state.action == "done":
        return RankDoing(rank, "done", "done", faults=faults, silent_s=silent, step=state.step)
    if state.open:
        c = state.open[0]  # the oldest: the one it is stuck behind
        return RankDoing(rank, "in collective", state.action, c.op, c.group, tuple(c.ranks), c.seq, c.nbytes,
                         max(0.0, now - c.entered), faults, silent, state.step)
    return RankDoing(rank, "in compute", state.action, faults=faults, silent_s=silent, step=state.step)


def build_report(rows: list[RankDoing], reason: str) -> HangReport:
    """Group the ranks by the collective they wait in and name, for each, the group's ranks that are not there."""
    waiting: dict[tuple, list[RankDoing]] = {}
    for r in rows:
        if r.op:
            waiting.setdefault((r.op, r.group, r.group_ranks, r.seq), []).append(r)
    findings, never = [], set()
    for (op, group, ranks, seq), there in sorted(waiting.items(), key=lambda kv: kv[1][0].rank):
        inside = {r.rank for r in there}
        verb = "waits" if len(inside) == 1 else "wait"
        line = f"{rank_list(inside)} {verb} in {there[0].collective} (for {max(r.waited_s for r in there):.1f} s)"
        for other in (rows[k] for k in ranks if k not in inside and k < len(rows)):
            if other.op:
                line += f"; rank {other.rank} waits in {other.collective} instead"
                continue
            never.add(other.rank)
            seen = {"in compute": f"last seen in {other.action}", "done": "it had returned"}.get(other.state, other.state)
            line += f"; rank {other.rank} never entered it ({seen})"
        findings.append(line)
    if not findings:
        findings.append("no rank waits in a collective: " + "; ".join(f"rank {r.rank} {r.describe()}" for r in rows))
    return HangReport(reason, tuple(rows), tuple(findings), tuple(sorted(never)))


def flight_findings(groups: dict[int, tuple[FlightGroup, ...]]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """From each rank's flight-recorder summary: per group with a collective not finished, who is in it and who never came.

    The collective is the newest one a rank of the group has entered and not finished;
    a member whose last collective in that group is older never entered it.
    """
    by_group: dict[str, dict[int, FlightGroup]] = {}
    for rank, rows in groups.items():
        for row in rows:
            by_group.setdefault(row.group, {})[rank] = row
    lines, never = [], set()
    for name, seen in sorted(by_group.items(), key=lambda kv: min(kv[1])):
        open_rows = [g for g in seen.values() if g.last_seq > g.last_done_seq]
        if not open_rows:
            continue
        seq = max(g.last_seq for g in open_rows)
        first = next(g for g in open_rows if g.last_seq == seq)
        label = f"{first.last_op} #{seq} of group {first.axis or 'c10d ' + name}=[{','.join(map(str, first.ranks))}]"
        inside = sorted(r for r, g in seen.items() if g.last_seq == seq and g.last_done_seq < seq)
        line = f"{label}: {rank_list(inside)} entered it and {'has' if len(inside) == 1 else 'have'} not finished"
        for member in first.ranks:
            row = seen.get(member)
            if row is None:
                line += f"; rank {member} sent no flight record"
            elif row.last_seq < seq:
                never.add(member)
                state = "finished" if row.last_done_seq >= row.last_seq else "not finished"
                line += f"; rank {member} never entered it (its last was #{row.last_seq}, {state})"
        lines.append(line)
    return tuple(lines), tuple(sorted(never))


class HangWatch:
    """Follows the ranks' state files during one call (module docstring); ``report`` once captured."""

    def __init__(self, cluster: Any, hang_after: float | None = None) -> None:
        directory = cluster._dump_dir()
        self.hang_after = hang_after
        self.paths = {r.rank: log_path(r.pid, directory) for r in cluster.rank_map.ranks
                      if directory and r.pid in cluster._local_pids}
        self.world_size = cluster.world_size
        self._client = cluster.client
        self._metadata: dict[int, Any] = {}
        self._baseline = self._counters()
        self._last: dict[int, int] = dict(self._baseline)
        self._progress_at: float | None = None
        self.report: HangReport | None = None

    def follow(self, pending: dict[int, Any]) -> None:
        """Read the beacons of this call's per-rank futures (``Cluster.run`` calls this once it has submitted)."""
        self._metadata = call_metadata(self._client, pending)

    def _beacon(self, rank: int) -> dict[str, Any] | None:
        md = self._metadata.get(rank)
        return md["data"].get(BEACON_KEY) if md is not None else None

    def _states(self) -> dict[int, RankActivity | None]:
        states = {rank: read_state(path) for rank, path in self.paths.items()}
        for rank in range(self.world_size):
            if states.get(rank) is None:
                beacon = self._beacon(rank)
                states[rank] = RankActivity.from_dict(beacon["state"]) if beacon and beacon["state"] else None
        return states

    def _counters(self, states: dict[int, RankActivity | None] | None = None) -> dict[int, int]:
        states = self._states() if states is None else states
        return {rank: s.counter if s is not None else 0 for rank, s in states.items()}

    def stalled(self) -> bool:
        """True once no rank has changed its state for ``hang_after`` seconds (never without ``hang_after``)."""
        if self.hang_after is None:
            return False
        counters, now = self._counters(), time.monotonic()
        if counters != self._last:
            self._last, self._progress_at = counters, now
        return self._progress_at is not None and now - self._progress_at >= self.hang_after

    def capture(self, reason: str) -> HangReport:
        """Read every rank's state now and keep the report (the first one captured wins)."""
        if self.report is None:
            states, now = self._states(), time.time()
            rows = [doing(r, states.get(r), fresh=states.get(r) is not None
                          and states[r].counter > self._baseline.get(r, 0), now=now)
                    for r in range(self.world_size)]
            report = build_report(rows, reason)
            flight = {rank: tuple(FlightGroup.from_dict(g) for g in beacon["flight"])
                      for rank in range(self.world_size)
                      if (beacon := self._beacon(rank)) and beacon["flight"] is not None}
            lines, never = flight_findings(flight)
            self.report = dataclasses.replace(report, flight=lines, flight_never_arrived=never)
        return self.report
