"""A run that does not block: ``RunHandle``, what ``Experiment.start()`` returns.

The ranks train in a call the pool supervises as always (``Cluster.run``: failures name
their rank, dead engines are replaced), on a thread of its own; ``wait()`` joins it and
returns the ``RunResult`` or raises what the call raised. While the ranks train, each
sends one ``kernels.contract.watch_records.StepProgress`` per finished step through
ipyparallel's data channel (``kernels.watch.progress``); the client merges them into each
call's metadata as they arrive, and a monitor thread here hands the new ones to whoever
follows the run (a dashboard, a progress bar, TensorBoard), every ``POLL_S``.

``stop()`` sends ``kernels.watch.progress.STOP_SIGNAL`` to every rank once all of them have
armed its handler (a rank signalled before that would die of it); the ranks agree on the
step to stop after, so all of them return at one step boundary and the pool stays
ready for the next run.
"""
from __future__ import annotations

import dataclasses
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable

from kernels.watch.progress import ARMED_KEY, STOP_SIGNAL
from kernels.contract.watch_records import StepProgress
from kernels.train.entry import train_rank
from lab.pool.hang_report import HangWatch
from lab.pool.supervise import call_metadata

if TYPE_CHECKING:
    from lab.run.experiment import Experiment
    from lab.run.run_result import RunResult
    from widgets import TrainingDashboard

POLL_S = 0.1
_KEY = "progress."


