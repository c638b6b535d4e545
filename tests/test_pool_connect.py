"""Engines started by ``ipcluster`` (any launcher) become ranks; the lab never stops them."""
from __future__ import annotations

import subprocess
import sys
import time
import warnings

import pytest

import lab
from lab import launch


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
