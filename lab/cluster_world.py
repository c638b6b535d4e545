"""Keeping the torch.distributed world of a pool alive: forming it on the engines, and bringing it back after a failure.

``WorldKeeper`` is the part of ``lab.cluster.Cluster`` that numbers the engines as
ranks (``lab.rank_map``), opens the store and joins every rank to the process group,
and recovers from a failed call: peers get a grace period to fail on their own, ranks
still running are sent SIGINT, and ranks wedged even then are killed (only engines the
lab started) and the pool restarted. It works on the Cluster's state (``_source``,
``_rank_map``, ``_views``, ``_dead``, ``_states`` ...) and its ``_is_dead``,
``_engine_of`` and ``restart``.
"""
from __future__ import annotations

import signal
import socket
import time
import warnings
from typing import Iterable

from kernels import runtime
from lab import launch
from lab.errors import DeadRankError, LabError, RankError, RankTimeoutError
from lab.rank_map import build_rank_map
from kernels.records import EngineInfo, RankMap
from lab.supervise import Outcome, describe_failures, wait_ranks

GRACE_S = 3.0  # how long peers get to fail on their own once one rank has failed


class OversubscribedWarning(UserWarning):
    """More ranks than CPU cores on a host: timings will reflect time-sharing."""


class WorldKeeper:
    """Forms a pool's world and re-forms it after a failure (mixed into ``lab.cluster.Cluster``)."""

    def _adopt_engines(self, engine_ids: Iterable[int] | None = None, *, warn: bool = False) -> None:
        """Ask the engines who they are and number the ranks (``lab.rank_map.build_rank_map``)."""
        client = self._source.client
        controller_host = client._config.get("interface", "tcp://127.0.0.1").split("//")[-1]
        ids = sorted(client.ids if engine_ids is None else engine_ids)
        described = client[ids].apply_sync(runtime.describe_engine, controller_host)
        infos = [EngineInfo(engine_id=eid, host=d["host"], ip=d["ip"], pid=d["pid"],
                            gpus=tuple(d["gpus"]), cpu_count=d["cpu_count"]) for eid, d in zip(ids, described)]
        self._rank_map = build_rank_map(infos, self._backend_request, share_gpu=self._share_gpu)
        self._views = {r.rank: client[r.engine_id] for r in self._rank_map.ranks}
        # Only this machine's engines can be checked by PID; others rely on ipyparallel's heartbeat.
        here = socket.gethostname()
        self._local_pids = {r.pid for r in self._rank_map.ranks if r.host == here}
        self._threads = self._pick_threads(infos, warn)
        self._states = {}

    def _pick_threads(self, infos: list[EngineInfo], warn: bool) -> int:
        per_host = self._rank_map.hosts()
        cores = min(i.cpu_count for i in infos)
        busiest = max(len(v) for v in per_host.values())
        if warn and busiest > cores:
            warnings.warn(f"{busiest} ranks share {cores} CPU cores on one host: ranks will time-share the "
                          "cores, so measured times include waiting; use 1 thread per rank and small models",
                          OversubscribedWarning, stacklevel=5)
        return self._threads_request or 1  # torchrun's default too; see lab.pool.start

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
            failures = describe_failures(out, rm, timed_out=set(out.pending))
            raise RankError(failures, "could not bring up the process group: " + failures[0].evalue)
        for r in rm.ranks:
            self._views[r.rank].push({"rank": r.rank, "world": rm.world_size, "local_rank": r.local_rank,
                                      "device": r.device}, block=False)
        everyone = self._source.client[[r.engine_id for r in rm.ranks]]
        everyone.execute("import torch\nimport torch.distributed as dist\ndevice = torch.device(device)", block=True)
        if self._activate and _in_ipython():
            self.activate()

    def _recover(self, out: Outcome, *, interrupt: bool = False) -> set[int]:
        """Bring every live rank back to idle and rebuild the world; return the ranks the lab interrupted.

        Peers of a failed rank normally fail on their own within the grace period.
        Ranks still running after it are sent SIGINT; ranks wedged in a collective
        even then are killed (only engines the lab started) and the whole pool is
        restarted, so the user is never left with a hung pool.
        """
        interrupted: set[int] = set()
        if out.pending and not interrupt:
            wait_ranks({}, self._is_dead, deadline=time.monotonic() + GRACE_S, stop_on_failure=False, outcome=out)
        if out.pending:
            interrupted = set(out.pending)
            self._signal_ranks(interrupted, signal.SIGINT)
            wait_ranks({}, self._is_dead, deadline=time.monotonic() + GRACE_S, stop_on_failure=False, outcome=out)
        # ipyparallel may fail a killed engine's task (EngineError) before its heartbeat
        # unregisters it, so the death shows up only now: count it as a death, not an error.
        for rank in range(self.world_size):
            if rank not in out.dead and self._is_dead(rank):
                out.errors.pop(rank, None)
                out.pending.pop(rank, None)
                out.dead.add(rank)
        self._dead |= out.dead
        if out.pending and self._source.owned:
            self._kill_leftovers({self._rank_map.ranks[r].pid for r in out.pending})
            self.restart()
        elif not self._dead:
            self._form_world()
        self._states = {r: ("dead", "engine process is gone") for r in self._dead}
        return interrupted

    def _raise_after_recovery(self, out: Outcome, *, timed_out: bool) -> None:
        late = set(out.pending) if timed_out else set()
        interrupted = self._recover(out)
        failures = describe_failures(out, self._rank_map, interrupted=interrupted - late, timed_out=late)
        if failures[0].rank not in self._dead:
            self._states[failures[0].rank] = ("failed", f"{failures[0].ename}: {failures[0].evalue}"[:200])
        if out.dead:
            dead = ", ".join(f"rank {f.rank} ({f.host})" for f in failures if f.ename == "EngineDied")
            raise DeadRankError(failures, f"{dead} died; call cluster.restart() to bring the world back")
        if timed_out:
            names = ", ".join(f"rank {r} ({self._rank_map.ranks[r].host})" for r in sorted(late))
            raise RankTimeoutError(failures, f"{names} did not finish within the timeout; they were "
                                             "interrupted and the world was rebuilt")
        raise RankError(failures)

    def _signal_ranks(self, ranks: set[int], sig: int) -> None:
        local = socket.gethostname()
        mine = {r for r in ranks if self._rank_map.ranks[r].host == local and self._source.owned}
        launch.signal_pids({self._rank_map.ranks[r].pid for r in mine}, self._source.pids, sig)
        others = ranks - mine
        if others:  # through ipyparallel's engine nanny, which works on any host
            self._source.client.send_signal(sig, targets=[self._engine_of(r) for r in others], block=True)

    def _kill_leftovers(self, pids: set[int]) -> None:
        alive = {p for p in pids if launch.is_alive(p)}
        launch.signal_pids(alive, self._source.pids, signal.SIGKILL)

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
