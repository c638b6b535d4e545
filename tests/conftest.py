"""Shared fixtures: 4- and 8-rank CPU pools that are always stopped, whatever the test did."""
from __future__ import annotations

import warnings

import pytest
import torch

import lab


def start_pool(n: int = 4, timeout: float = 60) -> lab.Cluster:
    """A local gloo pool with short timeouts, quiet about oversubscribing the CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.OversubscribedWarning)
        return lab.start(n=n, backend="gloo", timeout=timeout, collective_timeout=60, activate=False)


@pytest.fixture
def one_thread():
    """Two cores are shared with the ranks and other jobs: one-process work runs on one thread, like each rank."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def cluster():
    pool = start_pool(4)
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="module")
def cluster8():
    """Eight ranks for 3D (pp, dp, tp) layouts; started only by the tests that ask for it."""
    pool = start_pool(8, timeout=180)  # eight engines import torch on two shared cores
    try:
        yield pool
    finally:
        pool.stop()


@pytest.fixture(scope="session", autouse=True)
def no_engine_outlives_the_tests():
    """Fail the run if any ipyparallel process started under the tests is still alive at the end."""
    import psutil

    yield
    me = psutil.Process()
    leftovers = [p for p in me.children(recursive=True)
                 if "ipyparallel" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, f"processes left behind: {[(p.pid, p.cmdline()) for p in leftovers]}"
