"""``hosts(k, ranks_per_host)``: a pool spread over k simulated hosts on this machine (needs root).

Each host is a network namespace plus a UTS namespace (``lab.testing.netns``): its own
host name (``host0``, ``host1`` ...), its own address on a bridge, and its own ``lo``.
The controller listens on the bridge address only; each host's engines are started
inside its namespaces with the controller's engine connection file
(``ip netns exec NS unshare --uts -- sh -c 'hostname NAME; exec python -m ipyparallel.engine ...'``),
so they register over the bridge as engines of another machine would. The lab's usual
``Cluster`` then numbers them host by host and forms the world on the hosts' addresses,
as it does for real hosts: gloo listens on each host's ``eth0``, ranks of one host talk
over its ``lo``, and only traffic between hosts crosses the (optionally capped) link.

Limits: spare engines and ``cluster.restart()`` would start engines in the root
namespace (ipyparallel's launcher knows nothing of the hosts), so the pool has no
spares; a failure is still reported and the world rebuilt on the surviving engines.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator

import ipyparallel as ipp

from lab.pool import launch
from lab.pool.cluster import Cluster
from lab.testing.link_check import measure_gbit
from lab.testing.netns import Network, new_network

CHECK_MEGABYTES_PER_GBIT = 40  # the cap check sends ~0.3 s worth of data at the capped rate


class ShapingError(RuntimeError):
    """The measured link speed does not honour the cap that was set."""


@contextlib.contextmanager
def hosts(k: int, ranks_per_host: int, link_gbit: float | None = None, *, timeout: float = 120.0,
          collective_timeout: float = 300.0) -> Iterator[Cluster]:
    """A ``Cluster`` of ``k`` simulated hosts with ``ranks_per_host`` ranks each; removed on exit, also after an error.

    ``link_gbit`` caps every host's traffic to the other hosts (``tc`` HTB, else TBF) and
    the cap is checked by a measured TCP transfer between two hosts. The yielded cluster's
    ``network`` says what was built: host names and addresses, ``shaping`` ("htb", "tbf",
    or None when no cap was asked or none could be set; ``shaping_problem`` says why) and
    ``measured_gbit`` (the checked transfer), and gives per-host byte counters
    (``sent_bytes()``). Needs root (PermissionError otherwise).
    """
    if k < 1 or ranks_per_host < 1:
        raise ValueError(f"hosts needs k >= 1 hosts and ranks_per_host >= 1, got k={k}, ranks_per_host={ranks_per_host}")
    if link_gbit is not None and link_gbit <= 0:
        raise ValueError(f"link_gbit must be a positive number of Gbit/s, got {link_gbit}")
    network = new_network()  # raises PermissionError when not root, before anything is made
    engines: list[subprocess.Popen] = []
    source: launch.EngineSource | None = None
    cluster: Cluster | None = None
    try:
        network.build(k)
        if link_gbit is not None:
            _cap_and_check(network, link_gbit)
        else:
            network.count_only()
        source = _start_controller(network)
        _start_engines(network, source, ranks_per_host, engines, timeout)
        source.pids |= {p.pid for p in engines}
        cluster = Cluster(source, backend="gloo", timeout=timeout, collective_timeout=collective_timeout,
                          spare_engines=0)
        cluster.network = network
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        elif source is not None:
            launch.stop_source(source)
        _kill(engines)
        left = network.remove()
        if left and sys.exc_info()[0] is None:  # an error already on its way is the one to report
            raise RuntimeError(f"simulated hosts left behind: {', '.join(left)}")
        if left:
            warnings.warn(f"simulated hosts left behind: {', '.join(left)}", RuntimeWarning, stacklevel=3)


def _cap_and_check(network: Network, gbit: float) -> None:
    network.link_gbit = gbit
    network.cap(gbit)
    if network.shaping is None or len(network.hosts) < 2:
        return
    mb = max(4, int(CHECK_MEGABYTES_PER_GBIT * gbit))
    network.measured_gbit = measure_gbit(network.hosts[0], network.hosts[1], network.addresses[1], mb)
    if network.measured_gbit > 1.2 * gbit:
        raise ShapingError(f"the link was capped at {gbit} Gbit/s with {network.shaping}, but a {mb} MiB transfer "
                           f"between two hosts ran at {network.measured_gbit:.2f} Gbit/s")


def _start_controller(network: Network) -> launch.EngineSource:
    profile_dir = tempfile.mkdtemp(prefix="cluster-lab-hosts-")  # 0700
    cluster = ipp.Cluster(n=0, profile_dir=profile_dir, controller_ip=network.bridge_address, log_level=40,
                          shutdown_atexit=False, controller_args=launch.CONTROLLER_ARGS)
    source = launch.EngineSource(None, cluster, True, profile_dir)  # type: ignore[arg-type]
    try:
        cluster.start_controller_sync()
        source.pids |= launch.launched_pids(cluster)
        source.client = cluster.connect_client_sync()
    except BaseException:
        launch.stop_source(source)
        raise
    launch.restrict_security_files(profile_dir)
    launch.ship_functions_with_globals()
    return source


def _engine_file(source: launch.EngineSource) -> str:
    cluster = source.ipp_cluster
    return str(Path(cluster.profile_dir) / "security" / f"ipcontroller-{cluster.cluster_id}-engine.json")


def _start_engines(network: Network, source: launch.EngineSource, per_host: int, started: list[subprocess.Popen],
                   timeout: float) -> None:
    """Start each host's engines into ``started``; a host's engines register before the next host's start.

    The rank map numbers hosts by their lowest engine id, so registering host by host is
    what makes ``host0`` hold rank 0 (engines started all at once register in any order).
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per rank, as lab.start does
    conn = _engine_file(source)
    for i, ns in enumerate(network.hosts):
        for _ in range(per_host):
            log = open(Path(source.profile_dir) / f"engine-{i}-{len(started)}.log", "wb")  # type: ignore[arg-type]
            # ip netns exec, unshare and sh's exec all exec in place: the Popen pid is the engine's.
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                   network.hostnames[i], sys.executable, "-m", "ipyparallel.engine", f"--file={conn}", "--log-level=40"]
            started.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL))
            log.close()
        _wait_for_engines(source, started, len(started), timeout)


def _wait_for_engines(source: launch.EngineSource, engines: list[subprocess.Popen], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(source.client.ids) < n:
        dead = [p for p in engines if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            logs = sorted(Path(source.profile_dir).glob("engine-*.log"))  # type: ignore[arg-type]
            tail = "\n".join(f"{p.name}: {p.read_text(errors='replace')[-400:]}" for p in logs)
            raise RuntimeError(f"{len(source.client.ids)} of {n} engines registered "
                               f"({len(dead)} exited, {timeout:g} s limit); engine logs:\n{tail}")
        time.sleep(0.1)


def _kill(engines: list[subprocess.Popen]) -> None:
    for p in engines:  # only the processes started here, by their PID
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
    for p in engines:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=5)
