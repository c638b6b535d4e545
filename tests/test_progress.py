"""Runs that do not block: records arrive per step while ranks train, stop() ends at a step boundary, logs read back."""
from __future__ import annotations

import importlib.util
import time

import pytest

import lab
from kernels.contract.watch_records import StepProgress

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)


def test_records_arrive_while_the_run_goes(cluster):
    # Enough steps to outlast several of the ranks' send intervals (kernels.watch.progress.SEND_EVERY_S).
    steps = 40
    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=4), steps=steps)
    handle = exp.start()
    arrivals: list[tuple[float, bool, StepProgress]] = []
    handle.follow(lambda records: arrivals.extend((time.time(), handle.done, r) for r in records))
    result = handle.wait()
    assert handle.done and len(result.losses) == steps and result.stopped_at is None
    seen = {(r.rank, r.step) for _, _, r in arrivals}
    assert seen == {(rank, step) for rank in range(4) for step in range(steps)}  # one per step per rank, before wait()
    last_sent = max(r.sent_at for _, _, r in arrivals)
    assert arrivals[0][0] < last_sent  # the first record was here before the last one left its rank
    assert any(not done for _, done, _ in arrivals)
    by_step = {r.step: r for _, _, r in arrivals if r.rank == 0}
    assert [by_step[s].loss for s in range(steps)] == pytest.approx(result.losses)
    for _, _, r in arrivals:
        assert r.step_s > 0 and 0 <= r.collective_s <= r.step_s and r.memory_kind == "rss" and r.memory_bytes > 0
        assert r.compute_s == pytest.approx(r.step_s - r.collective_s)
    assert [StepProgress.from_dict(d) for d in result.progress] == handle.history  # saved for replay
    assert all(row.last_heard_s is not None and row.last_heard_s >= 0 for row in cluster.status())  # cluster.view()
    assert [row["step"] for row in result.dashboard().ranks] == [steps - 1] * 4


def test_stop_ends_every_rank_at_one_step_boundary_and_the_next_run_works(cluster):
    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=2, pp=2, microbatches=2), steps=400)
    handle = exp.start()
    while len(handle.history) < 8 and not handle.done:
        time.sleep(0.02)
    result = handle.stop()
    assert result.stopped_at is not None and result.stopped_at < 399
    assert [len(t) for t in result.step_times] == [result.stopped_at + 1] * 4  # every rank stopped after one step
    assert len(result.losses) == result.stopped_at + 1
    after = lab.Experiment(cluster, TINY, lab.Parallel(dp=4), steps=2).run(progress=False)
    assert len(after.losses) == 2 and after.stopped_at is None


def test_tensorboard_scalars_read_back(cluster, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=4), steps=3)
    result = exp.run(progress=False, log_to=f"tensorboard:{tmp_path}")
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"rank{r}/step_s" for r in range(4)} | {"all/loss", "all/step_s_max", "all/collective_s_mean"} <= tags
    loss = events.Scalars("all/loss")
    assert [e.step for e in loss] == [0, 1, 2]
    assert [e.value for e in loss] == pytest.approx(result.losses, rel=1e-6)
    slowest = [max(result.step_times[r][s] for r in range(4)) for s in range(3)]
    assert [e.value for e in events.Scalars("all/step_s_max")] == pytest.approx(slowest, rel=1e-5)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="wandb is an optional extra and not installed")
def test_wandb_offline_run(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    result = lab.Experiment(cluster, TINY, lab.Parallel(dp=4), steps=2).run(progress=False, log_to="wandb")
    assert len(result.losses) == 2
    assert list(tmp_path.rglob("*.wandb"))  # the offline run's log file


def test_bad_log_to_is_refused_before_launch():
    class RefusingCluster:
        world_size = 4

        def run(self, *args, **kwargs):
            raise AssertionError("a bad log_to reached the ranks")

    exp = lab.Experiment(RefusingCluster(), TINY, lab.Parallel(dp=4))
    with pytest.raises(lab.ParallelConfigError, match="log_to must be 'tensorboard:DIR' or 'wandb'"):
        exp.start(log_to="csv:/tmp/x")
