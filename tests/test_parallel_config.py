"""Parallel layouts: each rule rejects what it should, by name, and valid layouts pass."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kernels.contract.layout_rules import SCHEDULES
from lab.run.parallel import RULES, Parallel, ParallelConfigError

# Any object with layers/d_model/heads/d_ff will do as the model config.
MODEL = SimpleNamespace(layers=8, d_model=64, heads=4, d_ff=256)


def _check(fields: dict, world: int | None = None, batch: int = 64, model=MODEL) -> list[str]:
    par = Parallel(**fields)
    return par.check(model, par.world_size if world is None else world, batch)


# (rule, Parallel fields, check overrides): each case breaks exactly that rule.
VIOLATIONS = [
    ("positive-sizes", dict(dp=0), {}),
    ("positive-sizes", dict(pp=2, microbatches=0), {}),
    ("world-size", dict(dp=2, tp=2), dict(world=8)),
    ("tp-heads", dict(tp=8), dict(model=SimpleNamespace(layers=8, d_model=64, heads=4, d_ff=256))),
    ("tp-d-model", dict(tp=3), dict(model=SimpleNamespace(layers=8, d_model=64, heads=3, d_ff=255))),
    ("tp-d-ff", dict(tp=2), dict(model=SimpleNamespace(layers=8, d_model=64, heads=4, d_ff=255))),
    ("pp-layers", dict(pp=3, microbatches=3, schedule="gpipe"), dict(batch=63)),
    ("pp-layers", dict(pp=2, stages_per_rank=3, schedule="looped_bfs", microbatches=2), {}),
    ("pp-microbatches", dict(pp=4, microbatches=2, schedule="gpipe"), {}),
    ("unknown-schedule", dict(pp=2, schedule="zigzag"), {}),
    ("single-stage-schedule", dict(pp=2, schedule="gpipe", stages_per_rank=2), {}),
    ("1f1b-microbatches", dict(pp=2, microbatches=2, schedule="1f1b", stages_per_rank=2), {}),
    ("interleaved-stages-per-rank", dict(pp=2, schedule="interleaved_1f1b", stages_per_rank=1), {}),
    ("interleaved-stages-per-rank", dict(pp=2, schedule="interleaved_zero_bubble", stages_per_rank=1), {}),
    ("interleaved-rounds", dict(pp=4, schedule="interleaved_1f1b", microbatches=9), dict(batch=72)),
    ("interleaved-rounds", dict(pp=2, schedule="interleaved_zero_bubble", microbatches=7), dict(batch=56)),
    ("v-schedule-stages", dict(pp=2, schedule="zbv", stages_per_rank=1), {}),
    ("v-schedule-stages", dict(pp=2, schedule="dualpipev", stages_per_rank=4, microbatches=8), {}),
    ("dualpipev-microbatches", dict(pp=2, schedule="dualpipev", microbatches=3), dict(batch=48)),
    ("global-batch", dict(dp=2, pp=2, microbatches=4), dict(batch=12)),
    ("zero-stage", dict(dp=2, zero=4), {}),
    ("fsdp-strategy", dict(dp=2, fsdp_strategy="ddp"), {}),
    ("zero-fsdp-agree", dict(dp=2, zero=2, fsdp_strategy="full"), {}),
    ("zero-fsdp-agree", dict(dp=2, zero=3, fsdp_strategy="grad_op"), {}),
    ("zero-fsdp-agree", dict(dp=2, zero=1, fsdp_strategy="no_shard"), {}),
    ("hybrid-dp", dict(fsdp_strategy="hybrid"), {}),
    ("dp-replicate", dict(dp=4, zero=3, dp_replicate=2), {}),
    ("dp-replicate", dict(dp=4, fsdp_strategy="hybrid", dp_replicate=3), {}),
    ("mixed-precision", dict(dp=2, zero=3, mixed_precision="fp16"), {}),
    ("cpu-offload", dict(dp=2, zero=2, cpu_offload=True), {}),
    ("cpu-offload", dict(dp=2, cpu_offload=True), {}),
    ("reshard-after-forward", dict(dp=2, zero=3, reshard_after_forward={"head": False}), {}),
    ("reshard-after-forward", dict(dp=2, zero=3, reshard_after_forward={"root": 0}), {}),
    ("reshard-fsdp", dict(dp=2, reshard_after_forward={"root": False}), {}),
    ("reshard-fsdp", dict(dp=2, tp=2, reshard_after_forward=True), {}),  # FSDP2 only replicating: nothing sharded
    ("mesh-order", dict(dp=2, tp=2, mesh_order=("pp", "dp", "dp")), {}),
    ("mesh-order", dict(mesh_order="pp,dp,tp"), {}),
    ("ep-dp", dict(dp=3, ep=2), {}),
    ("ep-combination", dict(dp=2, ep=2, tp=2, zero=3), {}),
    ("ep-combination", dict(dp=2, ep=2, cp=2), {}),
    ("ep-sharding", dict(dp=2, ep=2, zero=1), {}),
    ("ep-sharding", dict(dp=4, ep=2, fsdp_strategy="hybrid"), {}),
    ("ep-experts", dict(dp=2, ep=2), dict(model=SimpleNamespace(layers=8, d_model=64, heads=4, d_ff=256, experts=5,
                                                               seq_len=32))),
    ("ep-experts", dict(dp=2, ep=2), {}),  # a dense model has no experts to split
    ("cp-chunks", dict(cp=4), dict(model=SimpleNamespace(layers=8, d_model=64, heads=4, d_ff=256, seq_len=20))),
    ("cp-combination", dict(cp=2, tp=2, sequence_parallel=True), {}),
    ("world-size", dict(dp=2, cp=2), dict(world=2)),
    ("stage-layers", dict(pp=2, stage_layers=(4, 2, 2)), {}),  # three counts for two stages
    ("stage-layers", dict(pp=2, stage_layers=(8, 0)), {}),
    ("stage-layers", dict(stage_layers=(8,)), {}),  # no pipeline to split
    ("stage-layers-sum", dict(pp=2, stage_layers=(5, 2)), {}),  # 7 blocks of the model's 8
]


# With one stage per rank, 1f1b-microbatches can only fire beside another rule.
ALSO_BROKEN = {"1f1b-microbatches": {"single-stage-schedule"}}


@pytest.mark.parametrize("rule, fields, overrides", VIOLATIONS,
                         ids=[f"{r}-{i}" for i, (r, _, _) in enumerate(VIOLATIONS)])
def test_each_rule_rejects_its_violation_by_name(rule, fields, overrides):
    assert rule in RULES
    with pytest.raises(ParallelConfigError) as err:
        _check(fields, **overrides)
    assert set(err.value.rules) == {rule} | ALSO_BROKEN.get(rule, set())
    assert f"[{rule}]" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_unknown_schedule_error_lists_the_allowed_ones():
    with pytest.raises(ParallelConfigError) as err:
        Parallel(pp=2, schedule="zigzag")
    assert all(name in str(err.value) for name in SCHEDULES)


def test_field_rules_fail_on_construction():
    with pytest.raises(ParallelConfigError, match=r"\[zero-stage\]"):
        Parallel(zero=5)


def test_several_violations_are_all_named():
    with pytest.raises(ParallelConfigError) as err:
        Parallel(dp=1, tp=3, pp=1).check(MODEL, world_size=4, global_batch=64)
    assert set(err.value.rules) == {"world-size", "tp-heads", "tp-d-model", "tp-d-ff"}


VALID = [
    dict(),
    dict(dp=4),
    dict(dp=2, tp=2, pp=2, microbatches=4),
    dict(tp=4, sequence_parallel=True),
    dict(dp=2, zero=1, pp=2),
    dict(dp=2, tp=2, zero=1), dict(dp=2, tp=2, pp=2, zero=1),  # ZeRO-1 over TP's DTensors
    dict(dp=4, zero=3, mixed_precision="bf16", cpu_offload=True),
    dict(dp=4, fsdp_strategy="full", cpu_offload=True),
    dict(dp=4, zero=2, fsdp_strategy="grad_op"),
    dict(dp=4, fsdp_strategy="hybrid", zero=3),
    dict(dp=2, fsdp_strategy="no_shard"),
    dict(dp=2, tp=2, zero=3),
    dict(cp=2), dict(dp=2, cp=2, zero=3), dict(cp=2, tp=2), dict(cp=2, fsdp_strategy="hybrid"), dict(cp=2, pp=2),
    dict(pp=4, schedule="gpipe", microbatches=4),
    dict(pp=4, schedule="gpipe", microbatches=1),  # naive model parallelism (warned, not refused)
    dict(pp=2, schedule="interleaved_1f1b", microbatches=4),
    dict(pp=4, schedule="interleaved_1f1b", stages_per_rank=2, microbatches=6),  # 1 round of 6
    dict(pp=2, schedule="interleaved_zero_bubble", microbatches=2),
    dict(pp=2, schedule="looped_bfs", microbatches=2),
    dict(pp=2, schedule="zbv", microbatches=2),
    dict(pp=2, schedule="dualpipev"),  # default m = number of stages
    dict(pp=4, schedule="zbv", activation_checkpointing=True),
]


@pytest.mark.parametrize("fields", VALID, ids=["-".join(f"{k}{v}" for k, v in f.items()) for f in VALID])
def test_valid_layouts_raise_nothing_and_warn_in_plain_strings(fields):
    warnings = _check(fields, batch=48)
    assert isinstance(warnings, list) and all(isinstance(w, str) for w in warnings)


@pytest.mark.parametrize("fields, resolved", [
    (dict(), (1, 1, 1)),
    (dict(pp=4), (4, 1, 4)),
    (dict(pp=2, schedule="zbv"), (2, 2, 4)),
    (dict(pp=2, schedule="interleaved_1f1b"), (2, 2, 4)),
    (dict(pp=2, schedule="dualpipev"), (4, 2, 4)),
    (dict(pp=2, schedule="gpipe", microbatches=6), (6, 1, 2)),
])
def test_defaults_resolve_from_the_schedule(fields, resolved):
    par = Parallel(**fields)
    assert (par.num_microbatches, par.num_stages_per_rank, par.num_stages) == resolved
    assert par.microbatches == fields.get("microbatches")  # the stored fields stay unresolved
    assert par.stages_per_rank == fields.get("stages_per_rank")


@pytest.mark.parametrize("fields, sizes", [
    (dict(dp=4), (1, 4)),
    (dict(dp=4, fsdp_strategy="hybrid"), (2, 2)),  # the default split of kernels.contract.layout_rules.hsdp_split
    (dict(dp=8, fsdp_strategy="hybrid"), (2, 4)),
    (dict(dp=8, fsdp_strategy="hybrid", dp_replicate=4), (4, 2)),
])
def test_hsdp_sizes_resolve_dp_replicate(fields, sizes):
    assert Parallel(**fields).hsdp_sizes == sizes


@pytest.mark.parametrize("fields, needle", [
    (dict(dp=2, pp=2, zero=3, microbatches=2), "ZeRO-3 with pp=2"),
    (dict(dp=2, pp=2, fsdp_strategy="grad_op", microbatches=2), "ZeRO-2 with pp=2"),
    (dict(zero=3), "dp=1"),
    (dict(dp=2, fsdp_strategy="hybrid"), "hybrid with dp=2"),
    (dict(sequence_parallel=True), "sequence_parallel"),
    (dict(schedule="zbv"), "pp=1"),
    (dict(pp=4, schedule="gpipe", microbatches=1), "naive model parallelism"),
])
def test_wasteful_layouts_warn(fields, needle):
    warnings = _check(fields)
    assert any(needle in w for w in warnings), warnings


def test_a_plain_layout_has_no_warnings():
    assert _check(dict(dp=2, tp=2, pp=2, microbatches=4)) == []


@pytest.mark.parametrize("fields", VALID[:6] + [dict(pp=2, schedule="zbv", stages_per_rank=2, microbatches=4),
                                                 dict(dp=4, fsdp_strategy="hybrid", dp_replicate=2),
                                                 dict(dp=2, tp=2, mesh_order=("pp", "tp", "dp"))])
def test_to_dict_from_dict_round_trips_through_json(fields):
    par = Parallel(**fields)
    assert Parallel.from_dict(json.loads(json.dumps(par.to_dict()))) == par


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ValueError, match="bogus"):
        Parallel.from_dict({"dp": 2, "bogus": 1})


@pytest.mark.parametrize("fields, text", [
    (dict(dp=2, tp=2, pp=2, microbatches=4), "TP2×PP2×DP2, ZeRO-0 (whole parameters, one all-reduce per gradient "
                                             "after the schedule), 1f1b with 4 micro-batches"),
    (dict(dp=4, fsdp_strategy="full", mixed_precision="bf16"),
     "DP4, ZeRO-3 (FSDP2: sharded parameters gathered per block and freed after forward; gradients "
     "reduce-scattered), bf16"),
    (dict(pp=2, schedule="zbv", activation_checkpointing=True),
     "PP2, zbv with 2 micro-batches, 2 stages per rank, activation checkpointing"),
    (dict(dp=8, fsdp_strategy="hybrid", dp_replicate=2, zero=2),
     "DP8, ZeRO-2 (FSDP2: sharded parameters gathered per block and kept until backward ends; gradients "
     "reduce-scattered; HSDP: 2 replicas of 4 shards)"),
    # What the sharding view once called "fsdp · ZeRO-2": the user chose ZeRO 0, and is told how it runs.
    (dict(dp=2, tp=2, mesh_order=["pp", "tp", "dp"]),
     "TP2×DP2, ZeRO-0 (DP through FSDP2 replicate: whole parameters, all-reduced gradients, as DDP; DDP cannot "
     "take TP's DTensors), rank order pp,tp,dp"),
])
def test_describe_says_what_was_chosen_and_what_it_runs_as(fields, text):
    assert Parallel(**fields).describe() == text


def test_world_size_is_the_product_of_the_axes():
    assert Parallel(dp=2, tp=3, pp=2, microbatches=2).world_size == 12


def test_check_accepts_the_kernels_gpt_config():
    from kernels.model.gpt import GPTConfig

    cfg = GPTConfig(layers=4, d_model=64, heads=4, vocab=256, seq_len=32)  # d_ff defaults to 256
    assert Parallel(tp=2, pp=2, microbatches=4).check(cfg, world_size=4, global_batch=32) == []


def test_the_readme_lists_every_parallel_field():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    signature = re.search(r"`lab\.Parallel\(([^`]*)\)`", readme).group(1)
    listed = [re.match(r"\s*(\w+)", part).group(1) for part in signature.split(",")]
    assert sorted(listed) == sorted(f.name for f in dataclasses.fields(Parallel))
