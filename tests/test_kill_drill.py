"""The kill drill: a rank's engine is SIGKILLed mid-run, and training resumes from the last complete checkpoint.

Train with ``checkpoint_every=2``; once the first checkpoint is complete, SIGKILL one
rank's engine; the driver gets ``DeadRankError``; ``cluster.restart()`` replaces every
engine; ``lab.Training.load`` picks the latest complete checkpoint (a save the kill cut
short is a ``.partial`` directory nothing lists) and trains the remaining steps. Under
ZeRO-3 the resumed run is the uninterrupted one's computation, so losses and final
parameters are equal to the bit. No engine of the old world is left alive.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import lab
from kernels.checkpoint.files import complete_checkpoints
from lab.pool import launch

TINY = dict(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq_len=16)
STEPS = 20  # long enough that the kill lands mid-run, once the first save is complete


def kill_after_first_checkpoint(checkpoint_dir, pid: int, killed: list) -> None:
    """SIGKILL ``pid`` as soon as a complete checkpoint exists under ``checkpoint_dir``."""
    deadline = time.monotonic() + 120
    while not complete_checkpoints(checkpoint_dir) and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    killed.append(len(complete_checkpoints(checkpoint_dir)))


@pytest.mark.slow
def test_a_killed_rank_resumes_from_the_last_checkpoint(cluster, tmp_path):
    model, parallel = lab.GPT(**TINY), lab.Parallel(dp=4, zero=3)
    whole = lab.Experiment(cluster, model, parallel, steps=STEPS).run(return_params=True)
    old_pids = [r.pid for r in cluster.rank_map.ranks]
    training = lab.Training(cluster, model, parallel, checkpoint_dir=tmp_path, checkpoint_every=2)
    killed: list = []
    killer = threading.Thread(target=kill_after_first_checkpoint, args=(tmp_path, old_pids[1], killed))
    killer.start()
    with pytest.raises(lab.DeadRankError):
        training.step(STEPS)
    killer.join()
    assert killed, "the killer never ran"
    cluster.restart()
    assert not [pid for pid in old_pids if launch.is_alive(pid)], "an engine of the old world is still alive"
    saved = complete_checkpoints(tmp_path)
    assert saved and all(int(p.name.split("_")[1]) % 2 == 0 for p in saved)
    with lab.Training.load(cluster, tmp_path) as resumed:
        assert 2 <= resumed.steps_done < STEPS, "the kill did not land mid-run"
        last = resumed.step(STEPS - resumed.steps_done, return_params=True)
        assert resumed.losses == whole.losses
        assert last.params == whole.params
