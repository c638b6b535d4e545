"""Keeping the torch.distributed world of a pool alive: forming it on the engines, and bringing it back after a failure.

``WorldKeeper`` is the part of ``lab.pool.cluster.Cluster`` that numbers the engines as
ranks (``lab.pool.rank_map``), opens the store and joins every rank to the process group,
and recovers from a failed call (``_recover``):

1. ranks that already returned leave the world, so peers waiting on them fail at once;
2. the other ranks get a grace period to fail on their own (a failing rank's guard
   closes its connections, so its peers fail within a second or so), counted from
   when the last of them began the call (its stack shows ``call_guarded``);
3. ranks still running are sent SIGINT;
4. ranks wedged even then (blocked inside a collective whose peers are all alive) are
   killed, only if the lab started their engines;
5. every rank whose engine died or was killed gets a warmed spare engine in its place
   (``lab.pool.standby``), with the same rank number, host and device;
6. the world is formed again on every rank.

When more ranks are lost than spares are ready, the error is raised at once, saying
so, and the next call waits for the new engines and forms the world first
(``_finish_recovery``): the user hears within seconds what happened, and no call
needs a restart.

It works on the Cluster's state (``_source``, ``_rank_map``, ``_views``, ``_dead``,
``_states``, ``_standby`` ...) and its ``_is_dead``, ``_engine_of``, ``_check_not_stopped`` and ``_stacks_now``.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time
import warnings
from typing import Iterable, Self

from kernels.engine import runtime
from kernels.watch import stack_report
from kernels.contract.pool_records import EngineInfo, RankMap
from lab.pool import launch
from lab.errors import LabError, RankError, Recovery, rank_list
from lab.pool.rank_map import build_rank_map
from lab.pool.standby import engine_info
from lab.pool.supervise import Outcome, describe_failures, wait_ranks

GRACE_S = 1.0  # how long peers get to fail on their own once one rank has failed (and has begun the call)
BEGIN_WAIT_S = 20.0  # how long a rank that has not begun the failed call gets to begin it
INTERRUPT_S = 1.5  # how long a rank gets to return after SIGINT before it counts as wedged
SPARE_WAIT_S = 1.0  # how long recovery waits for a spare still warming up; lost ranks beyond wait for the next call


class OversubscribedWarning(UserWarning):
    """More ranks than CPU cores on a host: timings will reflect time-sharing."""


class WorldKeeper:
    """Forms a pool's world and re-forms it after a failure (mixed into ``lab.pool.cluster.Cluster``)."""

    def _adopt_engines(self, engine_ids: Iterable[int] | None = None, *, warn: bool = False) -> None:
        """Ask the engines who they are and number the ranks (``lab.pool.rank_map.build_rank_map``)."""
        client = self._source.client
        ids = sorted(client.ids if engine_ids is None else engine_ids)
        described = client[ids].apply_sync(runtime.describe_engine, self._controller_host())
        infos = [engine_info(eid, d) for eid, d in zip(ids, described)]
        self._set_rank_map(build_rank_map(infos, self._backend_request, share_gpu=self._share_gpu))
        self._threads = self._pick_threads(infos, warn)
        self._states = {}

    def _controller_host(self) -> str:
        return self._source.client._config.get("interface", "tcp://127.0.0.1").split("//")[-1]

    def _dump_dir(self) -> str | None:
        """The profile directory the engines write their stack dumps to (``kernels.watch.stack_report``), if known here."""
        source = self._source
        return source.profile_dir or (str(source.ipp_cluster.profile_dir) if source.ipp_cluster else None)

    def _set_rank_map(self, rank_map) -> None:
        self._rank_map = rank_map
        # A rank still waiting for an engine keeps the view of its dead one (ipyparallel refuses new views of it).
        views = getattr(self, "_views", {})
        self._views = {r.rank: views[r.rank] if r.rank in views and views[r.rank].targets == r.engine_id
                       else self._source.client[r.engine_id] for r in rank_map.ranks}
        # Only this machine's engines can be checked by PID; others rely on ipyparallel's heartbeat.
        here = socket.gethostname()
        self._local_pids = {r.pid for r in rank_map.ranks if r.host == here}

    def _pick_threads(self, infos: list[EngineInfo], warn: bool) -> int:
        per_host = self._rank_map.hosts()
        cores = min(i.cpu_count for i in infos)
        busiest = max(len(v) for v in per_host.values())
        if warn and busiest > cores:
            warnings.warn(f"{busiest} ranks share {cores} CPU cores on one host: ranks will time-share the "
                          "cores, so measured times include waiting; use 1 thread per rank and small models",
                          OversubscribedWarning, stacklevel=5)
        return self._threads_request or 1  # torchrun's default too; see lab.pool.start_or_connect.start

    def _form_world(self) -> None:
        """(Re)build the process group on every rank over a fresh store, then bind names for %%px."""
        rm = self._rank_map
        bind = listen_addresses(rm)
        port = self._views[0].apply_sync(runtime.open_store, bind[0], rm.world_size, self._timeout)
        pending = {r.rank: self._views[r.rank].apply_async(runtime.join_world, {
            "rank": r.rank, "world_size": rm.world_size, "backend": rm.backend, "device": r.device,
            "master_addr": bind[0], "port": port, "bind_addr": bind[r.rank], "threads": self._threads,
            "timeout_s": self._collective_timeout}) for r in rm.ranks}
        out = wait_ranks(pending, self._is_dead, deadline=time.monotonic() + self._timeout)
        if not out.clean:
            failures = describe_failures(out, rm, late={r: None for r in out.pending})
            raise RankError(failures, "could not bring up the process group: " + failures[0].evalue,
                            Recovery(rebuilt=False, why_not="call cluster.restart() to start over"))
        for r in rm.ranks:
            self._views[r.rank].push({"rank": r.rank, "world": rm.world_size, "local_rank": r.local_rank,
                                      "device": r.device}, block=False)
        everyone = self._source.client[[r.engine_id for r in rm.ranks]]
        everyone.execute("import torch\nimport torch.distributed as dist\ndevice = torch.device(device)", block=True)
        if self._activate and _in_ipython():
            self.activate()

    def restart(self) -> Self:
        """Replace every engine with a fresh one and rebuild the world from scratch."""
        self._check_not_stopped()
        source = self._source
        if source.ipp_cluster is None:
            raise LabError("this pool was attached through a url file only; restart its engines with "
                           "ipcluster, then call lab.connect() again")
        n = self.world_size
        old = set(source.client.ids)
        if source.owned:
            source.pids |= launch.launched_pids(source.ipp_cluster)
            source.ipp_cluster.stop_engines_sync()
            self._kill_leftovers(set(r.pid for r in self._rank_map.ranks))
            self._standby.forget_all(old)
            source.ipp_cluster.start_engines_sync(n)
            source.pids |= launch.launched_pids(source.ipp_cluster)
        else:
            source.ipp_cluster.restart_engines_sync()
        new_ids = self._wait_for_new_engines(n, old)
        self._dead.clear()
        self._adopt_engines(new_ids)
        self._form_world()
        self._standby.refill()
        return self

    # ------------------------------------------------------------------ recovery
    def _recover(self, out: Outcome, *, interrupt: bool = False) -> Recovery:
        """Bring every rank back to idle and the world back whole (module docstring); say what it took.

        With ``interrupt`` (a timeout, or the user's interrupt) there is no grace
        period: nobody is going to fail on their own. Ranks still running when this
        returns were neither interruptible nor killable (an attached pool's engines).
        """
        self._release_waiters(out)
        if out.pending and not interrupt:
            self._let_peers_fail(out)
        interrupted = tuple(sorted(out.pending))
        if out.pending:
            self.signal_ranks(set(out.pending), signal.SIGINT)
            wait_ranks({}, self._is_dead, deadline=time.monotonic() + INTERRUPT_S, stop_on_failure=False, outcome=out)
        killed = tuple(sorted(out.pending)) if self._source.owned else ()
        if killed:
            self._kill_and_wait({self._rank_map.ranks[r].pid for r in killed})
            out.pending.clear()
        self._count_deaths(out, set(killed))
        lost = out.dead | set(killed)
        if out.pending:
            return Recovery(interrupted, rebuilt=False, why_not=(
                f"{rank_list(out.pending)} {'is' if len(out.pending) == 1 else 'are'} still blocked and this pool's "
                "engines were not started by the lab, so it will not kill them; restart them with ipcluster, then "
                "call cluster.restart()"))
        if lost and not self._source.owned:
            self._dead |= out.dead
            return Recovery(interrupted, killed, rebuilt=False, why_not=(
                "the lab did not start this pool's engines, so it cannot replace them; restart them with "
                "ipcluster, then call cluster.restart()"))
        self._dead |= lost
        replaced: dict[int, tuple[int, int]] = {}
        try:
            replaced = self._replace_ranks(SPARE_WAIT_S)
            if self._dead:  # more ranks lost than spares were ready: the next call finishes the job
                return Recovery(interrupted, killed, replaced, tuple(sorted(self._dead)), rebuilt=False)
            self._form_world()
        except LabError as error:
            return Recovery(interrupted, killed, replaced, rebuilt=False,
                            why_not=f"{str(error).splitlines()[0]}; call cluster.restart() to start over")
        return Recovery(interrupted, killed, replaced)

    def _finish_recovery(self) -> None:
        """Give the ranks that still have no engine one each, waiting for engines to start, and rebuild the world."""
        self._replace_ranks(self._timeout)
        if self._dead:
            raise LabError(f"{rank_list(self._dead)} still {'has' if len(self._dead) == 1 else 'have'} no engine after "
                           f"{self._timeout:g} s; call cluster.restart() to start over")
        self._form_world()
        self._states = {}

    def _let_peers_fail(self, out: Outcome) -> None:
        """Wait ``GRACE_S`` for the ranks still running to fail on their own, and longer for any not yet begun.

        On an oversubscribed machine a rank may not have begun the call when a peer
        fails; interrupting it then would lose what its cell was about to write. A rank
        has begun when ``call_guarded`` is on its stack (dumped on this host; a rank
        elsewhere counts as begun). Nothing is asked of the ranks on the happy path.
        """
        begun_by = time.monotonic() + BEGIN_WAIT_S
        wait_ranks({}, self._is_dead, deadline=time.monotonic() + GRACE_S, stop_on_failure=False, outcome=out)
        while out.pending and time.monotonic() < begun_by:
            stacks = self._stacks_now(set(out.pending))
            if not any(frames is not None and not _in_a_call(frames) for frames in stacks.values()):
                return
            wait_ranks({}, self._is_dead, deadline=time.monotonic() + GRACE_S, stop_on_failure=False, outcome=out)

    def _release_waiters(self, out: Outcome) -> None:
        """Ranks that returned leave the world, closing their connections, so ranks still waiting on them fail."""
        if out.pending and out.results:
            for rank in out.results:
                self._views[rank].apply_async(runtime.leave_world)

    def _count_deaths(self, out: Outcome, killed: set[int]) -> None:
        # ipyparallel may fail a dead engine's task (EngineError) before its heartbeat
        # unregisters it, so a death may show up only now: count it as a death, not an error.
        for rank in range(self.world_size):
            if rank not in out.dead and rank not in killed and self._is_dead(rank):
                out.errors.pop(rank, None)
                out.pending.pop(rank, None)
                out.dead.add(rank)

    def _replace_ranks(self, wait_s: float) -> dict[int, tuple[int, int]]:
        """Put a warmed spare engine in place of each rank in ``_dead`` (same number, host, device), waiting
        at most ``wait_s`` for spares; returns rank -> (old pid, new pid). Ranks left without one stay in ``_dead``."""
        old = self._rank_map
        self._standby.retire({old.ranks[r].engine_id for r in self._dead})
        spares = self._standby.take(len(self._dead), {r.engine_id for r in old.ranks}, wait_s)
        ranks, replaced = list(old.ranks), {}
        for rank, spare in zip(sorted(self._dead), spares):
            if spare.host != old.ranks[rank].host:
                raise LabError(f"the spare engine for rank {rank} runs on {spare.host}, not {old.ranks[rank].host}")
            ranks[rank] = dataclasses.replace(old.ranks[rank], engine_id=spare.engine_id, pid=spare.pid)
            replaced[rank] = (old.ranks[rank].pid, spare.pid)
            if self._dump_dir():
                stack_report.remove_dump(old.ranks[rank].pid, self._dump_dir())
        self._set_rank_map(dataclasses.replace(old, ranks=tuple(ranks)))
        self._dead -= set(replaced)
        self._standby.refill()
        return replaced

    def signal_ranks(self, ranks: set[int], sig: int) -> None:
        """Send ``sig`` to the engines of ``ranks``: by PID on this host (only to processes the lab started), else
        through ipyparallel's engine nanny. A started run's stop (``kernels.watch.progress.STOP_SIGNAL``) uses it."""
        local = socket.gethostname()
        mine = {r for r in ranks if self._rank_map.ranks[r].host == local and self._source.owned}
        launch.signal_pids({self._rank_map.ranks[r].pid for r in mine}, self._source.pids, sig)
        others = ranks - mine
        if others:  # through ipyparallel's engine nanny, which works on any host
            self._source.client.send_signal(sig, targets=[self._engine_of(r) for r in others], block=True)

    def _kill_leftovers(self, pids: set[int]) -> None:
        alive = {p for p in pids if launch.is_alive(p)}
        launch.signal_pids(alive, self._source.pids, signal.SIGKILL)

    def _kill_and_wait(self, pids: set[int], wait_s: float = 2.0) -> None:
        self._kill_leftovers(pids)
        deadline = time.monotonic() + wait_s
        while any(launch.is_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.02)

    def _wait_for_new_engines(self, n: int, old: set[int]) -> list[int]:
        deadline = time.monotonic() + self._timeout
        client = self._source.client
        while len(set(client.ids) - old) < n:
            if time.monotonic() > deadline:
                raise LabError(f"only {len(set(client.ids) - old)} of {n} engines came back within {self._timeout}s")
            time.sleep(0.1)
        return sorted(set(client.ids) - old)[:n]


def listen_addresses(rank_map: RankMap) -> list[str]:
    """The address each rank's store and collective sockets listen on, by rank.

    Loopback when every rank is on one host, whatever address the controller has; on
    several hosts, each rank's address in the rank map (the interface that routes to
    the controller), and no other.
    """
    if len(rank_map.hosts()) == 1:
        return ["127.0.0.1"] * rank_map.world_size
    return [r.ip for r in rank_map.ranks]


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def _in_a_call(frames: list[tuple[str, int, str]]) -> bool:
    """Whether a rank's main-thread stack holds the guard of a lab call (``kernels.engine.runtime.call_guarded``)."""
    return any(name == "call_guarded" and file.endswith(os.path.join("engine", "runtime.py"))
               for file, _, name in frames)
