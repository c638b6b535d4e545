"""Run ``ipcluster start --engines=...`` as a user would, in a private profile, and prove afterwards
that ``ipcluster stop`` left no process (and, for batch launchers, no job) behind."""
from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator

import psutil

import lab
from tests.launcher_checks import alive

CLUSTER_ID = "labtest"


def ipcluster_command(action: str, profile_dir: str) -> list[str]:
    """The ``ipcluster <action>`` command line for the test profile."""
    return [sys.executable, "-m", "ipyparallel.cluster", action, "--profile-dir", profile_dir,
            "--cluster-id", CLUSTER_ID]


@contextlib.contextmanager
def ipcluster(tmp_path: Path, engines: str, n: int, config: str = "") -> Iterator[str]:
    """``ipcluster start --engines=<engines> --n <n>`` with ``config`` as its ipcluster_config.py.

    Yields the profile dir; on exit runs ``ipcluster stop`` and waits (60 s at most) until
    the server, everything under it and every engine that registered is gone.
    """
    profile_dir = tmp_path / "profile"
    profile_dir.mkdir()
    (profile_dir / "ipcluster_config.py").write_text(config)
    server = subprocess.Popen([*ipcluster_command("start", str(profile_dir)), f"--engines={engines}",
                               "--n", str(n), "--ip", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = {server.pid}
    try:
        yield str(profile_dir)
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            started |= {p.pid for p in psutil.Process(server.pid).children(recursive=True)}
        subprocess.run(ipcluster_command("stop", str(profile_dir)), capture_output=True, timeout=120)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()  # ours, by PID
            server.wait()
            raise
        wait_gone(started | ENGINE_PIDS.pop(str(profile_dir), set()), 60)


ENGINE_PIDS: dict[str, set[int]] = {}  # profile dir -> engine PIDs seen by connect_when_ready


def wait_gone(pids: set[int], timeout: float) -> None:
    """Wait until none of ``pids`` runs; fail naming those that still do."""
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = alive(pids)
    assert not left, f"processes left after ipcluster stop: {[(p, psutil.Process(p).cmdline()) for p in left]}"


def engines_and_their_children(pids: set[int]) -> set[int]:
    """The engines and what they started (each engine's nanny), all on this machine."""
    found = set(pids)
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            found |= {p.pid for p in psutil.Process(pid).children(recursive=True)}
    return found


def connect_when_ready(profile_dir: str, n: int, timeout: float) -> lab.Cluster:
    """``lab.connect`` to the test profile once ipcluster has written its cluster file."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", lab.OversubscribedWarning)
                pool = lab.connect(profile_dir=profile_dir, cluster_id=CLUSTER_ID, n=n, timeout=timeout,
                                   activate=False)
            ENGINE_PIDS[profile_dir] = engines_and_their_children({r.pid for r in pool.rank_map.ranks})
            return pool
        except (FileNotFoundError, OSError):  # the cluster file is not written yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
