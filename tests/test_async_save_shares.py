"""An asynchronous save copies to CPU memory only this rank's share of a replicated state, and every save stays whole.

On each rank of the 4-rank gloo pool, a small model and its AdamW state are the same on every
rank (as under DDP), so DCP gives each tensor to one rank to write. ``AsyncSaver`` saves three
times, the model training in between. From the second save on, each rank's stager must skip
the tensors the first save's plan gave other ranks, and the ranks together must still write
every tensor: each checkpoint, loaded into a fresh model and optimizer, must equal the state
at the moment it was saved, bit for bit. A save whose plan would write a skipped tensor (the
ranks' shares changed) must fail rather than write a stale copy.
"""
from __future__ import annotations

import torch


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # every rank alike: replicated, as under DDP
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _save_three_times(root: str) -> dict:
    """On every rank: what each save skipped, and whether each loaded checkpoint equals the state saved."""
    import torch.distributed as dist

    from kernels.checkpoint.async_save import AsyncSaver
    from kernels.checkpoint.save_load import load_checkpoint

    model, optimizer = _model_and_optimizer()
    saver, skipped, expected = AsyncSaver(), [], []
    for step in range(1, 4):
        _train_step(model, optimizer, step)
        saver.save(f"{root}/step_{step}", model, optimizer, {"step": step})
        saver.staged()
        skipped.append(sorted(saver.stager.skipped))
        expected.append(({k: v.clone() for k, v in model.state_dict().items()},
                         {p: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state_dict()["state"].items()}))
        _train_step(model, optimizer, 100 + step)  # the training changes the tensors while the write goes on
    saver.close()
    equal = []
    for step, (weights, state) in enumerate(expected, start=1):
        fresh, fresh_optimizer = _model_and_optimizer()
        _train_step(fresh, fresh_optimizer, 0)  # the optimizer holds state to load into
        load_checkpoint(f"{root}/step_{step}", fresh, fresh_optimizer)
        loaded = fresh_optimizer.state_dict()["state"]
        equal.append(all(torch.equal(weights[k], v) for k, v in fresh.state_dict().items())
                     and all(torch.equal(state[p][k], loaded[p][k]) for p in state for k in state[p]))
    return {"rank": dist.get_rank(), "skipped": skipped, "equal": equal,
            "tensors": len(model.state_dict()) + sum(len(s) for s in optimizer.state_dict()["state"].values())}


def _write_a_skipped_tensor(root: str) -> str:
    """On every rank: the error of a save whose plan writes a tensor this rank's copy skipped."""
    from kernels.checkpoint.async_save import AsyncSaver

    model, optimizer = _model_and_optimizer()
    saver = AsyncSaver()
    _train_step(model, optimizer, 1)
    saver.save(f"{root}/step_1", model, optimizer, {"step": 1})
    saver.wait()
    everything = saver.planner.written()
    saver.planner.written = lambda: frozenset(sorted(everything)[:1])  # pretend this rank's share was one tensor
    saver.save(f"{root}/step_2", model, optimizer, {"step": 2})
    try:
        saver.wait()
    except BaseException as error:  # DCP's CheckpointException (a BaseException) carries the failed rank's error
        return f"{type(error).__name__}: {error}"
    finally:
        saver.close()  # the failed save is no longer pending: this frees the buffers and the saver's group
    return ""


def test_each_rank_copies_its_share_and_every_save_loads_as_saved(cluster, tmp_path):
    results = cluster.run(_save_three_times, str(tmp_path))
    for r in results:
        assert r["equal"] == [True, True, True], r
        assert r["skipped"][0] == [], r  # the first save copies everything: no plan yet
    for later in (1, 2):
        shares = [r["tensors"] - len(r["skipped"][later]) for r in results]
        assert all(0 < share < r["tensors"] for share, r in zip(shares, results)), shares  # each copies a part
        assert sum(shares) >= results[0]["tensors"]  # together, every tensor


def test_a_plan_that_writes_a_skipped_tensor_fails_instead_of_writing_it_stale(cluster, tmp_path):
    errors = cluster.run(_write_a_skipped_tensor, str(tmp_path))
    assert all(errors), errors  # every rank's save failed
    assert any("skipped as another rank's share" in e for e in errors), errors
    assert not (tmp_path / "step_2").exists()  # never named whole
