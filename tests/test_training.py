"""lab.Training: the model and optimizer stay on the ranks between calls, and steps continue exactly."""
from __future__ import annotations

import pytest
import torch

import lab
from kernels.train import live_training
from lab.errors import LabError

TINY = dict(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq_len=16)


@pytest.mark.parametrize("parallel", [pytest.param(lab.Parallel(dp=2, tp=2, zero=3), marks=pytest.mark.slow),  # 16 s
                                      lab.Parallel(dp=4)], ids=["tp2-dp2-zero3", "ddp"])
def test_steps_continue_bit_for_bit(cluster, tmp_path, parallel):
    """step(2) then step(1) is one 3-step Experiment's computation, to the bit; so is a save loaded and stepped."""
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, parallel, steps=3).run(return_params=True)
    with lab.Training(cluster, model, parallel) as training:
        first = training.step(2)
        saved = training.save(tmp_path)
        last = training.step(1, return_params=True)
        assert first.losses + last.losses == training.losses == whole.losses
        assert last.params == whole.params
        assert training.steps_done == 3
    with lab.Training.load(cluster, saved) as loaded:  # the saved layout, by default
        assert loaded.steps_done == 2 and loaded.parallel == parallel
        assert loaded.step(1, return_params=True).params == whole.params
        assert loaded.losses == whole.losses
    lab.Experiment(cluster, model, parallel, steps=2, checkpoint_dir=str(tmp_path / "exp")).run()
    with lab.Training.load(cluster, tmp_path / "exp") as loaded:  # an Experiment's checkpoint keeps no losses
        assert loaded.steps_done == 2 and loaded.step(1).losses == whole.losses[2:]
    assert cluster.run(live_training.held_keys) == [[]] * cluster.world_size  # closed: nothing held


def test_async_checkpoints_are_complete_when_step_returns(cluster, tmp_path):
    """checkpoint_async: step() returns with every due save named; one loaded goes on to the bit (ZeRO-3 TP2xDP2).

    The one loaded is the second save, whose payload reused the first one's tensors (the live ones).
    """
    model, parallel = lab.GPT(**TINY), lab.Parallel(dp=2, tp=2, zero=3)
    with lab.Training(cluster, model, parallel, checkpoint_dir=tmp_path, checkpoint_every=1,
                      checkpoint_async=True) as training:
        training.step(3)
        assert [c.step for c in lab.checkpoints(tmp_path)] == [1, 2, 3]
    with lab.Training.load(cluster, tmp_path / "step_000002") as loaded:
        assert loaded.step(1).losses == training.losses[2:]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [lab.Parallel(dp=4), lab.Parallel(dp=2, tp=2, zero=3)], ids=["ddp", "tp2-dp2-zero3"])
def test_a_save_before_the_first_step_changes_neither_the_run_nor_its_resumption(cluster, tmp_path, parallel):
    """torch steps a fresh AdamW at lr 0 to describe it; the lab sets the step count back, so nothing shifts."""
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, parallel, steps=3).run(progress=False)
    with lab.Training(cluster, model, parallel) as training:
        saved = training.save(tmp_path)
        assert training.step(3).losses == whole.losses
    with lab.Training.load(cluster, saved) as loaded:
        assert loaded.steps_done == 0 and loaded.step(3).losses == whole.losses


@pytest.mark.slow
def test_a_loaded_sgd_run_goes_on_with_sgd(cluster, tmp_path):
    """The saved run's optimizer is the loaded one's: an SGD checkpoint does not come back as AdamW."""
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4), steps=3, optimizer="sgd").run(progress=False)
    with lab.Training(cluster, model, lab.Parallel(dp=4), optimizer="sgd") as training:
        training.step(2)
        saved = training.save(tmp_path)
    with lab.Training.load(cluster, saved, parallel=lab.Parallel(dp=2, tp=2)) as loaded:
        assert loaded.step(1).losses == pytest.approx(whole.losses[2:], rel=1e-4)


def test_plain_sgd_trains_on_across_a_relayout(cluster):
    """SGD keeps no optimizer state: a ZeRO-1 -> TP2xDP2 ZeRO-3 relayout still goes on as one SGD run."""
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4), steps=3, optimizer="sgd").run(progress=False)
    with lab.Training(cluster, model, lab.Parallel(dp=4, zero=1), optimizer="sgd") as training:
        training.step(1)
        training.relayout(lab.Parallel(dp=2, tp=2, zero=3))
        training.step(2)
    assert training.losses == pytest.approx(whole.losses, rel=1e-4)
    adamw = lab.Experiment(cluster, model, lab.Parallel(dp=4), steps=3).run(progress=False)
    assert whole.losses[-1] != pytest.approx(adamw.losses[-1], rel=1e-3)  # it did train with SGD


