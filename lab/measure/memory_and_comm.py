"""Measured memory and communication beside their predictions (issue "Measured, not drawn").

The ranks run ``kernels.train.entry.measure_rank`` (or ``lab.Experiment(..., measure=True)``,
the same probes on the run's last step) and return plain dicts; this module turns
each into ``MemoryRecord``s and ``CommRecord``s with two predictions beside every
measured value:

- ``formula``: the ZeRO formula of docs/design.md#zero-formulas (``plan_math.zero_memory``) for the dtypes
  held. In fp32 the parameters are the master copy: params 4Ψ, grads 4Ψ, AdamW
  K = 8 (exp_avg + exp_avg_sq); plain SGD K = 0. ZeRO-2 holds whole parameters only from forward to
  backward, so *at rest* its parameters take the sharded term 4Ψ/N. TP divides Ψ by
  tp (norms and row-parallel biases are in fact replicated: a small excess).
- ``predicted``: the exact rule the code follows, so a difference from the formula is
  explained, never waved away:
  * FSDP2 shards dim 0 like ``torch.chunk``: rank r holds rows
    [r·c, min((r+1)·c, d)) with c = ceil(d/N) (possibly none); its storage is padded to
    c rows, and the all-gather/reduce-scatter payload is the padded N·c rows;
  * ZeroRedundancyOptimizer does not split tensors: it sorts whole parameters by size
    (largest first) and gives each to the rank with the smallest total so far
    (``zero1_partition``), so a rank holds near, not exactly, Ψ/N of the state
    (3.5% over on rank 0 for the tiny GPT; the model-state total stays within 1%);
  * AdamW keeps one fp32 ``step`` scalar per parameter tensor (4 bytes each), which
    the formula leaves out (148 bytes for the tiny GPT's 37 tensors, <0.1%).

Communication volume (docs/design.md#communication-volume), as payload bytes per step: DDP all-reduce = the
gradient bytes (DDP all-reduces flat buckets of all gradients); ZeRO-1 adds one
broadcast of every parameter from its owner; FSDP all-gathers the padded parameters
once in forward and again in backward under ZeRO-3, and reduce-scatters the padded
gradients once. TP and PP traffic come from the planner's exact per-stage account
(``lab.plan(...).stages[pp_rank].comm`` for the lab's GPT): two all-reduces of b·s·h per
block forward, four backward (separate q/k/v each all-reduce their input gradient, then
fc_in), plus the embeddings' forward all-reduces, the head's backward all-reduce and its
logits all-gather; each stage-boundary send carries b·s·h. With pp > 1 the record holds
this rank's stages only, at rest. Wire bytes per rank = payload × the busbw factor, and
busbw = algbw × the same factor.
"""
from __future__ import annotations

import math
import re
from typing import Any

from kernels.contract import activation_rules
from kernels.train.entry import measure_rank
from kernels.contract.measure_records import CommRecord, MemoryRecord
from kernels.contract.run_config import RunConfig
from lab.measure import host_traffic
from lab.planning.plan_math import busbw_factor, dtype_bytes, optimizer_bytes, zero_memory
from lab.planning.planner import plan

