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
  * between forward and backward each FSDP2 unit (the root, each block) holds its
    parameters whole unless it reshards after forward (ZeRO-3, or its own
    ``reshard_after_forward``), in which case it holds its shard; whole parameters are bf16
    under FSDP2's bf16 policy (the fp32 shard is then not registered);
  * with gradient accumulation FSDP2 reduces on the last micro-batch only, so until then every unit also
    holds its gradient whole (ZeRO-2, ZeRO-3 and TP×DP's replication alike: the price of one reduction a step);
  * in a pipeline, whose schedule interleaves forwards and backwards, ``peak_fwd_bwd`` is the most held at
    once over the step: torch's schedule keeps a unit whole after every backward but the step's last, so
    with more than one micro-batch ZeRO-3's parameters peak whole too;
  * ZeroRedundancyOptimizer does not split tensors: it sorts whole parameters by size
    (largest first) and gives each to the rank with the smallest total so far
    (``zero1_partition``), so a rank holds near, not exactly, Ψ/N of the state
    (3.5% over on rank 0 for the tiny GPT; the model-state total stays within 1%);
    ZeRO-1 with TP or PP (``kernels.parallel.zero1_slices``) splits every flattened local shard
    instead, ceil(n/N) elements per rank (``slice_elements``): exactly Ψ/N of the state when N divides n;
  * AdamW keeps one fp32 ``step`` scalar per parameter tensor (4 bytes each), which
    the formula leaves out (148 bytes for the tiny GPT's 37 tensors, <0.1%).

Communication, each collective beside its analytic volume, is ``lab.measure.comm_prediction``'s;
``measure_layout`` returns both.
"""
from __future__ import annotations

import math
from typing import Any

from kernels.contract import activation_rules
from kernels.train.entry import measure_rank
from kernels.contract.measure_records import MemoryRecord
from lab.measure.comm_prediction import comm_records
from lab.measure.param_shards import (optimizer_name, param_table, reshards_after_forward, shard_group, slice_elements,
                                      zero1_slices, zero_stage)
from lab.planning.plan_math import optimizer_bytes, zero_memory

# Optimizer state per tensor beside the K bytes per element (plan_math.optimizer_bytes): AdamW's fp32 step scalar.
STEP_BYTES = {"adamw": 4, "sgd": 0}
PART_SOURCE = ("measured: saved-tensor hooks, each new storage counted for the innermost running module that "
               "names a part (kernels/measure/activation_parts.py); outside the model = the loss")


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


def _k(optimizer: str) -> int:
    """Optimizer-state bytes per parameter element of an fp32 run (K: AdamW 8, plain SGD 0)."""
    return int(optimizer_bytes(optimizer, "fp32"))


def predicted_memory(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The exact rule per moment and category (bytes), from the layout alone."""
    table, stage, dp = param_table(record), zero_stage(record), record["dims"]["dp"]
    rest_params = sum(p["local"] * p["elem"] for p in table)
    name = optimizer_name(record)
    k, step_bytes = _k(name), STEP_BYTES[name]
    if stage == 1 and zero1_slices(record):  # ZeRO-1 with TP or PP: a 1/dp slice of every local shard
        opt = sum(slice_elements(record, p) * k + step_bytes for p in table)
    else:
        owned = [table[i] for i in zero1_partition([p["whole"] for p in table], dp)[record["coords"]["dp"]]] \
            if stage == 1 else table
        opt = sum(p["local"] * k + step_bytes for p in owned)
    # Between forward and backward an FSDP2 unit that does not reshard after forward (all of ZeRO-2's, FSDP2 only
    # replicating, or those reshard_after_forward names False) registers its parameters whole, in bf16 under
    # FSDP2's bf16 policy (its fp32 shard is then unregistered); the others hold their shards.
    units = [p for p in table if record["strategy"] == "fsdp" and not p["expert"]]
    kept = [p for p in units if not reshards_after_forward(record, p)]
    # Gradient accumulation: the lab (and a pipeline's schedule) reduces once, on the last micro-batch, so every
    # FSDP2 unit (replicating only too) holds its earlier micro-batches' gradients whole (fp32) until then, beside
    # the gradient buffers it reduces into.
    accumulating = int(record.get("microbatches", 1)) > 1
    if record["dims"]["pp"] > 1 and accumulating:  # the schedule keeps a unit whole after a backward but the last
        kept = units
    whole_elem = 2 if activation_rules.precision_of(record) == "bf16" else None
    peak_params = rest_params + sum(p["whole"] * (whole_elem or p["elem"]) - p["local"] * p["elem"] for p in kept)
    peak_grads = rest_params + (sum(p["whole"] * p["elem"] for p in units) if accumulating else 0)
    return {"at_rest": {"params": rest_params, "grads": rest_params, "optimizer": opt},
            "peak_fwd_bwd": {"params": peak_params, "grads": peak_grads, "optimizer": opt}}


def formula_memory(record: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The ZeRO formula of docs/design.md#zero-formulas in fp32 (4, 4, K), Ψ = all parameters / tp, N = the shard
    group (dp, or HSDP's dp_shard)."""
    dims, stage, k = record["dims"], zero_stage(record), _k(optimizer_name(record))
    psi = sum(math.prod(i["global_shape"]) for i in record["params"].values()) / dims["tp"]
    peak = zero_memory(psi, shard_group(record), stage, 4, 4, k)
    rest = zero_memory(psi, shard_group(record), 3 if stage == 2 else stage, 4, 4, k)  # ZeRO-2 reshards after backward
    rest = (rest[0], peak[1], peak[2])
    keys = ("params", "grads", "optimizer")
    return {"at_rest": dict(zip(keys, rest)), "peak_fwd_bwd": dict(zip(keys, peak))}


def _memory_note(record: dict[str, Any], category: str) -> str:
    notes = []
    if category == "optimizer" and optimizer_name(record) == "adamw":
        notes.append("includes AdamW's 4-byte step scalar per tensor (not in the formula)")
        if record["strategy"] == "zero1" and zero1_slices(record):
            notes.append("ZeRO-1 by slices: ceil(n/N) elements of every local shard per rank (exactly Ψ/N "
                         "when N divides each)")
        elif record["strategy"] == "zero1":
            notes.append("ZeroRedundancyOptimizer partitions whole tensors greedily (not exactly Ψ/N)")
    if record["strategy"] == "fsdp" and category in ("params", "grads"):
        notes.append("FSDP2 dim-0 chunk rule: ceil(d/N) rows per rank, the last ranks fewer")
        if len(set(record.get("reshard_after_forward", {}).values())) > 1:
            notes.append("reshard_after_forward per unit: the whole-parameter units between forward and backward "
                         "are predicted; the formula is the stage's")
    if record["dims"]["tp"] > 1:
        notes.append("TP: norms and row-parallel biases replicated")
    return "; ".join(notes)


def _held_note(record: dict[str, Any]) -> str:
    note = "a pipeline step: the most held at once, sampled after each stage action"
    if len(record.get("stage_ids", ())) > 1 and zero_stage(record) in (2, 3):
        note += ("; several stages per rank: predicted is every stage whole at once, which the schedule's order may "
                 "not reach (interleaved 1F1B at M = P finishes one stage's backwards before the other's begin)")
    return note


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
        rows.append(MemoryRecord(rank=record["rank"], moment=moment, category="cuda_workspaces",
                                 measured=snap.get("cuda_workspaces"), predicted=None, formula=None,
                                 note="cuBLAS workspaces inside cuda_allocated (one per stream); None on CPU"))
    if record.get("model_states_held"):  # a pipeline step: the most held at once; its optimizer state does not change
        held = {**record["model_states_held"], "optimizer": record["memory"]["at_rest"]["optimizer"]}
        rows += [MemoryRecord(rank=record["rank"], moment="peak_fwd_bwd", category=category, measured=held[category],
                              predicted=pred["peak_fwd_bwd"][category], formula=form["peak_fwd_bwd"][category],
                              note="; ".join(filter(None, [_held_note(record), _memory_note(record, category)])))
                 for category in ("params", "grads", "optimizer")]
    if record.get("activations_held"):  # a pipeline step: the most activations held at once
        rows += _activation_rows(record, "peak_fwd_bwd", record["activations_held"])
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


def measure_layout(cluster: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``measure_rank(cfg)`` on every rank; memory and comm records of all ranks, and the raw rank dicts."""
    raw = cluster.run(measure_rank, cfg)
    hosts = [r.host for r in cluster.rank_map.ranks]
    memory = [r for rec in raw for r in memory_records(rec)]
    comm = [r for rec in raw for r in comm_records(rec, cfg, hosts)]
    return {"memory": memory, "comm": comm, "ranks": raw}
