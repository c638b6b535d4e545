"""Pure transforms behind ShardingView: per-rank layout records -> which slice of each tensor a rank holds.

A layout record is what the ranks return as ``"layout"`` (one per rank; ``RunResult.layout``
is the list): a ``kernels.contract.measure_records.LayoutRecord`` or its dict, checked by ``from_dict``; its
``params`` map each name to a ``ParamLayout``. Placements are DTensor's short
or long strings ("S(0)", "Shard(dim=0)", "_S(0, 2)" for FSDP's strided shard over a
TP shard, "R", "Replicate()"). Without an ``offset`` the slice start is computed
from the rank's mesh coordinates, as torch.chunk places shards (exact for even splits).
An extent is ``[start0, stop0, start1, stop1]`` over the first two tensor dims.
"""
from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

from kernels.contract.measure_records import LayoutRecord

_SHARD = re.compile(r"^(_S|_StridedShard|S|Shard)\((?:dim=)?(\d+)")
DP_AXES = ("dp", "dp_shard", "dp_replicate")  # the axes FSDP all-gathers / reduce-scatters over


def _records(layout: Any) -> list[dict[str, Any]]:
    """LayoutRecord dicts in rank order, from a list, a RunResult dict, {"ranks": [...]} or {rank: record}."""
    if isinstance(layout, dict):
        if "layout" in layout:
            layout = layout["layout"]
        elif "ranks" in layout:
            layout = layout["ranks"]
        elif "params" in layout:
            layout = [layout]
        else:
            layout = list(layout.values())
    return sorted((LayoutRecord.coerce(r).to_dict() for r in layout), key=lambda r: r["rank"])


