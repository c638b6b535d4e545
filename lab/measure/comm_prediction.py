"""Communication per step predicted beside what the ranks measured (``lab.measure.memory_and_comm``'s other half).

Communication volume (docs/design.md#communication-volume), as payload bytes per step: DDP all-reduce = the
gradient bytes (DDP all-reduces flat buckets of all gradients); ZeRO-1 adds one broadcast of every
parameter from its owner (with TP or PP, one all-gather of every local shard's padded slices instead); FSDP
all-gathers the padded parameters (in bf16 under its bf16 policy) once in forward and again in backward for
every unit that resharded after forward (all of them under ZeRO-3, or as ``reshard_after_forward`` says per
unit), per micro-batch, or 1 + M times in all inside a pipeline stage, and reduce-scatters the padded
gradients once per step (HSDP then all-reduces each reduced shard over the replicas); a head tied to the
embedding under a
pipeline adds one all-reduce of its gradient over the pipeline group. TP and PP traffic come from the
planner's exact per-stage account (``lab.plan(...).stages[pp_rank].comm``) for the models the planner
sizes: the lab's GPT and Llama, and Hugging Face configs of the types it counts (``planned_model``); a
``lab.Model``'s tp and pp rows are measured only. Wire bytes per rank = payload × the busbw factor, and
busbw = algbw × the same factor.
"""
from __future__ import annotations

from typing import Any

from kernels.contract.activation_rules import precision_of
from kernels.contract.measure_records import CommRecord
from kernels.contract.model_rules import HF
from kernels.contract.run_config import RunConfig
from kernels.model.family import LLAMA, model_config
from kernels.model.own_model import hf_config
from lab.measure import host_traffic
from lab.measure.param_shards import (optimizer_name, padded_rows, param_table, reshards_after_forward, shard_group,
                                      zero1_slices, zero_stage)
from lab.planning.plan_math import busbw_factor
from lab.planning.plan_own_models import COUNTED_TYPES
from lab.planning.planner import plan


def predicted_comm(record: dict[str, Any], stage: Any = None) -> dict[str, float]:
    """Analytic payload bytes per step by op (docs/design.md#communication-volume) for this rank.

    Keys are op names for the dp axis, "tp_<op>" for the tp axis (DTensor "funcol" rows) and
    "send" for stage-boundary p2p; tp and pp come from the planner's StagePlan for this rank
    (``planned_stage``; None for a model the planner cannot size, whose tp and pp rows go unpredicted).
    """
    table, zero = param_table(record), zero_stage(record)
    dense = [p for p in table if not p["expert"]]  # EP's experts stay out of DDP and FSDP
    grads = sum(p["whole"] * p["elem"] for p in dense)
    out: dict[str, float] = {}
    replicas = record["dims"]["dp"] // record["dims"].get("ep", 1)
    if len(dense) < len(table) and replicas > 1:  # expert gradients summed over the ranks holding the same experts
        out[f"all_reduce/{replicas}"] = sum(p["whole"] * p["elem"] for p in table if p["expert"])
    if record["strategy"] in ("ddp", "zero1", "allreduce") and record["dims"]["dp"] > 1:
        out["all_reduce"] = grads  # DDP's flat buckets, or (pp) one all_reduce per gradient
    if record.get("hybrid") and record["dims"].get("dp_replicate") == record["dims"]["dp"] > 1:
        out["all_reduce"] = grads  # FSDP2 replicating only (TP with dp > 1, no ZeRO): one gradient all-reduce
    if record.get("tied_bytes"):  # a head tied to the embedding: its two copies' gradients summed over the pipeline
        out["all_reduce"] = out.get("all_reduce", 0.0) + record["tied_bytes"]
    if zero == 1 and zero1_slices(record):  # every local shard's slices gathered, each padded to ceil(n/dp)
        out["all_gather"] = sum(padded_rows(p["whole"], record["dims"]["dp"]) * record["dims"]["dp"] * p["elem"]
                                for p in dense)
    elif zero == 1:
        out["broadcast"] = grads  # every parameter, from its owner, after the step
    if record["strategy"] == "fsdp":
        n, m = shard_group(record), int(record.get("microbatches", 1))
        gathered = 2 if record.get("mixed_precision") == "bf16" else None  # FSDP2 gathers in its param_dtype
        # Per micro-batch a gather in forward, and again in backward for a unit that resharded after forward; a
        # pipeline stage keeps a unit whole from its first backward to the step's end, so it gathers 1 + m times.
        # The gradients are reduced once, after the last micro-batch (kernels.parallel.ddp, torch's stages).
        def times(p: dict[str, Any]) -> int:
            again = reshards_after_forward(record, p)
            if record["dims"]["pp"] > 1:
                return 1 + m if again else 1
            return m * (2 if again else 1)

        out["all_gather"] = sum(p["padded"] * (gathered or p["elem"]) * n * times(p) for p in dense)
        out["reduce_scatter"] = sum(p["padded"] * p["elem"] for p in dense) * n
        if record.get("hybrid") and 1 < n < record["dims"]["dp"]:  # HSDP: each reduced shard summed over replicas
            out["all_reduce"] = out.get("all_reduce", 0.0) + out["reduce_scatter"] / n
        elif record.get("hybrid") and 1 < n == record["dims"]["dp"]:  # HSDP with one replica: torch still calls it
            out["all_reduce/1"] = out["reduce_scatter"] / n
    autocast = precision_of(record) == "autocast"  # bf16 matmuls over fp32 weights: only their outputs are bf16
    for e in stage.comm if stage is not None else []:
        if e.axis in ("tp", "pp", "ep", "cp") and (e.axis != "pp" or e.op == "p2p"):  # tied_bytes above: the rest
            # pp's stage sends, cp's ring sends and receives (each send has its receive), ep's all-to-alls
            keys = {"pp": ["send"], "cp": ["cp_send", "cp_recv"], "ep": [e.op]}.get(e.axis, [f"tp_{e.op}"])
            for key in keys:
                out[key] = out.get(key, 0.0) + e.total_payload / (2 if autocast and e.matmul_output else 1)
    return out


