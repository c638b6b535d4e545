"""The pool handle: ranks on ipyparallel engines with a torch.distributed world on them.

``lab.start()`` / ``lab.connect()`` return a :class:`Cluster`. Every call the
handle makes on the ranks is supervised (see ``lab.pool.supervise``): a failing rank
raises :class:`~lab.errors.RankError` naming it, a dead engine is noticed within
a second and replaced by a warmed spare (``lab.pool.standby``), an interrupt signals
every busy engine, and the world is rebuilt after each failure so the next cell
works without restarting the kernel.
"""
from __future__ import annotations

import time
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ipyparallel import AsyncResult

from kernels.engine import runtime
from kernels.contract.pool_records import RankMap, RankStatus
from lab.pool import launch, lifetime, px_magic
from lab.pool.busy import PoolOccupancy
from lab.pool.cluster_status import StatusBoard
from lab.pool.cluster_world import WorldKeeper
from lab.errors import LabError, PoolStoppedError
from lab.pool.failure_report import FailureReporter
from lab.pool.sent_code import SentCodeBook
from lab.pool.standby import Standby
from lab.pool.supervise import Outcome, wait_ranks

if TYPE_CHECKING:
    from lab.pool.hang_report import HangWatch


class Cluster(WorldKeeper, FailureReporter, PoolOccupancy, StatusBoard):
    """A pool of ranks; use :func:`lab.start` or :func:`lab.connect` to make one."""

    network: Any = None  # the simulated hosts' network (lab.testing.hosts); None on a real pool

    def __init__(self, source: launch.EngineSource, *, backend: str = "auto", share_gpu: bool = False,
                 threads_per_rank: int | None = None, timeout: float = 60.0,
                 collective_timeout: float = 300.0, activate: bool = True, spare_engines: int = 0) -> None:
        self._source = source
        self._backend_request = backend
        self._share_gpu = share_gpu
        self._threads_request = threads_per_rank
        self._timeout = timeout
        self._collective_timeout = collective_timeout
        self._activate = activate
        self._stopped = False
        self._dead: set[int] = set()
        self._states: dict[int, tuple[str, str]] = {}
        self._watchers: list[Callable[[list[RankStatus]], None]] = []
        self._on_stop: list[Callable[[], None]] = []
        # Called with each call's per-rank futures as it is sent (lab.run.run_handle reads their data messages).
        self._submit_listeners: list[Callable[[dict[int, AsyncResult]], None]] = []
        self._heard: dict[int, float] = {}  # rank -> wall clock of its last progress record (heard_from)
        self._sent_code = SentCodeBook()  # the notebook code each call carried: a rank's frames name their cell
        self._finalizer = weakref.finalize(self, launch.stop_source, source)
        lifetime.stop_on_termination(self)  # SIGTERM/SIGHUP stop the pool as stop() does, then end the driver
        try:
            self._adopt_engines(warn=True)
            # Only a pool the lab started can start engines; an attached pool gets no spares.
            self._standby = Standby(source, spare_engines if source.owned else 0, self._controller_host())
            self._form_world()
            self._standby.refill()
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

    @property
    def timeout(self) -> float:
        """Seconds a pool operation (start, world forming, engine replacement) may take before it is an error."""
        return self._timeout

    @property
    def collective_timeout(self) -> float:
        """Seconds a rank waits in one collective before torch.distributed gives up."""
        return self._collective_timeout

    @property
    def client(self) -> Any:
        """The connected ``ipyparallel.Client`` (each call's metadata carries what its ranks publish)."""
        return self._source.client

    def on_submit(self, listener: Callable[[dict[int, AsyncResult]], None]) -> None:
        """Call ``listener(futures by rank)`` as each call is sent (a started run reads its ranks' records)."""
        self._submit_listeners.append(listener)

    def off_submit(self, listener: Callable[[dict[int, AsyncResult]], None]) -> None:
        """Stop calling ``listener``."""
        self._submit_listeners.remove(listener)

    def spares(self) -> int:
        """Spare engines started and warmed, ready to replace a rank whose engine dies (see ``lab.pool.standby``)."""
        self._standby.warm({r.engine_id for r in self._rank_map.ranks})
        return self._standby.ready

    # ---------------------------------------------------------------- running code
    def run(self, fn: Callable[..., Any], *args: Any, ranks: Iterable[int] | None = None,
            timeout: float | None = None, hang_watch: "HangWatch | None" = None, wait: bool = True,
            **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)`` on the ranks and return their results.

        Returns a list indexed by rank when ``ranks`` is None, else a dict keyed by
        rank. Raises :class:`RankError` (the cause first, with its host and its own
        frame), :class:`RankTimeoutError` naming the ranks that kept the others
        waiting when ``timeout`` seconds pass, or :class:`DeadRankError` when an
        engine dies. Before any of these is raised the world is rebuilt, lost engines
        replaced, and the error's ``recovery`` says what that took.

        With ``hang_watch`` (``lab.pool.hang_report.HangWatch``) a stall ends the call with
        :class:`HangError`, and on a stall, a timeout or an interrupt its ``HangReport``
        is taken before recovery and rides on the error (``err.report``).

        While a run started with ``.start()`` trains, the call waits for it, saying so
        (``lab.pool.busy``); with ``wait=False`` it raises :class:`PoolBusyError` instead.
        """
        self.wait_until_free(wait)
        targets = self._targets(ranks)
        # An engine that died between calls (with its whole mpiexec, under MPI) fails the call like a death in one.
        died_idle = {r for r in range(self.world_size) if self._is_dead(r)}
        if died_idle:
            self._raise_after_recovery(Outcome(dead=died_idle), timeout=timeout)
        self._standby.warm({r.engine_id for r in self._rank_map.ranks})
        self._sent_code.remember(fn, args, kwargs)
        pending = self._submit(targets, runtime.call_guarded, fn, args, kwargs)
        for listener in list(self._submit_listeners):
            listener(pending)
        if hang_watch is not None:
            hang_watch.follow(pending)
        for r in targets:
            self._states[r] = ("busy", getattr(fn, "__name__", "call"))
        self._notify()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            out = wait_ranks(pending, self._is_dead, deadline=deadline,
                             on_slice=self._notify if self._watchers else None,
                             stalled=hang_watch.stalled if hang_watch is not None else None)
        except KeyboardInterrupt as interrupt:
            if hang_watch is not None:  # before recovery signals anyone
                interrupt.report = hang_watch.capture("an interrupt")
                interrupt.add_note(str(interrupt.report))
            recovery = self._recover(Outcome(pending=dict(pending)), interrupt=True)
            self._states = {r: ("dead", "engine process is gone") for r in self._dead}
            self._notify()
            if recovery.killed or not recovery.rebuilt:
                warnings.warn(f"after the interrupt: {recovery.summary()}", RuntimeWarning, stacklevel=2)
            raise
        if not out.clean:
            try:
                self._raise_after_recovery(out, timeout=timeout, hang_watch=hang_watch)
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
        a one-element list, so a single rank gets a single-target view instead. ``split`` is
        called unwrapped: ipyparallel caches it (``lru_cache``), which would keep the last 128
        calls' futures, and every rank's result with them, alive in a warm pool's driver.
        """
        client = self._source.client
        if len(targets) == 1:
            return {targets[0]: client[self._engine_of(targets[0])].apply_async(fn, *args)}
        submitted = client[[self._engine_of(r) for r in targets]].apply_async(fn, *args)
        return dict(zip(targets, AsyncResult.split.__wrapped__(submitted)))

    def push(self, namespace: dict[str, Any], ranks: Iterable[int] | None = None, *, wait: bool = True) -> None:
        """Bind the names in ``namespace`` on the ranks (visible to ``%%px`` cells); ``wait`` as for ``run``."""
        self.wait_until_free(wait)
        targets = self._targets(ranks)
        self._sent_code.remember(namespace)
        self._source.client[[self._engine_of(r) for r in targets]].push(namespace, block=True)

    def pull(self, name: str, ranks: Iterable[int] | None = None, *, wait: bool = True) -> Any:
        """Fetch a name's value from each rank: a list by rank, or a dict for ``ranks``; ``wait`` as for ``run``."""
        self.wait_until_free(wait)
        targets = self._targets(ranks)
        values = self._source.client[[self._engine_of(r) for r in targets]].pull(name, block=True)
        return list(values) if ranks is None else dict(zip(targets, values))

    def activate(self) -> None:
        """Make IPython's ``%px``/``%%px`` run cells on these ranks (``lab.pool.px_magic``).

        A ``%%px`` cell runs like ``cluster.run``: each rank's output is shown, labelled
        by rank, when the cell ends; a failing rank raises ``RankError`` and the world is
        rebuilt; ``%%px --timeout S`` bounds the cell and ``--ranks 0,2`` picks ranks.
        """
        px_magic.register(self)

    # ------------------------------------------------------------------ lifecycle
    def stop(self) -> None:
        """Tear the world down and stop every process the lab started (checked by PID)."""
        if self._stopped:
            return
        self._stopped = True
        for callback in self._on_stop:  # views that offer to run on the pool take their buttons away
            callback()
        # Engines the lab started are about to be terminated, their process groups with them; waiting for a rank
        # that trains to leave its world would only slow a stop that must fit inside a kernel's shutdown.
        if hasattr(self, "_views") and not self._dead and not self._source.owned:
            try:
                wait_ranks({r: v.apply_async(runtime.leave_world) for r, v in self._views.items()},
                           self._is_dead, deadline=time.monotonic() + 5, stop_on_failure=False)
            except Exception:  # stopping must go on even if the engines are in a bad state
                pass
        self._finalizer()

    @property
    def stopped(self) -> bool:
        """True once ``stop()`` ran: nothing can run on this pool any more."""
        return self._stopped

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` when the pool stops (at once if it already has)."""
        if self._stopped:
            callback()
        else:
            self._on_stop.append(callback)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _is_dead(self, rank: int) -> bool:
        info = self._rank_map.ranks[rank]
        if info.engine_id not in self._source.client.ids:
            return True
        return info.pid in self._local_pids and not launch.is_alive(info.pid)

    def _targets(self, ranks: Iterable[int] | None) -> list[int]:
        self._check_not_stopped()
        if self._dead and self._source.owned:
            self._finish_recovery()  # ranks lost in the last failure get the engines started for them
        elif self._dead:
            names = ", ".join(f"rank {r} ({self._rank_map.ranks[r].host})" for r in sorted(self._dead))
            raise LabError(f"{names} died earlier; restart the engines with ipcluster, then call cluster.restart()")
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


def default_rank_count() -> int:
    """One rank per visible GPU, or 4 CPU ranks when there is none."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 4
