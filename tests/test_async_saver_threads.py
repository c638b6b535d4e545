"""An asynchronous saver writes every save from one long-lived thread, and leaves no plans behind in DCP's caches.

``dcp.async_save`` starts a thread per save, and ``Thread.start`` waits for that thread to run,
which on ranks that outnumber the cores held the save call up for tens of milliseconds. The
saver's own writer thread must write every save, started once; DCP's process-wide plan cache
must see a key per saver that no later saver reuses, and lose the saver's entries when it closes.
"""
from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlanner

import kernels.checkpoint.async_save as async_save
from kernels.checkpoint.async_save import AsyncSaver
from kernels.checkpoint.save_load import load_checkpoint

PLAN_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
               "_cached_final_save_plan")


@pytest.fixture
def world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_every_save_is_written_by_the_savers_one_writer_thread(world, tmp_path, monkeypatch):
    writers, original = [], async_save.dcp.save

    def recorded(*args, **kwargs):
        writers.append((threading.current_thread().name, threading.get_ident()))
        return original(*args, **kwargs)

    monkeypatch.setattr(async_save.dcp, "save", recorded)
    model, optimizer = _model_and_optimizer()
    saver = AsyncSaver()
    threads = []
    for step in range(1, 4):
        _step(model, optimizer)
        saver.save(str(tmp_path / f"step_{step}"), model, optimizer, {"step": step})
        saver.staged()
        saver.wait()
        threads.append(threading.active_count())
    saver.close()
    assert len(writers) == 3 and len(set(writers)) == 1, writers  # one thread wrote all three saves
    assert writers[0][0].startswith("lab-checkpoint-writer"), writers
    assert threads[0] == threads[1] == threads[2], threads  # no thread started per save
    fresh, fresh_optimizer = _model_and_optimizer()
    _step(fresh, fresh_optimizer)
    load_checkpoint(str(tmp_path / "step_3"), fresh, fresh_optimizer)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_each_saver_caches_its_plans_under_a_key_of_its_own_and_drops_them_on_close(world, tmp_path):
    keys = []
    for run in range(2):  # the first saver is gone before the second is built, as between two runs
        model, optimizer = _model_and_optimizer()
        saver = AsyncSaver()
        key = saver.planner._cached_plans_key
        _step(model, optimizer)
        saver.save(str(tmp_path / f"run_{run}"), model, optimizer, {"step": 1})
        saver.wait()
        assert key in SavePlanner._cached_save_plan  # the plan cache is on
        saver.close()
        assert not any(key in getattr(SavePlanner, cache) for cache in PLAN_CACHES)
        keys.append(key)
        del saver
    assert keys[0] != keys[1]
    assert Path(tmp_path / "run_1").is_dir()
