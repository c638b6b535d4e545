"""A pool starts, numbers its ranks, runs code, binds %%px names and shows its rank table."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import psutil
import pytest

import lab
from lab.pool import launch


def rank_sum(offset: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(t)
    return t.item()


def test_world_of_four_cpu_ranks_is_verified_by_all_reduce(cluster):
    assert cluster.world_size == 4 and cluster.backend == "gloo"
    assert [r.rank for r in cluster.rank_map.ranks] == [0, 1, 2, 3]
    assert all(r.device == "cpu" for r in cluster.rank_map.ranks)
    assert cluster.run(rank_sum, 1.0) == [10.0] * 4


def test_results_are_indexed_by_rank_and_subsets_come_back_as_dict(cluster):
    import torch.distributed as dist  # noqa: F401  (the function below runs on the ranks)

    def who(tag):
        import os
        import torch.distributed as dist
        return (dist.get_rank(), os.getpid(), tag)

    results = cluster.run(who, "x")
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert [r[1] for r in results] == [r.pid for r in cluster.rank_map.ranks]
    subset = cluster.run(who, "y", ranks=[3, 1])
    assert set(subset) == {1, 3} and subset[3][0] == 3 and subset[1][2] == "y"
    with pytest.raises(ValueError, match="ranks 0..3"):
        cluster.run(who, "z", ranks=[7])


def test_push_and_pull_bind_names_on_every_rank(cluster):
    cluster.push({"greeting": "hi"})
    assert cluster.pull("greeting") == ["hi"] * 4
    assert cluster.pull("rank") == [0, 1, 2, 3]
    assert cluster.pull("world", ranks=[2]) == {2: 4}


def test_px_cells_see_rank_world_device_torch_and_dist(cluster):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    cluster.activate()
    shell.run_cell_magic("px", "", "t = torch.full((2,), float(rank)); dist.all_reduce(t)\n"
                                   "seen = (rank, world, str(device), t.tolist())")
    assert cluster.pull("seen") == [(r, 4, "cpu", [6.0, 6.0]) for r in range(4)]


def test_rank_table_shows_rank_host_pid_device_backend_threads(cluster):
    text = repr(cluster)
    for column in ("rank", "host", "pid", "device", "backend", "threads"):
        assert column in text.splitlines()[1]
    assert str(cluster.rank_map.ranks[3].pid) in text
    page = cluster._repr_html_()
    assert page.count("<tr") == 5 and "gloo" in page and "cluster-lab-ranks" in page


@pytest.mark.slow  # starts a second 4-rank pool to see its warning
def test_threads_per_rank_are_set_and_oversubscription_is_warned():
    if os.cpu_count() >= 4:
        pytest.skip("this machine has enough cores for 4 ranks: no oversubscription to warn about")
    with pytest.warns(lab.OversubscribedWarning, match="4 ranks share"):
        pool = lab.start(n=4, backend="gloo", timeout=60, activate=False)
    with pool:
        assert pool.threads == 1

        def threads():
            import torch
            return torch.get_num_threads()

        assert pool.run(threads) == [1] * 4


def test_controller_is_on_loopback_signed_and_its_files_are_private(cluster):
    config = cluster.client._config
    assert config["interface"] == "tcp://127.0.0.1"
    assert config["key"] and config["signature_scheme"].startswith("hmac-")
    profile = Path(cluster._source.profile_dir)
    assert stat.S_IMODE(profile.stat().st_mode) & 0o077 == 0
    files = list((profile / "security").glob("*.json"))
    assert files and all(stat.S_IMODE(f.stat().st_mode) & 0o077 == 0 for f in files)


def test_cluster_view_follows_a_call_live_and_marks_a_failed_rank_red(cluster):
    view = cluster.view()
    seen = []
    view.observe(lambda change: seen.append([r["state"] for r in change["new"]]), names="ranks")

    def slow_then_fail():
        import time

        import torch.distributed as dist
        time.sleep(1.0)
        if dist.get_rank() == 3:
            raise RuntimeError("rank 3 fails on purpose")

    with pytest.raises(lab.RankError):
        cluster.run(slow_then_fail, timeout=10)
    assert ["busy"] * 4 in seen  # shown busy while the call ran
    final = {r["rank"]: r for r in view.ranks}
    assert final[3]["state"] == "failed" and "rank 3 fails" in final[3]["detail"]
    assert all(final[r]["rss_bytes"] > 10 * 2**20 for r in range(4))  # real resident memory of each engine
    cluster.run(rank_sum, 0.0)
    assert [r["state"] for r in view.ranks] == ["idle"] * 4


def test_engines_start_with_their_openmp_pool_capped_like_torchrun(cluster):
    def omp_threads():
        import os
        return os.environ.get("OMP_NUM_THREADS")

    assert cluster.run(omp_threads) == [str(cluster.threads)] * 4


def test_the_hub_beats_every_half_second_and_still_drops_an_engine_only_after_30_s(cluster):
    # Registration waits for the hub's next heartbeat: ipyparallel's 3 s period doubled a local start.
    controller = psutil.Process(cluster._source.ipp_cluster.controller.pid)
    args = " ".join(controller.cmdline())
    assert f"--HeartMonitor.period={launch.HEARTBEAT_MS}" in args
    assert f"--HeartMonitor.max_heartmonitor_misses={launch.HEARTBEAT_MISSES}" in args
    assert launch.HEARTBEAT_MS <= 500 and launch.HEARTBEAT_MS * launch.HEARTBEAT_MISSES == 30_000


def _world_groups_recorded() -> tuple[str | None, int]:
    """On a rank: TORCH_FR_BUFFER_SIZE, and how many groups torch's flight recorder saw in an all_reduce just made."""
    import os
    import time

    import torch
    import torch.distributed as dist

    from kernels.watch.flight_recorder import group_summaries

    since = time.time_ns()
    dist.all_reduce(torch.ones(1))
    return os.environ.get("TORCH_FR_BUFFER_SIZE"), len(group_summaries(since_ns=since))


def test_flight_recorder_must_be_true_or_false_and_nothing_starts_otherwise():
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(TypeError, match="flight_recorder must be True or False"):
        lab.start(n=2, flight_recorder="off", activate=False)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@pytest.mark.slow  # starts a second pool
def test_a_pool_started_without_the_flight_recorder_records_nothing_and_its_spares_start_alike(cluster):
    assert cluster.run(_world_groups_recorded) == [("500", 1)] * 4  # the default pool records the all_reduce
    with lab.start(n=2, backend="gloo", activate=False, flight_recorder=False) as pool:
        assert pool.run(_world_groups_recorded) == [("0", 0)] * 2
        # Spares and restarts are started from the same launcher configuration.
        assert pool._source.ipp_cluster.config.LocalEngineSetLauncher.environment["TORCH_FR_BUFFER_SIZE"] == "0"
