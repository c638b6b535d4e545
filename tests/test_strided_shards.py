"""The rule that decides which DTensor shards a checkpoint writes as they are, against the shards themselves.

``is_one_box`` says whether a rank's shard is a single box of the global tensor (what DCP can
describe with one offset and shape). Here each of 4 ranks of a 2×2 mesh (torch's fake process
group: one process plays each rank in turn, no communication) shards a numbered tensor under
the placements the lab's layouts produce, and the test compares the rank's real local tensor with
the box DCP would read for it: the rule must say "one box" exactly when they agree on every rank.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from kernels.checkpoint.strided_shards import is_one_box

PLACEMENTS = {
    "dp-then-tp rows": (Shard(0), Shard(0)),
    "fsdp over tp colwise": (_StridedShard(0, split_factor=2), Shard(0)),
    "fsdp over tp rowwise": (Shard(0), Shard(1)),
    "strided with nothing after": (_StridedShard(0, split_factor=2), Shard(1)),
    "fused qkv rows by heads": (Replicate(), _StridedShard(0, split_factor=3)),
    "fused qkv columns by heads": (Replicate(), _StridedShard(1, split_factor=3)),
    "fsdp over fused qkv": (Shard(0), _StridedShard(0, split_factor=3)),
    "strided over strided": (_StridedShard(0, split_factor=6), _StridedShard(0, split_factor=3)),
    "replicated": (Replicate(), Replicate()),
}


def _shard_is_its_box(rank: int, placements) -> bool:
    numbered = torch.arange(24 * 12).reshape(24, 12)
    dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        local = distribute_tensor(numbered, mesh, placements, src_data_rank=None).to_local()
        shape, offset = compute_local_shape_and_global_offset(numbered.shape, mesh, placements)
        box = numbered[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        return torch.equal(box, local)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_the_rule_says_one_box_exactly_when_every_rank_holds_its_box(name):
    assert not dist.is_initialized(), "a process group leaked into the test process"
    placements = PLACEMENTS[name]
    holds_its_box = [_shard_is_its_box(rank, placements) for rank in range(4)]
    assert is_one_box(placements, (2, 2)) == all(holds_its_box), holds_its_box
    assert len(set(holds_its_box)) == 1  # a layout is a box on every rank or on none, here