def test_a_rebuilt_world_releases_the_training(cluster):
    """leave_world (a failure, a rebuild) closes what the ranks held; the next step names the lost training."""
    training = lab.Training(cluster, lab.GPT(**TINY), lab.Parallel(dp=4))
    training.step(1)
    cluster._form_world()  # what the pool does after a failure
    assert cluster.run(live_training.held_keys) == [[]] * cluster.world_size
    with pytest.raises(LabError, match="no longer on the ranks"):
        training.step(1)


@pytest.mark.slow  # seven layouts built and loaded in turn: 20-35 s on two loaded cores
def test_relayout_keeps_the_weights(cluster):
    """Relayouts mid-run, one step apart, go on as the uninterrupted DP4 run (losses rtol 1e-4, parameters 1e-5).

    The hops cover DP4 -> TP2xDP2 ZeRO-3, ZeRO-3 DP4 -> PP2xTP2 1F1B and PP2xDP2 GPipe -> ZeRO-1 DP4, and the
    last two change the world size: ZeRO-1 DP4 -> DP2 on the pool's first two ranks -> TP2xDP2 on all four.
    """
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4), steps=8).run(return_params=True)
    hops = [lab.Parallel(dp=2, tp=2, zero=3), lab.Parallel(dp=4, zero=3),
            lab.Parallel(pp=2, tp=2, schedule="1f1b", microbatches=2),
            lab.Parallel(pp=2, dp=2, schedule="gpipe", microbatches=2), lab.Parallel(dp=4, zero=1),
            lab.Parallel(dp=2), lab.Parallel(dp=2, tp=2)]
    with lab.Training(cluster, model, lab.Parallel(dp=4)) as training:
        training.step(1)
        for parallel in hops:
            training.relayout(parallel)
            last = training.step(1, return_params=True)
            if parallel.world_size == 2:  # ranks 2 and 3 are beyond the layout, and still count the steps
                assert [r["strategy"] for r in last.layout[2:]] == ["idle", "idle"]
        assert training.parallel == hops[-1]
    assert training.losses == pytest.approx(whole.losses, rel=1e-4)
    params = {k: v for rank_params in last.params.values() for k, v in rank_params.items()}
    assert params.keys() == whole.params[0].keys()
    for name, value in params.items():  # attn.k.bias is rounding noise scaled by AdamW (test_layout_parity)
        worst = (torch.tensor(value) - torch.tensor(whole.params[0][name])).abs().max().item()
        assert worst <= (1e-4 if name.endswith("attn.k.bias") else 1e-5), f"{name}: max |diff| {worst:.1e}"


@pytest.mark.slow
def test_a_training_opened_on_fewer_ranks_than_the_pool_trains_on_its_first_ranks(cluster):
    # The same rule as a relayout to DP2 above, but from the start: the layout's world size reaches the ranks.
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4), steps=2).run()
    with lab.Training(cluster, model, lab.Parallel(dp=2)) as training:
        last = training.step(2)
        assert [r["strategy"] for r in last.layout[2:]] == ["idle", "idle"]
    assert training.losses == pytest.approx(whole.losses, rel=1e-4)


def _moment_placements(key: str) -> list[tuple[str, str, str]]:
    """(name, the parameter's placements, its AdamW first moment's) for each DTensor parameter on this rank."""
    build = live_training.held(key).build
    return [(name, str(p.placements), str(build.optimizer.state[p]["exp_avg"].placements))
            for name, p in build.params_module.named_parameters() if hasattr(p, "placements")]


def _gpt2():
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)


@pytest.mark.parametrize("make", [lambda: lab.GPT(**TINY), pytest.param(_gpt2, marks=pytest.mark.slow)],
                         ids=["gpt", "gpt2-fused-qkv"])
def test_the_optimizer_state_keeps_the_parameters_shards_through_a_relayout(cluster, make):
    """Under TP×FSDP the column-parallel weights are ``_StridedShard`` over dp (one box per rank: saved as they are)
    and GPT-2's fused q/k/v is strided by heads too (not one box: it passes through replicated). After a relayout
    every AdamW moment is sharded as its parameter is: none was left whole on every rank (ZeRO's saving lost, and a
    redistribution each step, which made every step after a load of the lab's GPT about twice as slow)."""
    with lab.Training(cluster, make(), lab.Parallel(dp=2, tp=2, zero=3), global_batch=8) as training:
        training.step(1)
        training.relayout(lab.Parallel(dp=2, tp=2, zero=3))
        for rank in cluster.run(_moment_placements, training.key):
            assert any("_StridedShard" in param for _, param, _ in rank)
            assert [(name, param) for name, param, moment in rank if moment != param] == []
