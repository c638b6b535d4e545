"""Training(auto_resume=True): a rank killed mid-step is replaced, and training goes on from the last complete
checkpoint, bit for bit the uninterrupted run under the same layout.

The slow test kills a rank of the shared 4-rank pool with ``lab.Kill`` (the rank SIGKILLs its own engine, a
process the lab started, in the first forward of the step); the pool's warmed spare takes its place, as
the conftest allows for a test that leaves the world usable. The torch-free tests drive ``AutoResume`` with a
stand-in training: which checkpoint it goes back to, which fault it spends, and the error when the pool has no
spare engine for the lost rank.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import lab
from kernels.checkpoint.files import META_NAME, step_dir
from kernels.contract.pool_records import RankFailure
from lab.errors import DeadRankError, Recovery
from lab.pool import launch
from lab.run.auto_resume import AutoResume, AutoResumeError
from lab.run.events import EventSink

TINY = dict(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq_len=16)
STEPS = 6
NOT_OURS = "the lab did not start this pool's engines, so it cannot replace them; restart them with ipcluster"


def _complete(root: Path, step: int, saved_at: float) -> Path:
    """A step directory as a finished save leaves it (DCP's .metadata and the meta record)."""
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"")
    (path / META_NAME).write_text(json.dumps({"step": step, "saved_at": saved_at, "losses": [1.0] * step}))
    return path


class StandIn:
    """What AutoResume uses of a lab.Training: a save, a call that fails as scripted, a reload."""

    def __init__(self, root: Path, failures: list[DeadRankError], *, writes: int | None = None) -> None:
        self.steps_done, self.losses, self.root = 4, [1.0] * 4, root
        self.experiment = SimpleNamespace(checkpoint_dir=str(root), events=EventSink(None))
        self.cluster = SimpleNamespace(rank_map=SimpleNamespace(ranks=[SimpleNamespace(pid=200 + r) for r in range(4)]))
        self.failures, self.writes, self.reloaded = failures, writes, []

    def save(self, root) -> Path:
        return _complete(Path(root), self.steps_done, time.time())

    def _advance(self, n: int, **call) -> SimpleNamespace:
        if self.writes is not None:  # the call gets as far as this save before it fails
            _complete(self.root, self.writes, time.time())
            self.writes = None
        if self.failures:
            raise self.failures.pop(0)
        self.steps_done += n
        return SimpleNamespace(first_step=self.steps_done - n, losses=[1.0] * n)

    def _reload(self, path: Path) -> None:
        self.reloaded.append(path.name)
        self.steps_done = int(path.name.split("_")[1])


def _death(rank: int, recovery: Recovery) -> DeadRankError:
    failure = RankFailure(rank, "vm", "EngineDied", "the engine process (pid 100) on vm is gone", "")
    return DeadRankError([failure], f"rank {rank} (host vm) died: its engine process (pid 100) is gone", recovery)


def test_it_goes_back_to_the_latest_checkpoint_it_wrote_and_spends_the_fault_that_struck(tmp_path):
    _complete(tmp_path, 7, saved_at=time.time() - 3600)  # an older run's save in the same directory: never loaded
    training = StandIn(tmp_path, [_death(1, Recovery(replaced={1: (100, 200)}))], writes=6)
    resume = AutoResume(True, [lab.Kill(1, at_step=5), lab.Kill(1, at_step=9), lab.Slow(2, 2.0)])
    result = resume.step(training, 4)
    assert training.reloaded == ["step_000006"] and training.steps_done == 8 and result.first_step == 6
    assert resume.faults == [lab.Kill(1, at_step=9), lab.Slow(2, 2.0)]  # the one in the failed call's steps
    assert resume.point == (8, step_dir(tmp_path, 8))


def test_without_a_spare_engine_it_stops_with_an_error_naming_it_and_loses_nothing(tmp_path):
    training = StandIn(tmp_path, [_death(1, Recovery(rebuilt=False, why_not=NOT_OURS))])
    with pytest.raises(AutoResumeError) as error:
        AutoResume(True).step(training, 3)
    message = str(error.value)
    assert "no spare engine to put in place of rank 1" in message and NOT_OURS in message
    assert "Nothing is lost" in message and str(step_dir(tmp_path, 4)) in message
    assert isinstance(error.value.__cause__, DeadRankError)
    assert training.reloaded == [] and training.steps_done == 4 and training.losses == [1.0] * 4
    assert (step_dir(tmp_path, 4) / META_NAME).is_file()  # the start point it saved is still there


def test_a_failure_that_comes_back_after_three_resumes_from_one_checkpoint_gives_up(tmp_path):
    deaths = [_death(1, Recovery(replaced={1: (100, 200)})) for _ in range(4)]
    with pytest.raises(AutoResumeError, match="gave up after 3 resumes"):
        AutoResume(True).step(StandIn(tmp_path, deaths), 2)


@pytest.mark.slow
def test_a_rank_killed_mid_step_is_replaced_and_the_losses_after_the_resume_are_the_uninterrupted_ones(
        cluster, tmp_path):
    model, parallel = lab.GPT(**TINY), lab.Parallel(dp=4)
    whole = lab.Experiment(cluster, model, parallel, steps=STEPS).run(progress=False, return_params=True)
    old_pid = cluster.rank_map.ranks[1].pid
    heard: list[lab.RunEvent] = []
    with lab.Training(cluster, model, parallel, checkpoint_dir=tmp_path, checkpoint_every=2, auto_resume=True,
                      faults=[lab.Kill(1, at_step=3)], on_event=heard.append) as training:
        last = training.step(STEPS, return_params=True)
        assert [(e.kind, e.rank, e.step) for e in heard] == [("death", 1, 3), ("resume", None, 2), ("finish", None, 6)]
        assert last.first_step == 2 and last.losses == whole.losses[2:]  # trained again from the resume point
        assert training.losses == whole.losses  # steps 0-1 from the checkpoint's record
        assert last.params == whole.params
    new_pid = cluster.rank_map.ranks[1].pid
    assert not launch.is_alive(old_pid) and new_pid != old_pid
    assert f"rank 1 now runs in pid {new_pid}" in heard[1].message
