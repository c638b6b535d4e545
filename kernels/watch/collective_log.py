"""Where a rank is, readable while it is blocked: the last collective it entered or left, kept in a file.

A rank blocked inside a gloo collective cannot answer an ipyparallel call, and Python
signal handlers do not run while it waits in C++. So the rank's state changes at every
collective entry and exit, and at every traced action (forward, backward, optimizer),
and is published into a small memory-mapped file of its own in the pool's profile
directory (``kernels.watch.state_file``); the driver reads it whenever it likes, even
from a rank that will never return. A training rank's log publishes from a thread, at
most every 100 ms (``publish_every_s``), so a change costs the step no file write; a
fault and the run's end are written at once. NCCL has its own flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``); this
is the lab's equivalent for gloo, and for any backend what the ranks traced.

The file holds one JSON snapshot (``RankActivity``) behind a sequence lock.
``CollectiveLog`` also sums, per step, the time the rank spent
inside collectives (the union of their intervals, so overlapping ones count once) and
inside those it entered during backward (the gradient all-reduce or reduce-scatter),
and returns them as ``StepWait`` records: what a dashboard sets against compute. The same
stamps, with the rank watch's forward and backward windows, give each step's overlap of
communication with compute (``kernels.watch.overlap``).

Torch-free (the driver and the views import it). Run alone (writes, then reads back a state)::

    python -m kernels.watch.collective_log
"""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

from kernels.contract.watch_records import OpenCollective, StepWait
from kernels.watch.overlap import StepSpans
from kernels.watch.state_file import StateFile, StatePublisher, log_path, read_state

MAX_OPEN = 8  # oldest open collectives kept in a snapshot (the one a rank is stuck behind is the oldest)
BEACON_KEY = "watch"  # the data key under which a rank's beacon sends its state (kernels.watch.flight_recorder)


