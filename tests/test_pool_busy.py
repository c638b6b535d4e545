"""A pool training a started run says so: the next cell waits for it in the open (or refuses with wait=False),
and the run's views keep every record, however the cells around it were run."""
from __future__ import annotations

import time

import pytest

import lab

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
STEPS = 30


def rank_sum(offset: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank()) + offset])
    dist.all_reduce(t)
    return t.item()


def started_run(cluster: lab.Cluster, steps: int = STEPS) -> "lab.run.run_handle.RunHandle":
    """A run started with .start() that has finished at least one step on some rank."""
    handle = lab.Experiment(cluster, TINY, lab.Parallel(dp=4), steps=steps).start()
    while not handle.history and not handle.done:
        time.sleep(0.02)
    assert not handle.done, "the run ended before the test could call during it"
    return handle


def test_a_call_during_a_started_run_waits_for_it_saying_so_then_returns_its_values(cluster, capsys):
    handle = started_run(cluster)
    assert cluster.busy.startswith("the run started at ") and f"/{STEPS})" in cluster.busy
    assert cluster.run(rank_sum, 1.0) == [10.0] * 4
    assert handle.done and len(handle.wait().losses) == STEPS  # it waited for the whole run, which went on
    out = capsys.readouterr().out
    assert "waiting for the run started at " in out and "its handle's stop() ends it" in out
    assert cluster.busy is None


def test_wait_false_raises_pool_busy_error_naming_the_run(cluster):
    handle = started_run(cluster, steps=100000)
    try:
        busy = r"busy with the run started at \d\d:\d\d:\d\d \(step \d+/100000\)"
        with pytest.raises(lab.PoolBusyError, match=busy) as info:
            cluster.run(rank_sum, 0.0, wait=False)
        assert info.value.run is handle
        for refused in (lambda: cluster.push({"x": 1}, wait=False),
                        lambda: lab.Experiment(cluster, TINY, lab.Parallel(dp=4), steps=2).run(wait=False),
                        lambda: lab.Experiment(cluster, TINY, lab.Parallel(dp=4), steps=2).start(wait=False)):
            with pytest.raises(lab.PoolBusyError):
                refused()
        assert not handle.done  # refusing left the run alone
    finally:
        result = handle.stop()
    assert result.stopped_at is not None and cluster.busy is None
    assert cluster.run(rank_sum, 0.0, wait=False) == [6.0] * 4


def test_px_cells_wait_for_a_started_run_or_refuse_with_no_wait(cluster):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    cluster.activate()
    handle = started_run(cluster, steps=100000)
    try:
        with pytest.raises(lab.PoolBusyError):
            shell.run_cell_magic("px", "--no-wait", "seen = rank")
    finally:
        handle.stop(wait=False)
    shell.run_cell_magic("px", "", "seen = rank * 10")  # waits for the stop to take effect, then runs
    assert handle.done and cluster.pull("seen") == [0, 10, 20, 30]


def test_the_dashboard_holds_every_step_after_a_concurrent_cell(cluster):
    handle = started_run(cluster)
    live = handle.dashboard()
    assert cluster.run(rank_sum, 0.0) == [6.0] * 4  # another cell's call while the run trains
    handle.wait()
    late = handle.dashboard()  # made after the run ended: never watched it while it ran
    every = {(rank, step) for rank in range(4) for step in range(STEPS)}
    for view in (live, late):
        assert view.finished
        assert {(r.rank, r.step) for r in view.records} == every
        assert [row["step"] for row in view.ranks] == [STEPS - 1] * 4
        assert [step for step, _ in view.loss] == list(range(STEPS))


@pytest.mark.slow  # a real kernel (jupyter_client, as JupyterLab) with a 2-rank pool
def test_a_dashboard_in_a_kernel_moves_while_another_cell_waits_and_ends_with_every_step():
    from tests.live_kernel import Kernel

    steps = 200
    kernel = Kernel()
    try:
        kernel.run(f"""
            import time, warnings
            import lab
            from IPython.display import display
            warnings.simplefilter("ignore")
            pool = lab.start(n=2, backend="gloo", spare_engines=0, timeout=120)
            exp = lab.Experiment(pool, lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16),
                                 lab.Parallel(dp=2), steps={steps})
            h = exp.start()
            display(h.dashboard())
            while not h.history:
                time.sleep(0.05)
        """)
        messages = kernel.messages_of("print('after the run:', pool.run(lambda: rank))")
        kernel.run("pool.stop()")
    finally:
        kernel.close()
    texts = [m["content"]["text"] if m["msg_type"] == "stream" else "" for m in messages]
    waiting = next(i for i, t in enumerate(texts) if "waiting for the run started at" in t)
    ended = next(i for i, t in enumerate(texts) if "after the run: [0, 1]" in t)
    states = [(i, m["content"]["data"]["state"]) for i, m in enumerate(messages)
              if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "update"]
    during = {min(row["step"] for row in s["ranks"]) for i, s in states if waiting < i < ended and "ranks" in s
              and all(row["step"] is not None for row in s["ranks"])}
    assert len(during) >= 3  # the view moved on, step after step, while the other cell waited
    final: dict = {}
    for _, state in states:
        final.update(state)
    assert final["finished"] and [row["step"] for row in final["ranks"]] == [steps - 1] * 2
    assert [step for step, _ in final["loss"]] == list(range(steps))
    assert all(len(row["step_s"]) == steps for row in final["ranks"])  # every step's time, on every rank
