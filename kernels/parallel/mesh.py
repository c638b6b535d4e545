"""The rank grid: ``ParallelDims`` and the (pp, dp, tp) DeviceMesh every layout uses.

Algorithm: the 3D device mesh of Megatron-LM (Narayanan et al., 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") as torchtitan
builds it: ranks ``arange(world).view(pp, dp, tp)``, so tp varies fastest and a
tensor-parallel group is made of neighbouring ranks (one host, the fastest links).
Rank r sits at ``pp = r // (dp*tp)``, ``dp = (r // tp) % dp``, ``tp = r % tp``.
``ParallelDims.order`` may lay the ranks out in another order (``rank_grid``), e.g.
("pp", "tp", "dp") puts each tp group's ranks dp apart, on different hosts: a way to see
what TP across hosts costs (docs/design.md#traffic-inside-and-across-hosts).

``ParallelDims`` checks ``dp * tp * pp == world_size`` with a readable error.
"axis" here means a mesh axis ("pp", "dp", "tp"); "dim" means a tensor dimension.

HSDP needs the dp axis split into (dp_replicate, dp_shard), dp = dp_replicate * dp_shard;
``build_hsdp_mesh`` builds that 2D sub-mesh over the same rank order with the public
``DeviceMesh`` constructor.

Run alone (prints each rank's coordinates and groups)::

    torchrun --nproc-per-node 4 -m kernels.parallel.mesh
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from kernels.contract.layout_rules import MESH_AXES, coords, mesh_order_problems


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1  # data-parallel degree: replicas (DDP) or shards (ZeRO/FSDP)
    tp: int = 1  # tensor-parallel degree (Megatron column/row split)
    pp: int = 1  # pipeline-parallel degree
    world_size: int = 1  # must equal dp * tp * pp
    dp_replicate: int = 1  # HSDP: replica groups of the data axis (1 without HSDP); dp_shard = data // dp_replicate
    cp: int = 1  # context-parallel degree: each dp replica's sequences split over cp ranks (inside the data axis)
    ep: int = 1  # expert-parallel degree: each MoE layer's experts split over groups of ep dp ranks
    # Rank order over the axes, outermost first: the default keeps tp on neighbouring ranks (one
    # host); another order (e.g. ("pp", "tp", "dp")) spreads tp over hosts, to see what that costs.
    order: tuple[str, ...] = MESH_AXES

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "world_size", "dp_replicate", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims.{name} must be a positive int, got {value!r}")
        if self.data * self.tp * self.pp != self.world_size:
            raise ValueError(f"ParallelDims: dp*cp*tp*pp = {self.dp}*{self.cp}*{self.tp}*{self.pp} = "
                             f"{self.data * self.tp * self.pp} must equal the world size {self.world_size}")
        if mesh_order_problems(self.order):
            raise ValueError(f"ParallelDims.order must name pp, dp and tp once each, got {self.order!r}")
        if self.data % self.dp_replicate:
            raise ValueError(f"ParallelDims: dp_replicate={self.dp_replicate} must divide dp*cp={self.data}")
        if self.dp % self.ep:
            raise ValueError(f"ParallelDims: ep={self.ep} must divide dp={self.dp}")

    @property
    def data(self) -> int:
        """Ranks on the mesh's "dp" axis, whose gradients meet: dp replicas times their cp sequence shards."""
        return self.dp * self.cp

    @property
    def dp_shard(self) -> int:
        """Ranks one parameter is sharded over (HSDP's shard group; the whole data axis without HSDP)."""
        return self.data // self.dp_replicate

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index on each mesh axis, from the row-major rank order ``order`` ((pp, dp, tp) by default).

        With cp > 1 the data axis index d splits into the replica ``dp`` = d // cp and ``cp`` = d % cp.
        """
        out = coords(rank, {"pp": self.pp, "dp": self.data, "tp": self.tp}, self.order)
        out = {axis: out[axis] for axis in MESH_AXES}
        if self.cp > 1:
            out["dp"], out["cp"] = divmod(out["dp"], self.cp)
        return out

    def batch_rank(self, data_rank: int) -> int:
        """The dp replica whose share of the batch the rank at ``data_rank`` on the data axis reads (cp ranks share one)."""
        return data_rank // self.cp


def build_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The (pp, dp, tp) mesh over ranks 0..dims.world_size-1; pass "cpu" explicitly on CPU (FSDP2 + gloo, docs/design.md#fsdp2-on-cpu).

    Its "dp" axis is the data axis of ``dims.data`` = dp · cp ranks: every rank on it holds the same
    weights, so DDP, FSDP and the loss average over it; ``build_cp_mesh`` splits it into the ring groups.

    Every rank of the process group must call it (group creation is collective); a
    rank beyond ``dims.world_size`` gets a mesh with ``get_coordinate() is None``.
    """
    if tuple(dims.order) == MESH_AXES:
        return init_device_mesh(device_type, (dims.pp, dims.data, dims.tp), mesh_dim_names=MESH_AXES)
    return DeviceMesh(device_type, rank_grid(dims), mesh_dim_names=MESH_AXES)


