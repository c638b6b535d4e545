"""Which DTensor shards DCP can describe as they are, and the replicated form of the ones it cannot.

DCP describes each rank's shard by one offset and one shape (``compute_local_shape_and_global_offset``):
a single box of the global tensor. Most shards are one: ``Shard`` on any dims, and FSDP2 over a
tensor-parallel parameter, whose ``_StridedShard(d, split_factor=k)`` on the dp dim is followed by
the ``Shard(d)`` over k tp ranks it was split for (the tp piece is taken first, then cut by dp:
one box). A strided shard that nothing later undoes, such as GPT-2's fused q/k/v sharded by heads
(``_StridedShard(1, split_factor=3)``, three pieces per rank), is not a box: those tensors pass
through a checkpoint replicated on their strided mesh dims, at one all-gather each, and loading
copies them back into the strided parameter (DTensor's ``copy_`` redistributes).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard


def is_one_box(placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    """True when every rank's local shard under ``placements`` is one box of the global tensor.

    A ``_StridedShard(d, split_factor=k)`` keeps the box when the ``Shard(d)`` placements after it
    span exactly k ranks (FSDP2 over TP); any other strided shard scatters the rank's rows.
    """
    for i, placement in enumerate(placements):
        if not isinstance(placement, _StridedShard):
            continue
        later = [(p, n) for p, n in zip(placements[i + 1:], mesh_shape[i + 1:])
                 if isinstance(p, (Shard, _StridedShard)) and p.dim == placement.dim]
        if any(isinstance(p, _StridedShard) for p, _ in later):
            return False
        if placement.split_factor != math.prod(n for _, n in later):
            return False
    return True


def _describable(value: Any) -> Any:
    if not isinstance(value, DTensor) or is_one_box(value.placements, value.device_mesh.shape):
        return value
    return value.redistribute(placements=[Replicate() if isinstance(p, _StridedShard) else p
                                          for p in value.placements])


def described(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as DCP can describe it: each DTensor whose shard is not one box replicated on its strided dims.

    The others are the very tensors of ``state``, so a load into them lands in place.
    """
    return {k: _describable(v) for k, v in state.items()}


def placed_like(loaded: dict[str, Any], originals: dict[str, Any]) -> dict[str, Any]:
    """``loaded`` (a ``described`` state read back) in the placements of ``originals``.

    The optimizer keeps the placements of the state it is handed: AdamW moments left replicated
    would stay whole on every rank (ZeRO's saving lost) and cost a redistribution each step.
    """
    return {k: v.redistribute(placements=originals[k].placements)
            if isinstance(originals.get(k), DTensor) and v is not originals[k] else v for k, v in loaded.items()}