class CollectiveLog:
    """This rank's state and per-step waits; its changes are published to its ``StateFile``.

    Only the rank's main thread changes the state. An async collective completes on the
    backend's thread, which only appends to ``_done`` (a deque: no lock, no file I/O on a
    thread that the backend's own shutdown joins); the main thread takes those in at its
    next call, with the time they completed.
    """

    def __init__(self, rank: int, path: str | None = None, publish_every_s: float | None = None) -> None:
        """``publish_every_s``: write the state from a thread at most that often (``StatePublisher``); None, at every change."""
        self.rank, self._pid = rank, os.getpid()
        self._done: collections.deque[tuple[int, float]] = collections.deque()
        self._file = StateFile(path or log_path(os.getpid()))
        self._publisher = StatePublisher(self._file, self._snapshot, publish_every_s)
        self._seq: dict[tuple[str, tuple[int, ...]], int] = {}
        self._open: dict[int, OpenCollective] = {}
        self._launched: dict[int, float] = {}  # token -> perf_counter at entry, for the overlap
        self.spans = StepSpans()  # this step's compute, waits and collectives (kernels.watch.overlap)
        self._next_token = 0
        self.step, self.action, self.faults = -1, "setup", []
        self._waits: list[StepWait] = []
        self._step_began = self._blocked_from = 0.0
        self._owner = threading.get_ident()  # the rank's main thread: the only one whose waits are its steps'
        self._reset_step(time.perf_counter())
        self._publisher.now()

    @property
    def path(self) -> str:
        """The state file this log publishes to."""
        return self._file.path

    # ----------------------------------------------------------------- state
    def enter(self, op: str, group: str, ranks: tuple[int, ...], nbytes: int) -> int:
        """A collective begins; returns the token ``leave`` (or ``completed``) takes."""
        self._take_completed()
        key = (group, ranks)
        self._seq[key] = self._seq.get(key, 0) + 1
        token, self._next_token = self._next_token, self._next_token + 1
        phase = self.action.split(",")[0]
        self._open[token] = OpenCollective(op, group, ranks, self._seq[key], int(nbytes), time.time(), phase)
        self._launched[token] = self._spans_opened(phase == "backward")
        self._publisher.changed()
        return token

    def leave(self, token: int) -> None:
        """On the main thread: the collective ``token`` names returned (or failed)."""
        now = time.perf_counter()
        self.spans.blocked.append((self._launched.get(token, now), now))  # the main thread waited all along
        self._done.append((token, now))
        self._take_completed()
        self._publisher.changed()

    def completed(self, token: int) -> None:
        """On any thread (a future's callback): the async collective ``token`` names completed."""
        self._done.append((token, time.perf_counter()))

    def wait_began(self) -> None:
        """The main thread blocks in a wait outside the log's own calls (a p2p, a functional collective).

        Called by ``kernels.watch.wait_clock`` for every timed wait: the span joins the
        step's wait (not the gradient sync's), unioned with the collectives open; nothing
        is published, so a wait costs no state write. Other threads' waits are not this
        rank's steps and are ignored.
        """
        if threading.get_ident() != self._owner:
            return
        self._take_completed()
        self._blocked_from = time.perf_counter()  # the overlap's blocked span (kernels.watch.overlap)
        if self._wait[1] == 0:
            self._wait[2] = self._blocked_from
        self._wait[1] += 1

    def wait_ended(self, seconds: float) -> None:
        """The wait ``wait_began`` opened is over (``seconds`` is the clock's; the span keeps its own)."""
        if threading.get_ident() == self._owner:
            now = time.perf_counter()
            self.spans.blocked.append((self._blocked_from, now))
            self._spans_closed(False, now)

    def act(self, action: str) -> None:
        """The rank is now doing ``action`` (e.g. "forward, step 2, micro-batch 0")."""
        self._take_completed()
        self.action = action
        self._publisher.changed()

    def note_fault(self, text: str) -> None:
        """Publish ``text`` at once: a fault may kill this process next."""
        self.faults.append(text)
        self._publisher.now()

    def begin_step(self, step: int) -> None:
        """Step ``step`` starts: the previous one's waits are closed into a ``StepWait``."""
        self._take_completed()
        now = time.perf_counter()
        self._close_step(now)
        self.step, self.action = step, f"step {step} begins"
        self._reset_step(now)
        self._publisher.changed()

    def step_wait_so_far(self) -> float:
        """Seconds the current step has spent inside collectives until now."""
        self._take_completed()
        return self._wait[0] + (time.perf_counter() - self._wait[2] if self._wait[1] else 0.0)

    def finish(self) -> list[StepWait]:
        """The last step ends; returns every step's ``StepWait``."""
        self._take_completed()
        self._close_step(time.perf_counter())
        self.step, self.action = -1, "done"
        self._publisher.now()  # the driver reads "done" as soon as the call returns
        return list(self._waits)

    def _take_completed(self) -> None:
        while self._done:
            token, at = self._done.popleft()
            entry = self._open.pop(token, None)
            if entry is not None:
                self._spans_closed(entry.phase == "backward", at)
                self.spans.comm.append((self._launched.pop(token), at))

    def close(self) -> None:
        self._publisher.stop()
        self._file.close()

    # -------------------------------------------------------------- accounting
    def _reset_step(self, now: float) -> None:
        # [seconds so far, open count, opened at]; a collective still open from the last step counts on
        open_grad = sum(c.phase == "backward" for c in self._open.values())
        self._step_began, self._entered = now, 0
        self._wait, self._grad = [0.0, len(self._open), now], [0.0, open_grad, now]

    def _spans_opened(self, grad: bool) -> float:
        self._entered += 1
        now = time.perf_counter()
        for span in (self._wait, self._grad) if grad else (self._wait,):
            if span[1] == 0:
                span[2] = now
            span[1] += 1
        return now

    def _spans_closed(self, grad: bool, now: float) -> None:
        for span in (self._wait, self._grad) if grad else (self._wait,):
            span[1] = max(0, span[1] - 1)
            if span[1] == 0:
                span[0] += now - span[2]

    def _close_step(self, now: float) -> None:
        if self.step < 0:
            self.spans = StepSpans()  # setup's spans belong to no step
            return
        wait, grad = (s[0] + (now - s[2] if s[1] else 0.0) for s in (self._wait, self._grad))
        step_s = now - self._step_began
        busy, overlap = self.spans.close(self._step_began, now, list(self._launched.values()))
        self._waits.append(StepWait(self.rank, self.step, step_s, wait, grad, max(0.0, step_s - wait), self._entered,
                                    busy, overlap))

    def _snapshot(self, counter: int) -> dict[str, Any]:
        # RankActivity.to_dict()'s dict, built directly: the record's generic conversion (asdict and a
        # JSON round trip) cost ~0.1 ms a write. May run on the publisher's thread: the dict is copied
        # first, in one step the main thread cannot interleave with.
        opened = sorted(list(self._open.values()), key=lambda c: c.entered)
        return {
            "rank": self.rank, "pid": self._pid, "counter": counter, "step": self.step,
            "action": self.action, "open": [_open_dict(c) for c in opened[:MAX_OPEN]], "updated": time.time(),
            "faults": self.faults[-8:], "more_open": max(0, len(opened) - MAX_OPEN)}


def _open_dict(c: OpenCollective) -> dict[str, Any]:
    """``c.to_dict()``, without the generic conversion."""
    return {"op": c.op, "group": c.group, "ranks": list(c.ranks), "seq": c.seq, "nbytes": c.nbytes,
            "entered": c.entered, "phase": c.phase}


if __name__ == "__main__":
    log = CollectiveLog(rank=0, path=log_path(os.getpid()))
    log.begin_step(0)
    log.act("forward, step 0, micro-batch 0")
    print(log.enter("all_reduce", "dp", (0, 1), 1024), read_state(log_path(os.getpid())))
