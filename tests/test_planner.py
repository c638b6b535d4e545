"""The analytic planner reproduces the sizing guides' worked examples and the formulas of docs/design.md.

Sources (described in docs/design.md#sources):
- the Turing Inc. guide: Turing Inc.'s article on FSDP / TP / PP infrastructure sizing
  (its section headings are named below);
- the multi-GPU textbook chapter: a textbook's §4.2 (ZeRO, GPT-2 1.5B at 16 bytes/param);
- Fujii's distributed-training talk: the W&B Meetup talk (maximise DP first, then TP/PP);
- the Rust tutorial's distributed chapter: its chapter 14 (the model table in §14.1);
- Hugging Face's multi-GPU guide: TP inside a node, ZeRO-1 with PP.

Conventions followed from the sizing guides: GB = 1e9 bytes, and presets are sized by the
nominal parameter count in their name (70e9 for Llama-3 70B, not the shape's 70.55e9).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from kernels.contract.layout_rules import bubble_theory, canonical_schedule
from lab.planning.plan_math import (GB, activation_bytes, busbw_factor, fsdp_comm_bytes, gbps, optimizer_bytes, pp_p2p_bytes,
                           required_bandwidth, tp_allreduce_bytes, tp_size_for_memory, zero_memory)
from lab.planning.plan_mesh import Layout, axis_link, hybrid_groups
from lab.planning.plan_models import PRESETS, custom_model, get_model
from lab.planning.plan_stages import in_flight
from lab.planning.planner import plan
from lab.planning.recommend import recommend

MB = 1e6
LLAMA70 = "llama3-70b"


def model_states(p) -> float:
    return p.memory.params + p.memory.grads + p.memory.optimizer


# --- the Turing Inc. guide, "How FSDP works / how it reduces memory" ------------------------------------

def test_ddp_llama3_70b_holds_560gb_per_gpu_with_bf16_adam_states():
    # The Turing Inc. guide: Parameters 140GB + Gradients 140GB + Optimizer States (Adam) 280GB = 560GB/GPU.
    # The guide keeps Adam's momentum + variance in bf16 (4 bytes/param): optimizer="adam_bf16".
    p = plan(LLAMA70, gpus=8, parallel={"dp": 8, "zero": 0}, optimizer="adam_bf16")
    assert (p.memory.params, p.memory.grads, p.memory.optimizer) == (140e9, 140e9, 280e9)
    assert model_states(p) == 560e9


@pytest.mark.parametrize("parallel", [{"dp": 8, "zero": 3}, {"dp": 8, "fsdp_strategy": "full"}])
def test_fsdp_over_8_gpus_holds_70gb_split_17_5_17_5_35(parallel):
    # The Turing Inc. guide: FSDP with 8 GPUs: 17.5GB + 17.5GB + 35GB = 70GB/GPU.
    p = plan(LLAMA70, gpus=8, parallel=parallel, optimizer="adam_bf16")
    assert (p.memory.params, p.memory.grads, p.memory.optimizer) == (17.5e9, 17.5e9, 35e9)
    assert model_states(p) == 70e9


def test_ddp_with_mixed_precision_adam_holds_16_bytes_per_parameter():
    # docs/design.md#zero-formulas: mixed-precision Adam holds 2+2+12 bytes/param, so DDP needs 16Ψ = 1120GB.
    p = plan(LLAMA70, gpus=8, parallel={"dp": 8}, optimizer="adam")
    assert model_states(p) == 1120e9


# --- the Turing Inc. guide, "FSDP infrastructure requirements, 2. network bandwidth" -----------------------

def test_fsdp_forward_allgather_plus_backward_reducescatter_is_245gb_per_iteration():
    # The Turing Inc. guide: 140GB × 7/8 = 122.5GB all-gather + 122.5GB reduce-scatter = 245GB/iteration.
    parts = fsdp_comm_bytes(140e9, 8, reshard_after_forward=False)
    assert parts == {"all_gather_fwd": 122.5e9, "reduce_scatter_bwd": 122.5e9}
    assert sum(parts.values()) == 245e9
    # The guide's pair is FSDP with reshard_after_forward=False, i.e. grad_op.
    p = plan(LLAMA70, gpus=8, parallel={"dp": 8, "fsdp_strategy": "grad_op"})
    assert p.comm_bytes(axis="dp") == pytest.approx(245e9)
    assert p.comm_bytes(op="all_gather") == pytest.approx(122.5e9)
    assert p.comm_bytes(op="reduce_scatter") == pytest.approx(122.5e9)


def test_full_shard_adds_the_backward_allgather_as_design_says():
    # docs/design.md#communication-volume: ZeRO-3/FSDP = all-gather twice plus reduce-scatter once:
    # 367.5GB here.
    p = plan(LLAMA70, gpus=8, parallel={"dp": 8, "fsdp_strategy": "full"})
    assert p.comm_bytes(axis="dp") == pytest.approx(3 * 122.5e9)
    assert p.comm_bytes(op="all_gather", phase="bwd") == pytest.approx(122.5e9)


def test_245gb_in_one_second_needs_245gbps_which_is_1960_gbit():
    # The Turing Inc. guide: iteration time 1s -> 245GB/s = 1,960Gbps.
    assert required_bandwidth(245e9, 1.0) == 245.0
    assert gbps(245.0) == 1960.0
    p = plan(LLAMA70, gpus=8, gpus_per_node=1, parallel={"dp": 8, "fsdp_strategy": "grad_op"},
             target_iter_s=1.0)
    assert p.link("inter").needed_gbps == pytest.approx(245.0)
    inter = p.link("inter")  # 400GB/s = EFA's 3,200Gbps; α 5 µs per ring step: (7 + 7) steps
    assert inter.latency_s == pytest.approx(14 * 5e-6)
    assert inter.time_s == pytest.approx(245.0 / 400.0 + inter.latency_s)


# --- the Turing Inc. guide, "Tensor Parallel infrastructure requirements" -------------------------------------

def test_tp_allreduce_is_536mb_per_layer_and_42_9gb_over_80_layers():
    # The Turing Inc. guide: 8192 × 8 × 4096 × 2 bytes = 536MB per layer; 536MB × 80 = 42.9GB/iteration.
    per_layer = tp_allreduce_bytes(b=8, s=4096, h=8192)
    assert per_layer == 8192 * 8 * 4096 * 2
    assert int(per_layer / MB) == 536  # The guide truncates 536.87MB
    assert round(int(per_layer / MB) * 80 / 1000, 1) == 42.9  # The guide's own rounding
    assert per_layer * 80 / GB == pytest.approx(42.9, abs=0.06)


def test_plan_counts_megatrons_four_tp_allreduces_per_layer_each_the_guides_size():
    # Megatron all-reduces twice per block forward and twice backward, each of the guide's
    # 536MB, so the guide's per-layer figure is one of four calls.
    p = plan(LLAMA70, gpus=8, parallel={"tp": 8}, global_batch=8, seq_len=4096)
    fwd = [e for e in p.comm if e.axis == "tp" and e.phase == "fwd"]
    assert len(fwd) == 1 and fwd[0].count == 2 * 80
    assert fwd[0].payload_bytes == tp_allreduce_bytes(8, 4096, 8192)
    assert p.comm_bytes(axis="tp", wire=False) == pytest.approx(4 * 80 * tp_allreduce_bytes(8, 4096, 8192))
    assert fwd[0].wire_bytes == pytest.approx(fwd[0].total_payload * 2 * 7 / 8)


def test_tp_shards_parameters_and_gradients_to_17_5gb():
    # The Turing Inc. guide, TP memory estimate: Llama 3 70B at TP=8: Parameters 140GB / 8 = 17.5GB,
    # Gradients 17.5GB.
    # The guide divides every weight by 8; the norms (161 of 8,192: 1.3M parameters) stay whole on every
    # rank, 2.3 MB more in bf16.
    p = plan(LLAMA70, gpus=8, parallel={"tp": 8}, optimizer="adam_bf16")
    assert p.memory.params == p.memory.grads == pytest.approx(17.5e9 + 2.3e6, abs=0.05e6)


def test_tp_size_rule_gives_4_67_rounded_up_to_8():
    # The Turing Inc. guide, TP sizing: TP_size >= 280GB / (80GB - 20GB) = 4.67 -> 8 GPU.
    ratio, tp = tp_size_for_memory(280e9, 80e9, 20e9, gpus_per_node=8)
    assert round(ratio, 2) == 4.67
    assert tp == 8
    # With 4 GPUs per node TP stops at 4, short of the ratio.
    assert tp_size_for_memory(280e9, 80e9, 20e9, gpus_per_node=4) == (pytest.approx(4.667, abs=1e-3), 4)


# --- the Turing Inc. guide, "Pipeline Parallel" -----------------------------------------------------------

def test_pp_sends_67mb_per_microbatch_and_536mb_per_iteration():
    # The Turing Inc. guide, PP bandwidth: 8192 × 1 × 4096 × 2 bytes = 67MB; 67MB × 8 = 536MB/iteration.
    assert int(pp_p2p_bytes(1, 4096, 8192) / MB) == 67
    p = plan(LLAMA70, gpus=4, parallel={"pp": 4}, global_batch=8, microbatches=8, seq_len=4096)
    fwd = [e for e in p.comm if e.axis == "pp" and e.phase == "fwd"]
    assert fwd[0].count == 8 and fwd[0].payload_bytes == pp_p2p_bytes(1, 4096, 8192)
    assert int(fwd[0].total_payload / MB) == 536
    assert p.comm_bytes(axis="pp", phase="bwd") == fwd[0].wire_bytes  # gradients come back


def test_bubble_for_p4_m8_is_27_3_percent():
    # The Turing Inc. guide, PP memory estimate: Bubble ≈ 3 / 11 = 27.3%.
    assert round(bubble_theory("1f1b", 4, 8)[0], 3) == 0.273
    p = plan(LLAMA70, gpus=4, parallel={"pp": 4}, microbatches=8)
    assert p.bubble == pytest.approx(3 / 11)
    assert p.bubble_megatron == pytest.approx(3 / 8)


def test_interleaved_and_megatron_bubble_forms_of_design():
    assert bubble_theory("interleaved_1f1b", 4, 8, 2) == pytest.approx((3 / 19, 3 / 16))
    p = plan(LLAMA70, gpus=4, parallel={"pp": 4, "schedule": "interleaved_1f1b", "stages_per_rank": 2},
             microbatches=8)
    assert p.bubble == pytest.approx(3 / 19)


def test_schedules_without_a_closed_form_bubble_say_so():
    p = plan(LLAMA70, gpus=4, parallel={"pp": 4, "schedule": "dualpipev"}, microbatches=8)
    assert (p.bubble, p.bubble_megatron) == (None, None) and "no closed form" in str(p)


def test_zero_bubble_schedules_quote_the_papers_bubble_and_its_assumption():
    p = plan(LLAMA70, gpus=4, parallel={"pp": 4, "schedule": "zbv"}, microbatches=8)
    assert (p.bubble, p.bubble_megatron) == (0.0, 0.0) and "T_F = T_B = T_W" in str(p)


def test_m_below_4p_warns_as_the_guide_advises():
    # The Turing Inc. guide, PP sizing and schedule: M >= 4 × P (P=4 -> M >= 16).
    short = plan(LLAMA70, gpus=4, parallel={"pp": 4}, microbatches=8, seq_len=1024)
    ok = plan(LLAMA70, gpus=4, parallel={"pp": 4}, microbatches=16, seq_len=1024)
    assert any("M=8 < 4P=16" in w for w in short.warnings)
    assert not any("4P" in w for w in ok.warnings)


# --- activations: the Turing Inc. guide, FSDP memory sizing and PP memory estimate -------------------------------------------------

def test_activation_estimate_is_b_s_h_l_16_bytes():
    # The Turing Inc. guide: Activations ≈ batch_size × seq_length × hidden_size × num_layers × 16.
    assert activation_bytes(1, 4096, 8192, 80) == 4096 * 8192 * 80 * 16
    p = plan(LLAMA70, gpus=8, parallel={"dp": 8}, micro_batch=2, seq_len=4096)
    assert p.memory.activations == 2 * 4096 * 8192 * 80 * 16


def test_gpipe_keeps_m_microbatches_and_1f1b_keeps_p():
    # The Turing Inc. guide, PP memory estimate: Activations = Activations_per_microbatch × M
    # (GPipe); 1F1B holds P.
    per_mb_stage = activation_bytes(1, 1024, 8192, 20)  # 80 layers over 4 stages
    kw = dict(gpus=4, microbatches=16, seq_len=1024)
    gpipe = plan(LLAMA70, parallel={"pp": 4, "schedule": "gpipe"}, **kw)
    one_f_one_b = plan(LLAMA70, parallel={"pp": 4, "schedule": "1f1b"}, **kw)
    assert gpipe.memory.activations == 16 * per_mb_stage
    assert one_f_one_b.memory.activations == 4 * per_mb_stage
    assert in_flight("interleaved_1f1b", 4, 16, 2) == pytest.approx(4 * (1 + 3 / 8))


def test_tp_leaves_activations_whole_unless_sequence_parallel():
    # The Turing Inc. guide, TP memory estimate: "Activations are not sharded".
    whole = plan(LLAMA70, gpus=8, parallel={"tp": 8}, seq_len=2048)
    sp = plan(LLAMA70, gpus=8, parallel={"tp": 8, "sequence_parallel": True}, seq_len=2048)
    assert whole.memory.activations == activation_bytes(1, 2048, 8192, 80)
    assert sp.memory.activations == whole.memory.activations / 8


def test_activation_checkpointing_keeps_block_inputs_only():
    p = plan(LLAMA70, gpus=8, parallel={"dp": 8}, seq_len=4096, activation_checkpointing=True)
    assert p.memory.activations == 4096 * 8192 * 2 * 80 + activation_bytes(1, 4096, 8192, 1)
    assert any(e.phase == "recompute" for e in plan(LLAMA70, gpus=8, parallel={"tp": 8},
                                                     activation_checkpointing=True).comm)


# --- the Turing Inc. guide, "2D / 3D Parallel" and the guideline; Fujii's distributed-training talk -------------------------------

def test_recommend_puts_70b_on_32_gpus_as_tp8_dp4():
    # The Turing Inc. guide, 2D example: 32 GPU (8-GPU nodes × 4), Llama 3 70B: TP=8 inside a node,
    # DP=4 across nodes. Inputs as the guide assumes them: bf16 Adam states, 20GB of activations (TP §3).
    rec = recommend(LLAMA70, 32, 8, 80, optimizer="adam_bf16", activations_gb=20)
    assert rec.best.parallel["tp"] == 8 and rec.best.parallel["pp"] == 1 and rec.best.parallel["dp"] == 4
    assert "most data parallelism" in rec.best.reason
    # And the README's one-line lab.plan(...) example, with the estimate in place of the 20GB (needs
    # checkpointing).
    p = plan(model=LLAMA70, gpus=32, gpus_per_node=8, gpu_mem_gb=80)
    assert (p.layout.tp, p.layout.pp, p.layout.dp) == (8, 1, 4) and p.fits
    assert p.layout.activation_checkpointing


def test_recommend_reproduces_the_1024_gpu_405b_layout_with_dp_fixed_at_8():
    # The Turing Inc. guide, 3D example: 1024 GPU (8-GPU nodes × 128), Llama 3.1 405B: TP=8, PP=16,
    # DP=8. The guide takes DP=8 as given ("PP_stages = ceil(Total_GPUs / (TP_size × DP_size))").
    rec = recommend("Llama-3.1-405B", 1024, 8, 80, dp=8, optimizer="adam_bf16", activations_gb=20)
    assert (rec.best.layout.tp, rec.best.layout.pp, rec.best.layout.dp) == (8, 16, 8)
    assert rec.best.plan.microbatches >= 4 * 16
    assert "DP fixed at 8" in rec.best.reason


def test_recommend_without_fixed_dp_puts_405b_on_tp8_pp4_and_grows_dp():
    # The Turing Inc. guide, "Amazon EC2 UltraClusters" table: 405B -> TP 8, PP 4 (DP grows with the GPUs).
    rec = recommend("llama3.1-405b", 1024, 8, 80, seq_len=4096, activation_checkpointing=True)
    assert (rec.best.layout.tp, rec.best.layout.pp, rec.best.layout.dp) == (8, 4, 32)
    assert all(c.plan.fits for c in rec)
    dps = [c.layout.dp for c in rec]
    assert dps == sorted(dps, reverse=True)


def test_recommend_keeps_tp_inside_the_node_and_at_most_8():
    for c in recommend("gpt3-175b", 64, 4, 80, seq_len=2048, activation_checkpointing=True):
        assert c.layout.tp <= 4
    for c in recommend("gpt3-175b", 256, 16, 80, seq_len=2048, activation_checkpointing=True):
        assert c.layout.tp <= 8


def test_recommend_7b_class_model_is_pure_data_parallel():
    # The Turing Inc. guide's table: 7B-13B -> TP 1, PP 1, DP 8-16.
    rec = recommend("llama3-8b", 16, 8, 80, seq_len=4096)
    assert (rec.best.layout.tp, rec.best.layout.pp, rec.best.layout.dp) == (1, 1, 16)


# --- the Rust tutorial's distributed chapter, §14.1 table and the multi-GPU textbook chapter, §4.2.6 -----------------------------------------------

@pytest.mark.parametrize("name, fp32_gb, train_gb", [
    ("gpt2-1.5b", 6, 24),  # The multi-GPU textbook chapter: 1.5B GPT-2 with Adam needs 16 × params = 24GB
    ("gpt3-175b", 700, 2800),
    ("llama2-70b", 280, 1120),
])
def test_model_table_training_memory_is_16_bytes_per_parameter(name, fp32_gb, train_gb):
    p = plan(name, gpus=1, parallel={"dp": 1}, optimizer="adam")
    assert model_states(p) / GB == pytest.approx(train_gb)
    assert get_model(name).params * 4 / GB == pytest.approx(fp32_gb)


@pytest.mark.parametrize("name, fp32_mb", [("resnet-50", 100), ("bert-base", 440)])
def test_model_table_fp32_size_is_4_bytes_per_parameter(name, fp32_mb):
    # The Rust tutorial's distributed chapter: ResNet-50 25M -> 100MB, BERT-Base 110M -> 440MB in FP32.
    assert get_model(name).params * 4 / MB == pytest.approx(fp32_mb)


@pytest.mark.parametrize("name, exact", [
    ("llama3-70b", 70.55e9), ("llama3-8b", 8.03e9), ("llama3.1-405b", 405.85e9),
    ("gpt3-175b", 174.6e9), ("gpt2-1.5b", 1.558e9), ("bert-base", 108.9e6)])
def test_preset_shapes_give_the_published_parameter_counts(name, exact):
    assert get_model(name).shape_params == pytest.approx(exact, rel=2e-3)


@pytest.mark.parametrize("alias", ["llama3-70b", "Llama-3-70B", "llama_3_70b", "LLAMA3-70B"])
def test_model_names_are_case_and_separator_insensitive(alias):
    assert get_model(alias) is PRESETS["llama3-70b"]


def test_gpt3_and_405b_aliases_resolve_and_unknown_names_raise():
    assert get_model("gpt3-175b").layers == 96
    assert get_model("GPT-3-175B").hidden == 12288
    assert get_model("llama-3.1-405b").layers == 126
    with pytest.raises(ValueError, match="unknown model"):
        get_model("llama9-1t")


def test_custom_model_by_shape_count_or_dict_and_count_only_plans_warn():
    by_shape = custom_model(layers=2, hidden=64, heads=4, ffn=256, vocab=256, seq_len=32)
    assert by_shape.params == by_shape.shape_params > 0
    by_count = get_model(3e9)
    assert by_count.params == 3e9 and not by_count.has_shape
    as_dict = get_model({"layers": 4, "hidden": 128, "vocab": 1000})
    assert as_dict.ffn == 512 and as_dict.params > 0
    p = plan(by_count, gpus=2, parallel={"dp": 2})
    assert p.memory.activations == 0 and any("parameter count only" in w for w in p.warnings)


# --- docs/design.md: ZeRO formulas, bus bandwidth, communication volume ---------------------------

@pytest.mark.parametrize("psi, n, k", [(70e9, 8, 12), (1.5e9, 64, 12), (1e6, 3, 4)])
def test_zero_stage_memory_follows_the_zero_paper_formulas(psi, n, k):
    expected = {0: (2 + 2 + k) * psi, 1: (2 + 2 + k / n) * psi,
                2: (2 + (2 + k) / n) * psi, 3: (2 + 2 + k) * psi / n}
    for stage, total in expected.items():
        assert sum(zero_memory(psi, n, stage, 2, 2, k)) == pytest.approx(total)


@pytest.mark.parametrize("stage, factor", [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_plan_memory_follows_the_zero_reference(stage, factor):
    p = plan("gpt2-1.5b", gpus=8, parallel={"dp": 8, "zero": stage})
    assert model_states(p) == pytest.approx(factor * 1.5e9)


def test_fp32_training_holds_16_bytes_per_parameter():
    # docs/design.md#zero-formulas: in fp32 the parameters are the master copy: 4 + 4 + 8 (Adam moments).
    assert optimizer_bytes("adam", "fp32") == 8
    p = plan("gpt2-1.5b", gpus=1, parallel={"dp": 1}, dtype="fp32")
    assert model_states(p) == pytest.approx(16 * 1.5e9)


@pytest.mark.parametrize("op, n, factor", [
    ("all_reduce", 8, 2 * 7 / 8), ("all_reduce", 2, 1.0), ("all_gather", 8, 7 / 8),
    ("reduce_scatter", 4, 3 / 4), ("broadcast", 8, 1.0), ("p2p", 2, 1.0)])
def test_busbw_factors_are_those_of_nccl_tests(op, n, factor):
    assert busbw_factor(op, n) == pytest.approx(factor)


def test_ddp_allreduce_sends_2_psi_n_minus_1_over_n():
    # docs/design.md#communication-volume: DDP all-reduce volume 2Ψ(n-1)/n elements (bf16: 2 bytes each).
    p = plan("gpt2-1.5b", gpus=4, parallel={"dp": 4, "zero": 0})
    assert p.comm_bytes(op="all_reduce") == pytest.approx(2 * 1.5e9 * 2 * 3 / 4)
    assert set(p.comm_by_op()) == {"all_reduce"}


# --- links, mesh order, warnings --------------------------------------------------------------

def test_tp_fastest_mesh_keeps_tp_intra_node_and_puts_dp_across_nodes():
    lay = Layout(dp=4, tp=8, pp=1)
    assert axis_link(lay, "tp", 8) == "intra" and axis_link(lay, "dp", 8) == "inter"
    lay = Layout(dp=2, tp=2, pp=4)
    assert (axis_link(lay, "tp", 8), axis_link(lay, "dp", 8), axis_link(lay, "pp", 8)) == \
        ("intra", "intra", "inter")


def test_tp_across_nodes_warns_and_goes_inter():
    p = plan(LLAMA70, gpus=16, parallel={"tp": 16}, seq_len=1024)
    assert any("TP across nodes" in w for w in p.warnings)
    assert p.comm_bytes(axis="tp", link="intra") == 0 and p.comm_bytes(axis="tp", link="inter") > 0


def test_layout_that_does_not_fit_warns():
    p = plan(LLAMA70, gpus=8, parallel={"dp": 8})
    assert not p.fits and any(w.startswith("does not fit") for w in p.warnings)


def test_hybrid_shards_inside_nodes_and_replicates_across():
    # The Turing Inc. guide: HYBRID_SHARD = FSDP inside a node, DDP across nodes (8-GPU nodes × 4).
    p = plan(LLAMA70, gpus=32, parallel={"dp": 32, "fsdp_strategy": "hybrid"}, optimizer="adam_bf16")
    assert model_states(p) == pytest.approx(560e9 / 8)
    shard = [e for e in p.comm if e.axis == "dp_shard"]
    replicate = [e for e in p.comm if e.axis == "dp_replicate"]
    assert {e.link for e in shard} == {"intra"} and shard[0].group_size == 8
    assert replicate[0].link == "inter" and replicate[0].group_size == 4
    assert replicate[0].payload_bytes == pytest.approx(140e9 / 8)
    assert p.layout.dp_replicate == 4 and any("stay inside a node" in n for n in p.notes)
    shard_groups, rep_groups = hybrid_groups(Layout(dp=8, fsdp_strategy="hybrid", dp_replicate=2))
    assert shard_groups == [[0, 1, 2, 3], [4, 5, 6, 7]] and rep_groups[0] == [0, 4]


def test_hybrid_takes_dp_replicate_and_says_when_shard_groups_cross_nodes():
    # dp=16's default split is 4 x 4; asking for 2 x 8 puts each shard group on one 8-GPU node.
    even = plan(LLAMA70, gpus=16, parallel={"dp": 16, "fsdp_strategy": "hybrid", "dp_replicate": 4})
    node = plan(LLAMA70, gpus=16, parallel={"dp": 16, "fsdp_strategy": "hybrid", "dp_replicate": 2})
    assert [e.group_size for e in node.comm if e.axis == "dp_shard"][0] == 8
    assert model_states(node) < model_states(even)
    crossing = plan(LLAMA70, gpus=16, gpus_per_node=2, parallel={"dp": 16, "fsdp_strategy": "hybrid"})
    assert any("cross nodes" in n for n in crossing.notes)


def test_recommend_shards_hybrid_inside_a_node():
    # A layout without a data axis (DP1) has nothing to shard; it ranks beside the hybrid ones on time.
    hybrid = [c for c in recommend(LLAMA70, gpus=32, fsdp_strategy="hybrid", zero=3) if c.layout.fsdp_strategy]
    assert hybrid
    for cand in hybrid:
        lay = cand.layout
        assert cand.parallel["dp_replicate"] == lay.dp_replicate  # replicate across nodes, shard a whole node
        assert lay.dp_shard * lay.tp <= 8 and (lay.dp_replicate == 1 or lay.dp_shard * lay.tp == 8), lay


def test_world_size_mismatch_and_bad_batches_raise():
    with pytest.raises(ValueError, match="must equal gpus"):
        plan(LLAMA70, gpus=8, parallel={"dp": 2, "tp": 2})
    with pytest.raises(ValueError):
        plan(LLAMA70, gpus=8, parallel={"dp": 8}, global_batch=12, micro_batch=1)
    with pytest.raises(ValueError, match="disagrees"):
        plan(LLAMA70, gpus=8, parallel={"dp": 8, "zero": 1, "fsdp_strategy": "full"})


@dataclass(frozen=True)
class FakeParallel:
    """The attributes lab.run.parallel.Parallel has; the planner must not need the class itself."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0
    fsdp_strategy: str | None = None
    schedule: str = "1f1b"
    microbatches: int | None = None
    stages_per_rank: int | None = None
    sequence_parallel: bool = False
    dp_replicate: int | None = None
    activation_checkpointing: bool = False