def rank_grid(dims: ParallelDims) -> torch.Tensor:
    """The (pp, dp, tp) grid of global ranks: laid out row-major in ``dims.order``, then the axes put
    back to (pp, dp, tp) so that every user indexes it alike."""
    sizes = {"pp": dims.pp, "dp": dims.data, "tp": dims.tp}
    grid = torch.arange(dims.world_size).view(*(sizes[a] for a in dims.order))
    return grid.permute(*(dims.order.index(a) for a in MESH_AXES)).contiguous()


def build_hsdp_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The 2D (dp_replicate, dp_shard) sub-mesh for HSDP, over the same rank grid as ``build_mesh``.

    dp index = replicate_index * dp_shard + shard_index, so a shard group is made of
    dp-neighbours. Every rank builds the whole 4D grid (new groups are collective).
    """
    grid = rank_grid(dims).reshape(dims.pp, dims.dp_replicate, dims.dp_shard, dims.tp)
    full = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    return full["dp_replicate", "dp_shard"]


def build_cp_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The 1D "cp" mesh of this rank's ring: the cp ranks of one dp replica (neighbours on the data axis)."""
    grid = rank_grid(dims).reshape(dims.pp, dims.dp, dims.cp, dims.tp)
    return DeviceMesh(device_type, grid, mesh_dim_names=("pp", "dp_replica", "cp", "tp"))["cp"]


def build_ep_mesh(dims: ParallelDims, device_type: str = "cpu") -> DeviceMesh:
    """The 2D ("ep_replicate", "ep") mesh of the experts: groups of ep dp-neighbours split the experts, and the
    dp / ep groups replicate them (their gradients are summed over "ep_replicate")."""
    grid = rank_grid(dims).reshape(dims.pp, dims.dp // dims.ep, dims.ep, dims.tp)
    full = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "ep_replicate", "ep", "tp"))
    return full["ep_replicate", "ep"]


# --- per-axis helpers ------------------------------------------------------------------
def dp_rank(mesh: DeviceMesh) -> int:
    return mesh.get_local_rank("dp")


def dp_world_size(mesh: DeviceMesh) -> int:
    return mesh.size(MESH_AXES.index("dp"))


def dp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    return mesh.get_group("dp")


def tp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    return mesh.get_group("tp")


def pp_rank(mesh: DeviceMesh) -> int:
    return mesh.get_local_rank("pp")


