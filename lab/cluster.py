"""The pool handle: ranks on ipyparallel engines with a torch.distributed world on them.

``lab.start()`` / ``lab.connect()`` return a :class:`Cluster`. Every call the
handle makes on the ranks is supervised (see ``lab.supervise``): a failing rank
raises :class:`~lab.errors.RankError` naming it, a dead engine is noticed within
a second, an interrupt signals every busy engine, and the world is rebuilt after
each failure so the next cell works without restarting the kernel.
"""
from __future__ import annotations

import html
import os
import signal
import socket
import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ipyparallel import AsyncResult

from kernels import runtime
from kernels.records import EngineInfo, RankMap, RankStatus
from lab import launch
from lab.errors import DeadRankError, LabError, PoolStoppedError, RankError, RankTimeoutError
from lab.rank_map import build_rank_map
from lab.supervise import Outcome, describe_failures, wait_ranks

if TYPE_CHECKING:
    from widgets import ClusterView

GRACE_S = 3.0  # how long peers get to fail on their own once one rank has failed


class OversubscribedWarning(UserWarning):
    """More ranks than CPU cores on a host: timings will reflect time-sharing."""


class Cluster:
    """A pool of ranks; use :func:`lab.start` or :func:`lab.connect` to make one."""

    def __init__(self, source: launch.EngineSource, *, backend: str = "auto",
                 threads_per_rank: int | None = None, timeout: float = 60.0,
                 collective_timeout: float = 300.0, activate: bool = True) -> None:
        self._source = source
        self._backend_request = backend
        self._threads_request = threads_per_rank
        self._timeout = timeout
        self._collective_timeout = collective_timeout
        self._activate = activate
        self._stopped = False
        self._dead: set[int] = set()
        self._states: dict[int, tuple[str, str]] = {}
        self._watchers: list[Callable[[list[RankStatus]], None]] = []
        self._finalizer = weakref.finalize(self, launch.stop_source, source)
        try:
            self._adopt_engines(warn=True)
            self._form_world()
        except BaseException:
            self.stop()
            raise

    # ----------------------------------------------------------------- properties
    @property
    def rank_map(self) -> RankMap:
        """Who is which rank, on which host and device, with which backend."""
        return self._rank_map

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self._rank_map.world_size

    @property
    def backend(self) -> str:
        """The torch.distributed backend of the world ("nccl" or "gloo")."""
        return self._rank_map.backend

    @property
    def threads(self) -> int:
        """torch intra-op threads per rank."""
        return self._threads

    @property
    def pids(self) -> set[int]:
        """Every process the lab started for this pool (empty for an attached pool)."""
        return set(self._source.pids)

    def status(self) -> list[RankStatus]:
        """One row per rank: where it runs, what state it is in, and its resident memory."""
        return [RankStatus(r.rank, r.host, r.pid, r.device, r.backend, self._threads,
                           *self._states.get(r.rank, ("idle", "")), rss_bytes=self._rss(r.pid))
                for r in self._rank_map.ranks]

    def view(self) -> "ClusterView":
        """A live ClusterView of the ranks: it follows every call (busy, failed, dead, memory)."""
        from widgets import ClusterView

        view = ClusterView(self.status())
        self._watchers.append(view.update)
        return view

    def _rss(self, pid: int) -> int | None:
        return launch.resident_bytes(pid) if pid in self._local_pids else None

    def _notify(self) -> None:
        if self._watchers:
            rows = self.status()
            for update in self._watchers:
                update(rows)

    # ---------------------------------------------------------------- running code
    def run(self, fn: Callable[..., Any], *args: Any, ranks: Iterable[int] | None = None,
            timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the ranks and return their results.

        Returns a list indexed by rank when ``ranks`` is None, else a dict keyed by
        rank. Raises :class:`RankError` (the cause first, with its host and remote
        traceback), :class:`RankTimeoutError` when ``timeout`` seconds pass, or
        :class:`DeadRankError` when an engine dies. After any of these the world is
        rebuilt on every live rank before the error is raised.
        """
        targets = self._targets(ranks)
        pending = self._submit(targets, runtime.call_guarded, fn, args, kwargs)
        for r in targets:
            self._states[r] = ("busy", getattr(fn, "__name__", "call"))
        self._notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            out = wait_ranks(pending, self._is_dead, deadline=deadline,
                             on_slice=self._notify if self._watchers else None)
        except KeyboardInterrupt:
            self._recover(Outcome(pending=dict(pending)), interrupt=True)
            self._notify()
            raise
        if not out.clean:
            try:
                self._raise_after_recovery(out, timed_out=out.deadline_hit)
            finally:
                self._notify()
        for r in targets:
            self._states[r] = ("idle", "")
        self._notify()
        if ranks is None:
            return [out.results[r] for r in range(self.world_size)]
        return {r: out.results[r] for r in targets}

    def _submit(self, targets: list[int], fn: Callable[..., Any], *args: Any) -> dict[int, AsyncResult]:
        """One future per rank whose result is that rank's value, at any world size.

        A multi-target message serialises the call once and ``split()`` gives a future per
        rank; but a one-target message's ``split()`` is the message itself, whose result is
        a one-element list, so a single rank gets a single-target view instead.
        """
        client = self._source.client
        if len(targets) == 1:
            return {targets[0]: client[self._engine_of(targets[0])].apply_async(fn, *args)}
        submitted = client[[self._engine_of(r) for r in targets]].apply_async(fn, *args)
        return dict(zip(targets, submitted.split()))

    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None) -> None:
        """Bind the names in ``namespace`` on the ranks (visible to ``%%px`` cells)."""
        targets = self._targets(ranks)
        self._source.client[[self._engine_of(r) for r in targets]].push(namespace, block=True)

    def pull(self, name: str, ranks: Iterable[int] | None = None) -> Any:
        """Fetch a name's value from each rank: a list by rank, or a dict for ``ranks``."""
        targets = self._targets(ranks)
        values = self._source.client[[self._engine_of(r) for r in targets]].pull(name, block=True)
        return list(values) if ranks is None else dict(zip(targets, values))

    def activate(self) -> None:
        """Point IPython's ``%px``/``%%px`` magics at the ranks, in rank order."""
        self._source.client[[r.engine_id for r in self._rank_map.ranks]].activate()

    # ------------------------------------------------------------------ lifecycle
    def restart(self) -> "Cluster":
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
            source.ipp_cluster.start_engines_sync(n)
            source.pids |= launch.launched_pids(source.ipp_cluster)
        else:
            source.ipp_cluster.restart_engines_sync()
        new_ids = self._wait_for_new_engines(n, old)
        self._dead.clear()
        self._adopt_engines(new_ids)
        self._form_world()
        return self

    def stop(self) -> None:
        """Tear the world down and stop every process the lab started (checked by PID)."""
        if self._stopped:
            return
        self._stopped = True
        if hasattr(self, "_views") and not self._dead:
            try:
                wait_ranks({r: v.apply_async(runtime.leave_world) for r, v in self._views.items()},
                           self._is_dead, deadline=time.monotonic() + 5, stop_on_failure=False)
            except Exception:  # stopping must go on even if the engines are in a bad state
                pass
        self._finalizer()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -------------------------------------------------------------- presentation
    def __repr__(self) -> str:
        if self._stopped:
            return "<Cluster: stopped>"
        head = f"Cluster: {_ranks(self.world_size)}, backend {self.backend}, {self._threads} thread(s) per rank"
        cols = ("rank", "host", "pid", "device", "backend", "threads", "state")
        rows = [tuple(str(getattr(s, c)) for c in cols) for s in self.status()]
        widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
        line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
        note = [f"note: {self._rank_map.note}"] if self._rank_map.note else []
        return "\n".join([head, line(cols), *(line(r) for r in rows), *note])

    def _repr_html_(self) -> str:
        if self._stopped:
            return "<p>Cluster: stopped</p>"
        cols = ("rank", "host", "pid", "device", "backend", "threads", "state")
        colour = {"failed": "#f8d7da", "dead": "#f5c2c7", "busy": "#fff3cd"}
        body = "".join(
            f"<tr style='background:{colour.get(s.state, 'transparent')}'>"
            + "".join(f"<td>{html.escape(str(getattr(s, c)))}</td>" for c in cols) + "</tr>"
            for s in self.status())
        note = f"<p><i>{html.escape(self._rank_map.note)}</i></p>" if self._rank_map.note else ""
        return (f"<div class='cluster-lab-ranks'><b>Cluster</b>: {_ranks(self.world_size)}, "
                f"backend <code>{self.backend}</code><table><thead><tr>"
                + "".join(f"<th>{c}</th>" for c in cols) + f"</tr></thead><tbody>{body}</tbody></table>{note}</div>")

    # ------------------------------------------------------------------ internals
    def _adopt_engines(self, engine_ids: Iterable[int] | None = None, *, warn: bool = False) -> None:
        """Ask the engines who they are and number the ranks (DESIGN.md §3)."""
        client = self._source.client
        controller_host = client._config.get("interface", "tcp://127.0.0.1").split("//")[-1]
        ids = sorted(client.ids if engine_ids is None else engine_ids)
        described = client[ids].apply_sync(runtime.describe_engine, controller_host)
        infos = [EngineInfo(engine_id=eid, host=d["host"], ip=d["ip"], pid=d["pid"],
                            gpus=tuple(d["gpus"]), cpu_count=d["cpu_count"]) for eid, d in zip(ids, described)]
        self._rank_map = build_rank_map(infos, self._backend_request)
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
        return self._threads_request or max(1, cores // busiest)

    def _form_world(self) -> None:
        """(Re)build the process group on every rank over a fresh store, then bind names for %%px."""
        rm = self._rank_map
        rank0 = self._views[0]
        port = rank0.apply_sync(runtime.open_store, rm.master_addr, rm.world_size, self._timeout)
        pending = {r.rank: self._views[r.rank].apply_async(runtime.join_world, {
            "rank": r.rank, "world_size": rm.world_size, "backend": rm.backend, "device": r.device,
            "master_addr": rm.master_addr, "port": port, "threads": self._threads,
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

    def _is_dead(self, rank: int) -> bool:
        info = self._rank_map.ranks[rank]
        if info.engine_id not in self._source.client.ids:
            return True
        return info.pid in self._local_pids and not launch.is_alive(info.pid)

    def _targets(self, ranks: Iterable[int] | None) -> list[int]:
        self._check_not_stopped()
        if self._dead:
            names = ", ".join(f"rank {r} ({self._rank_map.ranks[r].host})" for r in sorted(self._dead))
            raise LabError(f"{names} died earlier; call cluster.restart() to bring the world back")
        targets = list(range(self.world_size)) if ranks is None else list(ranks)
        bad = [r for r in targets if not 0 <= r < self.world_size]
        if bad:
            raise ValueError(f"ranks {bad} do not exist: the world has ranks 0..{self.world_size - 1}")
        return targets

    def _engine_of(self, rank: int) -> int:
        return self._rank_map.ranks[rank].engine_id

    def _check_not_stopped(self) -> None:
        if self._stopped:
            raise PoolStoppedError("this pool was stopped; start a new one with lab.start()")


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _in_ipython() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    return get_ipython() is not None


def default_rank_count() -> int:
    """One rank per visible GPU, or 4 CPU ranks when there is none."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 4


def engine_env_note() -> str:
    """The CPU budget the driver sees, for messages."""
    return f"{os.cpu_count()} CPU cores on {socket.gethostname()}"
