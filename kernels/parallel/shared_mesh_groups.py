"""Kept meshes share their process groups: a mesh axis over the same ranks, under the same name, gets one group.

Why: DTensor's sharding-propagation cache compares meshes by value (the ranks, the layout and the
axis names), not by object. A run under layout B whose tensors sit on a mesh equal to one of layout
A's (the "tp" axis over ranks 0-1, say) is handed the output specs cached for A, so B's tensors then
name A's mesh object and, through it, A's groups. When the warm pool evicted A's mesh and destroyed
its groups while B was held, B's next step failed ("Could not resolve the process group registered
under the name N"). Meshes that compare equal here use the same groups, and a group is destroyed
only when the last kept mesh using it goes (``kernels.parallel.warm_meshes``), so a spec handed
over by such a cache hit always names groups that are alive.

The groups are handed out by wrapping torch's ``DeviceMesh._init_one_process_group`` (private,
torch 2.13) while a kept mesh is built; a torch whose method has another signature is left alone
and builds its own groups, as before. Every rank builds and evicts the same meshes in the same
order, so every rank skips the same group creations (which are collective) alike.
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Hashable, Iterator

from torch.distributed.device_mesh import DeviceMesh

_PARAMETERS = ["sub_layout", "rank_map", "dim_name", "backend_override"]

_names: dict[Hashable, str | None] = {}  # axis key -> this rank's group on it (None: not a member)
_users: dict[Hashable, int] = {}  # axis key -> kept meshes built with it


def _torch_init_one():
    """torch's per-axis group builder when its signature is the one this module wraps, else None."""
    method = DeviceMesh.__dict__.get("_init_one_process_group")
    if not isinstance(method, staticmethod):
        return None
    try:
        names = list(inspect.signature(method.__func__).parameters)
    except (TypeError, ValueError):
        return None
    return method if names == _PARAMETERS else None


@contextlib.contextmanager
def sharing_groups(used: list[Hashable]) -> Iterator[None]:
    """While the block builds meshes on this thread, an axis whose groups a kept mesh already has gets those;
    ``used`` receives the key of every axis built (pass them to ``release`` when the mesh goes)."""
    torch_init_one = _torch_init_one()
    if torch_init_one is None:
        yield
        return

    def init_one(sub_layout, rank_map, dim_name, backend_override):
        key = _axis_key(sub_layout, rank_map, dim_name, backend_override)
        if key is None:  # a backend of its own for this axis: torch builds it, unshared
            return torch_init_one.__func__(sub_layout, rank_map, dim_name, backend_override)
        if key not in _names:
            _names[key] = torch_init_one.__func__(sub_layout, rank_map, dim_name, backend_override)
        _users[key] = _users.get(key, 0) + 1
        used.append(key)
        return _names[key]

    DeviceMesh._init_one_process_group = staticmethod(init_one)  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh._init_one_process_group = torch_init_one  # type: ignore[method-assign]


def _axis_key(sub_layout, rank_map, dim_name: str, backend_override) -> Hashable | None:
    if tuple(backend_override) != (None, None):
        return None
    key = (dim_name, sub_layout, tuple(rank_map.flatten().tolist()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def release(used: list[Hashable]) -> set[str]:
    """A kept mesh built with the axes ``used`` is going: the names of this rank's groups among them that another
    kept mesh still uses (the caller destroys the rest)."""
    for key in used:
        _users[key] -= 1
    still = {_names[key] for key in used if _users[key] > 0 and _names[key] is not None}
    for key in [k for k in used if _users.get(k) == 0]:
        _users.pop(key, None)
        _names.pop(key, None)
    return still


def forget() -> None:
    """Drop every shared group's record (their world is gone, or every kept mesh was destroyed)."""
    _names.clear()
    _users.clear()