def planned_stage(record: dict[str, Any], run: RunConfig) -> Any:
    """The planner's StagePlan for this rank's pipeline rank (fp32, the run's optimizer, batch and layout); None
    without tp or pp, or for a model the planner does not size (``planned_model``)."""
    s, model = run.strategy, planned_model(run)
    if s.tp == s.pp == s.ep == s.cp == 1 or model is None:
        return None
    parallel = {"dp": s.dp, "tp": s.tp, "pp": s.pp, "ep": s.ep, "cp": s.cp,
                "dp_replicate": record["dims"].get("dp_replicate", 1), "zero": int(record["zero"]),
                "schedule": s.schedule or "1f1b", "microbatches": record.get("microbatches", 1),
                "sequence_parallel": s.sequence_parallel, "loss_parallel": s.loss_parallel,
                "activation_checkpointing": s.activation_checkpointing}
    if s.pp > 1:
        parallel["stages_per_rank"] = s.stages_per_rank
    # FSDP2's bf16 policy computes in bf16, so the activations TP and PP move are bf16; autocast's are not all
    # (predicted_comm halves the entries that say matmul_output).
    dtype = "bf16" if precision_of(record) == "bf16" else "fp32"
    p = plan(model, gpus=s.world, parallel=parallel, global_batch=run.global_batch,
             seq_len=run.model.get("seq_len"), dtype=dtype, optimizer=optimizer_name(record))
    return p.stages[record["coords"]["pp"]]


def planned_model(run: RunConfig) -> Any:
    """What the planner sizes for a run's model: a GPT's fields as they are, a ``lab.Llama``'s config, an HF
    config of a type whose tensors the planner counts (``plan_own_models.COUNTED_TYPES``); None otherwise."""
    family = run.model.get("family")
    if family is None:
        return run.model
    if family == LLAMA:
        return model_config(run)
    if family == HF and run.model["config"].get("model_type") in COUNTED_TYPES:
        return hf_config(run.model, for_training=False)
    return None


def _predicted(pred: dict[str, float], row: dict[str, Any]) -> float | None:
    """The analytic volume for a row: dp-axis ops are "dist" rows, TP's are "funcol" rows."""
    if row["source"] == "funcol":
        return pred.get(f"tp_{row['op']}")
    if row["source"] == "dist" and f"cp_{row['op']}" in pred:  # the ring's p2p (a stage boundary's is "pipeline")
        return pred[f"cp_{row['op']}"]
    return pred.get(f"{row['op']}/{row['group_size']}", pred.get(row["op"]))  # a group-specific volume first


def _pp_sends(stage: Any) -> dict[str, float]:
    """The planner's stage-boundary send payloads of this rank by phase ("fwd", "bwd")."""
    out: dict[str, float] = {}
    for e in stage.comm if stage is not None else []:
        if e.axis == "pp" and e.op == "p2p":
            out[e.phase] = out.get(e.phase, 0.0) + e.total_payload
    return out


def comm_records(record: dict[str, Any], cfg: dict[str, Any], hosts: list[str] | None = None) -> list[CommRecord]:
    """One rank's per-step collectives with wire bytes, algbw, busbw and the analytic volume.

    With ``hosts`` (the host of each rank, by rank), each record also splits its wire bytes
    into intra- and inter-host traffic, beside the planner's inter-host bytes (``lab.measure.host_traffic``).
    """
    run = RunConfig.from_options(cfg)  # read (and checked) once per rank record, not per collective
    stage = planned_stage(record, run)  # and the planner once
    pred, sends, out = predicted_comm(record, stage), _pp_sends(stage), []
    order = run.strategy.mesh_order
    for row in record["comm"]:
        predicted = _predicted(pred, row)
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
