"""Meshes kept warm between runs: ``warm_mesh(key, build)`` reuses the groups of a mesh shape run before.

A run's first step under a layout pays for its mesh twice: the sub-groups (collective store
rendezvous, gloo connections) and DTensor's sharding propagation, whose cache keys on the mesh
and costs a few milliseconds per op signature on a miss (about half a second for the first
step of TP2×DP2 on this machine). A warm pool keeps the last ``capacity()`` meshes, by the key
the caller gives (the builder and the shape), with their groups alive and DTensor's caches
full, so a run under a shape run before finds both ready.

Every rank of the process group calls this for every run (mesh creation is collective), so
every rank keeps and evicts the same meshes in the same order. Kept meshes share the groups of
axes they have in common (``kernels.parallel.shared_mesh_groups``: DTensor's cache may hand one
layout's tensors another's equal mesh). An evicted mesh's groups that no kept mesh shares are
destroyed (``kernels.parallel.mesh.destroy_mesh_groups``), and DTensor's caches with them.
Leaving the world (a failure, a rebuilt pool) drops them all: they belong to the old world.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from kernels.engine.long_lived import thaw
from kernels.engine.runtime import on_leave_world
from kernels.parallel import shared_mesh_groups
from kernels.parallel.mesh import clear_dtensor_caches, destroy_mesh_groups, live_group_count, mesh_sub_groups

CPU_CAPACITY, GPU_CAPACITY = 6, 2  # an NCCL communicator holds device memory: fewer kept on a GPU

_meshes: OrderedDict[Hashable, DeviceMesh] = OrderedDict()
_users: dict[Hashable, int] = {}  # key -> builds holding the mesh now (a held training's stays in use between calls)
_axes: dict[Hashable, list[Hashable]] = {}  # key -> the shared axis groups its mesh was built with
_world: weakref.ref | None = None  # the default group the kept meshes were built in


def capacity(device_type: str) -> int:
    """How many meshes stay warm on a rank of this device type."""
    return GPU_CAPACITY if device_type == "cuda" else CPU_CAPACITY


def warm_mesh(key: Hashable, build: Callable[[], DeviceMesh], device_type: str) -> DeviceMesh:
    """The mesh kept under ``key`` in this world, else ``build()`` (collective) kept as the newest; the caller
    holds it until ``let_go(key)``.

    ``key`` must name everything ``build`` depends on. Beyond ``capacity`` the least recently
    used mesh that nobody holds is destroyed first, on every rank alike (every rank builds and
    lets go alike); a held training's mesh is never destroyed under it.
    """
    global _world
    world = dist.group.WORLD
    if _world is None or _world() is not world:
        forget()  # built in a world that is gone: its groups went with it
        _world = weakref.ref(world)
    if key not in _meshes:
        _evict(capacity(device_type) - 1)
        used: list[Hashable] = []
        with shared_mesh_groups.sharing_groups(used):
            try:
                mesh = build()
            except BaseException:
                shared_mesh_groups.release(used)  # a failed collective ends the world, and its groups with it
                raise
        _meshes[key], _axes[key] = mesh, used
    _meshes.move_to_end(key)
    _users[key] = _users.get(key, 0) + 1
    return _meshes[key]


def let_go(key: Hashable) -> None:
    """The build that got ``key``'s mesh is done with it (it stays warm, now evictable)."""
    if _users.get(key, 0) > 0:
        _users[key] -= 1


def _evict(keep: int) -> None:
    """Destroy the oldest meshes nobody holds until at most ``keep`` remain (or only held ones do)."""
    for key in [k for k in _meshes if not _users.get(k)]:
        if len(_meshes) <= keep:
            return
        destroy_mesh_groups(_meshes.pop(key), keep=shared_mesh_groups.release(_axes.pop(key, [])))
        _users.pop(key, None)
        thaw()  # the evicted mesh may sit in long-lived cycles: the run's closing collection frees them


def kept_meshes() -> list[str]:
    """What is kept warm on this rank, oldest first (each key's text)."""
    return [repr(key) for key in _meshes]


def unkept_group_count() -> int:
    """Process groups this rank holds beyond the warm meshes', the default one included: 1 means nothing leaked."""
    return live_group_count() - len(mesh_sub_groups(*_meshes.values())) if dist.is_initialized() else 0


def release_all() -> int:
    """Destroy every warm mesh's groups now, held or not (every rank calls it alike, with no training held
    that it wants to keep); returns how many groups."""
    destroyed = destroy_mesh_groups(*_meshes.values()) if _meshes and dist.is_initialized() else 0
    _meshes.clear()
    _users.clear()
    _axes.clear()
    shared_mesh_groups.forget()
    return destroyed


def forget() -> None:
    """Drop the kept meshes without touching their groups (the world they lived in is being destroyed)."""
    _users.clear()
    _axes.clear()
    shared_mesh_groups.forget()
    if _meshes:
        clear_dtensor_caches()  # they hold the meshes, and the meshes their groups
        _meshes.clear()
        thaw()  # so that the collection after the world's end frees the groups' cycles


on_leave_world(forget)
