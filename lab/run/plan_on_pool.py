"""``lab.plan``: the analytic plan, and with ``measure_on=cluster`` a scaled-down copy measured beside it.

The planner (``lab.planning.planner.plan``, torch-free) sizes a layout from formulas. Whether those
formulas hold for this model under this layout is a question the pool can answer in seconds: the
same architecture made small through its own sizes (``scaled_copy``: a Hugging Face config through
``lab.run.shrunk_config``, a ``lab.GPT`` or ``lab.Llama`` through its fields, a preset as the lab
model of its kind), under the planned layout with tp and pp kept and dp filling the pool, runs two
steps with ``measure=True``; the same planner plans that copy at the pool's size, and each stage's
model states and activations and each collective's bytes are set side by side
(``lab.planning.plan_check.PlanCheck``). The copy keeps what decides how the layout splits the
model (its kind, grouped-query heads, a tied head, the schedule, ZeRO, sequence and loss parallel)
and shrinks what only scales it (width, depth, vocabulary).

A layout the pool cannot hold (tp·pp more than its ranks, or not dividing them) is refused with
``[measure-on-size]`` before anything runs; one the lab refuses is refused by the lab's own rule.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Any

from lab.planning.plan_check import CheckRow, PlanCheck
from lab.planning.plan_models import get_model
from lab.planning.planner import Plan
from lab.planning.planner import plan as analytic_plan

SEQ_LEN, MICRO_BATCH, STEPS = 16, 2, 2
# Collectives as the planner names their axis -> as the ranks record their source.
_SOURCE = {"dp": "dist", "dp_shard": "dist", "dp_replicate": "dist", "tp": "funcol", "pp": "pipeline"}


def plan(model: Any, gpus: int, *, measure_on: Any = None, **options: Any) -> Plan:
    """Size one layout analytically (``lab.planning.planner.plan``, whose every option this takes); with
    ``measure_on=cluster``, also run a scaled-down copy of the model on that pool under the layout and put
    what it measured beside what the planner predicts for the copy (``Plan.measured``, module docstring)."""
    planned = analytic_plan(model, gpus, **options)
    if measure_on is None:
        return planned
    return dataclasses.replace(planned, measured=measured_beside(planned, model, measure_on))


def measured_beside(planned: Plan, model: Any, cluster: Any) -> PlanCheck:
    """Run the scaled copy of ``model`` under ``planned``'s layout on ``cluster``; the rows of predicted and
    measured bytes (module docstring)."""
    import lab  # the run side (torch) only when a measurement is asked for
    from lab.run.own_models import is_hf_config
    lay, world = planned.layout, cluster.world_size
    if lay.tp * lay.pp > world or world % (lay.tp * lay.pp):
        raise lab.ParallelConfigError([("measure-on-size", f"tp*pp = {lay.tp * lay.pp} must divide the pool's "
                                        f"{world} ranks to measure this layout there: plan tp and pp that fit, "
                                        "or start a pool of a multiple of tp*pp ranks")])
    parallel = lab.Parallel(dp=world // (lay.tp * lay.pp), tp=lay.tp, pp=lay.pp, zero=lay.zero,
                            fsdp_strategy=lay.fsdp_strategy, schedule=lay.schedule,
                            stages_per_rank=lay.stages_per_rank if lay.pp > 1 else None,
                            sequence_parallel=lay.sequence_parallel, loss_parallel=lay.loss_parallel,
                            activation_checkpointing=lay.activation_checkpointing)
    copy = scaled_copy(model, lay.tp, parallel.num_stages if lay.pp > 1 else 2)
    global_batch = parallel.dp * parallel.num_microbatches * MICRO_BATCH
    trained = lab.Model(copy, seq_len=SEQ_LEN) if is_hf_config(copy) else copy  # an HF model's window is set here
    run = lab.Experiment(cluster, trained, parallel, global_batch=global_batch, steps=STEPS, measure=True)
    result = run.run(progress=False)
    predicted = analytic_plan(copy, world, parallel=_layout_dict(parallel), global_batch=global_batch,
                              micro_batch=MICRO_BATCH, seq_len=SEQ_LEN, dtype="fp32", optimizer="adam")
    rows = _memory_rows(predicted, result) + _comm_rows(predicted, result)
    return PlanCheck(predicted.model, parallel.describe(), world, tuple(rows))


def scaled_copy(model: Any, tp: int, layers: int) -> Any:
    """The model made small (module docstring): ``layers`` blocks, heads that ``tp`` divides, narrow, a
    vocabulary of 128; what a run takes as ``model=``."""
    import lab
    from lab.run.own_models import is_hf_config
    kv = max(2, tp)
    heads = 2 * kv
    if isinstance(model, lab.LlamaConfig):
        return dataclasses.replace(model, layers=layers, hidden=heads * 8, heads=heads, kv_heads=kv,
                                   ffn=2 * heads * 8, vocab=128, seq_len=SEQ_LEN)
    if isinstance(model, lab.GPTConfig):
        return dataclasses.replace(model, layers=layers, d_model=heads * 8, heads=heads, vocab=128, seq_len=SEQ_LEN,
                                   d_ff=4 * heads * 8)
    if is_hf_config(model):
        from lab.run.shrunk_config import DEPTH, shrunk_copy
        depth = {k: layers for k in DEPTH}
        width = {k: heads * 16 for k in ("hidden_size", "n_embd", "d_model", "dim")}
        return shrunk_copy(model, {**depth, **width, "num_attention_heads": heads, "n_head": heads,
                                   "num_key_value_heads": kv, "intermediate_size": 2 * heads * 16,
                                   "n_inner": 4 * heads * 16})
    spec = get_model(model)
    if spec.gated_mlp:
        return lab.Llama(layers=layers, hidden=heads * 8, heads=heads, kv_heads=kv if spec.kv_heads else heads,
                         ffn=2 * heads * 8, vocab=128, seq_len=SEQ_LEN)
    return lab.GPT(layers=layers, d_model=heads * 8, heads=heads, vocab=128, seq_len=SEQ_LEN, bias=spec.bias)


def _layout_dict(parallel: Any) -> dict[str, Any]:
    fields = ("dp", "tp", "pp", "zero", "fsdp_strategy", "schedule", "sequence_parallel", "loss_parallel",
              "activation_checkpointing")
    out = {k: getattr(parallel, k) for k in fields}
    out["microbatches"] = parallel.num_microbatches
    if parallel.pp > 1:
        out["stages_per_rank"] = parallel.num_stages_per_rank
    return out


def _memory_rows(predicted: Plan, result: Any) -> list[CheckRow]:
    """Per pipeline rank: the busiest rank's model states (forward done, or in a pipeline the most held at once
    over the step) and activations (peak), beside the planner's StagePlan memory."""
    pp_of = {rec["rank"]: rec["coords"]["pp"] for rec in result.layout}
    busiest: dict[tuple[int, str], float] = defaultdict(float)
    for row in result.memory_records:
        category, rank = row["category"], row["rank"]
        wanted = category in ("params", "grads", "optimizer", "activations") and row["measured"] is not None
        if wanted and row["moment"] == "peak_fwd_bwd":
            key = (pp_of[rank], category)
            busiest[key] = max(busiest[key], row["measured"])
    notes = {"optimizer": "measured includes AdamW's 4-byte step per tensor",
             "activations": "the planner estimates activations from a formula; measured: saved for backward"}
    return [CheckRow(f"pp rank {stage.pp_rank} {category}", getattr(stage.memory, category),
                     busiest[(stage.pp_rank, category)], notes.get(category, ""))
            for stage in predicted.stages for category in ("params", "grads", "optimizer", "activations")
            if (stage.pp_rank, category) in busiest]


def _comm_rows(predicted: Plan, result: Any) -> list[CheckRow]:
    """Per axis and collective: rank 0's payload bytes per step beside its stage's planned entries."""
    planned: dict[tuple[str, str], float] = defaultdict(float)
    for entry in predicted.stages[0].comm:
        source = "dist" if entry.axis == "pp" and entry.op != "p2p" else _SOURCE[entry.axis]  # a tied head's sum
        planned[(source, "send" if entry.op == "p2p" else entry.op)] += entry.total_payload
    measured: dict[tuple[str, str], float] = defaultdict(float)
    for row in result.comm_records:
        if row["rank"] == 0:
            measured[(row["source"], row["op"])] += row["payload_bytes"]
    note = {("dist", "broadcast"): "ZeroRedundancyOptimizer's broadcast of updated parameters (the planner counts "
                                   "the ZeRO paper's all-gather instead)"}
    return [CheckRow(f"rank 0 {source} {op}", planned.get((source, op), 0.0), measured.get((source, op), 0.0),
                     note.get((source, op), ""))
            for source, op in sorted(set(planned) | set(measured))]
