"""The planner's predictions for the lab's GPT equal what the ranks measure (issue "Measured vs predicted").

``lab.plan(TINY, ...)`` (a GPTConfig dict: ``ModelSpec.from_gpt``, counted tensor by
tensor) is set beside ``lab.measure.memory_and_comm.measure_layout`` on the 4-rank gloo pool, for the
tiny GPT (2 layers, d_model 32, 4 heads, d_ff 64, vocab 64, seq_len 16: Ψ = 21,760
fp32 parameters in 37 tensors), global batch 8, fp32 AdamW (the planner's
``dtype="fp32", optimizer="adam"``: 4 + 4 + K=8 bytes per parameter).

Layouts (``LAYOUTS``): DDP and ZeRO-1/2/3 on dp=4; TP2×DP2 with zero 0, which
``kernels.parallel.strategy.resolve_strategy`` builds as FSDP2 *replication* on the dp axis (a hybrid
mesh with shard size 1: DDP cannot take TP DTensors), so memory is DDP's and the dp
traffic is one gradient all-reduce; TP2×DP2 ZeRO-3 (FSDP2 sharding over TP shards,
2D DTensors); TP4 alone and PP2×TP2, where nothing but TP decides where gradients
live (the row-parallel embeddings' gradients must be sharded like their weights);
PP2×DP2 1F1B, m=2 (one block per stage; stage 0 also holds the embeddings, stage 1
the final norm and LM head; gradients all-reduced per tensor over dp). Inside a
pipeline the tp collectives are metered by the same CommDebugMode-based meter and
match the planner's tp traffic. TP4 and PP2×TP2 again under sequence parallelism (the
norms' partial gradients all-reduced, the ends' collectives cut, a stage's s/tp positions
sent) and under full recompute (torch's checkpoint stops before a block's last all-reduce).
ZeRO-3 DP4 and TP2×DP2 ZeRO-2 again with two micro-batches of gradient accumulation, where FSDP2
holds a whole gradient beside the shard until the step's one reduce-scatter.

Model states are compared at ``peak_fwd_bwd`` (forward done, backward not started:
the moment ZeRO-2 holds whole parameters, which the planner's ZeRO-2 term counts)
and, with pp, at the most held at once over the schedule step (``model_states_held``:
PP2×DP2 ZeRO-3 holds its stage's parameters and gradient whole, beside the gradient's
shard, from its first backward to its last). Each allowance is computed, not guessed:

- AdamW's ``step`` scalar per tensor (4 bytes each) is not in K: the measured
  ``optimizer_step_scalars`` is taken off before comparing.
- FSDP2 shards dim 0 like ``torch.chunk`` (ceil(d/N) rows, the last ranks fewer):
  the allowance is Σ over tensors of the largest |rows held − d/N| × the row bytes.
  Every dim 0 here (after TP) divides by N, so it is 0 and the match is exact.
- ZeroRedundancyOptimizer gives whole tensors to ranks greedily (largest first, to
  the least loaded): the allowance is K × the largest |greedy share − Ψ/N| over the
  ranks, from ``zero1_partition`` over the planner's own tensor list (5,632 vs 5,440
  elements on rank 0: 1,536 bytes).

Traffic per step is compared within 5% as payload bytes (the planner's
``total_payload``; wire bytes are both × the same busbw factor), and is in fact
exact: dp axis against the ``torch.distributed`` rows, tp axis against the DTensor
("funcol") rows, embedding, LM-head and logits collectives included (under
loss_parallel, the sharded cross-entropy's three all-reduces instead), pp against the
stage's sends. ZeRO-1 is compared in wire bytes: the planner counts the ZeRO paper's
reduce-scatter + all-gather (2Ψ(N-1)/N), which is what torch's gradient all-reduce
puts on the wire; ZeroRedundancyOptimizer's parameter broadcast (Ψ) comes on top and
is named, not compared.
"""
from __future__ import annotations

import math
import re