def _params(record: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return list(record["params"].items())


def _shard_dim(placement: str) -> tuple[int, bool] | None:
    """(tensor dim, strided?) for a Shard placement, None for Replicate/Partial."""
    m = _SHARD.match(placement.strip())
    return (int(m.group(2)), m.group(1).startswith("_")) if m else None


def _shard_axes(info: dict[str, Any], dim: int, skip: tuple[str, ...] = ()) -> list[str]:
    """Mesh axes sharding ``dim``, outermost first: a strided shard (FSDP over TP) splits inside the others."""
    found = [(axis, s[1]) for p, axis in zip(info.get("placements", []), info.get("mesh_axes", []))
             if (s := _shard_dim(p)) and s[0] == dim and axis not in skip]
    return [a for a, strided in found if not strided] + [a for a, strided in found if strided]


def _axis_sizes(records: list[dict[str, Any]]) -> dict[str, int]:
    """Mesh axis sizes: pp/dp/tp from the coordinates; how dp splits into shards and replicas from the
    placements: a Shard over the ``dp`` axis splits parameters dp ways (FSDP, ZeRO-3), a Shard over
    HSDP's ``dp_shard`` axis splits them as many ways as the local shapes say, no dp Shard replicates."""
    sizes = {a: 1 + max(r["coords"].get(a, 0) for r in records) for a in ("pp", "dp", "tp")}
    if any("dp" in _shard_axes(info, d) for r in records for _, info in _params(r)
           for d in range(min(2, len(info["global_shape"])))):
        return {**sizes, "dp_shard": sizes["dp"], "dp_replicate": 1}
    votes: Counter = Counter()
    for r in records:
        for _, info in _params(r):
            for d in range(min(2, len(info["global_shape"]))):
                axes = _shard_axes(info, d)
                if "dp_shard" in axes and info["local_shape"][d]:
                    known = math.prod(sizes.get(a, 1) for a in axes if a != "dp_shard")
                    votes[max(1, math.ceil(info["global_shape"][d] / info["local_shape"][d]) // known)] += 1
    shard = votes.most_common(1)[0][0] if votes else 1
    return {**sizes, "dp_shard": shard, "dp_replicate": max(1, sizes["dp"] // shard)}


def _axis_index(axis: str, coords: dict[str, int], sizes: dict[str, int]) -> int:
    if axis in coords:
        return coords[axis]
    if axis == "dp_shard":
        return coords.get("dp", 0) % sizes["dp_shard"]
    if axis == "dp_replicate":
        return coords.get("dp", 0) // sizes["dp_shard"]
    return 0


def _extent(info: dict[str, Any], coords: dict[str, int], sizes: dict[str, int],
            skip: tuple[str, ...] = ()) -> list[int]:
    """[start0, stop0, start1, stop1] of the slice held; ``skip`` drops axes (e.g. dp after an all-gather)."""
    shape, local = list(info["global_shape"]) or [1], list(info["local_shape"]) or [1]
    out = []
    for d in range(2):
        if d >= len(shape):
            out += [0, 1]
            continue
        axes = _shard_axes(info, d, skip)
        index, count = 0, 1
        for axis in axes:
            index, count = index * sizes.get(axis, 1) + _axis_index(axis, coords, sizes), count * sizes.get(axis, 1)
        n = shape[d]
        if info.get("offset") is not None and not skip:
            start = info["offset"][d] if isinstance(info["offset"], list) else (info["offset"] if d == 0 else 0)
        else:
            start = min(index * math.ceil(n / count), n)
        length = local[d] if not skip else math.ceil(n / count)
        out += [start, min(n, start + length)]
    return out


def _unit(name: str) -> str:
    """The FSDP unit a parameter belongs to: one per transformer block, the rest in the root."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else "root"


def _unit_order(unit: str) -> tuple[int, int]:
    """root first (embeddings run first in forward), then blocks by index."""
    return (0, 0) if unit == "root" else (1, int(unit.split(".")[1]))


def _row(record: dict[str, Any], names: list[str], sizes: dict[str, int], fsdp: bool) -> dict[str, Any]:
    """One rank: its extents per tensor for the parameters, the optimizer state and (FSDP) after an all-gather."""
    held, coords = dict(_params(record)), record["coords"]
    params = [_extent(held[n], coords, sizes) if n in held else None for n in names]
    owned = record["optimizer_params"]  # ZeRO-1: whole parameters whose optimizer state this rank owns
    optim = params if owned is None else [e if n in owned else None for n, e in zip(names, params)]
    if record.get("optimizer_slices") is not None:  # ZeRO-1 with TP or PP: a flat slice of every local shard
        optim = [_slice_rows(e, held[n], record["optimizer_slices"].get(n)) if e is not None else None
                 for n, e in zip(names, params)]
    gathered = [_extent(held[n], coords, sizes, DP_AXES) if n in held else None for n in names] if fsdp else []
    return {"rank": record["rank"], "coords": coords, "strategy": record["strategy"],
            "stages": record["stage_ids"],
            "blocks": sorted({int(n.split(".")[1]) for n in held if _unit(n) != "root"}),
            "params": params, "optim": optim, "gathered": gathered}


def _slice_rows(extent: list[int], info: dict[str, Any], bounds: list[int] | None) -> list[int] | None:
    """The rows of ``extent`` that the flat slice ``bounds`` = [start, stop) of the local shard touches; None if empty."""
    if not bounds or bounds[1] <= bounds[0]:
        return None
    width = math.prod(info["local_shape"][1:])  # elements per row of the local shard (1 for a vector)
    return [extent[0] + bounds[0] // width, extent[0] + math.ceil(bounds[1] / width), *extent[2:]]


def _sharding_view(layout: Any) -> dict[str, Any]:
    """{strategy, zero, sizes, tensors, rows, phases}: everything ShardingView draws, JSON-only."""
    records = _records(layout)
    sizes = _axis_sizes(records) if records else {}
    tensors: dict[str, dict[str, Any]] = {}
    for r in records:
        for name, info in _params(r):
            tensors.setdefault(name, {"name": name, "shape": list(info["global_shape"]), "unit": _unit(name),
                                      "placements": info["placements"], "mesh_axes": info["mesh_axes"],
                                      "dtype": info["dtype"]})
    names = list(tensors)
    first = records[0] if records else {}
    fsdp = first.get("strategy") == "fsdp" and sizes["dp_shard"] > 1  # FSDP2 over one shard only replicates
    rows = [_row(r, names, sizes, fsdp) for r in records]
    zero = int(first.get("zero", 0) or 0) if fsdp or first.get("strategy") != "fsdp" else 0
    return {"strategy": first.get("strategy", ""), "zero": zero, "sizes": sizes,
            "title": _title(first, sizes, list(tensors.values())),
            "tensors": list(tensors.values()), "rows": rows,
            "phases": _fsdp_phases(list(tensors.values()), int(first.get("zero", 3) or 3)) if fsdp else []}


def _title(first: dict[str, Any], sizes: dict[str, int], tensors: list[dict[str, Any]]) -> str:
    """What the view shows, from the built layout: strategy, mesh sizes, how dp splits, the placements."""
    if not first:
        return "no layout"
    mesh = " ".join(f"{a}={sizes[a]}" for a in ("pp", "dp", "tp"))
    split = f"dp_shard={sizes['dp_shard']} dp_replicate={sizes['dp_replicate']}"
    how = Counter(", ".join(f"{a}: {p}" for a, p in zip(t["mesh_axes"], t["placements"])) for t in tensors)
    placed = f"placements [{how.most_common(1)[0][0]}]" if how and how.most_common(1)[0][0] else "plain tensors"
    owned = " · optimizer state split by parameter (ZeRO-1)" if first.get("optimizer_params") is not None else \
        " · optimizer state split in 1/dp slices of every tensor (ZeRO-1)" if first.get("optimizer_slices") else ""
    # The ranks say in words what the user chose and what it runs as; a bare record gives its fields.
    how_dp = first.get("describe") or f"{first.get('strategy', '')} · ZeRO-{int(first.get('zero', 0) or 0)}"
    return f"{how_dp} · {mesh} · {split} · {placed}{owned}"


def _fsdp_phases(tensors: list[dict[str, Any]], zero: int) -> list[dict[str, Any]]:
    """FSDP2's order per unit: forward all-gather (then free under ZeRO-3), backward all-gather again
    (ZeRO-3), whole gradients, reduce-scatter to gradient shards; then the optimizer on local shards.

    Each phase lists the tensor indices whose parameters are whole (gathered over dp),
    whose gradients are whole, and whose gradients are already reduce-scattered shards.
    """
    units = sorted({t["unit"] for t in tensors}, key=_unit_order)
    members = {u: {i for i, t in enumerate(tensors) if t["unit"] == u} for u in units}
    whole: set[int] = set()
    g_whole: set[int] = set()
    g_shard: set[int] = set()
    phases: list[dict[str, Any]] = []

    def snap(label: str, op: str, unit: str) -> None:
        phases.append({"label": label, "op": op, "unit": unit, "whole": sorted(whole),
                       "grads_whole": sorted(g_whole), "grads_shard": sorted(g_shard)})

    snap("at rest: every rank holds only its shards", "", "")
    for u in units:
        whole |= members[u]
        snap(f"forward {u}: all-gather its parameters", "all_gather", u)
        if zero >= 3 and u != "root":
            whole -= members[u]
            snap(f"forward {u}: free the gathered parameters (reshard after forward)", "free", u)
    if zero >= 3 and "root" in members:
        whole -= members["root"]
        snap("forward done: free root", "free", "root")
    blocks = [u for u in units if u != "root"]
    if zero >= 3 and "root" in members:  # the LM head (root unit) runs first in backward
        whole |= members["root"]
        snap("backward root: all-gather its parameters again", "all_gather", "root")
    for u in blocks[::-1] + (["root"] if "root" in members else []):
        if zero >= 3 and u != "root":
            whole |= members[u]
            snap(f"backward {u}: all-gather its parameters again", "all_gather", u)
        g_whole |= members[u]
        snap(f"backward {u}: whole (unreduced) gradients", "compute", u)
        g_whole -= members[u]
        g_shard |= members[u]
        whole -= members[u]
        snap(f"backward {u}: reduce-scatter gradients to shards, free parameters", "reduce_scatter", u)
    snap("optimizer step: each rank updates only its own shards", "step", "")
    return phases
