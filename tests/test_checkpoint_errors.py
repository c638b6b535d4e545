"""Nothing lost, nothing half-written: a save killed half-way, another model, a missing checkpoint, a bad layout.

A checkpoint counts once every rank has written it (rank 0 renames ``step_N.partial`` to
``step_N`` last), so a rank killed inside a save leaves the previous checkpoint listed and
loadable and the half-written one unlisted. Each bad resume raises its own error, naming
the cause, before anything launches. The weights also travel as one safetensors file
(``lab.export``) that loads into any layout.
"""
from __future__ import annotations

import os
import signal
import warnings

import pytest

import lab
from kernels.checkpoint.files import PARTIAL_SUFFIX, step_dir
from kernels.train.entry import train_rank

MODEL = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}

pytestmark = pytest.mark.usefixtures("one_thread")


def _experiment(pool, model: dict = MODEL, parallel: dict | None = None, **kwargs) -> lab.Experiment:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.LayoutWarning)
        return lab.Experiment(pool, lab.GPT(**model), lab.Parallel(**(parallel or {"dp": 4})), **kwargs)


@pytest.fixture(scope="module")
def saved(cluster, tmp_path_factory):
    """Two steps of ZeRO-3 DP4 with a checkpoint after each: (the run, the checkpoint directory)."""
    root = str(tmp_path_factory.mktemp("ckpts"))
    run = _experiment(cluster, {**MODEL}, {"dp": 4, "zero": 3}, steps=2, checkpoint_dir=root, checkpoint_every=1).run()
    return run, root


def _die_in_second_save(cfg: dict) -> dict:
    """Rank 1 SIGKILLs itself as it starts writing its share of the second checkpoint."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter

    if dist.get_rank() == 1:
        write, saves = FileSystemWriter.write_data, []

        def write_or_die(self, plan, planner):
            saves.append(plan)
            if len(saves) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, plan, planner)

        FileSystemWriter.write_data = write_or_die
    return train_rank(cfg)


@pytest.mark.slow  # the pool restarts after the kill
def test_a_save_killed_half_way_leaves_the_previous_checkpoint(cluster, tmp_path):
    root = str(tmp_path / "ckpts")
    exp = _experiment(cluster, steps=3, checkpoint_dir=root, checkpoint_every=1)
    with pytest.raises(lab.DeadRankError):
        cluster.run(_die_in_second_save, exp.config(), timeout=120)
    cluster.restart()
    assert [c.step for c in lab.checkpoints(root)] == [1]  # the half-written step 2 is not listed
    partial = step_dir(root, 2).with_name("step_000002" + PARTIAL_SUFFIX)
    assert partial.is_dir() and not step_dir(root, 2).exists()
    with pytest.raises(lab.CheckpointMissingError, match=r"partial.*missing \.metadata, meta\.json"):
        _experiment(cluster, steps=3, resume_from=str(partial)).run()
    resumed = _experiment(cluster, steps=3, resume_from=root).run()  # the latest complete one: step 1
    whole = _experiment(cluster, steps=3).reference()
    assert resumed.steps_ran == [2, 3]
    assert resumed.losses == pytest.approx(whole.losses[1:], rel=1e-4)


def test_a_checkpoint_of_another_model_names_the_mismatched_keys_and_shapes(cluster, saved):
    _, root = saved
    wider = {**MODEL, "d_model": 48, "heads": 4}
    with pytest.raises(lab.CheckpointMismatchError, match=r"tok_emb\.weight: checkpoint \[64, 32\], model \[64, 48\]"):
        _experiment(cluster, wider, steps=4, resume_from=root).run()


def test_a_missing_checkpoint_names_the_path_and_what_is_missing(cluster, saved, tmp_path):
    _, root = saved
    with pytest.raises(lab.CheckpointMissingError, match="step_000009: the path does not exist"):
        _experiment(cluster, steps=4, resume_from=os.path.join(root, "step_000009")).run()
    with pytest.raises(lab.CheckpointMissingError, match="no complete checkpoint under"):
        _experiment(cluster, steps=4, resume_from=str(tmp_path)).reference()
    deeper = {**MODEL, "layers": 3}  # shapes agree, one block more: its tensors are missing
    with pytest.raises(lab.CheckpointMissingError, match=r"lacks .* first: model\.blocks\.2\."):
        _experiment(cluster, deeper, steps=4, resume_from=root).run()
    with pytest.raises(lab.ParallelConfigError, match=r"\[checkpoint\].*at step 2 and steps=2"):
        _experiment(cluster, steps=2, resume_from=root).run()
    with pytest.raises(lab.ParallelConfigError, match=r"\[checkpoint\].*holds adamw's state and this run's "
                                                      r"optimizer is sgd"):
        _experiment(cluster, steps=4, optimizer="sgd", resume_from=root).run()


def test_a_layout_invalid_for_the_model_names_its_rule(cluster, saved):
    _, root = saved
    with pytest.raises(lab.ParallelConfigError, match=r"\[tp-heads\]"):
        _experiment(cluster, {**MODEL, "heads": 2}, {"tp": 4}, steps=4, resume_from=root)


def test_exported_weights_load_into_another_layout_like_into_one_process(cluster, saved, tmp_path):
    _, root = saved
    out = lab.export(lab.checkpoints(root)[-1], tmp_path / "model.safetensors")
    from safetensors import safe_open

    from kernels.model.gpt import build_gpt

    from kernels.model.family import model_config
    from kernels.contract.run_config import RunConfig

    with safe_open(str(out), "pt") as f:
        assert sorted(f.keys()) == sorted(build_gpt(model_config(RunConfig(model=MODEL))).state_dict())
    on_ranks = _experiment(cluster, parallel={"dp": 2, "tp": 2}, steps=2, resume_from=str(out)).run()
    in_one = _experiment(cluster, parallel={"dp": 2, "tp": 2}, steps=2, resume_from=str(out)).reference()
    fresh = _experiment(cluster, steps=2).reference()
    assert on_ranks.steps_ran == [1, 2]  # weights only: the optimizer and the data start again
    assert on_ranks.losses == pytest.approx(in_one.losses, rel=1e-4)
    assert on_ranks.losses[0] < fresh.losses[0]  # trained weights, not the initial ones