def pp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    return mesh.get_group("pp")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's own tensor: a DTensor's local shard (outside grad mode, the shard itself, so in-place
    work on it lands in the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def dtensor_like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (shaped as ``p``'s local shard) as a DTensor on ``p``'s mesh and placements; itself when ``p`` is plain."""
    if not isinstance(p, DTensor):
        return local
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def destroy_mesh_groups(*meshes: DeviceMesh | None, keep: frozenset[str] | set[str] = frozenset()) -> int:
    """Destroy the sub-groups these meshes created, but the default (world) group and those named in ``keep``
    (another kept mesh shares them: ``kernels.parallel.shared_mesh_groups``).

    A mesh axis that spans every rank may reuse the default group, so that one is
    skipped. Groups are taken from each mesh's *root*: a sub-mesh (``mesh["dp"]``,
    ``build_hsdp_mesh``'s 2D slice of a 4D grid) only names its own axes, but the
    root created groups for every axis (and for any flattened axes, which torch
    2.13 files in the root's ``_pg_registry``). Returns how many were destroyed.

    DTensor's sharding-propagation cache keys on meshes, and two meshes over the
    same ranks compare equal whatever their groups: left alone, the next run's
    DTensors would be given this run's (destroyed) mesh by a cache hit ("Could not
    resolve the process group registered under the name N"). DTensor's
    redistribution caches hold meshes too, and a root mesh holds its groups: left
    filled, every run's destroyed groups stay alive on a warm pool, gloo threads,
    sockets and buffers included. So every such cache is cleared first, while these
    groups are still alive (torch has no public call for this; ``clear_dtensor_caches``).
    """
    clear_dtensor_caches()
    roots = _roots(meshes)
    seen = {i: group for i, group in _root_groups(roots).items() if group.group_name not in keep}
    for group in seen.values():
        dist.destroy_process_group(group)
    # A gloo group closes its connections only once freed, and DTensor's other caches keep
    # meshes alive across runs: without this each run would leave its groups' sockets open,
    # and a mesh over the whole world would keep the world's group alive after it is destroyed.
    for root in roots:
        getattr(root, "_pg_registry", {}).clear()
    return len(seen)


def _roots(meshes: tuple[DeviceMesh | None, ...]) -> list[DeviceMesh]:
    return [mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh for mesh in meshes
            if mesh is not None and mesh.get_coordinate() is not None]  # a non-member created no groups here


def mesh_sub_groups(*meshes: DeviceMesh | None) -> dict[int, dist.ProcessGroup]:
    """The groups these meshes' roots created (flattened axes included), by id; the default group left out."""
    return _root_groups(_roots(meshes))


def _root_groups(roots: list[DeviceMesh]) -> dict[int, dist.ProcessGroup]:
    world, seen = dist.group.WORLD, {}
    for root in roots:
        for group in [*root.get_all_groups(), *getattr(root, "_pg_registry", {}).values()]:
            if group is not None and group is not world:
                seen.setdefault(id(group), group)
    return seen


def live_group_count() -> int:
    """Process groups this rank holds, the default one included (the warm meshes' too:
    ``kernels.parallel.warm_meshes.unkept_group_count`` is the count that says whether a run leaked).

    torch has no public registry of groups; ``distributed_c10d._world.pg_map`` is the
    private one that ``destroy_process_group`` removes from.
    """
    from torch.distributed import distributed_c10d as c10d
    return len(c10d._world.pg_map) if dist.is_initialized() else 0


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches that hold meshes (sharding propagation, redistribution plans, topologies)."""
    # Private torch names, looked up softly: a torch without one of them has nothing to clear there.
    from torch.distributed.tensor import _collective_utils, _redistribute, debug
    topology = getattr(_collective_utils, "MeshTopoInfo", None)
    for clear in (getattr(debug, "_clear_sharding_prop_cache", None),  # op schema -> output specs
                  getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),  # spec pairs
                  getattr(_redistribute, "clear_redistribute_planner_cache", None),  # a planner per mesh
                  getattr(getattr(topology, "build_from_mesh", None), "cache_clear", None)):  # mesh -> topology
        if clear is not None:
            clear()


def _main() -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    dims = ParallelDims(dp=max(1, world // 2), tp=2 if world % 2 == 0 else 1, world_size=world)
    mesh = build_mesh(dims, "cpu")
    r = dist.get_rank()
    print(f"rank {r}: {dims.coords(r)}  dp group {dist.get_process_group_ranks(dp_group(mesh))}  "
          f"tp group {dist.get_process_group_ranks(tp_group(mesh))}")
    destroy_mesh_groups(mesh)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
