"""The planner sizes mixtures of experts, expert parallelism (ep) and context parallelism (cp).

docs/design.md#experts-and-context-parallelism: experts split 1/ep per rank and stay out of ZeRO under EP;
activations fall as 1/cp; per MoE layer and micro-batch 2 all-to-alls forward and 2 backward of the rank's
tokens·top_k·hidden; per attention layer cp-1 key/value sends forward and cp-1 gradient sends backward.
The hand-computed cases use the lab's GPT (``ModelSpec.from_gpt``, counted tensor by tensor), fp32 (4 bytes).
Torch-free: every figure here is arithmetic.
"""
from __future__ import annotations

import json

import pytest

from lab.planning.plan_math import GB
from lab.planning.plan_mesh import Layout, layout_groups
from lab.planning.plan_models import ModelSpec, get_model
from lab.planning.plan_tensors import gpt_tensors
from lab.planning.planner import plan
from lab.planning.recommend import recommend

# The lab's GPT with a mixture of 4 experts (d_ff = 4·32 = 128 each), 2 per token, in both blocks.
MOE_GPT = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "experts": 4, "top_k": 2}
DENSE_GPT = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16}
FP32 = 4
EXPERT = 2 * 32 * 128 + 128 + 32  # one GELU expert: w_in, b_in, w_out, b_out
EXPERTS = 2 * 4 * EXPERT  # both layers' 4 experts: 66,816 parameters


def _gpt_plan(model: dict, gpus: int, parallel: dict, **kwargs):
    return plan(model, gpus=gpus, parallel=parallel, dtype="fp32", optimizer="adam", **kwargs)


# --- model counts ---------------------------------------------------------------------------------

def test_mixtral_8x7b_counts_46_7b_parameters_and_12_9b_active():
    # Jiang et al. 2024: "47B total parameters" (46.7B on its model card), "13B active" (12.9B).
    mixtral = get_model("Mixtral-8x7B")
    assert mixtral.shape_params == pytest.approx(46.7e9, rel=0.01)
    assert mixtral.active_params == pytest.approx(12.9e9, rel=0.01)
    assert mixtral.shape_params == 46_702_792_704  # what transformers builds from its config.json
    assert mixtral.expert_params == 32 * 8 * 3 * 4096 * 14336


def test_qwen3_30b_a3b_counts_30_5b_parameters_and_3_3b_active():
    qwen = get_model("qwen3-30b-a3b")
    assert qwen.shape_params == 30_532_122_624  # transformers' count for its config.json (q/k norms included)
    assert qwen.shape_params == pytest.approx(30.5e9, rel=0.01)
    assert qwen.active_params == pytest.approx(3.3e9, rel=0.02)  # 3.35B: the report's "3.3B" is cut, not rounded


def test_from_gpt_carries_the_experts_and_lists_the_packed_expert_tensors():
    spec = ModelSpec.from_gpt(MOE_GPT)
    assert (spec.experts, spec.top_k, spec.capacity_factor) == (4, 2, None)
    dense = ModelSpec.from_gpt(DENSE_GPT)
    mlp = 2 * 32 * 128 + 128 + 32
    assert spec.params == dense.params - 2 * mlp + 2 * (4 * 32 + 4 * EXPERT)  # router (E, h) and 4 experts per block
    names = {t.name: t for t in gpt_tensors(spec)}
    assert names["blocks.0.mlp.experts.w_in"].shape == (4, 32, 128) and names["blocks.0.mlp.experts.w_in"].expert
    assert names["blocks.1.mlp.router.weight"].shape == (4, 32) and not names["blocks.1.mlp.router.weight"].expert
    assert "blocks.0.mlp.fc_in.weight" not in names
    assert spec.expert_params == EXPERTS


def test_every_other_layer_and_dense_first_layers_choose_which_blocks_route():
    base = dict(layers=6, hidden=64, heads=4, ffn=256, vocab=100, experts=4, top_k=1)
    every_other = get_model(base | {"moe_every": 2})
    late = get_model(base | {"dense_first": 3})
    assert every_other.expert_params == late.expert_params == 3 * 4 * (2 * 64 * 256 + 256 + 64)
    assert get_model(base).expert_params == 2 * every_other.expert_params


# --- memory -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_memory_falls_as_one_over_ep_and_the_dense_part_stays(ep):
    # DDP (zero 0): the experts' 4 + 4 + 8 bytes each, 1/ep of them per rank; the rest is unchanged.
    p = _gpt_plan(MOE_GPT, 4, {"dp": 4, "ep": ep}, global_batch=8)
    assert p.memory.experts == EXPERTS * 16 / ep
    whole = _gpt_plan(MOE_GPT, 4, {"dp": 4}, global_batch=8)
    assert p.memory.total - p.memory.experts == whole.memory.total - whole.memory.experts