# A parameter's dtype as the ranks record it (str(torch.dtype)) -> the planner's name for it.
_DTYPE_NAMES = {"torch.float32": "fp32", "torch.float64": "fp64", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
# Optimizer state per tensor beside the K bytes per element (plan_math.optimizer_bytes): AdamW's fp32 step scalar.
STEP_BYTES = {"adamw": 4, "sgd": 0}
PART_SOURCE = ("measured: saved-tensor hooks, each new storage counted for the innermost running module that "
               "names a part (kernels/measure/activation_parts.py); outside the model = the loss")


def shard_rows(d: int, n: int, r: int) -> int:
    """Rows of a dim-0 size ``d`` that rank ``r`` of ``n`` holds (torch.chunk rule, as FSDP2)."""
    c = math.ceil(d / n)
    return max(0, min(c, d - r * c))


def padded_rows(d: int, n: int) -> int:
    """Rows per rank FSDP2 stores and communicates: ceil(d/n) (so N·ceil(d/n) in all)."""
    return math.ceil(d / n)


def zero1_partition(numels: list[int], n: int) -> list[list[int]]:
    """ZeroRedundancyOptimizer's partition: indices of whole parameters per rank.

    Largest first (a stable sort, so ties keep the model's order), each to the first
    rank with the smallest total so far.
    """
    owners: list[list[int]] = [[] for _ in range(n)]
    sizes = [0] * n
    for i in sorted(range(len(numels)), key=lambda j: numels[j], reverse=True):
        r = sizes.index(min(sizes))
        owners[r].append(i)
        sizes[r] += numels[i]
    return owners


def _tp_local_shape(info: dict[str, Any], tp: int, tp_index: int) -> list[int]:
    """The shape after TP: a Shard(k) placement on the tp axis splits dim k (chunk rule)."""
    shape = list(info["global_shape"])
    for axis, placement in zip(info["mesh_axes"], info["placements"]):
        m = re.search(r"S(?:hard)?\((?:dim=)?(\d+)", placement)  # "S(0)", "Shard(dim=0)", "_S(0, 2)"
        if axis == "tp" and m:
            k = int(m.group(1))
            shape[k] = shard_rows(shape[k], tp, tp_index)
    return shape


def param_table(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Per parameter (model order): element bytes, whole numel after TP, and this rank's dp shard."""
    dims, coords, fsdp = record["dims"], record["coords"], record["strategy"] == "fsdp"
    out = []
    for name, info in record["params"].items():
        shape = _tp_local_shape(info, dims["tp"], coords["tp"])
        rest = math.prod(shape[1:]) if shape else 1
        d0 = shape[0] if shape else 1
        whole = d0 * rest
        local = shard_rows(d0, dims["dp"], coords["dp"]) * rest if fsdp else whole
        padded = padded_rows(d0, dims["dp"]) * rest if fsdp else whole
        out.append({"name": name, "elem": dtype_bytes(_DTYPE_NAMES.get(info["dtype"], "fp32")), "whole": whole,
                    "local": local, "padded": padded})
    return out


def _k(optimizer: str) -> int:
    """Optimizer-state bytes per parameter element of an fp32 run (K: AdamW 8, plain SGD 0)."""
    return int(optimizer_bytes(optimizer, "fp32"))


def _optimizer(record: dict[str, Any]) -> str:
    """The run's optimizer; records saved before it was recorded were all AdamW."""
    return record.get("optimizer", "adamw")


def _stage(record: dict[str, Any]) -> int:
    return {"zero1": 1, "fsdp": int(record["zero"])}.get(record["strategy"], 0)


def predicted_memory(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The exact rule per moment and category (bytes), from the layout alone."""
    table, stage, dp = param_table(record), _stage(record), record["dims"]["dp"]
    rest_params = sum(p["local"] * p["elem"] for p in table)
    whole_params = sum(p["whole"] * p["elem"] for p in table)
    if stage == 1:
        mine = zero1_partition([p["whole"] for p in table], dp)[record["coords"]["dp"]]
        owned = [table[i] for i in mine]
    else:
        owned = table
    name = _optimizer(record)
    k, step_bytes = _k(name), STEP_BYTES[name]
    opt = sum(p["local"] * k + step_bytes for p in owned)
    peak_params = whole_params if stage == 2 else rest_params
    # ZeRO-2 with gradient accumulation (no pp): FSDP2 keeps the earlier micro-batches' gradients
    # unsharded (whole) until the last one reduce-scatters them, beside the sharded buffers.
    accumulating = stage == 2 and record["dims"]["pp"] == 1 and int(record.get("microbatches", 1)) > 1
    peak_grads = rest_params + (whole_params if accumulating else 0)
    return {"at_rest": {"params": rest_params, "grads": rest_params, "optimizer": opt},
            "peak_fwd_bwd": {"params": peak_params, "grads": peak_grads, "optimizer": opt}}


def formula_memory(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The ZeRO formula of docs/design.md#zero-formulas in fp32 (4, 4, K), Ψ = all parameters / tp, N = dp."""
    dims, stage, k = record["dims"], _stage(record), _k(_optimizer(record))
    psi = sum(math.prod(i["global_shape"]) for i in record["params"].values()) / dims["tp"]
    peak = zero_memory(psi, dims["dp"], stage, 4, 4, k)
    rest = zero_memory(psi, dims["dp"], 3 if stage == 2 else stage, 4, 4, k)  # ZeRO-2 reshards after backward
    rest = (rest[0], peak[1], peak[2])
    keys = ("params", "grads", "optimizer")
    return {"at_rest": dict(zip(keys, rest)), "peak_fwd_bwd": dict(zip(keys, peak))}


def _memory_note(record: dict[str, Any], category: str) -> str:
    notes = []
    if category == "optimizer" and _optimizer(record) == "adamw":
        notes.append("includes AdamW's 4-byte step scalar per tensor (not in the formula)")
        if record["strategy"] == "zero1":
            notes.append("ZeroRedundancyOptimizer partitions whole tensors greedily (not exactly Ψ/N)")
    if record["strategy"] == "fsdp" and category in ("params", "grads"):
        notes.append("FSDP2 dim-0 chunk rule: ceil(d/N) rows per rank, the last ranks fewer")
    if record["dims"]["tp"] > 1:
        notes.append("TP: norms and row-parallel biases replicated; sharded embeddings get whole grads")
    return "; ".join(notes)


def memory_records(record: dict[str, Any]) -> list[MemoryRecord]:
    """One rank's measured memory, category by category, with ``predicted`` and ``formula`` beside."""
    pred, form, rows = predicted_memory(record), formula_memory(record), []
    for moment, snap in record["memory"].items():
        for category in ("params", "grads", "optimizer"):
            rows.append(MemoryRecord(rank=record["rank"], moment=moment, category=category,
                                     measured=snap[category], predicted=pred[moment][category],
                                     formula=form[moment][category], note=_memory_note(record, category)))
        rows += _activation_rows(record, moment, snap)
        rows.append(MemoryRecord(rank=record["rank"], moment=moment, category="cuda_allocated",
                                 measured=snap.get("cuda_allocated"), predicted=None, formula=None,
                                 note="torch.cuda.memory_allocated at this moment: every live tensor; None on CPU"))
        rows.append(MemoryRecord(rank=record["rank"], moment=moment, category="cuda_max_allocated",
                                 measured=snap.get("cuda_max_allocated"), predicted=None, formula=None,
                                 note="torch.cuda.max_memory_allocated since the step began; None on CPU"))
    return rows


def _activation_rows(record: dict[str, Any], moment: str, snap: dict[str, Any]) -> list[MemoryRecord]:
    """The activations measured at ``moment`` and, split by part, each beside the lab GPT's rule where it holds."""
    if snap.get("activations") is None:
        return []
    parts = snap.get("activation_parts", {})
    rule = activation_rules.predicted_for(record) if parts else None
    source = activation_rules.SOURCE if rule else f"not predicted: {activation_rules.why_not(record) or 'no split'}"
    rows = [MemoryRecord(rank=record["rank"], moment=moment, category="activations", measured=snap["activations"],
                         predicted=sum(rule.values()) if rule else None, formula=None,
                         note="unique storages saved for backward, parameters left out", predicted_source=source)]
    for part, nbytes in parts.items():  # the same bytes again, split by part
        rows.append(MemoryRecord(rank=record["rank"], moment=moment, category=f"activations.{part}",
                                 measured=nbytes, predicted=rule.get(part, 0) if rule else None, formula=None,
                                 note=PART_SOURCE, predicted_source=source))
    return rows


def predicted_comm(record: dict[str, Any], cfg: dict[str, Any]) -> dict[str, float]:
    """Analytic payload bytes per step by op (docs/design.md#communication-volume) for this rank.

    Keys are op names for the dp axis, "tp_<op>" for the tp axis (DTensor "funcol" rows) and
    "send" for stage-boundary p2p; tp and pp come from the planner's StagePlan for this rank.
    """
    table, stage = param_table(record), _stage(record)
    grads = sum(p["whole"] * p["elem"] for p in table)
    out: dict[str, float] = {}
    if record["strategy"] in ("ddp", "zero1", "allreduce") and record["dims"]["dp"] > 1:
        out["all_reduce"] = grads  # DDP's flat buckets, or (pp) one all_reduce per gradient
    if record.get("hybrid") and record["dims"].get("dp_replicate") == record["dims"]["dp"] > 1:
        out["all_reduce"] = grads  # FSDP2 replicating only (TP with dp > 1, no ZeRO): one gradient all-reduce
    if stage == 1:
        out["broadcast"] = grads  # every parameter, from its owner, after the step
    if record["strategy"] == "fsdp":
        padded = sum(p["padded"] * p["elem"] for p in table) * record["dims"]["dp"]
        # Without pp, gradient accumulation gathers again for every micro-batch (and reduce-scatters once).
        m = int(record.get("microbatches", 1)) if record["dims"]["pp"] == 1 else 1
        out["all_gather"] = padded * (2 if stage == 3 else 1) * m  # forward, and backward under ZeRO-3
        out["reduce_scatter"] = padded
    if record["dims"]["tp"] > 1 or record["dims"]["pp"] > 1:
        for e in _planned_stage(record, cfg).comm:
            if e.axis in ("tp", "pp"):
                key = "send" if e.axis == "pp" else f"tp_{e.op}"
                out[key] = out.get(key, 0.0) + e.total_payload
    return out


def _planned_stage(record: dict[str, Any], cfg: dict[str, Any]) -> Any:
    """The planner's StagePlan for this rank's pipeline rank (fp32, the run's optimizer, batch and layout)."""
    dims, run = record["dims"], RunConfig.from_options(cfg)
    s = run.strategy
    parallel = {**dims, "zero": int(record["zero"]), "schedule": s.schedule or "1f1b",
                "microbatches": record.get("microbatches", 1), "sequence_parallel": s.sequence_parallel,
                "loss_parallel": s.loss_parallel}
    if s.pp > 1:
        parallel["stages_per_rank"] = s.stages_per_rank
    p = plan(run.model, gpus=dims["dp"] * dims["tp"] * dims["pp"], parallel=parallel,
             global_batch=run.global_batch, dtype="fp32", optimizer=_optimizer(record))
    return p.stages[record["coords"]["pp"]]


def _predicted(pred: dict[str, float], row: dict[str, Any], record: dict[str, Any]) -> float | None:
    """The analytic volume for a row: dp-axis ops are "dist" rows, TP's are "funcol" rows."""
    if row["source"] == "funcol":
        return pred.get(f"tp_{row['op']}")
    return pred.get(row["op"])


def _pp_sends(record: dict[str, Any], cfg: dict[str, Any]) -> dict[str, float]:
    """The planner's stage-boundary send payloads of this rank by phase ("fwd", "bwd")."""
    if record["dims"]["pp"] == 1:
        return {}
    out: dict[str, float] = {}
    for e in _planned_stage(record, cfg).comm:
        if e.axis == "pp":
            out[e.phase] = out.get(e.phase, 0.0) + e.total_payload
    return out


def comm_records(record: dict[str, Any], cfg: dict[str, Any], hosts: list[str] | None = None) -> list[CommRecord]:
    """One rank's per-step collectives with wire bytes, algbw, busbw and the analytic volume.

    With ``hosts`` (the host of each rank, by rank), each record also splits its wire bytes
    into intra- and inter-host traffic, beside the planner's inter-host bytes (``lab.measure.host_traffic``).
    """
    pred, out = predicted_comm(record, cfg), []
    sends = _pp_sends(record, cfg) if hosts else {}
    order = RunConfig.from_options(cfg).strategy.mesh_order  # read (and checked) once, not per collective
    for row in record["comm"]:
        predicted = _predicted(pred, row, record)
        both = host_traffic.split(row, record["rank"], hosts) if hosts else None
        planned = host_traffic.planned_inter(row, record, predicted, sends, hosts, order) if hosts else None
        f = busbw_factor(row["op"], row["group_size"]) if row["op"] != "all_to_all" else 1.0
        algbw = row["payload_bytes"] / row["seconds"] if row["seconds"] > 0 else 0.0
        out.append(CommRecord(rank=record["rank"], op=row["op"], group_size=row["group_size"],
                              count=row["count"], payload_bytes=row["payload_bytes"],
                              wire_bytes=row["payload_bytes"] * f, seconds=row["seconds"], algbw=algbw,
                              busbw=algbw * f, predicted_payload_bytes=predicted, source=row["source"],
                              intra_bytes=both[0] if both else None, inter_bytes=both[1] if both else None,
                              predicted_inter_bytes=planned))
    return out


def measure_layout(cluster: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``measure_rank(cfg)`` on every rank; memory and comm records of all ranks, and the raw rank dicts."""
    raw = cluster.run(measure_rank, cfg)
    hosts = [r.host for r in cluster.rank_map.ranks]
    memory = [r for rec in raw for r in memory_records(rec)]
    comm = [r for rec in raw for r in comm_records(rec, cfg, hosts)]
    return {"memory": memory, "comm": comm, "ranks": raw}
