"""Where a rank is, readable while it is blocked: the last collective it entered or left, kept in a file.

A rank blocked inside a gloo collective cannot answer an ipyparallel call, and Python
signal handlers do not run while it waits in C++. So the rank publishes its state at
every collective entry and exit, and at every traced action (forward, backward,
optimizer), into a small memory-mapped file of its own in the pool's profile directory
(:func:`log_path`); the driver reads it whenever it likes, even from a rank that will
never return. NCCL has its own flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``); this
is the lab's equivalent for gloo, and for any backend what the ranks traced.

The file holds one JSON snapshot (``RankActivity``) behind a sequence lock: the writer
makes the counter odd, writes, makes it even; a reader retries while the counter is odd
or changed under it. ``CollectiveLog`` also sums, per step, the time the rank spent
inside collectives (the union of their intervals, so overlapping ones count once) and
inside those it entered during backward (the gradient all-reduce or reduce-scatter),
and returns them as ``StepWait`` records: what a dashboard sets against compute. The same
stamps, with the rank watch's forward and backward windows, give each step's overlap of
communication with compute (``kernels.watch.overlap``).

Torch-free (the driver and the views import it). Run alone (writes, then reads back a state)::

    python -m kernels.watch.collective_log
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import json
import mmap
import os
import struct
import tempfile
import threading
import time
from typing import Any

from kernels.contract.watch_records import OpenCollective, RankActivity, StepWait
from kernels.watch.overlap import StepSpans

SIZE = 1 << 16  # bytes of one rank's file: a snapshot is well under a kilobyte, open collectives included
MAX_OPEN = 8  # oldest open collectives kept in a snapshot (the one a rank is stuck behind is the oldest)
_HEADER = struct.Struct("<QI")  # sequence counter (odd while writing), JSON length
BEACON_KEY = "watch"  # the data key under which a rank's beacon sends its state (kernels.watch.flight_recorder)


def log_path(pid: int, directory: str | None = None) -> str:
    """The file process ``pid`` publishes its state to (default directory: this process's profile dir)."""
    directory = directory or os.environ.get("IPP_PROFILE_DIR") or tempfile.gettempdir()
    return os.path.join(directory, f"cluster-lab-collectives-{pid}.bin")


_TO_REMOVE: set[str] = set()


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


class StateFile:
    """A fixed-size memory-mapped file holding one JSON snapshot behind a sequence lock."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._counter = _HEADER.unpack_from(self._map, 0)[0] & ~1  # keep counting where the file was
        if path not in _TO_REMOVE:  # it outlives each run (the driver reads "done"), not the process
            _TO_REMOVE.add(path)
            atexit.register(_remove, path)

    def write(self, state: dict[str, Any]) -> int:
        """Publish ``state``; returns the new (even) counter."""
        body = json.dumps(state, separators=(",", ":")).encode()
        if len(body) > SIZE - _HEADER.size:  # never a cut snapshot: readers would get broken JSON
            raise ValueError(f"a rank state of {len(body)} bytes does not fit {SIZE - _HEADER.size}")
        self._counter += 1
        _HEADER.pack_into(self._map, 0, self._counter, 0)  # odd: readers wait
        self._map[_HEADER.size:_HEADER.size + len(body)] = body
        self._counter += 1
        _HEADER.pack_into(self._map, 0, self._counter, len(body))
        return self._counter

    @property
    def counter(self) -> int:
        return self._counter

    def close(self) -> None:
        self._map.close()


def read_state(path: str, tries: int = 50) -> RankActivity | None:
    """The snapshot in ``path``, or None if there is none (no file, never written, or always mid-write)."""
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
    except OSError:
        return None
    for _ in range(tries):
        counter, length = _HEADER.unpack_from(data, 0)
        if counter and not counter & 1:
            body = data[_HEADER.size:_HEADER.size + length]
            with open(path, "rb") as f:
                again = f.read(_HEADER.size)
            if _HEADER.unpack_from(again, 0)[0] == counter:
                try:
                    return RankActivity.from_dict(json.loads(body))
                except ValueError:  # another writer's format (an older lab): no state to trust
                    return None
        time.sleep(0.001)
        with open(path, "rb") as f:
            data = f.read(SIZE)
    return None


class CollectiveLog:
    """This rank's state and per-step waits; every change is published to its ``StateFile``.

    Only the rank's main thread changes the state. An async collective completes on the
    backend's thread, which only appends to ``_done`` (a deque: no lock, no file I/O on a
    thread that the backend's own shutdown joins); the main thread takes those in at its
    next call, with the time they completed.
    """

    def __init__(self, rank: int, path: str | None = None) -> None:
        self.rank, self._pid = rank, os.getpid()
        self._done: collections.deque[tuple[int, float]] = collections.deque()
        self._file = StateFile(path or log_path(os.getpid()))
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
        self._publish()

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
        self._publish()
        return token

    def leave(self, token: int) -> None:
        """On the main thread: the collective ``token`` names returned (or failed)."""
        now = time.perf_counter()
        self.spans.blocked.append((self._launched.get(token, now), now))  # the main thread waited all along
        self._done.append((token, now))
        self._take_completed()
        self._publish()

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
        self._publish()

    def note_fault(self, text: str) -> None:
        self.faults.append(text)
        self._publish()

    def begin_step(self, step: int) -> None:
        """Step ``step`` starts: the previous one's waits are closed into a ``StepWait``."""
        self._take_completed()
        now = time.perf_counter()
        self._close_step(now)
        self.step, self.action = step, f"step {step} begins"
        self._reset_step(now)
        self._publish()

    def step_wait_so_far(self) -> float:
        """Seconds the current step has spent inside collectives until now."""
        self._take_completed()
        return self._wait[0] + (time.perf_counter() - self._wait[2] if self._wait[1] else 0.0)

    def finish(self) -> list[StepWait]:
        """The last step ends; returns every step's ``StepWait``."""
        self._take_completed()
        self._close_step(time.perf_counter())
        self.step, self.action = -1, "done"
        self._publish()
        return list(self._waits)

    def _take_completed(self) -> None:
        while self._done:
            token, at = self._done.popleft()
            entry = self._open.pop(token, None)
            if entry is not None:
                self._spans_closed(entry.phase == "backward", at)
                self.spans.comm.append((self._launched.pop(token), at))

    def close(self) -> None:
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

    def _publish(self) -> None:
        # RankActivity.to_dict()'s dict, built directly: this runs twice per collective, and the record's
        # generic conversion (asdict and a JSON round trip) cost ~0.1 ms of every collective's latency.
        opened = sorted(self._open.values(), key=lambda c: c.entered)
        self._file.write({
            "rank": self.rank, "pid": self._pid, "counter": self._file.counter + 2, "step": self.step,
            "action": self.action, "open": [_open_dict(c) for c in opened[:MAX_OPEN]], "updated": time.time(),
            "faults": self.faults[-8:], "more_open": max(0, len(opened) - MAX_OPEN)})


def _open_dict(c: OpenCollective) -> dict[str, Any]:
    """``c.to_dict()``, without the generic conversion."""
    return {"op": c.op, "group": c.group, "ranks": list(c.ranks), "seq": c.seq, "nbytes": c.nbytes,
            "entered": c.entered, "phase": c.phase}


if __name__ == "__main__":
    log = CollectiveLog(rank=0, path=log_path(os.getpid()))
    log.begin_step(0)
    log.act("forward, step 0, micro-batch 0")
    print(log.enter("all_reduce", "dp", (0, 1), 1024), read_state(log_path(os.getpid())))
