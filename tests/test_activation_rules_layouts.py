"""The activation rule (kernels/contract/activation_rules.py) equals the measured bytes, part by part, in every layout.

Issue #26 part 2. The tiny GPT of tests/test_memory_comm.py (b = global batch / (dp·m), s 16, h 32,
f 64, a 4, V 64, L 2; 4 layers for the pipelines) is measured on the 4-rank gloo pool by
``lab.measure.memory_and_comm.measure_layout`` (saved-tensor hooks, split by the module that saved
them, plus what selective checkpointing's cache keeps; a pipeline's peak held over the schedule),
and the driver puts the rule beside each part. Every part is exact: tensor parallel, sequence
parallel, full and selective recompute, bf16 (FSDP2's policy and autocast), gradient accumulation,
and the pipeline stages of 1F1B (stage k holds p - k micro-batches) and GPipe (all m).
"""
from __future__ import annotations

import functools

import pytest
import torch

import lab
from kernels.contract.activation_rules import korthikanti_layer_bytes, predicted_parts
from kernels.contract.config_rules import ConfigError
from kernels.measure.memory import SavedActivations
from kernels.model.gpt import GPTConfig, build_gpt, loss_fn
from kernels.parallel.activation_checkpoint import apply_ac
from kernels.parallel.autocast import apply_autocast
from lab.measure.memory_and_comm import measure_layout

TINY = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "d_ff": 64}
BASE = {"model": TINY, "global_batch": 8, "steps": 2, "lr": 1e-2, "seed": 0}
PIPE = {"model": {**TINY, "layers": 4}, "microbatches": 4}
LAYOUTS = {
    "tp2": {"dp": 2, "tp": 2},
    "tp2-sp": {"dp": 2, "tp": 2, "sequence_parallel": True},
    "tp2-sp-loss-parallel": {"dp": 2, "tp": 2, "sequence_parallel": True, "loss_parallel": True},
    "tp2-sp-selective": {"dp": 2, "tp": 2, "sequence_parallel": True, "activation_checkpointing": "selective"},
    "tp2-selective": {"dp": 2, "tp": 2, "activation_checkpointing": "selective"},
    "tp2-full": {"dp": 2, "tp": 2, "activation_checkpointing": True},
    "ddp4-full": {"dp": 4, "activation_checkpointing": True},
    "ddp4-selective": {"dp": 4, "activation_checkpointing": "selective"},
    "ddp4-accumulation": {"dp": 4, "microbatches": 2},
    "zero3-bf16": {"dp": 4, "zero": 3, "mixed_precision": "bf16"},
    "tp2-fsdp-bf16": {"dp": 2, "tp": 2, "zero": 3, "mixed_precision": "bf16"},
    "tp2-bf16-autocast": {"tp": 2, "pp": 2, "mixed_precision": "bf16", **PIPE},
    "ddp4-bf16-autocast-selective": {"dp": 4, "mixed_precision": "bf16", "activation_checkpointing": "selective"},
    "pp2-1f1b": {"pp": 2, "dp": 2, **PIPE},
    "pp4-1f1b": {"pp": 4, **PIPE},
    "pp2-gpipe": {"pp": 2, "dp": 2, "schedule": "gpipe", **PIPE},
    "pp2-1f1b-full": {"pp": 2, "dp": 2, "activation_checkpointing": True, **PIPE},
    "pp2-tp2-1f1b": {"pp": 2, "tp": 2, **PIPE},
}
# The fast tier keeps one case per kind (TP, recompute, a pipeline stage); CI runs every case.
SLOW = {"tp2-sp-loss-parallel", "ddp4-accumulation", "tp2-fsdp-bf16", "tp2-bf16-autocast", "pp2-1f1b-full",
        "pp2-tp2-1f1b", "tp2-sp", "tp2-sp-selective", "tp2-selective", "tp2-full", "zero3-bf16", "pp2-gpipe",
        "pp4-1f1b", "ddp4-bf16-autocast-selective"}


@pytest.fixture(scope="module")
def measured(cluster):
    @functools.lru_cache(maxsize=None)
    def run(layout: str):
        return measure_layout(cluster, {**BASE, **LAYOUTS[layout]})
    return run