def test_expert_parallelism_keeps_experts_out_of_zero():
    # ZeRO-3 over dp=4 shards the dense parts; under EP the experts stay whole (1/ep of them).
    p = _gpt_plan(MOE_GPT, 4, {"dp": 4, "ep": 2, "zero": 3}, global_batch=8)
    dense = ModelSpec.from_gpt(MOE_GPT).params - EXPERTS
    assert p.memory.params + p.memory.grads + p.memory.optimizer == pytest.approx(dense * 16 / 4 + EXPERTS * 16 / 2)
    assert p.memory.experts == EXPERTS * 16 / 2


@pytest.mark.parametrize("model", ["llama3-8b", "mixtral-8x7b"])
def test_activations_fall_as_one_over_cp_and_zero_shards_over_dp_times_cp(model):
    plans = {cp: plan(model, gpus=8, parallel={"dp": 8 // cp, "cp": cp}, micro_batch=1, seq_len=8192)
             for cp in (1, 2, 4)}
    for cp, p in plans.items():
        assert p.memory.activations == pytest.approx(plans[1].memory.activations / cp)
        assert p.memory.optimizer == plans[1].memory.optimizer  # ZeRO-1 over dp·cp = 8 ranks either way


# --- traffic: hand-computed cases ----------------------------------------------------------------

def test_ep_all_to_all_payload_is_tokens_top_k_hidden_bytes_four_times_per_moe_layer():
    # ep=2 inside dp=2, global batch 8: each rank reads 4 sequences of 16 tokens (M=1), 64 tokens, and
    # routes 2 copies of each: 128 rows of d_model=32 fp32 = 16,384 bytes per all-to-all.
    p = _gpt_plan(MOE_GPT, 2, {"dp": 2, "ep": 2}, global_batch=8)
    one = 4 * 16 * 2 * 32 * FP32
    assert one == 16_384
    a2a = [e for e in p.comm if e.op == "all_to_all"]
    counts = 8 * MOE_GPT["experts"]  # the int64 count of each expert, exchanged before each forward dispatch
    assert {(e.phase, e.count, e.payload_bytes, e.group_size, e.link) for e in a2a} == \
        {("fwd", 2 * 2, one, 2, "intra"), ("bwd", 2 * 2, one, 2, "intra"),  # dispatch + combine, 2 MoE layers
         ("fwd", 2, counts, 2, "intra")}
    assert p.comm_bytes(axis="ep", wire=False) == 4 * 2 * one + 2 * counts  # 4 per MoE layer, and the counts
    assert p.comm_bytes(axis="ep") == (4 * 2 * one + 2 * counts) / 2  # half of each input stays on its rank
    assert not [e for e in p.comm if e.axis == "ep_replicate"]  # dp/ep = 1: nobody else holds these experts
    dense = ModelSpec.from_gpt(MOE_GPT).params - EXPERTS
    assert p.comm_bytes(axis="dp", wire=False) == dense * FP32  # the gradient all-reduce skips the experts


def test_expert_gradients_meet_over_the_ranks_holding_the_same_experts():
    p = _gpt_plan(MOE_GPT, 4, {"dp": 4, "ep": 2}, global_batch=8)
    (grads,) = [e for e in p.comm if e.axis == "ep_replicate"]
    assert (grads.op, grads.group_size, grads.count, grads.payload_bytes) == ("all_reduce", 2, 1, EXPERTS / 2 * FP32)
    assert layout_groups(p.layout, "ep") == [[0, 1], [2, 3]]
    assert layout_groups(p.layout, "ep_replicate") == [[0, 2], [1, 3]]


def test_full_recompute_runs_the_forward_all_to_alls_and_ring_sends_again():
    ep = _gpt_plan(MOE_GPT, 2, {"dp": 2, "ep": 2}, global_batch=8, activation_checkpointing=True)
    assert ep.comm_bytes(axis="ep", phase="recompute") == ep.comm_bytes(axis="ep", phase="fwd") > 0
    cp = _gpt_plan(DENSE_GPT, 2, {"dp": 1, "cp": 2}, global_batch=2, activation_checkpointing=True)
    assert cp.comm_bytes(axis="cp", phase="recompute") == cp.comm_bytes(axis="cp", phase="fwd") > 0


@pytest.mark.parametrize("cp, sends", [(2, 1), (4, 3)])
def test_cp_ring_passes_the_key_value_block_forward_and_again_beside_its_gradient_back(cp, sends):
    # Micro-batch 2, seq 16: each rank holds 16/cp tokens; k and v are 4 heads × 8 = 32 wide, fp32.
    p = _gpt_plan(DENSE_GPT, cp, {"dp": 1, "cp": cp}, global_batch=2)
    block = 2 * 2 * (16 // cp) * 32 * FP32  # k and v, one message
    ring = {(e.phase, e.count, e.payload_bytes, e.op) for e in p.comm if e.axis == "cp"}
    # cp-1 block sends per layer forward and again backward (2 layers), and the float32 gradient's cp sends
    assert ring == {("fwd", 2 * sends, block, "p2p"), ("bwd", 2 * sends, block, "p2p"), ("bwd", 2 * cp, block, "p2p")}
    assert p.comm_bytes(axis="cp") == (2 * 2 * sends + 2 * cp) * block
    (sync,) = [e for e in p.comm if e.axis == "dp"]  # cp ranks share the weights: DDP over dp·cp = cp ranks
    assert (sync.op, sync.group_size, sync.payload_bytes) == ("all_reduce", cp, p.params * FP32)


def test_cp_ring_carries_only_the_grouped_key_value_heads():
    p = plan("llama3-8b", gpus=8, parallel={"dp": 4, "cp": 2}, micro_batch=1, seq_len=8192)
    (fwd,) = [e for e in p.comm if e.axis == "cp" and e.phase == "fwd"]
    assert fwd.payload_bytes == 2 * 1 * 4096 * (8 * 128) * 2  # 8 kv heads of 128, bf16
    assert fwd.count == 32 and fwd.link == "intra"  # 1 send per layer; cp neighbours share a node


def test_the_latency_term_counts_the_all_to_all_steps():
    # One dp all-reduce on 2 ranks (2 steps) and 8 + 2 all-to-alls (tokens, counts) on 2 ranks (1 step each), 1 µs a step.
    p = _gpt_plan(MOE_GPT, 2, {"dp": 2, "ep": 2}, global_batch=8)
    assert p.link("intra").latency_s == pytest.approx(12e-6)


def test_ep_groups_cross_nodes_when_tp_spreads_them():
    inside = plan("mixtral-8x7b", gpus=16, parallel={"dp": 16, "ep": 8}, seq_len=4096)
    spread = plan("mixtral-8x7b", gpus=16, parallel={"dp": 8, "tp": 2, "ep": 8}, seq_len=4096)
    assert {e.link for e in inside.comm if e.axis == "ep"} == {"intra"}
    assert {e.link for e in spread.comm if e.axis == "ep"} == {"inter"}


# --- layout fields, refusals, reports --------------------------------------------------------------

def test_layout_names_and_serialises_ep_and_cp():
    p = plan("mixtral-8x7b", gpus=64, parallel={"dp": 16, "pp": 2, "cp": 2}, ep=8, seq_len=4096)
    assert (p.layout.ep, p.layout.cp, p.layout.world) == (8, 2, 64)
    assert p.layout.describe() == "CP2×PP2×DP16 EP8 ZeRO-0 1f1b"
    data = json.loads(json.dumps(p.to_dict()))
    assert (data["layout"]["ep"], data["layout"]["cp"]) == (8, 2)
    assert Layout(dp=4, cp=2).dp_shard == 8


def test_text_and_html_reports_show_ep_cp_and_their_traffic():
    p = plan("mixtral-8x7b", gpus=16, parallel={"dp": 8, "cp": 2, "ep": 8}, seq_len=4096)
    text, html = p.render_text(), p.render_html()
    for shown in ("CP2×DP8 EP8", "all_to_all", "ep_replicate", "2048 tokens per cp rank", "experts"):
        assert shown in text and shown in html, shown
    assert "\n  cp " in text


def test_layouts_the_model_or_the_lab_refuses_raise_or_are_noted():
    with pytest.raises(ValueError, match="divisible by ep"):
        plan("mixtral-8x7b", gpus=16, parallel={"dp": 16, "ep": 16})
    with pytest.raises(ValueError, match="experts"):
        plan("llama3-8b", gpus=8, parallel={"dp": 8, "ep": 2})
    with pytest.raises(ValueError, match="must divide dp"):
        plan("mixtral-8x7b", gpus=8, parallel={"dp": 4, "tp": 2, "ep": 8})
    with pytest.raises(ValueError, match="2\\*cp"):
        plan(DENSE_GPT, gpus=4, parallel={"dp": 1, "cp": 4}, seq_len=12)
    with pytest.raises(ValueError, match="must equal gpus"):
        plan("llama3-8b", gpus=8, parallel={"dp": 8, "cp": 2})
    noted = plan("mixtral-8x7b", gpus=16, parallel={"dp": 8, "pp": 2, "ep": 8}, seq_len=4096)
    assert any("[ep-combination]" in n for n in noted.notes)


# --- recommend ---------------------------------------------------------------------------------------

def test_recommend_puts_mixtral_on_64_gpus_with_expert_parallelism():
    rec = recommend("mixtral-8x7b", 64, 8, 80)
    best = rec.best
    assert best.plan.fits and best.layout.ep > 1 and best.parallel["ep"] == best.layout.ep
    assert f"EP{best.layout.ep}: 1/{best.layout.ep} of the experts" in best.reason
    assert any("ZeRO-1 with ep > 1" in w for w in rec.warnings)


def test_recommend_tries_cp_only_when_activations_alone_do_not_fit():
    short = recommend("llama3-8b", 16, 8, 80, seq_len=4096)
    assert all(c.layout.cp == 1 for c in short)
    long = recommend("llama3-8b", 8, 8, 80, seq_len=262144)  # 256k tokens: even recomputation does not fit
    assert long.best.plan.fits and long.best.layout.cp > 1
    assert "CP" in long.best.reason and any("context parallelism" in w for w in long.warnings)
    assert long.best.plan.memory.activations < 80 * GB
    asked = recommend("llama3-8b", 8, 8, 80, seq_len=4096, cp=2)
    assert {c.layout.cp for c in asked} == {2}
