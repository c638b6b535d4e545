"""The parameter server (lab.ParameterServer) on the 4-rank pool: 1 server + 3 workers, and 2 + 2."""
from __future__ import annotations

import time

import pytest

import lab
from kernels.ps.parameter_server import split_by_bytes
from lab.run.parallel import RULES
from lab.ps.ps_result import server_bytes_per_step

TINY = dict(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
RUN = dict(global_batch=12, steps=3)  # 12: divisible by 3 and 2 workers and by DDP's 4 ranks


@pytest.fixture(scope="module")
def ddp(cluster):
    """DDP over the whole pool on the same model, data and optimizer: the losses sync PS must equal."""
    return lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=4), **RUN).run(progress=False)


@pytest.mark.parametrize("servers", [1, 2])
def test_sync_ps_equals_reference_and_ddp(cluster, ddp, servers):
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=servers, mode="sync", **RUN)
    result = ps.run(timeout=120)
    assert result.matches(ps.reference(), rtol=1e-4), result.loss_table(ps.reference())
    assert result.matches(ddp, rtol=1e-4), result.loss_table(ddp)
    assert result.staleness == [0] * (RUN["steps"] * ps.workers * servers)
    workers = result.worker_table()
    assert [w["rank"] for w in workers] == list(range(servers, 4))
    assert all(w["pulls"] == w["pushes"] == RUN["steps"] * servers for w in workers)


def test_sync_ps_with_sgd_equals_the_sgd_reference_and_ddp(cluster):
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode="sync", optimizer="sgd", **RUN)
    result, reference = ps.run(timeout=120), ps.reference()
    ddp = lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=4), optimizer="sgd", **RUN).run(progress=False)
    assert result.matches(reference, rtol=1e-4), result.loss_table(reference)
    assert result.matches(ddp, rtol=1e-4), result.loss_table(ddp)
    adamw = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode="sync", **RUN).reference()
    assert reference.losses[-1] != pytest.approx(adamw.losses[-1], rel=1e-3)  # it did train with another optimizer


@pytest.mark.parametrize("servers", [1, 2])
def test_server_bytes_equal_formula(cluster, servers):
    result = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=servers, **RUN).run(timeout=120)
    rows = result.server_bytes()
    assert len(rows) == servers
    for row in rows:  # each step: every worker pushes the shard's gradients and pulls the shard back
        assert row["measured_per_step"] == server_bytes_per_step(row["param_bytes"], 4 - servers)
    assert sum(row["param_bytes"] for row in rows) == result.model_bytes
    shards = result.ps["shards"]
    assert sorted(n for shard in shards for n in shard) == sorted(set(n for shard in shards for n in shard))


def test_split_by_bytes_balances_servers():
    sizes = {"a": 400, "b": 300, "c": 200, "d": 100, "e": 100}
    shards = split_by_bytes(sizes, 2)
    assert sorted(shards[0] + shards[1]) == sorted(sizes)
    loads = [sum(sizes[n] for n in shard) for shard in shards]
    assert loads == [500, 600] or loads == [600, 500]


def test_async_with_a_slow_worker_is_stale_and_still_learns(cluster):
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode="async", global_batch=12, steps=4,
                             faults=[lab.Slow(3, 4.0)])
    result = ps.run(timeout=120)
    assert max(result.staleness) > 0, result.staleness_histogram()
    assert len(result.staleness) == 4 * 3  # every push applied on its own
    assert result.losses[-1] < result.losses[0], result.losses


@pytest.mark.slow  # 4 s; the other staleness modes stay in the fast tier
def test_bounded_never_exceeds_max_staleness(cluster):
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=2, mode="bounded", max_staleness=1, global_batch=12,
                             steps=4, faults=[lab.Slow(3, 4.0)])
    result = ps.run(timeout=120)
    assert result.staleness and max(result.staleness) <= 1, result.staleness_histogram()
    assert all(0 <= s <= 1 for w in result.ps["workers"] for s in w["staleness"])


def test_a_worker_that_raises_is_named_and_the_pool_runs_on(cluster):
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode="sync", faults=[lab.Crash(2, at_step=1)],
                             **RUN)
    with pytest.raises(lab.RankError) as caught:
        ps.run(timeout=120)  # a hang would end as RankTimeoutError, not pass
    assert caught.value.failures[0].rank == 2
    assert "InjectedCrash" in caught.value.failures[0].ename
    again = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode="sync", **RUN).run(timeout=120)
    assert len(again.losses) == RUN["steps"]
    after = lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=4), **RUN).run(progress=False)
    assert after.matches(again, rtol=1e-4)