class RunHandle:
    """One training run under way: ``wait()``, ``done``, ``stop()``, and live ``progress`` per rank."""

    def __init__(self, experiment: "Experiment", cfg: dict[str, Any], *, timeout: float | None = None,
                 return_params: bool = False) -> None:
        self.experiment, self.config = experiment, cfg
        self.world_size = experiment.cluster.world_size
        self._timeout, self._return_params = timeout, return_params
        self._records: dict[tuple[int, int], StepProgress] = {}
        self._heard: dict[int, float] = {}  # rank -> driver wall clock when its last record arrived
        self._seen_keys: dict[int, set[str]] = {}
        self._armed: set[int] = set()
        self._metadata: dict[int, dict[str, Any]] = {}  # rank -> its call's ipyparallel metadata
        self._futures: list[Any] = []  # the call's per-rank AsyncResults
        self._followers: list[Callable[[list[StepProgress]], None]] = []
        self._on_finish: list[Callable[[], None]] = []
        self._stop_requested = self._stop_sent = False
        self._result: "RunResult | None" = None
        self._error: BaseException | None = None
        self._call_ended = threading.Event()  # the ranks returned: the monitor polls once more and ends
        self._finished = threading.Event()  # ... and the result is complete
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # the thread whose cluster.run is this run's training call
        self.started_at = time.time()
        self._monitor = threading.Thread(target=self._watch, name="lab-run-monitor", daemon=True)

    # ------------------------------------------------------------------ driving
    def _begin(self, *, background: bool) -> "RunHandle":
        """Start watching, and train on a thread of its own (``start()``) or on this one (``run()``)."""
        self.started_at = time.time()  # now, not when the handle was made: it may have waited for another run
        self._monitor.start()
        if background:
            self._thread = threading.Thread(target=self._train, name="lab-run", daemon=True)
            self.experiment.cluster.hold(self)  # until it ends, other cells wait for it (lab.pool.busy)
            self._thread.start()
        else:
            self._thread = threading.current_thread()
            self._train()
        return self

    def _abandon(self) -> None:
        """The run will never begin (its wait for the pool was refused or interrupted): close what follows it."""
        for callback in self._on_finish:
            callback()

    def _train(self) -> None:
        cluster, result = self.experiment.cluster, None
        cluster.on_submit(self._submitted)
        try:
            per_rank = cluster.run(train_rank, self.config, timeout=self._timeout,
                                   hang_watch=HangWatch(cluster, self.experiment.hang_after))
            result = self.experiment.result_from_ranks(per_rank, self.config, self._return_params)
        except BaseException as error:  # raised again by wait(), on the caller's thread
            self._error = error
        finally:
            cluster.off_submit(self._submitted)
            self._call_ended.set()
            self._monitor.join()
            if result is not None:
                self._result = self._with_progress(result)
            for callback in self._on_finish:
                callback()
            cluster.let_go(self)
            self._finished.set()

    def _submitted(self, pending: dict[int, Any]) -> None:
        if threading.current_thread() is not self._thread:
            return  # another cell's call (a subset of ranks, say): its records are not this run's
        self._metadata = call_metadata(self.experiment.cluster.client, pending)
        self._futures = list(pending.values())

    def _watch(self) -> None:
        """Until the call ends: gather new records, pass them on, send a requested stop once every rank is armed."""
        while not self._call_ended.wait(POLL_S):
            self._poll()
        for future in self._futures:  # iopub ends a call's messages with "idle": then every record is in
            try:
                future.wait_for_output(timeout=2.0)
            except Exception:  # a dead engine sends no "idle"; what arrived is kept
                pass
        self._poll()

    def _poll(self) -> None:
        new: list[StepProgress] = []
        for rank, md in list(self._metadata.items()):
            data = md["data"].copy()  # the client's thread merges into this dict as messages arrive
            seen = self._seen_keys.setdefault(rank, set())
            for key in data.keys() - seen:
                seen.add(key)
                if key == ARMED_KEY:
                    self._armed.add(rank)
                elif key.startswith(_KEY):
                    new.append(StepProgress.from_dict(data[key]))
        if new:
            now = time.time()
            with self._lock:
                for record in new:
                    self._records[(record.rank, record.step)] = record
                    self._heard[record.rank] = now
            self.experiment.cluster.heard_from(self._heard)  # cluster.view() shows the same freshness
            for follow in list(self._followers):
                try:
                    follow(sorted(new, key=lambda r: (r.step, r.rank)))
                except Exception as error:  # a broken view must not stop the records or a stop request
                    self._followers.remove(follow)
                    warnings.warn(f"stopped passing progress to {follow!r}: {error!r}", RuntimeWarning, stacklevel=1)
        if self._stop_requested and not self._stop_sent and len(self._armed) == self.world_size:
            self._stop_sent = True
            self.experiment.cluster.signal_ranks(set(range(self.world_size)), STOP_SIGNAL)

    def _with_progress(self, result: "RunResult") -> "RunResult":
        done = [r.to_dict() for r in self.history]
        stopped = result.first_step + len(result.losses) < self.config["steps"]
        return dataclasses.replace(result, progress=done, stopped_at=len(result.losses) - 1 if stopped else None)

    # ------------------------------------------------------------------ the user's side
    @property
    def done(self) -> bool:
        """True once every rank has returned (or the run failed)."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> "RunResult":
        """Block until the run ends; returns its ``RunResult`` or raises the error the ranks raised.

        ``timeout`` bounds this wait only (the run goes on); ``TimeoutError`` when it passes.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"the run is still going after {timeout} s (it goes on; call wait() again or stop())")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    def stop(self, wait: bool = True) -> "RunResult | None":
        """Ask every rank to stop at the next step boundary they agree on; with ``wait``, return the result."""
        self._stop_requested = True
        return self.wait() if wait else None

    @property
    def progress(self) -> list[StepProgress | None]:
        """The latest record of each rank (None for a rank not heard from yet), indexed by rank."""
        latest: list[StepProgress | None] = [None] * self.world_size
        for record in self.history:
            latest[record.rank] = record
        return latest

    @property
    def history(self) -> list[StepProgress]:
        """Every record so far, by step then rank."""
        with self._lock:
            return sorted(self._records.values(), key=lambda r: (r.step, r.rank))

    def last_heard(self) -> list[float | None]:
        """Seconds since each rank's last record reached this process (None: not heard from yet)."""
        now = time.time()
        with self._lock:
            return [now - self._heard[r] if r in self._heard else None for r in range(self.world_size)]

    def heard_at(self) -> list[float | None]:
        """When (this process's wall clock) each rank's last record arrived."""
        with self._lock:
            return [self._heard.get(r) for r in range(self.world_size)]

    def follow(self, callback: Callable[[list[StepProgress]], None]) -> None:
        """Call ``callback(new_records)`` from the monitor thread whenever records arrive (after those so far)."""
        so_far = self.history
        if so_far:
            callback(so_far)
        self._followers.append(callback)

    def unfollow(self, callback: Callable[[list[StepProgress]], None]) -> None:
        """Stop passing records to ``callback`` (given to ``follow``); unknown callbacks are ignored."""
        try:
            self._followers.remove(callback)
        except ValueError:  # never followed, or already dropped for raising
            pass

    def on_finish(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the run has ended and its last records were passed on (before ``wait`` returns)."""
        self._on_finish.append(callback)

    def dashboard(self, stale_after: float = 5.0, peak_flops: float | str | None = None) -> "TrainingDashboard":
        """A ``widgets.TrainingDashboard`` that follows this run live; with ``peak_flops`` (one device's FLOP/s or a
        GPU's name) it shows MFU beside tokens/s (the lab's own models; ``lab.run.run_views.follow_dashboard``)."""
        from lab.run.run_views import follow_dashboard

        return follow_dashboard(self, stale_after, peak_flops)

    def __repr__(self) -> str:
        steps = [r.step for r in self.progress if r is not None]
        state = "done" if self.done else ("stopping" if self._stop_requested else "running")
        where = f", step {min(steps) + 1}/{self.config['steps']} on every rank" if len(steps) == self.world_size else ""
        return f"<RunHandle {state}{where}>"
