"""Which of a rank's bytes stay inside its host and which cross to another: measured and planned.

Counted as a ring counts them (nccl-tests, docs/design.md#bus-bandwidth): a rank sends
payload × busbw factor of each collective to the next rank of its group, in the group's
rank order, and a p2p send's payload to its peer. Those bytes are *inter-host* when the
receiving rank is on another host, *intra-host* otherwise.

- measured: the meter records each call's group (as torch.distributed reports it) and
  from that the destination (``kernels.watch.comm``, the row's ``"to"``); ``split`` uses the
  pool's rank → host map;
- planned: the groups of the (pp, dp, tp) mesh in the run's rank order
  (``lab.planning.plan_mesh.axis_groups``) and the planner's
  payloads (``lab.measure.comm_prediction.predicted_comm``), with pipeline sends split into the
  forward ones (to the next stage) and backward ones (to the one before), and context parallelism's
  ring sends to the next rank of the ring, on the same rank → host map (``planned_inter``).
  Under HSDP the data axis is two sets of rings
  (``lab.planning.plan_mesh.hybrid_groups``): FSDP's all-gathers and reduce-scatters run in
  the shard groups (dp_shard consecutive data ranks), the all-reduce of each reduced shard in the
  replicate groups (the ranks holding the same shard) — with shard groups inside a host, only
  that all-reduce crosses, which is the saving HYBRID_SHARD exists for.

Pure Python; no torch.
"""
from __future__ import annotations

from typing import Any, Sequence

from kernels.contract.layout_rules import MESH_AXES
from lab.planning.plan_math import busbw_factor
from lab.planning.plan_mesh import Layout, axis_groups, hybrid_groups, layout_groups

P2P = ("send", "recv")


def wire_factor(op: str, group_size: int) -> float:
    """Bytes one rank sends per payload byte: the busbw factor (1 for p2p and all_to_all)."""
    return 1.0 if op in (*P2P, "all_to_all") else busbw_factor(op, group_size)


def split(row: dict[str, Any], rank: int, hosts: Sequence[str]) -> tuple[float, float] | None:
    """(intra-host, inter-host) wire bytes of one measured row of ``rank``; None when the row names no destination."""
    to = row.get("to") or {}
    if not to:
        return None
    f = wire_factor(row["op"], row["group_size"])
    inter = sum(b for r, b in to.items() if hosts[int(r)] != hosts[rank]) * f
    return sum(to.values()) * f - inter, inter


def neighbour(dims: dict[str, int], axis: str, rank: int, step: int = 1, order: Sequence[str] = MESH_AXES) -> int:
    """The rank ``step`` places after ``rank`` in its group along ``axis`` (wrapping), groups ordered by the axis index."""
    group = next(g for g in axis_groups(dims["dp"], dims["tp"], dims["pp"], axis, tuple(order)) if rank in g)
    return group[(group.index(rank) + step) % len(group)]


def planned_inter(row: dict[str, Any], record: dict[str, Any], predicted: float | None, pp_sends: dict[str, float],
                  hosts: Sequence[str], order: Sequence[str] = MESH_AXES) -> float | None:
    """The planner's inter-host wire bytes for a measured row's kind of traffic on this rank.

    ``predicted`` is the planner's payload for the row (``lab.measure.comm_prediction._predicted``);
    ``pp_sends`` its forward and backward stage-boundary payloads ({"fwd": .., "bwd": ..}).
    None where the planner gives no payload, and for receives (their bytes are the peer's sends).
    """
    rank, dims = record["rank"], record["dims"]
    if predicted is None or row["op"] == "recv":
        return None
    if row["op"] == "send" and row["source"] != "pipeline":  # context parallelism's ring: to the next rank of it
        ahead = _cp_next(dims, rank, order)
        return predicted * (hosts[ahead] != hosts[rank])
    if row["op"] == "send":
        ahead, back = neighbour(dims, "pp", rank, 1, order), neighbour(dims, "pp", rank, -1, order)
        return (pp_sends.get("fwd", 0.0) * (hosts[ahead] != hosts[rank])
                + pp_sends.get("bwd", 0.0) * (hosts[back] != hosts[rank]))
    if row["source"] == "funcol":
        ahead = neighbour(dims, "tp", rank, 1, order)
    elif record.get("hybrid"):
        ahead = hsdp_neighbour(dims, row["op"], rank, order)
    else:
        ahead = neighbour(dims, "dp", rank, 1, order)
    return predicted * wire_factor(row["op"], row["group_size"]) * (hosts[ahead] != hosts[rank])


def _record_mesh(dims: dict[str, int], order: Sequence[str], **options: Any) -> Layout:
    cp = dims.get("cp", 1)  # the record's dp is the data axis, dp · cp ranks
    return Layout(dp=dims["dp"] // cp, tp=dims["tp"], pp=dims["pp"], cp=cp, mesh_order=tuple(order), **options)


def _cp_next(dims: dict[str, int], rank: int, order: Sequence[str]) -> int:
    ring = next(g for g in layout_groups(_record_mesh(dims, order), "cp") if rank in g)
    return ring[(ring.index(rank) + 1) % len(ring)]


def hsdp_neighbour(dims: dict[str, int], op: str, rank: int, order: Sequence[str] = MESH_AXES) -> int:
    """The next rank of ``rank``'s HSDP ring for ``op``: its replicate group for the all-reduce, its shard group for
    FSDP's all-gathers and reduce-scatters (module docstring)."""
    shard, replicate = hybrid_groups(_record_mesh(dims, order, fsdp_strategy="hybrid",
                                                  dp_replicate=dims["dp_replicate"]))
    group = next(g for g in (replicate if op == "all_reduce" else shard) if rank in g)
    return group[(group.index(rank) + 1) % len(group)]


def inter_host_total(records: Sequence[Any], field: str = "inter_bytes") -> float:
    """Inter-host bytes sent in all, over CommRecords (receives left out: they are the senders' bytes)."""
    return sum(getattr(r, field) or 0.0 for r in records if r.op != "recv")
