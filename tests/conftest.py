"""Shared fixtures: one 4-rank and one 8-rank CPU pool for the whole session, healed between tests, always stopped.

Starting a pool costs 8-20 s on two cores, so every module that asks for ``cluster`` (or ``cluster8``) gets
the same pool. A test may kill, interrupt or restart the shared pool's engines as long as it leaves the
world usable; when it does not (or when it fails half way), the pool is restarted before the next test.
A test that needs to stop a pool starts its own with :func:`start_pool`.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import lab
from lab.pool import launch

PROBE_TIMEOUT_S = 30  # the probe all_reduce of one number takes well under a second, even on two loaded cores


def start_pool(n: int = 4, timeout: float = 60) -> lab.Cluster:
    """A local gloo pool with short timeouts, quiet about oversubscribing the CPU."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.OversubscribedWarning)
        return lab.start(n=n, backend="gloo", timeout=timeout, collective_timeout=60, activate=False)


def _world_sum() -> float:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def pool_is_healthy(pool: lab.Cluster, *, probe: bool) -> bool:
    """No rank known dead and every engine process alive; with ``probe``, an all_reduce also answers."""
    if pool._stopped or pool._dead or not all(launch.is_alive(r.pid) for r in pool.rank_map.ranks):
        return False
    if not probe:
        return True
    try:
        return pool.run(_world_sum, timeout=PROBE_TIMEOUT_S) == [float(pool.world_size)] * pool.world_size
    except Exception:  # any failure of the probe means the world needs rebuilding
        return False


class SharedPools:
    """The session's pools by rank count: started on first use, restarted when a test leaves one broken."""

    def __init__(self) -> None:
        self._pools: dict[int, lab.Cluster] = {}

    def get(self, n: int) -> lab.Cluster:
        """The shared n-rank pool, started now if no test asked for it yet (or a test stopped it)."""
        pool = self._pools.get(n)
        if pool is None or pool._stopped:
            pool = self._pools[n] = start_pool(n, timeout=60 if n <= 4 else 180)  # 8 engines import torch slowly
        return pool

    def heal(self, pool: lab.Cluster, *, probe: bool) -> None:
        """Restart ``pool`` in place (same object, fresh engines) unless it is healthy."""
        if pool._stopped or pool_is_healthy(pool, probe=probe):
            return
        pool.restart()

    def stop_all(self) -> None:
        """Stop every shared pool (each stop is checked by PID inside the lab)."""
        for pool in self._pools.values():
            pool.stop()
        self._pools.clear()


@pytest.fixture(scope="session", autouse=True)
def no_engine_outlives_the_tests():
    """Fail the run if any ipyparallel process started under the tests is still alive at the end."""
    import psutil

    yield
    me = psutil.Process()
    leftovers = [p for p in me.children(recursive=True)
                 if "ipyparallel" in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]
    assert not leftovers, f"processes left behind: {[(p.pid, p.cmdline()) for p in leftovers]}"


@pytest.fixture(scope="session")
def shared_pools(no_engine_outlives_the_tests):
    """Depends on the leftover check so that the pools are stopped before it looks."""
    pools = SharedPools()
    try:
        yield pools
    finally:
        pools.stop_all()


@pytest.fixture(scope="module")
def cluster(shared_pools):
    """The session's 4-rank pool (module-scoped so that module-scoped fixtures can run on it)."""
    return shared_pools.get(4)


@pytest.fixture(scope="module")
def cluster8(shared_pools):
    """The session's 8-rank pool for 3D (pp, dp, tp) layouts; started only if a selected test asks for it."""
    return shared_pools.get(8)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Remember whether a test failed, so the pool check after it also probes the world."""
    outcome = yield
    if outcome.get_result().failed:
        item.failed_a_phase = True


@pytest.fixture(autouse=True)
def shared_pool_left_healthy(request):
    """After a test that used a shared pool, restart the pool if the test left it dead or wedged.

    A passing test is checked cheaply (engines alive, none known dead); a failed one may have left ranks
    inside a collective, so its pool is also probed with an all_reduce. Stopping a shared pool is an error
    of the test: the next module gets a fresh pool, but later tests of this module would see it stopped.
    """
    yield
    for name in ("cluster", "cluster8"):
        if name not in request.fixturenames:
            continue
        pool = request.getfixturevalue(name)
        assert not pool._stopped, (f"{request.node.nodeid} stopped the shared {pool.world_size}-rank pool; "
                                   "a test that stops a pool starts its own with tests.conftest.start_pool()")
        request.getfixturevalue("shared_pools").heal(pool, probe=getattr(request.node, "failed_a_phase", False))


@pytest.fixture
def world_of_one(tmp_path):
    """A gloo world of one rank in this process (DCP and DTensor code run as on a rank), destroyed after."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def one_thread():
    """Two cores are shared with the ranks and other jobs: one-process work runs on one thread, like each rank."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class FastTierClock:
    """Adds up the time of the tests not marked slow, so every full run says how long the fast tier took.

    Summed setup, call and teardown: a shared pool started by a slow test is not counted, one started by a
    fast test is. It tracks a separate ``pytest -m "not slow"`` run to within that pool start (10-20 s).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tests: set[str] = set()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if "slow" not in report.keywords:
            self.seconds += report.duration
            self.tests.add(report.nodeid)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.tests:
            terminalreporter.write_line(f"fast tier (the tests not marked slow): {len(self.tests)} tests, "
                                        f"{self.seconds:.0f} s of setup, call and teardown (goal: under 240 s)")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(FastTierClock(), "fast-tier-clock")


@pytest.hookimpl(trylast=True)  # after any plugin that reorders the tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The book is built from the notebooks the other tests executed (build/executed/): its tests run last."""
    items.sort(key=lambda item: getattr(getattr(item, "module", None), "__name__", "") == "tests.test_book")