@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=pytest.mark.slow)])  # 7 s each
def test_a_hung_worker_is_named_in_a_hang_report_and_the_pool_runs_on(cluster, mode):
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode=mode, faults=[lab.Hang(3, at_step=1)],
                             hang_after=3.0, **RUN)
    with pytest.raises(lab.HangError) as caught:
        ps.run(timeout=120)  # hang_after ends it long before the timeout would
    report = caught.value.report
    assert report.rank(3).faults == ("Hang(rank=3, at_step=1) struck at step 1",)
    assert "rank 3 never entered it (last seen in step 1 begins)" in report.findings[0]
    if mode == "sync":  # the others wait in the push the server answers once every worker has pushed
        assert report.never_arrived == (3,), str(report)
        assert report.findings[0].startswith("ranks 1, 2 wait in push #2 of group workers=[1,2,3]"), report.findings
        assert "workers [1, 2, 3] still training" in report.rank(0).action
        assert caught.value.rank == 3  # the server and the pushing workers were held up by it
    else:  # nobody waits for it until the end: the others finish, the server waits for its last push
        assert report.never_arrived == (0, 3), str(report)
        assert report.findings[0].startswith("ranks 1, 2 wait in barrier #1 of group world=[0,1,2,3]")
        assert "rank 0 never entered it (last seen in serving 37 parameters; workers [3] still training)" \
            in report.findings[0]
    again = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode="sync", **RUN).run(timeout=120)
    assert len(again.losses) == RUN["steps"]
    assert len(lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=4), **RUN).run(progress=False).losses) == 3


def test_bad_arguments_are_named_before_launch(cluster):
    with pytest.raises(lab.ParallelConfigError) as caught:
        lab.ParameterServer(cluster, lab.GPT(**TINY), servers=4, mode="bounded", global_batch=10,
                            faults=[lab.Slow(0, 2.0)])
    message = str(caught.value)
    assert set(caught.value.rules) <= set(RULES), caught.value.rules
    assert "servers must be an int from 1 to world_size-1 = 3" in message
    assert "needs max_staleness" in message
    with pytest.raises(lab.ParallelConfigError, match="divisible by the 3 workers"):
        lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, global_batch=10)
    with pytest.raises(lab.ParallelConfigError, match="a server; faults act on workers"):
        lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, global_batch=12, faults=[lab.Slow(0, 2.0)])


@pytest.mark.slow  # the lab replaces the killed engine (~10-20 s)
def test_a_killed_worker_is_named_and_a_replaced_engine_serves_the_next_run(cluster):
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, faults=[lab.Kill(2, at_step=1)], **RUN)
    with pytest.raises(lab.DeadRankError, match="rank 2"):
        ps.run(timeout=120)
    # the replaced engine counts its RPC starts from 0 again; the next run must still meet
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, **RUN)
    assert ps.run(timeout=120).matches(ps.reference(), rtol=1e-4)


@pytest.mark.slow  # 5 s each; the fast tier keeps the hung worker's report
@pytest.mark.parametrize("mode", ["sync", "bounded"])
def test_stop_ends_a_started_run_after_a_step_and_the_pool_runs_on(cluster, mode):
    steps = 400  # far more than run in the seconds before the stop
    ps = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, mode=mode, global_batch=12, steps=steps,
                             max_staleness=1 if mode == "bounded" else None)
    handle = ps.start(timeout=120)
    time.sleep(3.0)
    assert not handle.done
    result = handle.stop()
    ran = len(result.losses)
    assert handle.done and 1 <= ran < steps
    if mode == "sync":  # every worker ran the same steps: still the reference's first ones
        assert all(len(w["losses"]) == ran for w in result.ps["workers"])
        reference = lab.ParameterServer(cluster, lab.GPT(**TINY), servers=1, global_batch=12, steps=ran).reference()
        assert result.matches(reference, rtol=1e-4)
    after = lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=4), **RUN).run(progress=False)
    assert len(after.losses) == RUN["steps"]
