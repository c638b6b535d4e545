"""Kept meshes share the groups of equal axes, and an evicted mesh takes only the groups nobody else uses
(``kernels.parallel.shared_mesh_groups`` through ``kernels.parallel.warm_meshes``).

One process plays rank 0 of a 4-rank world on torch's fake process group: groups are created, named and
destroyed as on real ranks, and a collective resolves its group by name (a destroyed one raises), though
nothing is sent.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from kernels.parallel import warm_meshes
from kernels.parallel.mesh import ParallelDims, build_mesh, live_group_count

TP_DP = ParallelDims(dp=2, tp=2, world_size=4)
PP_TP = ParallelDims(pp=2, tp=2, world_size=4)
PP_DP = ParallelDims(pp=2, dp=2, world_size=4)


@pytest.fixture
def world(monkeypatch):
    monkeypatch.setattr(warm_meshes, "CPU_CAPACITY", 2)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield
    finally:
        warm_meshes.release_all()
        dist.destroy_process_group()


def _kept(dims: ParallelDims) -> DeviceMesh:
    return warm_meshes.warm_mesh(("build_mesh", dims), lambda: build_mesh(dims), "cpu")


def _alive(name: str) -> bool:
    return name in {group.group_name for group in dist.distributed_c10d._world.pg_map}


def test_equal_axes_share_one_group_and_other_axes_do_not(world):
    torch_init_one = DeviceMesh.__dict__["_init_one_process_group"]
    a, b = _kept(TP_DP), _kept(PP_TP)
    assert a["tp"] == b["tp"] and a["tp"].get_group() is b["tp"].get_group()
    assert a["dp"].get_group() is not b["pp"].get_group()  # the same ranks ({0, 2}, {1, 3}) on another axis
    assert DeviceMesh.__dict__["_init_one_process_group"] is torch_init_one  # torch's own again after the builds
    assert warm_meshes.unkept_group_count() == 1


def test_an_evicted_mesh_leaves_alive_the_groups_a_held_layouts_tensors_name(world):
    a = _kept(TP_DP)
    torch.manual_seed(0)
    on_a = distribute_tensor(torch.randn(4, 4), a["tp"], [Shard(0)])
    (on_a * 2).full_tensor()  # DTensor caches this op's answer, naming a's "tp" mesh
    warm_meshes.let_go(("build_mesh", TP_DP))
    b = _kept(PP_TP)  # held from here on
    on_b = distribute_tensor(torch.randn(4, 4), b["tp"], [Shard(0)]) * 2  # may be handed a's mesh by that cache
    dp_of_a = a["dp"].get_group().group_name
    _kept(PP_DP)  # over the capacity of 2: a, the only mesh nobody holds, is evicted
    assert warm_meshes.kept_meshes() == [repr(("build_mesh", PP_TP)), repr(("build_mesh", PP_DP))]
    on_b.full_tensor()  # its mesh's "tp" group is still alive, whichever mesh object it names
    assert not _alive(dp_of_a), "the evicted mesh's own axis outlived it"
    assert warm_meshes.unkept_group_count() == 1


def test_a_shared_group_goes_with_the_last_mesh_using_it(world):
    _kept(TP_DP)
    warm_meshes.let_go(("build_mesh", TP_DP))
    tp = _kept(PP_TP)["tp"].get_group().group_name
    warm_meshes.let_go(("build_mesh", PP_TP))
    _kept(PP_DP)  # evicts TP_DP: PP_TP still uses the tp group
    assert _alive(tp)
    _kept(TP_DP)  # evicts PP_TP, the tp group's last user, before building TP_DP's anew
    assert not _alive(tp)
    assert warm_meshes.unkept_group_count() == 1
    warm_meshes.release_all()
    assert live_group_count() == 1  # the world's group alone