def test_any_object_with_parallel_attributes_is_accepted():
    p = plan(LLAMA70, gpus=32, parallel=FakeParallel(dp=2, tp=8, pp=2, zero=1, schedule="gpipe",
                                                     microbatches=8))
    assert (p.layout.dp, p.layout.tp, p.layout.pp, p.layout.zero) == (2, 8, 2, 1)
    assert p.layout.schedule == "gpipe" and p.microbatches == 8
    assert canonical_schedule("Interleaved1F1B") == "interleaved_1f1b"


def test_plan_is_json_able_and_renders_text_and_html():
    p = plan(LLAMA70, gpus=32, parallel={"dp": 2, "tp": 8, "pp": 2, "zero": 1}, microbatches=8,
             seq_len=4096)
    data = json.loads(json.dumps(p.to_dict()))
    assert data["memory"]["total"] == pytest.approx(p.memory.total)
    assert data["layout"]["tp"] == 8 and len(data["comm"]) == len(p.comm)
    html = p._repr_html_()
    assert '<table class="lab-plan-memory">' in html and "lab-plan-comm" in html
    assert "TP8×PP2×DP2" in str(p) and "bubble" in repr(p)
    rec = recommend(LLAMA70, 32, 8, 80, seq_len=4096, activation_checkpointing=True)
    assert json.loads(json.dumps(rec.to_dict()))["candidates"][0]["parallel"]["tp"] == 8
    assert "lab-recommend" in rec._repr_html_() and "TP8×DP4" in str(rec)


