"""Engines started by ``ipcluster`` (any launcher) become ranks; the lab never stops them."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import ipyparallel as ipp
import pytest

import lab
from lab.pool import launch


def rank_sum() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


@pytest.fixture
def ipcluster(tmp_path):
    """Two engines started by ipcluster's local launcher, stopped by ipcluster itself."""
    profile_dir = str(tmp_path / "profile")
    command = [sys.executable, "-m", "ipyparallel.cluster", "--profile-dir", profile_dir, "--cluster-id", "labtest"]
    server = subprocess.Popen([*command[:3], "start", *command[3:], "--n", "2", "--ip", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield profile_dir, "labtest"
    finally:
        subprocess.run([*command[:3], "stop", *command[3:]], capture_output=True, timeout=60)
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow  # an ipcluster of its own (about 9 s quiet); the fast tier keeps the url-file connect
def test_connect_makes_ipcluster_engines_ranks_and_stop_leaves_them_running(ipcluster):
    profile_dir, cluster_id = ipcluster
    deadline = time.monotonic() + 60
    pool = None
    while pool is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", lab.OversubscribedWarning)
                pool = lab.connect(profile_dir=profile_dir, cluster_id=cluster_id, n=2, timeout=60, activate=False)
        except (FileNotFoundError, OSError):  # ipcluster has not written its cluster file yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    engine_pids = [r.pid for r in pool.rank_map.ranks]
    assert pool.world_size == 2 and pool.pids == set()  # the lab owns none of these processes
    assert pool.run(rank_sum) == [1.0, 1.0]
    pool.stop()
    assert all(launch.is_alive(p) for p in engine_pids)


def test_cluster_file_caught_mid_write_is_read_once_ipcluster_finishes_it(tmp_path):
    location = {"profile_dir": str(tmp_path)}
    written = ipp.Cluster(cluster_id="half", n=3, **location)
    Path(written.cluster_file).parent.mkdir(parents=True, exist_ok=True)
    Path(written.cluster_file).write_text("")  # ipcluster truncates before it writes
    finish = threading.Timer(0.5, lambda: Path(written.cluster_file).write_text(json.dumps(written.to_dict())))
    finish.start()
    try:
        loaded = launch.load_cluster_file("half", location, timeout=10)
    finally:
        finish.cancel()
    assert loaded.cluster_id == "half" and loaded.n == 3


def test_cluster_file_errors_name_the_file(tmp_path):
    location = {"profile_dir": str(tmp_path)}
    with pytest.raises(FileNotFoundError, match="no ipcluster cluster file at .*cluster-absent.json"):
        launch.load_cluster_file("absent", location, timeout=10)
    broken = Path(ipp.Cluster(cluster_id="broken", **location).cluster_file)
    broken.parent.mkdir(parents=True, exist_ok=True)
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="cluster-broken.json stayed unreadable"):
        launch.load_cluster_file("broken", location, timeout=0.5)
