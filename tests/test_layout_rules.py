"""The layout vocabulary (kernels.contract.layout_rules) and the schedule simulation, against their
definitions and against torch's own schedules.

Fast: no ranks. torch is imported here only to check that the rules agree with
``torch.distributed.pipelining`` (the module itself never imports it).
"""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed.pipelining.schedules as torch_schedules
from torch import nn
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

from kernels.contract.layout_rules import (CLOSED_FORM_BUBBLE_SCHEDULES, FSDP_STRATEGY_ZERO, LOOPED_SCHEDULES,
                                  ROUND_SCHEDULES, SCHEDULES, SINGLE_STAGE_SCHEDULES, V_SCHEDULES,
                                  bubble_theory, canonical_schedule, default_microbatches,
                                  default_stages_per_rank, hsdp_split, layer_split, microbatch_problems,
                                  stage_ids, stage_problems, zero_stage)
from kernels.contract.schedule_simulation import lay_out

TORCH_CLASS = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
               "looped_bfs": "ScheduleLoopedBFS", "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
               "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def test_the_module_is_torch_free():
    tree = ast.parse(Path("kernels/contract/layout_rules.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "enum"}, imported  # the standard library's, never torch


def test_schedule_families_partition_the_schedules_as_torch_classes_do():
    assert set(TORCH_CLASS) == set(SCHEDULES)
    assert set(SINGLE_STAGE_SCHEDULES) | set(LOOPED_SCHEDULES) | set(V_SCHEDULES) == set(SCHEDULES)
    assert not set(SINGLE_STAGE_SCHEDULES) & set(LOOPED_SCHEDULES) and not set(LOOPED_SCHEDULES) & set(V_SCHEDULES)
    for name in SCHEDULES:
        single = issubclass(getattr(torch_schedules, TORCH_CLASS[name]), torch_schedules.PipelineScheduleSingle)
        assert single == (name in SINGLE_STAGE_SCHEDULES), name
    assert set(ROUND_SCHEDULES) <= set(LOOPED_SCHEDULES)
    assert set(CLOSED_FORM_BUBBLE_SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "looped_bfs"}


@pytest.mark.parametrize("spelling, name", [
    ("Interleaved1F1B", "interleaved_1f1b"), ("interleaved-1f1b", "interleaved_1f1b"), ("ScheduleGPipe", "gpipe"),
    ("ZBVZeroBubble", "zbv"), ("DualPipeV", "dualpipev"), ("LOOPED_BFS", "looped_bfs"), ("1F1B", "1f1b")])
def test_canonical_schedule_accepts_torch_class_names_and_dashes(spelling, name):
    assert canonical_schedule(spelling) == name
    assert canonical_schedule(TORCH_CLASS[name]) == name


def test_unknown_schedule_names_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed: gpipe, 1f1b"):
        canonical_schedule("pipedream")
    assert stage_problems("pipedream", 1)[0][0] == "unknown-schedule"


def test_default_stages_per_rank():
    assert {s: default_stages_per_rank(s) for s in SCHEDULES} == {s: 1 if s in ("gpipe", "1f1b") else 2
                                                                   for s in SCHEDULES}


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_stage_placement_is_the_one_torch_schedules_expect(schedule, pp):
    v = 3 if schedule in ("interleaved_1f1b", "looped_bfs") else default_stages_per_rank(schedule)
    placed = {s: r for r in range(pp) for s in stage_ids(schedule, r, pp, v)}
    assert sorted(placed) == list(range(pp * v))  # every stage once
    if schedule in SINGLE_STAGE_SCHEDULES:
        assert placed == {r: r for r in range(pp)}
    else:
        style = "v" if schedule in V_SCHEDULES else "loop"
        assert placed == generate_stage_to_rank_mapping(pp, pp * v, style=style)


def test_stage_placement_examples():
    assert [stage_ids("zbv", r, 4, 2) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert stage_ids("interleaved_1f1b", 1, 4, 3) == (1, 5, 9)
    assert stage_ids("dualpipev", 0, 2, 2) == (0, 3)  # rank 0 holds the first and the last stage


@pytest.mark.parametrize("schedule, v, rule", [
    ("gpipe", 2, "single-stage-schedule"), ("1f1b", 2, "single-stage-schedule"),
    ("interleaved_1f1b", 1, "interleaved-stages-per-rank"),
    ("interleaved_zero_bubble", 1, "interleaved-stages-per-rank"),
    ("zbv", 3, "v-schedule-stages"), ("dualpipev", 1, "v-schedule-stages")])
def test_stage_counts_a_schedule_cannot_run(schedule, v, rule):
    assert [r for r, _ in stage_problems(schedule, v)] == [rule]
    with pytest.raises(ValueError, match="stages"):
        stage_ids(schedule, 0, 2, v)


def test_stage_ids_checks_the_rank():
    with pytest.raises(ValueError, match="pp_rank=2"):
        stage_ids("1f1b", 2, 2, 1)


@pytest.mark.parametrize("layers, stages", [(8, 4), (8, 8), (126, 16), (7, 3), (5, 1)])
def test_layer_split_is_contiguous_and_covers_every_block(layers, stages):
    runs = [layer_split(layers, stages, s) for s in range(stages)]
    assert [b for run in runs for b in run] == list(range(layers))
    assert max(map(len, runs)) - min(map(len, runs)) <= 1
    assert [len(r) for r in runs] == sorted((len(r) for r in runs), reverse=True)  # longer runs first
    if layers % stages == 0:
        assert runs == [range(s * layers // stages, (s + 1) * layers // stages) for s in range(stages)]


def test_layer_split_example_and_errors():
    assert [len(layer_split(126, 16, s)) for s in (0, 13, 14, 15)] == [8, 8, 7, 7]
    with pytest.raises(ValueError):
        layer_split(2, 4, 0)
    with pytest.raises(ValueError):
        layer_split(8, 4, 4)


def _fake_stage(index: int, num_stages: int, pp_rank: int, pp: int) -> SimpleNamespace:
    # Just what torch's schedule constructors read before they check the micro-batch count.
    return SimpleNamespace(stage_index=index, num_stages=num_stages, group_rank=pp_rank, group_size=pp,
                           is_first=index == 0, is_last=index == num_stages - 1, has_backward=True,
                           stage_index_to_group_rank={}, submod=nn.Linear(1, 1))


def _torch_accepts(schedule: str, pp: int, m: int) -> bool:
    v = default_stages_per_rank(schedule)
    stages = [_fake_stage(s, pp * v, 0, pp) for s in stage_ids(schedule, 0, pp, v)]
    cls = getattr(torch_schedules, TORCH_CLASS[schedule])
    try:
        cls(stages[0] if schedule in SINGLE_STAGE_SCHEDULES else stages, n_microbatches=m, loss_fn=lambda out, y: out)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_microbatch_rules_agree_with_torch_schedule_constructors(schedule):
    v = default_stages_per_rank(schedule)
    for pp in (2, 3, 4):
        for m in range(1, 13):
            torch_rules = [r for r, _ in microbatch_problems(schedule, pp, v, m) if r != "pp-microbatches"]
            assert _torch_accepts(schedule, pp, m) == (not torch_rules), (schedule, pp, m, torch_rules)


@pytest.mark.parametrize("schedule, pp, v, m, rules", [
    ("gpipe", 4, 1, 1, []),  # one micro-batch through GPipe: naive model parallelism, allowed
    ("gpipe", 4, 1, 2, ["pp-microbatches"]),
    ("1f1b", 4, 1, 3, ["pp-microbatches", "1f1b-microbatches"]),
    ("dualpipev", 2, 2, 3, ["dualpipev-microbatches"]),
    ("interleaved_1f1b", 4, 2, 9, ["interleaved-rounds"]),
    ("interleaved_1f1b", 4, 2, 6, []),  # one round of 6
    ("looped_bfs", 2, 2, 3, []),
    ("zbv", 2, 2, 0, ["positive-sizes"])])
def test_microbatch_rules_by_name(schedule, pp, v, m, rules):
    assert [r for r, _ in microbatch_problems(schedule, pp, v, m)] == rules


def test_default_microbatches_satisfy_every_schedule():
    for schedule in SCHEDULES:
        v = default_stages_per_rank(schedule)
        for pp in (1, 2, 4):
            assert not microbatch_problems(schedule, pp, v, default_microbatches(schedule, pp, v)), schedule


def test_bubble_theory_closed_forms():
    assert bubble_theory("gpipe", 4, 8) == pytest.approx((3 / 11, 3 / 8))
    assert bubble_theory("1f1b", 4, 8, 1) == pytest.approx((3 / 11, 3 / 8))
    assert bubble_theory("interleaved_1f1b", 4, 8, 2) == pytest.approx((3 / 19, 3 / 16))
    assert bubble_theory("looped_bfs", 2, 4, 3) == pytest.approx((1 / 13, 1 / 12))
    assert bubble_theory("interleaved_zero_bubble", 4, 8, 2) == pytest.approx((3 / 51, 3 / 48))  # ZB-H1 over v
    assert bubble_theory("zbv", 4, 8, 2) == (0.0, 0.0)  # ZB-V
    assert bubble_theory("dualpipev", 4, 8, 2) == (None, None)
    assert bubble_theory("1f1b", 1, 4) == (0.0, 0.0)
    with pytest.raises(ValueError):
        bubble_theory("1f1b", 0, 4)


def test_zero_stage_of_each_fsdp_strategy():
    assert FSDP_STRATEGY_ZERO == {"no_shard": (0,), "grad_op": (2,), "full": (3,), "hybrid": (2, 3)}
    assert [zero_stage(z, None) for z in range(4)] == [0, 1, 2, 3]
    assert {s: zero_stage(0, s) for s in FSDP_STRATEGY_ZERO} == {"no_shard": 0, "grad_op": 2, "full": 3, "hybrid": 3}
    assert zero_stage(2, "hybrid") == 2 and zero_stage(3, "full") == 3
    with pytest.raises(ValueError, match="disagrees"):
        zero_stage(1, "full")
    with pytest.raises(ValueError, match="unknown fsdp_strategy"):
        zero_stage(0, "sharded")


@pytest.mark.parametrize("dp, split", [(1, (1, 1)), (2, (1, 2)), (3, (1, 3)), (4, (2, 2)), (6, (2, 3)),
                                       (8, (2, 4)), (9, (3, 3)), (12, (3, 4)), (16, (4, 4)), (32, (4, 8))])
def test_hsdp_default_split_is_the_most_even_with_shard_at_least_replicate(dp, split):
    assert hsdp_split(dp) == split
    replicate, shard = split
    assert replicate * shard == dp and replicate <= shard


def test_hsdp_split_takes_an_explicit_replicate_degree():
    assert hsdp_split(8, 4) == (4, 2)
    assert hsdp_split(8, 1) == (1, 8)
    for bad in (3, 0, 16):
        with pytest.raises(ValueError, match="must divide dp=8"):
            hsdp_split(8, bad)


def test_schedule_simulation_raises_on_a_deadlock_or_forces_it_when_asked():
    crossed = {0: [(0, "B", 0)], 1: [(1, "F", 0)]}  # stage 0's backward first: it waits for stage 1 forever
    with pytest.raises(ValueError, match="deadlock"):
        lay_out(crossed, {"F": 1.0, "B": 2.0})
    placed = lay_out(crossed, {"F": 1.0, "B": 2.0}, force_when_stuck=True)
    assert [(p.rank, p.letter, p.start, p.end) for p in placed] == [(0, "B", 0.0, 2.0), (1, "F", 0.0, 1.0)]
