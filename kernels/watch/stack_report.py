"""Where a rank is: its Python stack on demand, and the frames of its last failure.

While a rank runs a call, the driver cannot ask it anything through ipyparallel (the
engine's main thread is busy), and a rank blocked inside a collective does not even run
Python signal handlers. ``faulthandler`` writes every thread's stack from a C signal
handler, so a rank armed with :func:`arm` answers ``DUMP_SIGNAL`` at once, wherever it
is blocked, into a file of its own (:func:`dump_path`). The driver sends that signal to
the ranks still running when a call's timeout passes and reads where each one was: in
a collective, waiting for a peer, or somewhere else, keeping its peers waiting.

:func:`record_failure` keeps the frames of the exception a call raised (file, line,
function), so the driver can show the user's own frame with source lines it has itself,
such as those of a notebook cell, which the engine never saw.

Torch-free. Run alone (arms this process, signals it, prints the main thread's frames)::

    python -m kernels.watch.stack_report
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import re
import signal
import tempfile
import threading
import traceback

DUMP_SIGNAL = signal.SIGUSR1

Frame = tuple[str, int, str]  # (file name, line number, function name)
# A frame's code beyond its name: a serializer may rename the file (cloudpickle >= 3.1.3 sends
# "<dynamic-code>"), and these tell apart two functions of one name whose lines overlap.
CodeId = tuple[str, int]  # (qualified name, first line)

_dump_file = None  # kept open: faulthandler writes to its descriptor from the signal handler
_last_failure: dict = {}  # the exception type name and frames of the current call's failure
_HEADER = "main thread 0x{:016x}\n"
_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')


def dump_dir() -> str:
    """Where this process writes its dump: its ipyparallel profile (a lab pool's private one, removed on stop)."""
    return os.environ.get("IPP_PROFILE_DIR") or tempfile.gettempdir()


def dump_path(pid: int, directory: str | None = None) -> str:
    """The file process ``pid`` writes its stacks to, in ``directory`` (default: this process's :func:`dump_dir`)."""
    return os.path.join(directory or dump_dir(), f"cluster-lab-stack-{pid}.txt")


def arm() -> str:
    """Make ``DUMP_SIGNAL`` append every thread's stack to :func:`dump_path`; returns the path.

    Idempotent. Until a process is armed, ``DUMP_SIGNAL`` would terminate it, so the
    driver arms every engine before it can become a rank.
    """
    global _dump_file
    path = dump_path(os.getpid())
    if _dump_file is None:
        _dump_file = open(path, "w")  # noqa: SIM115 - lives as long as the process
        _dump_file.write(_HEADER.format(threading.main_thread().ident))
        _dump_file.flush()
        faulthandler.register(DUMP_SIGNAL, file=_dump_file, all_threads=True, chain=False)
        atexit.register(remove_dump, os.getpid())
    return path


def remove_dump(pid: int, directory: str | None = None) -> None:
    """Delete the dump file of process ``pid``, if there is one."""
    try:
        os.remove(dump_path(pid, directory))
    except OSError:
        pass


def main_thread_frames(text: str) -> list[Frame] | None:
    """The main thread's frames in the last dump of a dump file's text, outermost first; None if none."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith("main thread 0x"):
        return None
    ident = lines[0].split()[-1]
    starts = [i for i, line in enumerate(lines) if line.endswith("(most recent call first):")
              and line.split(" (most")[0].split()[-1] == ident]
    if not starts:
        return None
    frames = []
    for line in lines[starts[-1] + 1:]:
        match = _FRAME.match(line)
        if match is None:
            break
        frames.append((match[1], int(match[2]), match[3]))
    return frames[::-1]


def read_dump(pid: int | None = None, directory: str | None = None) -> list[Frame] | None:
    """Parse the dump file of process ``pid`` (default: this process) in ``directory``."""
    try:
        with open(dump_path(os.getpid() if pid is None else pid, directory)) as f:
            return main_thread_frames(f.read())
    except OSError:
        return None


def forget_failure() -> None:
    """Called as a call starts, so :func:`last_failure` never reports an earlier call."""
    _last_failure.clear()


def record_failure(error: BaseException, skip: int = 1) -> None:
    """Keep ``error``'s type name, frames and their code ids, outermost first, less the ``skip`` outermost
    (the guard's)."""
    steps = list(traceback.walk_tb(error.__traceback__))[skip:]
    frames = [(frame.f_code.co_filename, lineno or 0, frame.f_code.co_name) for frame, lineno in steps]
    codes = [(getattr(frame.f_code, "co_qualname", frame.f_code.co_name), frame.f_code.co_firstlineno)
             for frame, _ in steps]
    _last_failure.update(ename=type(error).__name__, frames=frames, codes=codes)


def last_failure() -> dict:
    """``{"ename": ..., "frames": [...], "codes": [...]}`` of the current call's failure, or ``{}`` if none."""
    return dict(_last_failure)


if __name__ == "__main__":
    arm()
    os.kill(os.getpid(), DUMP_SIGNAL)
    for name, line, function in read_dump() or []:
        print(f"{name}:{line} in {function}")
    remove_dump(os.getpid())
