"""Which part of each parameter a rank holds, from its measured record alone (no torch).

The rules the layouts follow: tensor parallelism splits a ``Shard(k)`` placement's dim k (the chunk
rule); FSDP2 then shards dim 0 over its shard group like ``torch.chunk``, rank r holding rows
[r·c, min((r+1)·c, d)) with c = ceil(d/N), its storage padded to c rows. The shard group is all of
dp, HSDP's dp_shard, or no one when FSDP2 only replicates (TP x DP without ZeRO, held as DDP holds).
ZeRO-1 with TP or PP splits each flattened local shard by the same chunk rule (``slice_elements``).
Each parameter belongs to one ``fully_shard`` unit, a block or the root, and frees its gathered copy after
forward as that unit's ``reshard_after_forward`` says (``reshards_after_forward``).
``lab.measure.memory_and_comm`` (memory) and ``lab.measure.comm_prediction`` (collectives) both
predict from this table.
"""
from __future__ import annotations

import math
import re
from typing import Any

from lab.planning.plan_math import dtype_bytes

# A parameter's dtype as the ranks record it (str(torch.dtype)) -> the planner's name for it.
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.float64": "fp64", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
def shard_rows(d: int, n: int, r: int) -> int:
    """Rows of a dim-0 size ``d`` that rank ``r`` of ``n`` holds (torch.chunk rule, as FSDP2)."""
    c = math.ceil(d / n)
    return max(0, min(c, d - r * c))


def padded_rows(d: int, n: int) -> int:
    """Rows per rank FSDP2 stores and communicates: ceil(d/n) (so N·ceil(d/n) in all)."""
    return math.ceil(d / n)


def _local_shape(info: dict[str, Any], split: dict[str, tuple[int, int]]) -> list[int]:
    """The shape after TP and EP: a Shard(k) placement on the "tp" or "ep" axis splits dim k (chunk rule);
    ``split`` maps each such axis to (size, this rank's index)."""
    shape = list(info["global_shape"])
    for axis, placement in zip(info["mesh_axes"], info["placements"]):
        m = re.search(r"S(?:hard)?\((?:dim=)?(\d+)", placement)  # "S(0)", "Shard(dim=0)", "_S(0, 2)"
        if axis in split and m:
            k = int(m.group(1))
            shape[k] = shard_rows(shape[k], *split[axis])
    return shape


def param_table(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per parameter (model order): element bytes, whole numel after TP (and EP), this rank's dp shard, and
    whether it is an expert (EP's experts stay out of DDP and FSDP: each rank holds its E/ep whole)."""
    dims, coords, fsdp = record["dims"], record["coords"], record["strategy"] == "fsdp"
    # FSDP2 shards over a shard group: all of dp, HSDP's dp_shard, or no one (replicating only, as TP x DP ZeRO-0).
    n, ep = shard_group(record), dims.get("ep", 1)
    split = {"tp": (dims["tp"], coords["tp"]), "ep": (ep, coords["dp"] % ep)}  # an ep group: ep dp-neighbours
    blocks = tuple(f"{name}." for name in record.get("block_units", ()))
    out = []
    for name, info in record["params"].items():
        shape = _local_shape(info, split)
        rest = math.prod(shape[1:]) if shape else 1
        d0 = shape[0] if shape else 1
        whole = d0 * rest
        expert = "ep" in info["mesh_axes"]
        local = shard_rows(d0, n, coords["dp"] % n) * rest if fsdp and not expert else whole
        padded = padded_rows(d0, n) * rest if fsdp and not expert else whole
        out.append({"name": name, "elem": dtype_bytes(_DTYPE_NAMES.get(info["dtype"], "fp32")), "whole": whole,
                    "local": local, "padded": padded, "expert": expert,
                    "unit": "blocks" if name.startswith(blocks) else "root"})
    return out


def reshards_after_forward(record: dict[str, Any], param: dict[str, Any]) -> bool:
    """Whether FSDP2 frees ``param``'s gathered copy after its unit's forward (and gathers it again in backward):
    its unit's ``reshard_after_forward``; records made before units could differ say it by the stage alone.
    Never without sharding (no FSDP2, or FSDP2 only replicating: nothing to free)."""
    units = record.get("reshard_after_forward")
    if zero_stage(record) < 2:
        return False
    return int(record["zero"]) >= 3 if units is None else bool(units[param["unit"]])


def zero1_slices(record: dict[str, Any]) -> bool:
    """ZeRO-1 with TP or PP (``kernels.parallel.zero1_slices``): each dp rank holds the optimizer state of a
    slice of every local shard, not of whole tensors (ZeroRedundancyOptimizer's); the rank's record says which."""
    return record.get("optimizer_slices") is not None


def slice_elements(record: dict[str, Any], param: dict[str, Any]) -> int:
    """Elements of ``param``'s flattened local shard (``whole``) in this rank's ZeRO-1 slice: chunks of ceil(n/dp)
    over the data axis (dp·cp ranks), the torch.chunk rule ``shard_rows`` counts."""
    dims, coords = record["dims"], record["coords"]
    data_rank = coords["dp"] * dims.get("cp", 1) + coords.get("cp", 0)
    return shard_rows(param["whole"], dims["dp"], data_rank)


def optimizer_name(record: dict[str, Any]) -> str:
    """The run's optimizer; records saved before it was recorded were all AdamW."""
    return record.get("optimizer", "adamw")


def shard_group(record: dict[str, Any]) -> int:
    """The ranks FSDP2 shards one parameter over: dp, or HSDP's dp_shard (1 when it only replicates)."""
    return record["dims"]["dp"] // record["dims"].get("dp_replicate", 1)


def zero_stage(record: dict[str, Any]) -> int:
    if record["strategy"] == "fsdp" and shard_group(record) == 1:
        return 0  # FSDP2 replicating only (TP x DP without ZeRO): whole states, as DDP
    return {"zero1": 1, "fsdp": int(record["zero"])}.get(record["strategy"], 0)
