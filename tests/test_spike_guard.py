"""The spike guard: a NaN or a spiking loss skips that step's update on every rank, as in one process.

Fast: the guard's rule (NaN, inf, above factor x the window's median, judged once the window is
full, skipped losses kept out of it), the poisoned loss, and the one-process reference: a skipped
last step leaves the weights as the step before left them, and without the guard one NaN ruins
every weight. On the pool: ``lab.PoisonBatch`` injects a NaN and a spike into a TP2×DP2 and a
PP2×DP2 run guarded by ``lab.SpikeGuard``; each skips exactly the poisoned steps, records them in
``RunResult.spikes`` as its reference does, equals one process, and trains on to a lower loss.
"""
from __future__ import annotations

import math

import pytest
import torch

import lab
from kernels.contract.config_rules import ConfigError
from kernels.contract.faults import Poison, PoisonKind
from kernels.contract.run_config import RunConfig
from kernels.contract.training_hygiene import SpikeEvent, SpikeGuard
from kernels.train.poisoned_loss import PoisonedLoss
from kernels.train.reference import train_reference
from kernels.train.spike_guard import LossGuard
from tests.config_draws import RecordingPool
from tests.test_layout_parity import FP32, _check_params

TINY = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}
BASE = {"model": TINY, "global_batch": 8, "lr": 1e-2, "seed": 0}
POISONS = [lab.PoisonBatch(step=3, kind="nan"), lab.PoisonBatch(step=5, kind="spike", scale=50.0)]


def test_the_guard_skips_nan_inf_and_a_loss_above_factor_times_the_median():
    guard = LossGuard(SpikeGuard(factor=2.0, window=3))
    losses = [9.0, 4.0, 3.0, 2.9, math.nan, 9.0, 2.8, math.inf, 5.0, 2.7]
    skipped = {step: guard.judge(step, loss) for step, loss in enumerate(losses)}
    events = {step: e for step, e in skipped.items() if e is not None}
    assert {s: e.reason for s, e in events.items()} == {4: "nan", 5: "spike", 7: "inf"}
    assert events[5].median == 3.0  # of 4.0, 3.0, 2.9: the NaN stayed out of the window
    assert skipped[0] is None and skipped[8] is None  # 9.0 first: no full window yet; 5.0 < 2 x median 2.9
    taken = [SpikeEvent.from_dict(d) for d in guard.take()]  # plain records, as the ranks return them
    assert [(e.step, e.reason, e.median) for e in taken] == [(4, "nan", 3.0), (5, "spike", 3.0), (7, "inf", 2.9)]
    assert guard.take() == []
    assert set(events[5].to_dict()) == {"step", "loss", "median", "reason", "action"}


def test_a_guard_rebuilt_from_the_losses_so_far_decides_as_the_one_that_saw_them():
    losses = [4.0, 3.5, math.nan, 3.2, 30.0, 3.0]
    seen, rebuilt = LossGuard(SpikeGuard(window=2)), LossGuard(SpikeGuard(window=2))
    for step, loss in enumerate(losses):
        seen.judge(step, loss)
    rebuilt.catch_up(losses)
    assert list(rebuilt.kept) == list(seen.kept) and rebuilt.take() == []  # the events were reported already
    assert seen.judge(6, 9.5) is not None and rebuilt.judge(6, 9.5) is not None  # 9.5 > 3 x median(3.2, 3.0)


def test_a_poisoned_loss_is_multiplied_at_its_step_only():
    loss = PoisonedLoss(lambda x, y: (x - y).pow(2).mean(), (Poison(1, PoisonKind.NAN), Poison(2, scale=10.0)))
    x, y = torch.ones(3), torch.zeros(3)
    values = []
    for step in range(4):
        loss.step = step
        values.append(float(loss(x, y)))
    assert values[0] == values[3] == 1.0 and math.isnan(values[1]) and values[2] == 10.0


def test_a_poisoned_batch_is_checked_before_launch_and_reaches_the_run_config_beside_the_guard():
    pool = RecordingPool()
    with pytest.raises(ConfigError) as caught:
        lab.Experiment(pool, lab.GPT(**TINY), lab.Parallel(dp=4), faults=[lab.PoisonBatch(9, kind="bad", scale="x")])
    assert caught.value.rules == ("faults",) * 3 and pool.calls == []  # the step, the kind, the scale
    exp = lab.Experiment(pool, lab.GPT(**TINY), lab.Parallel(dp=4), steps=6, faults=POISONS,
                         spike_guard=lab.SpikeGuard())
    cfg = exp.config()
    assert [(p["step"], p["kind"]) for p in cfg["poison"]] == [(3, "nan"), (5, "spike")] and cfg["faults"] == []
    assert RunConfig.from_dict(cfg).spike_guard == SpikeGuard(factor=3.0, window=5, action="skip")


def test_a_skipped_step_leaves_the_weights_as_the_step_before_left_them(one_thread):
    guarded = train_reference(RunConfig(**BASE, steps=4, spike_guard=SpikeGuard(window=2), poison=[Poison(3, "nan")]))
    three = train_reference(RunConfig(**BASE, steps=3))
    assert guarded["losses"][:3] == three["losses"] and math.isnan(guarded["losses"][3])
    assert all(torch.equal(guarded["params"][k], v) for k, v in three["params"].items())
    assert [(e["step"], e["reason"], e["action"]) for e in guarded["spikes"]] == [(3, "nan", "skip")]
    ruined = train_reference(RunConfig(**BASE, steps=5, poison=[Poison(3, "nan")]))
    assert math.isnan(ruined["losses"][4]) and torch.isnan(ruined["params"]["blocks.0.mlp.fc_in.weight"]).all()


@pytest.fixture(scope="module")
def guarded_runs(cluster):
    """TP2×DP2 and PP2×DP2, 7 steps, a NaN at step 3 and a spike at step 5, guarded: each run and its reference."""
    runs = {}

    def get(layout: str):
        if layout not in runs:
            parallel = {"tp2-dp2": lab.Parallel(dp=2, tp=2),
                        "pp2-dp2": lab.Parallel(dp=2, pp=2, microbatches=2)}[layout]
            exp = lab.Experiment(cluster, lab.GPT(**TINY), parallel, global_batch=8, steps=7, faults=POISONS,
                                 spike_guard=lab.SpikeGuard(factor=3.0, window=2))
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # the reference on one core, beside the ranks
            try:
                runs[layout] = exp.run(return_params=True), exp.reference(return_params=True)
            finally:
                torch.set_num_threads(threads)
        return runs[layout]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2-dp2", "pp2-dp2"])
def test_an_injected_nan_and_spike_are_skipped_on_every_rank_as_in_one_process(guarded_runs, layout):
    run, ref = guarded_runs(layout)
    assert [(e["step"], e["reason"], e["action"]) for e in run.spikes] == [(3, "nan", "skip"), (5, "spike", "skip")]
    assert [(e["step"], e["reason"]) for e in ref.spikes] == [(3, "nan"), (5, "spike")]
    for mine, theirs in zip(run.spikes, ref.spikes):
        assert mine["median"] == pytest.approx(theirs["median"], rel=1e-4)
    assert run.losses == pytest.approx(ref.losses, rel=FP32["loss_rtol"], nan_ok=True)
    assert run.losses[5] > 10 * run.losses[4] and math.isnan(run.losses[3])
    for rank, params in run.params.items():
        _check_params(rank, params, {k: torch.tensor(v) for k, v in ref.params[0].items()}, FP32, {})
    assert all(math.isfinite(v) for v in run.losses[6:]) and run.losses[6] < run.losses[0]  # it trained on
