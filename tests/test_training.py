"""lab.Training: the model and optimizer stay on the ranks between calls, and steps continue exactly."""
from __future__ import annotations

import pytest

import lab
from kernels import live_training
from lab.errors import LabError

TINY = dict(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq_len=16)


def test_steps_continue_bit_for_bit(cluster):
    """step(2) then step(1) is the computation of one 3-step Experiment: same losses and weights, to the bit."""
    model, parallel = lab.GPT(**TINY), lab.Parallel(dp=2, tp=2, zero=3)
    whole = lab.Experiment(cluster, model, parallel, steps=3).run(return_params=True)
    with lab.Training(cluster, model, parallel) as training:
        first = training.step(2)
        last = training.step(1, return_params=True)
        assert first.losses + last.losses == training.losses == whole.losses
        assert last.params == whole.params
        assert training.steps_done == 3
    assert cluster.run(live_training.held_keys) == [[]] * cluster.world_size  # closed: nothing held


def test_a_rebuilt_world_releases_the_training(cluster):
    """leave_world (a failure, a rebuild) closes what the ranks held; the next step names the lost training."""
    training = lab.Training(cluster, lab.GPT(**TINY), lab.Parallel(dp=4))
    training.step(1)
    cluster._form_world()  # what the pool does after a failure
    assert cluster.run(live_training.held_keys) == [[]] * cluster.world_size
    with pytest.raises(LabError, match="no longer on the ranks"):
        training.step(1)