@pytest.mark.parametrize("layout", [pytest.param(k, marks=[pytest.mark.slow] if k in SLOW else []) for k in LAYOUTS])
def test_the_rule_equals_the_measured_activations_part_by_part(measured, layout):
    out = measured(layout)
    for rank in range(4):
        rows = {r.category: r for r in out["memory"] if r.rank == rank and r.moment == "peak_fwd_bwd"}
        parts = {c: r for c, r in rows.items() if c.startswith("activations.")}
        assert parts, (layout, rank)
        for category, row in parts.items():
            assert row.predicted == row.measured, (layout, rank, category, row.measured, row.predicted)
        assert rows["activations"].predicted == rows["activations"].measured, (layout, rank)


def test_1f1b_holds_p_minus_stage_micro_batches_and_gpipe_all(measured):
    """The first stage of PP 4 holds 4 micro-batches of attention, the last 1; the rule's in-flight counts."""
    per_mb = predicted_parts(2, 16, 32, 4, 64, 64, 1)["attention"]  # b = 8 / 4 micro-batches, one block a stage
    for rank, rec in enumerate(measured("pp4-1f1b")["ranks"]):
        assert rec["activations_held"]["activation_parts"]["attention"] == (4 - rank) * per_mb
    two_blocks = predicted_parts(1, 16, 32, 4, 64, 64, 2)["attention"]  # b = 8 / (dp 2 · 4), two blocks a stage
    for rec in measured("pp2-gpipe")["ranks"]:
        assert rec["activations_held"]["activation_parts"]["attention"] == 4 * two_blocks


def _one_process(ac, bf16: bool) -> dict[str, int]:
    torch.manual_seed(0)
    model = build_gpt(GPTConfig(**TINY))
    if ac:
        apply_ac(model, ac)
    if bf16:
        apply_autocast(model, "cpu")
    tokens = torch.randint(0, 64, (8, 17))
    with SavedActivations(model) as acts:
        loss_fn(model(tokens[:, :-1].clone()), tokens[:, 1:].clone()).backward()
    return acts.parts


@pytest.mark.parametrize("ac", [True, "selective"])
@pytest.mark.parametrize("bf16", [False, True])
def test_recompute_in_one_process_keeps_what_the_rule_says(ac, bf16):
    rule = predicted_parts(8, 16, 32, 4, 64, 64, 2, checkpointing=ac, precision="autocast" if bf16 else "fp32")
    assert _one_process(ac, bf16) == rule
    plain = predicted_parts(8, 16, 32, 4, 64, 64, 2, precision="autocast" if bf16 else "fp32")
    assert sum(rule.values()) < sum(plain.values())


def test_korthikanti_table_and_the_lab_rule_order_the_cases_alike():
    """Full < TP+SP+selective < TP+SP < TP < none, in Korthikanti's fp16 count and in the lab's fp32 rule."""
    s, b, h, a, t = 16, 8, 32, 4, 2
    paper = [korthikanti_layer_bytes(b, s, h, a, t, c) for c in ("none", "tp", "tp+sp", "tp+sp+selective", "full")]
    assert paper == sorted(paper, reverse=True) and paper[0] == s * b * h * (34 + 5 * a * s / h)

    def lab_layer(**kw) -> int:  # one block: the two-layer rule minus the one-layer rule
        two, one = predicted_parts(b, s, h, a, 64, 64, 2, **kw), predicted_parts(b, s, h, a, 64, 64, 1, **kw)
        return sum(two.values()) - sum(one.values())
    ours = [lab_layer(), lab_layer(tp=t), lab_layer(tp=t, sequence_parallel=True),
            lab_layer(tp=t, sequence_parallel=True, checkpointing="selective"), lab_layer(checkpointing=True)]
    assert ours[0] > ours[1] > ours[2] and ours[4] == 4 * s * b * h  # full: the fp32 block input
    assert ours[3] > ours[2]  # selective keeps the row-parallel outputs and gathered inputs SP's norms shed


def test_activation_checkpointing_is_false_true_or_selective_by_name():
    assert "selective activation checkpointing" in lab.Parallel(dp=4, activation_checkpointing="selective").describe()
    for bad in ("full", 1, None):
        with pytest.raises(ConfigError, match=r"\[activation-checkpointing\]"):
            lab.Parallel(dp=4, activation_checkpointing=bad)
    assert lab.plan("llama3-8b", gpus=8, parallel={"dp": 8}, seq_len=4096,
                    activation_checkpointing="selective").layout.activation_checkpointing == "selective"
