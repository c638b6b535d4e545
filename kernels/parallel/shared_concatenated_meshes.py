"""FSDP2 over tensor parallelism builds one (dp, tp) mesh per parameter; while the lab shards, it builds one.

When ``fully_shard`` meets a parameter that is already a DTensor (TP's), each ``FSDPParam``
joins the dp mesh and the parameter's tp mesh into one 2-D mesh, through torch's private
``DeviceMesh._concatenate``. Every call builds a new ``DeviceMesh`` and works out its layout
again, though every parameter of the model passes the same two meshes: on this machine about 0.1 ms a
parameter, a third of what ``apply_fsdp`` costs a TP2×DP2 build of the lab's small GPT, and more
with more parameters (a 32-block Llama has about 290).

``one_mesh_per_pair()`` hands back the first mesh built for a given list of mesh objects to
every later call with the same list, while the block runs. The shared mesh is the one torch would
have built (same layout, rank map, names and groups): DTensor compares meshes by value, and
nothing writes to a concatenated mesh after ``_concatenate`` returns. The memo keys on the
input meshes' identities, which stay alive for the block (the parameters hold them), and it ends
with the block: a mesh destroyed later (``kernels.parallel.warm_meshes``) is never handed out.

``tests/test_shared_concatenated_meshes.py`` checks that every TP parameter gets the same mesh
and that it equals torch's own in every field FSDP reads.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch.distributed.device_mesh import DeviceMesh

_lock = threading.RLock()  # a nested block on the same thread restores the outer one's patch


@contextlib.contextmanager
def one_mesh_per_pair() -> Iterator[None]:
    """While the block runs on this thread, equal lists of meshes concatenate to one shared mesh."""
    torch_concatenate = DeviceMesh.__dict__.get("_concatenate")
    if not isinstance(torch_concatenate, staticmethod):  # a torch without it (or that changed it) keeps its own way
        yield
        return
    built: dict[tuple[int, ...], tuple[list[DeviceMesh], DeviceMesh]] = {}
    owner = threading.get_ident()

    def concatenate(device_mesh_list: list[DeviceMesh]) -> DeviceMesh:
        if threading.get_ident() != owner:  # another thread's sharding is not this block's
            return torch_concatenate.__func__(device_mesh_list)
        key = tuple(id(mesh) for mesh in device_mesh_list)
        if key not in built:  # the list itself is kept too, so that no id in a key is reused while the block runs
            built[key] = (list(device_mesh_list), torch_concatenate.__func__(device_mesh_list))
        return built[key][1]

    with _lock:  # one thread's block at a time
        DeviceMesh._concatenate = staticmethod(concatenate)  # type: ignore[method-assign]
        try:
            yield
        finally:
            DeviceMesh._concatenate = torch_concatenate  # type: ignore[method-assign]
