"""The all-ranks dashboard from plain StepProgress records: staleness, the straggler, replay, the static figure."""
from __future__ import annotations

import pytest

from kernels.contract.watch_records import StepProgress
from kernels.contract.records import RecordShapeError
from widgets import TrainingDashboard, plot_dashboard
from widgets.training_dashboard import losses, rank_rows


def record(rank: int, step: int, compute: float = 0.01, wait: float = 0.002, loss: float = 4.0) -> StepProgress:
    return StepProgress(rank=rank, step=step, steps=4, loss=loss - step * 0.1, step_s=compute + wait,
                        tokens_per_s=1000.0, collective_s=wait, compute_s=compute, memory_bytes=2 ** 28,
                        memory_kind="rss", sent_at=100.0 + step)


def test_a_rank_not_heard_from_past_the_threshold_is_stale_until_the_run_ends():
    records = [record(r, s) for r in range(4) for s in range(3)]
    heard = [100.0, 100.0, 91.0, 100.0]
    rows = rank_rows(records, 4, heard, now=101.0, stale_after=5.0)
    assert [row["stale"] for row in rows] == [False, False, True, False]
    assert rows[2]["age_s"] == pytest.approx(10.0)
    assert not any(row["stale"] for row in rank_rows(records, 4, heard, now=101.0, stale_after=5.0, finished=True))


def test_the_rank_that_computes_slowest_is_the_straggler():
    records = [record(r, s, compute=0.02 if r == 2 else 0.01, wait=0.001 if r == 2 else 0.011)
               for r in range(4) for s in range(3)]
    assert [row["straggler"] for row in rank_rows(records, 4)] == [False, False, True, False]
    even = [record(r, s) for r in range(4) for s in range(3)]
    assert not any(row["straggler"] for row in rank_rows(even, 4))


def test_replay_shows_a_saved_run_and_refuses_a_foreign_shape():
    saved = [record(r, s).to_dict() for s in range(4) for r in range(2)]
    view = TrainingDashboard.replay(saved)
    assert view.world_size == 2 and view.steps == 4 and view.finished
    assert view.loss == [[s, pytest.approx(4.0 - s * 0.1)] for s in range(4)]
    assert [row["step"] for row in view.ranks] == [3, 3]
    assert losses(saved) == view.loss
    with pytest.raises(RecordShapeError, match="StepProgress: unknown key 'lossy'"):
        TrainingDashboard.replay([{**saved[0], "lossy": 1.0}])


def test_live_updates_and_the_static_figure():
    view = TrainingDashboard(world_size=2, steps=4, stale_after=1.0)
    assert [row["step"] for row in view.ranks] == [None, None]
    view.add([record(0, 0), record(1, 0)], heard_at=[1.0, 1.0])
    assert [row["step"] for row in view.ranks] == [0, 0] and all(row["stale"] for row in view.ranks)
    view.finish(heard_at=[1.0, 1.0])
    assert not any(row["stale"] for row in view.ranks)
    fig = plot_dashboard([record(r, s) for r in range(2) for s in range(4)])
    assert [ax.get_title() for ax in fig.axes[:3]] == ["loss", "step time per rank", "per step (recent median)"]
