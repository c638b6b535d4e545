"""The async-save stager that reuses its buffers stages what DCP's own stager stages, save after save.

``kernels.checkpoint.staging_buffers.ReusedStagingBuffers`` deep-copies the first state dict through
DCP's ``DefaultStager`` and afterwards copies only tensor data into that copy. Each save's
staged dict must equal a fresh ``DefaultStager`` copy of the same state, must not change
when the training changes its tensors afterwards, and a state of another shape must get
a new deep copy. Told this rank's share (``only``), it copies only those tensors and names the
rest (``skipped``). The copy runs on the stager's own thread, so the training goes on
while it runs. One process, a gloo world of one (for the DTensor).
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kernels.checkpoint.staging_buffers import ReusedStagingBuffers


@pytest.fixture
def mesh(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def _state(mesh, scale: float) -> dict:
    return {"model": {"w": distribute_tensor(torch.arange(12.0).reshape(3, 4) * scale, mesh, [Shard(0)]),
                      "b": torch.full((4,), scale)},
            "optim": {"state.w.step": torch.tensor(scale), "settings.lr": 0.01 * scale},
            "rng": {"0": torch.get_rng_state()}}


def _plain(state) -> object:
    """Nested values with DTensors as their local tensors, for comparison."""
    if isinstance(state, dict):
        return {k: _plain(v) for k, v in state.items()}
    return state.to_local().clone() if isinstance(state, DTensor) else state


def _staged(stager: ReusedStagingBuffers, state: dict) -> dict:
    """What ``stage`` staged, once its copy is done."""
    out = stager.stage(state)
    stager.start()
    return out.result()


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_later_saves_copy_into_the_first_saves_buffers_and_equal_dcps_own_staging(mesh):
    library = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                           use_async_staging=False, use_non_blocking_copy=False))
    stager = ReusedStagingBuffers()
    first = _staged(stager, _state(mesh, 1.0))
    for scale in (2.0, 3.0):
        live = _state(mesh, scale)
        staged = _staged(stager, live)
        assert staged is first  # the same buffers
        assert _equal(_plain(staged), _plain(library.stage(live)))
        assert isinstance(staged["model"]["w"], DTensor) and staged["model"]["w"].placements == (Shard(0),)
        before = _plain(staged)
        live["model"]["w"].to_local().add_(100.0)  # the training goes on changing its tensors
        live["model"]["b"].add_(100.0)
        assert _equal(_plain(staged), before)
    assert stager.deep_copies == 1
    stager.close()
    library.close()


def test_a_state_of_another_shape_is_deep_copied_again(mesh):
    stager = ReusedStagingBuffers()
    first = _staged(stager, _state(mesh, 1.0))
    grown = _state(mesh, 1.0)
    grown["model"]["b"] = torch.ones(5)
    assert _staged(stager, grown) is not first and stager.deep_copies == 2
    renamed = _state(mesh, 1.0)
    renamed["model"]["c"] = renamed["model"].pop("b")
    again = _staged(stager, renamed)
    assert stager.deep_copies == 3 and torch.equal(again["model"]["c"], renamed["model"]["c"])
    stager.close()


def test_the_copy_runs_on_the_stagers_thread_from_start_while_the_caller_goes_on(mesh):
    stager = ReusedStagingBuffers()
    _staged(stager, _state(mesh, 1.0))
    where, copying, release = {}, threading.Event(), threading.Event()
    original = stager._copy

    def held_copy(state):  # the copy waits until the caller has gone on, which it could not if it ran inline
        where["thread"] = threading.current_thread().name
        copying.set()
        assert release.wait(10)
        return original(state)
    stager._copy = held_copy
    future = stager.stage(_state(mesh, 2.0))
    assert isinstance(future, Future) and not copying.wait(0.2)  # not before start: the caller is still saving
    stager.start()
    assert copying.wait(10) and not future.done()
    release.set()
    assert future.result()["model"]["b"][0] == 2.0 and where["thread"].startswith("lab-checkpoint-staging")
    stager.close()


def test_only_copies_this_ranks_share_and_names_what_it_skipped(mesh):
    stager = ReusedStagingBuffers()
    first = _staged(stager, _state(mesh, 1.0))
    stager.only(frozenset({"model.w", "rng.0"}))  # the flattened keys, as DCP's plan names them
    staged = _staged(stager, _state(mesh, 2.0))
    assert staged is first and stager.skipped == {"model.b", "optim.state.w.step"}
    assert torch.equal(staged["model"]["w"].to_local(), torch.arange(12.0).reshape(3, 4) * 2.0)  # copied
    assert torch.equal(staged["model"]["b"], torch.full((4,), 1.0))  # another rank's share: left as it was
    assert staged["optim"]["settings.lr"] == 0.02  # plain values are always fresh
    stager.only(None)
    _staged(stager, _state(mesh, 3.0))
    assert stager.skipped == frozenset() and torch.equal(staged["model"]["b"], torch.full((4,), 3.0))
    stager.close()
