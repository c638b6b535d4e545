"""A rank's published state: one JSON snapshot in a small memory-mapped file, readable at any time.

The writer keeps a sequence lock in the file's header: the counter is odd while it writes
and even once the snapshot is whole, so a reader (the driver, a beacon thread) retries
while the counter is odd or changed under it and never parses a cut snapshot.

``StatePublisher`` writes on a background thread instead of at every change. A training
step changes a rank's state a dozen times or more (each collective's entry and exit, each
forward and backward), and encoding and writing each snapshot on the rank's main thread
was most of what watching cost a step on shared cores. The thread writes the newest
snapshot at most every ``every_s``; it runs while the main thread is blocked in a
collective, because the backends release the GIL while they wait, so a blocked rank's
file still names what it is blocked in, at most ``every_s`` late.

Torch-free (the driver reads these files).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import mmap
import os
import struct
import tempfile
import threading
import time
from typing import Any, Callable

from kernels.contract.watch_records import RankActivity

SIZE = 1 << 16  # bytes of one rank's file: a snapshot is well under a kilobyte, open collectives included
HEADER = struct.Struct("<QI")  # sequence counter (odd while writing), JSON length
PUBLISH_EVERY_S = 0.1  # how late a training rank's file may be; a hang report waits seconds, not milliseconds


def log_path(pid: int, directory: str | None = None) -> str:
    """The file process ``pid`` publishes its state to (default directory: this process's profile dir)."""
    directory = directory or os.environ.get("IPP_PROFILE_DIR") or tempfile.gettempdir()
    return os.path.join(directory, f"cluster-lab-collectives-{pid}.bin")


_TO_REMOVE: set[str] = set()


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.remove(path)


class StateFile:
    """A fixed-size memory-mapped file holding one JSON snapshot behind a sequence lock.

    Writes from several threads (a publisher's and the main thread's urgent ones) take a lock,
    so the counter and the bytes never interleave.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self._lock = threading.Lock()
        self._counter = HEADER.unpack_from(self._map, 0)[0] & ~1  # keep counting where the file was
        if path not in _TO_REMOVE:  # it outlives each run (the driver reads "done"), not the process
            _TO_REMOVE.add(path)
            atexit.register(_remove, path)

    def write(self, snapshot: Callable[[int], dict[str, Any]]) -> int:
        """Publish ``snapshot(counter)``, the state as of the new (even) counter it is given; returns that counter."""
        with self._lock:
            body = json.dumps(snapshot(self._counter + 2), separators=(",", ":")).encode()
            if len(body) > SIZE - HEADER.size:  # never a cut snapshot: readers would get broken JSON
                raise ValueError(f"a rank state of {len(body)} bytes does not fit {SIZE - HEADER.size}")
            self._counter += 1
            HEADER.pack_into(self._map, 0, self._counter, 0)  # odd: readers wait
            self._map[HEADER.size:HEADER.size + len(body)] = body
            self._counter += 1
            HEADER.pack_into(self._map, 0, self._counter, len(body))
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
        counter, length = HEADER.unpack_from(data, 0)
        if counter and not counter & 1:
            body = data[HEADER.size:HEADER.size + length]
            with open(path, "rb") as f:
                again = f.read(HEADER.size)
            if HEADER.unpack_from(again, 0)[0] == counter:
                try:
                    return RankActivity.from_dict(json.loads(body))
                except ValueError:  # another writer's format (an older lab): no state to trust
                    return None
        time.sleep(0.001)
        with open(path, "rb") as f:
            data = f.read(SIZE)
    return None


class StatePublisher:
    """Writes ``snapshot`` to ``file`` whenever it was marked changed, from a thread of its own (module docstring).

    ``changed()`` is all a change costs the caller; ``now()`` writes at once on the calling
    thread, for what must not wait (a fault about to kill the process, the end of a run).
    """

    def __init__(self, file: StateFile, snapshot: Callable[[int], dict[str, Any]], every_s: float | None) -> None:
        """``every_s=None``: no thread, every change is written at once (a log read back right away, as in tests)."""
        self._file, self._snapshot, self._every = file, snapshot, every_s
        self._dirty = False
        self._stop = threading.Event()
        self._thread = None
        if every_s is not None:
            self._thread = threading.Thread(target=self._loop, name="cluster-lab-state-publisher", daemon=True)
            self._thread.start()

    def changed(self) -> None:
        if self._thread is None:
            self.now()
        else:
            self._dirty = True

    def now(self) -> None:
        """Write the state on this thread, before returning."""
        self._dirty = False
        self._file.write(self._snapshot)

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            if self._dirty:
                self.now()

    def stop(self) -> None:
        """Write what is pending and end the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._dirty:
            self.now()
