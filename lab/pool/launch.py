"""Where engines come from: a private local ipyparallel cluster, or one already running.

Kept apart from the ``Cluster`` handle, as ipyparallel keeps launchers apart from its
client: this module starts, finds and stops processes; it knows nothing of ranks.

A local pool gets its own profile directory (mode 0700, removed on stop), a
controller on loopback and signed messages, and the lab records the PID of every
process it started so that it can later signal exactly those and no others. Each of
those processes also watches this one and ends when it is gone (``lab.pool.lifetime``).

Whatever the source, the driver sends functions with cloudpickle
(``ship_functions_with_globals``), so a function defined in a notebook carries the
globals it reads (variables, imported modules, other notebook functions).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ipyparallel as ipp
import psutil

from lab.pool import launchers, lifetime
from lab.pool.start_failure import start_error

KILL_WAIT_S = 10.0  # how long stop waits for killed processes to be gone (torn down by the kernel)
# The hub completes an engine's registration only at its next heartbeat: at ipyparallel's 3 s period a
# local pool took ~6.6 s to come up, ~3.2 s at 0.5 s. The misses scale with it, so an engine is still
# declared gone after 30 s of silence, as with ipyparallel's defaults.
HEARTBEAT_MS, HEARTBEAT_MISSES = 500, 60
CONTROLLER_ARGS = [f"--HeartMonitor.period={HEARTBEAT_MS}",
                   f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}"]


@dataclass
class EngineSource:
    """A connected client plus what the lab owns of the processes behind it."""

    client: ipp.Client
    ipp_cluster: ipp.Cluster | None  # None when attached through a bare url file
    owned: bool  # True when the lab started the processes and may stop or kill them
    profile_dir: str | None = None  # private profile to delete on stop (owned pools only)
    pids: set[int] = field(default_factory=set)  # every process the lab started
    stopped: bool = False  # set by stop_source: nothing more may be started for this source


def start_local(n: int, *, controller_ip: str = "127.0.0.1", timeout: float = 60.0,
                engine_env: dict[str, str] | None = None, launcher: str = "local") -> EngineSource:
    """Start a controller and ``n`` engines on this machine and connect to them.

    ``engine_env`` is added to each engine's environment (e.g. OMP_NUM_THREADS, which
    must be set before the engine's OpenMP runtime starts, as torchrun does).
    ``launcher`` is "local" or "mpi" (one mpiexec for all engines, see ``lab.pool.launchers``).
    Raises ``PoolStartError`` with what the processes printed when they do not come up.
    """
    profile_dir = tempfile.mkdtemp(prefix="cluster-lab-")  # mkdtemp makes it 0700
    engines, config = launchers.engine_launcher_config(launcher, n, engine_env or {})
    lifetime.watch_driver(config)  # every process started here ends when this one is gone
    cluster = ipp.Cluster(n=n, profile_dir=profile_dir, controller_ip=controller_ip, config=config,
                          engines=engines, log_level=40, shutdown_atexit=False, engine_timeout=timeout,
                          controller_args=CONTROLLER_ARGS)
    try:
        client = cluster.start_and_connect_sync(activate=False)
        client.wait_for_engines(n, timeout=timeout)
    except BaseException as error:
        failure = start_error(error, cluster) if isinstance(error, Exception) else None  # read before the rmtree
        source = EngineSource(None, cluster, True, profile_dir, launched_pids(cluster))  # type: ignore[arg-type]
        stop_source(source)
        if failure is None:
            raise
        raise failure from error
    restrict_security_files(profile_dir)
    ship_functions_with_globals()
    return EngineSource(client, cluster, True, profile_dir, launched_pids(cluster))


def connect_existing(profile: str | None = None, cluster_id: str | None = None, *,
                     url_file: str | None = None, profile_dir: str | None = None,
                     n: int | None = None, timeout: float = 60.0) -> EngineSource:
    """Attach to engines started elsewhere (``ipcluster start`` with any launcher).

    With a cluster file (written by ``ipcluster``), the lab can restart the engines
    through the launcher that started them; with only a ``url_file`` it cannot. The
    lab owns none of these processes, so it never stops or kills them.
    """
    if url_file is not None:
        client = ipp.Client(url_file=url_file, timeout=timeout)
        cluster = None
    else:
        kwargs = {"profile": profile or "default"} if profile_dir is None else {"profile_dir": profile_dir}
        cluster = load_cluster_file(cluster_id or "", kwargs, timeout=timeout)
        client = cluster.connect_client_sync()
    client.wait_for_engines(n or 1, timeout=timeout)
    ship_functions_with_globals()
    return EngineSource(client, cluster, owned=False)


def ship_functions_with_globals() -> None:
    """Make this process's ipyparallel clients pickle what they send with cloudpickle.

    By default ipyparallel sends a function defined in ``__main__`` (a notebook) as bare
    code and runs it on the engine's namespace, so the notebook variables and imports
    it reads are missing there (NameError). cloudpickle ships such functions by value
    with the globals they read; importable functions still go by name. Only the
    sending side changes (ipyparallel's switch is per process): engines unpickle
    cloudpickle's output with plain pickle, so engines the lab merely connects to,
    and new engines after a restart, need no switch, and their results are sent as before.
    """
    ipp.serialize.use_cloudpickle()


def load_cluster_file(cluster_id: str, location: dict[str, str], *, timeout: float) -> ipp.Cluster:
    """Load the cluster file ``ipcluster`` wrote for ``cluster_id`` in a profile.

    ``ipcluster`` rewrites that file in place (truncate, then write) each time an
    engine set starts, so a reader can catch it empty or half written; such a read
    is retried until ``timeout``, as ipyparallel does for its connection files. A
    file that does not exist is an error at once: nothing is starting there.
    """
    path = ipp.Cluster(cluster_id=cluster_id, **location).cluster_file
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ipp.Cluster.from_file(path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no ipcluster cluster file at {path}: start the engines with `ipcluster start` "
                                    f"for this profile and cluster id first") from None
        except json.JSONDecodeError:
            if time.monotonic() > deadline:
                raise ValueError(f"the cluster file {path} stayed unreadable (not JSON) for {timeout:.0f} s") from None
            time.sleep(0.2)


def launched_pids(cluster: ipp.Cluster) -> set[int]:
    """PIDs of the controller and engines this cluster's launchers started, and their children.

    A local engine set holds one launcher per engine; an MPI engine set is one
    ``mpiexec`` whose children (the engines) are found below it.
    """
    roots = []
    if cluster.controller is not None and cluster.controller.pid:
        roots.append(cluster.controller.pid)
    for engine_set in cluster.engines.values():
        per_engine = getattr(engine_set, "launchers", None)
        if per_engine is None:
            roots.append(engine_set.pid)
        else:
            roots.extend(launcher.pid for launcher in per_engine.values())
    roots = [pid for pid in roots if pid and pid > 0]
    pids = set(roots)
    for pid in roots:
        try:
            pids.update(p.pid for p in psutil.Process(pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return pids


def engine_pids(engine_set: object, wait_s: float = 10.0) -> set[int]:
    """PIDs of the engine processes of one engine set just started.

    A local set knows each engine's PID. An MPI set knows only its ``mpiexec``,
    which forks the engines a moment later: they are looked for among its children
    (by their ``ipyparallel.engine`` command line) for up to ``wait_s``.
    """
    per_engine = getattr(engine_set, "launchers", None)
    if per_engine is not None:
        return {launcher.pid for launcher in per_engine.values() if launcher.pid}
    deadline = time.monotonic() + wait_s
    while True:
        try:
            found = {p.pid for p in psutil.Process(engine_set.pid).children(recursive=True)
                     if "ipyparallel.engine" in p.cmdline()}  # not its nanny, "ipyparallel.engine.nanny"
        except psutil.Error:  # mpiexec gone, or a child exited while being read
            found = set()
        if len(found) >= engine_set.n or not is_alive(engine_set.pid) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def restrict_security_files(profile_dir: str) -> None:
    """Make every file in the profile's security folder readable by its owner only."""
    security = Path(profile_dir) / "security"
    for path in security.glob("*"):
        path.chmod(stat.S_IRUSR | stat.S_IWUSR)


def is_alive(pid: int) -> bool:
    """True while the process runs (a zombie, killed but not yet reaped, counts as dead)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def resident_bytes(pid: int) -> int | None:
    """Resident memory of a process, or None if it is gone."""
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.NoSuchProcess:
        return None


def signal_pids(pids: set[int], owned: set[int], sig: int) -> None:
    """Send ``sig`` to each pid, refusing any the lab did not start."""
    foreign = pids - owned
    if foreign:
        raise PermissionError(f"refusing to signal processes the lab did not start: {sorted(foreign)}")
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def stop_source(source: EngineSource, wait_s: float = 1.0) -> list[int]:
    """Stop what the lab started and return the PIDs that had to be killed.

    Every started process (controller, engines, nannies, spares) is sent SIGTERM at
    once, rather than ipyparallel stopping them one launcher after another; any
    still alive after ``wait_s`` (an engine blocked inside a collective) is killed.
    The whole stop fits well inside jupyter-server's wait for a kernel to shut down.
    Attached (not owned) pools only lose their client connection.
    """
    source.stopped = True
    if source.client is not None:
        source.client.close()
    if not source.owned:
        return []
    if source.ipp_cluster is not None:
        source.pids |= launched_pids(source.ipp_cluster)
    signal_pids({p for p in source.pids if is_alive(p)}, source.pids, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(is_alive(p) for p in source.pids):
        time.sleep(0.05)
    killed = [p for p in source.pids if is_alive(p)]
    signal_pids(set(killed), source.pids, signal.SIGKILL)
    # A killed process lives on until the kernel has torn it down (longer for a big one,
    # on a loaded machine): stop returns only once none of them runs.
    deadline = time.monotonic() + KILL_WAIT_S
    while killed and time.monotonic() < deadline and any(is_alive(p) for p in killed):
        _reap(set(killed))
        time.sleep(0.02)
    _reap(source.pids)
    if source.profile_dir:
        shutil.rmtree(source.profile_dir, ignore_errors=True)
    return killed


def _reap(pids: set[int]) -> None:
    """Collect the exit status of those that are this process's children, so none stays a zombie."""
    me = os.getpid()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.ppid() == me:
                proc.wait(timeout=2)
        except (psutil.NoSuchProcess, psutil.TimeoutExpired, ChildProcessError):
            pass