# --- recommend warnings -----------------------------------------------------------------------

def test_recommend_warns_when_nothing_fits():
    rec = recommend("llama3.1-405b", 8, 8, 80, seq_len=4096)
    assert not rec.best.plan.fits
    assert any(w.startswith("no layout fits") for w in rec.warnings)


def test_recommend_warns_when_the_global_batch_forces_m_below_4p():
    rec = recommend("llama3.1-405b", 1024, 8, 80, seq_len=4096, activation_checkpointing=True,
                    global_batch=128)
    assert rec.best.plan.microbatches < 4 * rec.best.layout.pp
    assert any("< 4P" in w for w in rec.warnings)


def test_recommend_turns_on_checkpointing_only_when_needed():
    rec = recommend(LLAMA70, 32, 8, 80)  # seq 8192: nothing fits without recomputation
    assert rec.best.layout.activation_checkpointing
    assert any("activation checkpointing" in w for w in rec.warnings)
    small = recommend("gpt2-1.5b", 8, 8, 80)
    assert not small.best.layout.activation_checkpointing and not small.warnings


def test_recommend_proposes_zero1_with_tp_without_sending_the_user_to_zero2():
    # lab.Parallel trains ZeRO-1 beside TP (the optimizer states sharded over dp on the DTensors' local shards).
    rec = recommend(LLAMA70, 32, 8, 80, optimizer="adam_bf16", activations_gb=20)
    assert rec.best.parallel["zero"] == 1 and rec.best.parallel["tp"] > 1
    assert not any("zero=2" in w for w in rec.warnings)