import pytest

from lab import plan
from lab.measure.memory_and_comm import measure_layout, zero1_partition
from lab.planning.plan_math import busbw_factor
from lab.planning.plan_models import ModelSpec, get_model
from lab.planning.plan_tensors import gpt_tensors

TINY = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "d_ff": 64}
BASE = {"model": TINY, "global_batch": 8, "steps": 2, "lr": 1e-2, "seed": 0}
LAYOUTS = {
    "ddp": {"dp": 4},
    "zero1": {"dp": 4, "zero": 1},
    "zero2": {"dp": 4, "zero": 2},
    "zero3": {"dp": 4, "zero": 3},
    "tp4": {"dp": 1, "tp": 4},
    "tp4_loss_parallel": {"dp": 1, "tp": 4, "loss_parallel": True},  # no logits all-gather: 3 small all-reduces
    "tp4_sp": {"dp": 1, "tp": 4, "sequence_parallel": True},  # the norms' gradients all-reduced; the ends cut
    "tp4_recompute": {"dp": 1, "tp": 4, "activation_checkpointing": True},  # each block's last all-reduce not rerun
    "tp2_dp2": {"dp": 2, "tp": 2},  # zero 0: FSDP2 replication on dp (resolve_strategy)
    "tp2_dp2_zero3": {"dp": 2, "tp": 2, "zero": 3},
    # Accumulation: FSDP2 holds each unit's gradient whole until the last micro-batch reduce-scatters it (ZeRO-3's
    # too, off the registered parameters), TP-sharded like its weight (the embeddings' as well).
    "zero3_accumulation": {"dp": 4, "zero": 3, "microbatches": 2},
    "tp2_dp2_zero2_accumulation": {"dp": 2, "tp": 2, "zero": 2, "microbatches": 2},
    "tp2_dp2_accumulation": {"dp": 2, "tp": 2, "microbatches": 2},  # FSDP2 replicating accumulates the same way
    "pp2_dp2": {"dp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2},
    # torch's schedule keeps a stage's units whole after each backward but the last, and their gradients whole
    "pp2_dp2_zero3": {"dp": 2, "pp": 2, "zero": 3, "schedule": "1f1b", "microbatches": 2},
    "pp2_tp2": {"dp": 1, "tp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2},
    "pp2_tp2_sp_recompute": {"dp": 1, "tp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2,  # sends of s/tp
                             "sequence_parallel": True, "activation_checkpointing": True},
}
K, ELEM = 8, 4  # fp32 AdamW: exp_avg + exp_avg_sq; fp32 parameters and gradients
STATES = ("params", "grads", "optimizer")


def _plan(layout: dict):
    return plan(TINY, gpus=4, parallel=layout, global_batch=8, dtype="fp32", optimizer="adam")


def _fsdp_allowance(tp: int, n: int) -> float:
    """Bytes by which FSDP2's chunk rule can move one rank's share away from Ψ_local/N."""
    total = 0.0
    for t in gpt_tensors(get_model(TINY)):
        d0 = t.shape[0] // tp if t.tp_dim == 0 else t.shape[0]
        c = math.ceil(d0 / n)
        worst = max(abs(max(0, min(c, d0 - r * c)) - d0 / n) for r in range(n))
        total += worst * t.tp_numel(tp) / d0 * ELEM
    return total


def _zero1_allowance(n: int) -> float:
    """Optimizer bytes by which the greedy whole-tensor partition misses Ψ/N on the worst rank."""
    numels = [t.numel for t in gpt_tensors(get_model(TINY))]
    shares = [sum(numels[i] for i in part) for part in zero1_partition(numels, n)]
    return K * max(abs(s - sum(numels) / n) for s in shares)


def _measured_states(rec: dict) -> dict[str, float]:
    rest = rec["memory"]["at_rest"]  # the optimizer state: the same all step
    held = rec["memory"].get("peak_fwd_bwd") or rec["model_states_held"]  # a pipeline's: the most over the step
    return {"params": held["params"], "grads": held["grads"],
            "optimizer": rest["optimizer"] - rest["optimizer_step_scalars"]}  # step scalars: not in K


def _measured_comm(out: dict, rank: int) -> dict[tuple[str, str], float]:
    """Payload bytes per (axis, op) this rank moved in the probed step."""
    axis = {"dist": "dp", "funcol": "tp", "pipeline": "pp"}
    got: dict[tuple[str, str], float] = {}
    for r in out["comm"]:
        if r.rank == rank:
            key = (axis[r.source], "p2p" if r.op == "send" else r.op)
            got[key] = got.get(key, 0.0) + r.payload_bytes
    return got


def _check_tp_split(rec: dict, tp: int) -> None:
    """Each parameter's TP placement is the one the planner's tensor list says (dim, or replicated)."""
    spec = {t.name: t for t in gpt_tensors(get_model(TINY))}
    for name, info in rec["params"].items():
        dims = [int(m.group(1)) for axis, pl in zip(info["mesh_axes"], info["placements"])
                if axis == "tp" and (m := re.search(r"S(?:hard)?\((?:dim=)?(\d+)", pl))]
        assert (dims[0] if dims else None) == (spec[name].tp_dim if tp > 1 else None), (name, info)


# The fast tier keeps one case per family (DP, ZeRO-3, TP, TP x DP, PP); each costs 2.5-5 s.
FAST = {"ddp", "zero3", "tp4", "tp2_dp2_zero3", "pp2_tp2", "tp2_dp2_zero2_accumulation"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in LAYOUTS])
def test_planner_predicts_the_measured_model_states_and_traffic(cluster, name):
    layout = LAYOUTS[name]
    p, out = _plan(layout), measure_layout(cluster, {**BASE, **layout})
    dp, tp = layout["dp"], layout.get("tp", 1)
    fsdp = layout.get("zero", 0) >= 2
    pad = _fsdp_allowance(tp, dp) if fsdp else 0.0
    opt_pad = _zero1_allowance(dp) if layout.get("zero") == 1 else 0.0
    assert pad == 0.0  # every dim 0 divides by N here: FSDP2's padding allows nothing
    totals = {}
    for rec in out["ranks"]:
        stage = p.stages[rec["coords"]["pp"]]
        got, want = _measured_states(rec), stage.memory
        assert got["params"] == pytest.approx(want.params, abs=pad), (name, rec["rank"], got, want)
        assert got["grads"] == pytest.approx(want.grads, abs=pad), (name, rec["rank"], got, want)
        assert got["optimizer"] == pytest.approx(want.optimizer, abs=K / ELEM * pad + opt_pad), (name, got, want)
        assert set(rec["params"]) == {t.name for t in gpt_tensors(get_model(TINY))
                                      if _on_stage(t, stage.stage_ids, p.layout.pp)}
        _check_tp_split(rec, tp)
        totals[rec["rank"]] = sum(got.values())
        _check_comm(name, p, stage, out, rec)
    busiest = max(totals, key=totals.get)  # the planner's headline is the busiest rank's
    assert totals[busiest] == pytest.approx(p.memory.params + p.memory.grads + p.memory.optimizer,
                                            abs=3 * pad + opt_pad)


def _on_stage(t, stage_ids: tuple[int, ...], pp: int) -> bool:
    owner = {"embed": 0, "head": pp - 1}.get(t.owner)
    return (owner if owner is not None else t.block * pp // TINY["layers"]) in stage_ids


def _check_comm(name: str, p, stage, out: dict, rec: dict) -> None:
    got = _measured_comm(out, rec["rank"])
    want: dict[tuple[str, str], float] = {}
    for e in stage.comm:
        want[(e.axis, e.op)] = want.get((e.axis, e.op), 0.0) + e.total_payload
    if name == "zero1":  # wire bytes: RS + AG (planner) = the all-reduce (torch); the broadcast is extra
        n = p.layout.dp
        assert got[("dp", "all_reduce")] * busbw_factor("all_reduce", n) == pytest.approx(
            stage.comm[0].wire_bytes + stage.comm[1].wire_bytes, rel=0.05)
        assert got[("dp", "broadcast")] == pytest.approx(p.memory.params, rel=0.05)
        return
    assert set(got) == set(want), (name, rec["rank"], got, want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=0.05), (name, rec["rank"], key, got[key], value)


def test_from_gpt_lists_every_parameter_of_the_lab_gpt_in_model_order():
    from kernels.model.gpt import GPTConfig, build_gpt

    for cfg in (GPTConfig(**TINY), GPTConfig(layers=4, d_model=32, heads=4, vocab=64, seq_len=16, d_ff=128),
                GPTConfig(layers=1, d_model=16, heads=2, vocab=32, seq_len=8, bias=False)):
        spec = ModelSpec.from_gpt(cfg)
        model = build_gpt(cfg)
        assert [(n, tuple(x.shape)) for n, x in model.named_parameters()] == \
            [(t.name, t.shape) for t in gpt_tensors(spec)]
        assert spec.params == sum(x.numel() for x in model.parameters())
        assert get_model(cfg) == spec == get_model({f: getattr(cfg, f) for f in TINY} | {"bias": cfg.bias})


def test_from_gpt_lists_every_parameter_of_the_lab_gpt_with_experts_in_model_order():
    from kernels.model.gpt import GPTConfig, build_gpt

    for cfg in (GPTConfig(**TINY, experts=4, top_k=2), GPTConfig(**{**TINY, "bias": False}, experts=2, top_k=1)):
        spec = ModelSpec.from_gpt(cfg)
        model = build_gpt(cfg)
        assert [(n, tuple(x.shape)) for n, x in model.named_parameters()] == \
            [(t.name, t.shape) for t in gpt_tensors(spec)]
        assert spec.params == sum(x.numel() for x in model.parameters())
        experts = sum(x.numel() for n, x in model.named_parameters() if ".experts." in n)
        assert spec.expert_params == experts == sum(t.numel for t in gpt_tensors(spec) if t.expert)


def test_tp_splits_columns_and_rows_and_replicates_norms_and_row_biases():
    spec = ModelSpec.from_gpt(TINY)
    by = {t.name: t for t in gpt_tensors(spec)}
    assert by["blocks.0.attn.q.bias"].tp_dim == 0 and by["blocks.0.mlp.fc_in.weight"].tp_dim == 0
    assert by["blocks.0.attn.out.weight"].tp_dim == 1 and by["blocks.0.attn.out.bias"].tp_dim is None
    assert by["tok_emb.weight"].tp_dim == 0 and by["lm_head.weight"].tp_dim == 0
    assert by["norm.weight"].tp_dim is None and by["blocks.1.mlp_norm.bias"].tp_dim is None
    # Ψ/tp would be 10,880: the replicated norms and row-parallel biases (448 elements) add 224.
    assert _plan({"dp": 2, "tp": 2}).stages[0].params == 21760 / 2 + 448 / 2


def test_pp_stages_hold_their_blocks_with_the_embeddings_first_and_the_head_last():
    p = _plan({"dp": 2, "pp": 2, "microbatches": 2})
    block = 4224 + 4192 + 128  # one block: attention (4h² + 4h), MLP (2·h·d_ff + d_ff + h), two LayerNorms
    assert [s.params for s in p.stages] == [block + 64 * 32 + 16 * 32, block + 2 * 32 + 64 * 32]
    assert p.memory == p.stages[0].memory  # the embeddings make stage 0 the busiest
    sends = [{e.phase: e.count for e in s.comm if e.axis == "pp"} for s in p.stages]
    assert sends == [{"fwd": 2}, {"bwd": 2}]  # activations out of stage 0, gradients out of stage 1