def test_loss_parallel_trades_the_logits_all_gather_for_three_b_s_all_reduces():
    model = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "d_ff": 64}

    def tp_forward(**flags):
        p = plan(model, gpus=4, parallel={"tp": 4, **flags}, global_batch=8, dtype="fp32")
        return {(e.op, e.payload_bytes): e.count for e in p.stages[0].comm if e.phase == "fwd"}

    gathered, sharded = tp_forward(), tp_forward(loss_parallel=True)
    b_s_h, b_s = 8 * 16 * 32 * 4, 8 * 16 * 4  # fp32 bytes; one micro-batch of 8
    assert gathered[("all_gather", b_s_h / 32 * 64)] == 1  # (b, s, V) logits
    assert "all_gather" not in {op for op, _ in sharded}
    assert sharded[("all_reduce", b_s)] == 3
    assert {k: v for k, v in sharded.items() if k[1] != b_s} == {k: v for k, v in gathered.items() if k[0] != "all_gather"}
    with pytest.raises(ValueError, match="loss_parallel needs pp == 1"):
        plan(model, gpus=4, parallel={"tp": 2, "pp": 2, "loss_parallel": True}, global_batch=8)
    assert plan(model, gpus=4, parallel={"dp": 4, "loss_parallel": True}, global_batch=8).layout.loss_parallel is False


def test_a_mesh_order_moves_each_axis_to_the_link_its_groups_span():
    model = get_model("llama3-8b")
    links = {}
    for order in (("pp", "dp", "tp"), ("pp", "tp", "dp")):
        p = plan(model, gpus=16, gpus_per_node=8, parallel={"dp": 2, "tp": 8, "mesh_order": order}, global_batch=32)
        links[order] = {e.axis: e.link for e in p.comm}
        assert any("TP across nodes" in w for w in p.warnings) == (order[-1] == "dp")
    assert links == {("pp", "dp", "tp"): {"dp": "inter", "tp": "intra"},
                     ("pp", "tp", "dp"): {"dp": "intra", "tp": "inter"}}
    with pytest.raises(ValueError, match="mesh_order must name pp, dp and tp"):
        plan(model, gpus=16, parallel={"dp": 2, "tp": 8, "mesh_order": ("pp", "tp")}, global_batch=32)
