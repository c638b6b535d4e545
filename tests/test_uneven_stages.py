"""Uneven pipeline stages (``lab.Parallel(pp=..., stage_layers=[...])``) train like one process, and the planner
balances them.

The fast tier is pure Python: a split that is not one count >= 1 per stage is refused as [stage-layers], one
that does not add up to the model's layers as [stage-layers-sum], on the driver before anything is sent and
again on the ranks; the planner's split (``lab.planning.stage_balance``) is the best possible for identical
blocks (checked against every split of small pipelines), spares the rank that holds the head, and fits the
costs back from per-stage compute.

The slow tier runs on the session's 4-rank gloo pool: GPT and Llama under 1F1B, GPipe, interleaved 1F1B and
ZB-V with uneven stages, and a Hugging Face GPT-2 whose head is tied to its embedding across the uneven
stages, each against the one-process reference (losses and gradient norms rtol 1e-4; parameters atol 1e-5,
or the update-norm bound of ``tests.test_layout_parity`` where a stage holds several blocks); a checkpoint
saved under equal stages resumes under uneven ones; the measured activations of each uneven stage equal the
rule's; the trace shows each stage's compute.
"""
from __future__ import annotations

import itertools
import warnings

import pytest

import lab
from kernels.contract.config_rules import ConfigError
from kernels.contract.layout_rules import layer_split
from kernels.contract.measure_records import TraceEvent
from kernels.contract.run_config import RunConfig
from lab.measure.timeline import stage_compute
from lab.planning.stage_balance import StageCosts, balance_stages, estimated_costs, measured_costs
from tests.config_draws import RecordingPool

GPT = {"layers": 4, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}


# --- refused by name, before launch -------------------------------------------------------------------------
@pytest.mark.parametrize("fields, rule", [
    (dict(pp=2, dp=2, stage_layers=(1, 2)), "stage-layers-sum"),  # 3 of the model's 4 blocks
    (dict(pp=2, dp=2, stage_layers=(2, 3)), "stage-layers-sum"),
    (dict(pp=2, dp=2, stage_layers=(1, 1, 2)), "stage-layers"),  # three counts for two stages
    (dict(pp=2, dp=2, schedule="interleaved_1f1b", stage_layers=(2, 2)), "stage-layers"),  # v=2: four stages
    (dict(pp=2, dp=2, stage_layers=(4, 0)), "stage-layers"),
    (dict(pp=2, dp=2, stage_layers=(True, 3)), "stage-layers"),
    (dict(dp=4, stage_layers=(4,)), "stage-layers"),  # no pipeline
])
def test_a_split_that_is_not_the_models_blocks_is_refused_by_name_before_launch(fields, rule):
    pool = RecordingPool()
    with pytest.raises(ConfigError) as err:
        lab.Experiment(pool, lab.GPT(**GPT), lab.Parallel(**fields), global_batch=8)
    assert err.value.rules == (rule,) and f"[{rule}]" in str(err.value)
    assert pool.calls == []


def test_the_ranks_refuse_the_same_splits_and_keep_a_good_one_through_json():
    with pytest.raises(ConfigError) as err:
        RunConfig.from_options({"model": GPT, "pp": 2, "stage_layers": [1, 1, 2]})
    assert err.value.rules == ("stage-layers",)
    run = RunConfig.from_options({"model": GPT, "pp": 2, "schedule": "zbv", "stage_layers": [1, 1, 1, 1]})
    assert RunConfig.from_dict(run.to_dict()) == run and run.strategy.stage_layers == (1, 1, 1, 1)
    assert "stages of 1/1/1/1 blocks" in run.strategy.describe()
    assert lab.Parallel.from_dict(lab.Parallel(pp=2, stage_layers=[3, 1]).to_dict()).stage_layers == (3, 1)


def test_layer_split_gives_each_stage_the_next_count_of_blocks():
    assert [list(layer_split(8, 3, s, (2, 5, 1))) for s in range(3)] == [[0, 1], [2, 3, 4, 5, 6], [7]]
    for bad in ((2, 5), (2, 5, 2), (0, 7, 1)):
        with pytest.raises(ValueError):
            layer_split(8, 3, 0, bad)


# --- the planner ------------------------------------------------------------------------------------------
def _best_busiest(layers: int, placement, costs: StageCosts) -> float:
    """The least busiest-rank load over every split with at least one block a stage (brute force)."""
    n = sum(len(stages) for stages in placement)
    best = float("inf")
    for cuts in itertools.combinations(range(1, layers), n - 1):
        split = [b - a for a, b in zip((0, *cuts), (*cuts, layers))]
        load = [costs.stage_cost(k, s, n) for s, k in enumerate(split)]
        best = min(best, max(sum(load[s] for s in stages) for stages in placement))
    return best


@pytest.mark.parametrize("layers, pp, schedule, first, last", [
    (8, 2, "1f1b", 0.0, 2.5), (9, 3, "gpipe", 1.2, 3.7), (10, 4, "1f1b", 0.4, 0.0), (12, 2, "zbv", 0.5, 2.2),
    (10, 2, "interleaved_1f1b", 2.0, 1.0), (12, 3, "looped_bfs", 0.0, 4.0), (9, 2, "dualpipev", 3.0, 3.0)])
def test_the_proposed_split_makes_the_busiest_rank_as_light_as_any_split_can(layers, pp, schedule, first, last):
    costs = StageCosts(1.0, first, last, "blocks", "given")
    plan = balance_stages({"layers": layers, "hidden": 64, "vocab": 64}, pp, schedule=schedule, costs=costs)
    assert sum(plan.stage_layers) == layers and min(plan.stage_layers) >= 1
    assert plan.busiest == pytest.approx(_best_busiest(layers, plan.rank_stages, costs))
    assert plan.busiest <= plan.even_busiest


def test_without_ends_the_split_is_the_equal_one_and_a_heavy_head_moves_blocks_off_the_last_stage():
    flat = StageCosts(1.0, 0.0, 0.0, "blocks", "given")
    assert balance_stages("llama3.1-405b", 16, costs=flat).stage_layers == tuple(
        len(layer_split(126, 16, s)) for s in range(16))
    # Llama-3-8B: the head's 2·h·V FLOPs per token are 1.84 blocks at s = 8192, so the last stage gives one up.
    llama = balance_stages("llama3-8b", 4)
    assert llama.stage_layers == (9, 8, 8, 7) and llama.costs.last / llama.costs.block == pytest.approx(1.84, abs=0.01)
    assert llama.busiest == 9 and llama.speedup > 1
    # Under ZB-V rank 0 holds the first and the last stage: it gets the fewer blocks.
    v = balance_stages("llama3-8b", 2, schedule="zbv")
    assert v.rank_stages == ((0, 3), (1, 2)) and v.stage_layers[0] + v.stage_layers[3] < 16


def test_costs_from_the_shape_count_flops_or_parameters():
    gpt = lab.GPT(layers=8, d_model=64, heads=4, vocab=2048, seq_len=16)
    flops = estimated_costs(gpt)
    assert flops.block == 2 * (12 * 64 * 64 + 13 * 64) + 4 * 16 * 64  # 2·Ψ_block + 4·s·h
    assert (flops.first, flops.last) == (0.0, 2 * 64 * 2048)  # the lookup has no FLOPs; the head 2·h·V
    params = estimated_costs(gpt, by="memory")
    assert (params.first, params.last) == (2048 * 64 + 16 * 64, 2048 * 64 + 2 * 64)
    assert balance_stages(gpt, 2).stage_layers == (5, 3)


def _events(split: tuple[int, ...], costs: StageCosts, replicas: int = 1) -> list[dict]:
    """One traced step whose stage s computes exactly its cost, held by ``replicas`` ranks."""
    out, n = [], len(split)
    for s, blocks in enumerate(split):
        seconds = blocks * costs.block + (costs.first if s == 0 else 0) + (costs.last if s == n - 1 else 0)
        for r in range(replicas):  # an F of a third and a B of two thirds
            rank = s * replicas + r
            out += [TraceEvent(rank, s, "forward", 0, 0.0, seconds / 3, action="F").to_dict(),
                    TraceEvent(rank, s, "backward", 0, 1.0, 1.0 + 2 * seconds / 3, action="B").to_dict()]
    return out


def _run(split: tuple[int, ...], costs: StageCosts, replicas: int = 1) -> dict:
    layout = [{"stage_layers": {str(s): list(layer_split(sum(split), len(split), s, split))}} for s in
              range(len(split))]
    return {"events": _events(split, costs, replicas), "layout": layout}


def test_measured_costs_recover_the_block_and_the_ends_from_the_trace():
    truth = StageCosts(0.02, 0.01, 0.05, "seconds per step", "made up")
    assert stage_compute(_events((1, 3), truth, replicas=2)) == pytest.approx({0: 0.03, 1: 0.11})
    for runs in ([_run((2, 2), truth), _run((3, 1), truth)], [_run((2, 1, 1, 2), truth)]):
        fitted = measured_costs(runs)
        assert (fitted.block, fitted.first, fitted.last) == pytest.approx((0.02, 0.01, 0.05))
    assert balance_stages(lab.GPT(**{**GPT, "layers": 8}), 2, measured=[_run((4, 4), truth), _run((5, 3), truth)]
                          ).stage_layers == (5, 3)
    with pytest.raises(ValueError, match="second run"):
        measured_costs([_run((2, 2), truth)])  # two stages, one split: a block's cost and the ends' are one


def test_plan_reports_the_balanced_split_and_sizes_a_given_one():
    plan = lab.plan("llama3-8b", gpus=32, parallel={"tp": 8, "pp": 4})
    assert plan.stage_balance.stage_layers == (9, 8, 8, 7)
    assert any("stage_layers=[9, 8, 8, 7]" in note for note in plan.notes) and "stage_layers" in str(plan)
    assert plan.to_dict()["stage_balance"]["stage_layers"] == (9, 8, 8, 7)
    given = lab.plan("llama3-8b", gpus=32, parallel={"tp": 8, "pp": 4, "stage_layers": (9, 8, 8, 7)})
    assert [s.layers for s in given.stages] == [9, 8, 8, 7] and "stages=9/8/8/7" in given.layout.describe()
    assert not any("stage_layers=" in note for note in given.notes)  # it is the balanced one
    assert lab.plan("llama3-8b", gpus=8, parallel={"tp": 8}).stage_balance is None
    with pytest.raises(ValueError, match="stage_layers"):
        lab.plan("llama3-8b", gpus=32, parallel={"tp": 8, "pp": 4, "stage_layers": (9, 8, 8, 8)})


# --- on the ranks (the session's 4-rank pool) ---------------------------------------------------------------
LLAMA = {"family": "llama", "layers": 6, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64,
         "seq_len": 16}
BASE = {"model": GPT, "global_batch": 8, "steps": 3, "lr": 1e-2, "seed": 0}
LAYOUTS = {  # id -> the run's layout fields; the blocks of each stage, in stage order, are stage_layers
    "gpt-pp2-dp2-1f1b-1+3": {"pp": 2, "dp": 2, "microbatches": 2, "stage_layers": [1, 3], "trace": True},
    "llama-pp4-gpipe-2+1+1+2": {"pp": 4, "schedule": "gpipe", "microbatches": 4, "stage_layers": [2, 1, 1, 2],
                                "model": LLAMA},
    "gpt-pp2-dp2-interleaved-2+1+1+2": {"pp": 2, "dp": 2, "schedule": "interleaved_1f1b", "microbatches": 4,
                                        "stage_layers": [2, 1, 1, 2], "model": {**GPT, "layers": 6}},
    "gpt-pp2-tp2-zbv-1+2+1+1": {"pp": 2, "tp": 2, "schedule": "zbv", "microbatches": 4, "stage_layers": [1, 2, 1, 1],
                                "model": {**GPT, "layers": 5}},
}


@pytest.fixture(scope="module")
def trained(cluster):
    from tests.layout_runs import layout_runs
    return layout_runs(cluster, lambda layout: {**BASE, **LAYOUTS[layout]})


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_uneven_stages_train_like_one_process(trained, layout):
    from tests.layout_runs import reference_of
    from tests.test_layout_parity import FP32, PIPELINE_NORM, _check_params
    from kernels.model.family import build_model, model_config

    cfg, results = trained(layout)
    ref, split = reference_of(cfg), cfg["stage_layers"]
    init = dict(build_model(model_config(RunConfig.from_options(cfg))).named_parameters())
    tol = PIPELINE_NORM if max(split) > 1 else FP32  # several blocks a stage: tests.test_layout_parity's bound
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-4), f"rank {rank} losses"
        assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4), f"rank {rank} norms"
        _check_params(rank, res["params"], ref["params"], tol, init)
        stages = res["layout"]["stage_layers"]  # {stage: its blocks} for this rank's stages
        assert stages == {s: list(layer_split(sum(split), len(split), int(s), split)) for s in stages}
        held = {int(n.split(".")[1]) for n in res["params"] if n.startswith("blocks.")}
        assert held == {b for blocks in stages.values() for b in blocks}, f"rank {rank} blocks"
    assert set().union(*(res["params"] for res in results)) == ref["params"].keys()
    assert ref["losses"][-1] < ref["losses"][0]


@pytest.mark.slow
def test_the_trace_gives_each_uneven_stage_its_compute(trained):
    """Each stage's compute in the traced step (how long is the CPU's to say, so no timing is asserted): every
    rank ran a forward and a backward of each micro-batch through its own stage."""
    cfg, results = trained("gpt-pp2-dp2-1f1b-1+3")
    result = lab.RunResult.from_ranks(results, cfg)
    compute = stage_compute(result.events)
    assert set(compute) == {0, 1} and min(compute.values()) > 0
    ran = sorted((e["rank"], e["stage"], e["action"], e["microbatch"]) for e in result.events
                 if e["kind"] in ("forward", "backward"))
    stage_of = {r: int(next(iter(results[r]["layout"]["stage_layers"]))) for r in range(4)}
    assert ran == sorted((r, stage_of[r], a, mb) for r in range(4) for a in "FB" for mb in range(2))
    assert result.bubble["ranks"] == [0, 1, 2, 3]


@pytest.mark.slow
def test_a_tied_head_stays_tied_across_uneven_stages(cluster):
    """Hugging Face GPT-2 ties its head to its embedding: stage 0 (3 blocks) and stage 1 (1 block) each hold a copy,
    their gradients summed (kernels.parallel.tied_stages)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=32)
    exp = lab.Experiment(cluster, config, lab.Parallel(pp=2, dp=2, microbatches=2, stage_layers=(3, 1)),
                         global_batch=8, steps=3, lr=3e-3)
    result, reference = exp.run(progress=False), exp.reference()
    assert result.losses == pytest.approx(reference.losses, rel=1e-4), result.loss_table(reference)
    assert [sorted(map(int, r["stage_layers"])) for r in result.layout] == [[0], [0], [1], [1]]


@pytest.mark.slow
def test_a_checkpoint_saved_under_equal_stages_resumes_under_uneven_ones(cluster, tmp_path):
    """The stages keep their blocks' names, so the checkpoint's keys are the same under any split."""
    def experiment(stage_layers, **kwargs) -> lab.Experiment:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", lab.LayoutWarning)
            return lab.Experiment(cluster, lab.GPT(**GPT), lab.Parallel(pp=2, dp=2, microbatches=2,
                                                                         stage_layers=stage_layers),
                                  global_batch=8, steps=4, **kwargs)
    whole = experiment(None, checkpoint_dir=str(tmp_path), checkpoint_every=2).run(progress=False)
    saved = next(c for c in lab.checkpoints(tmp_path) if c.step == 2)
    resumed = experiment((3, 1), resume_from=saved).run(progress=False)
    assert resumed.steps_ran == [3, 4]
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-4)


@pytest.mark.slow
def test_each_uneven_stage_holds_the_activations_the_rule_predicts(cluster):
    from lab.measure.memory_and_comm import measure_layout

    out = measure_layout(cluster, {**BASE, "pp": 4, "microbatches": 4, "stage_layers": [1, 2, 2, 1],
                                   "model": {**GPT, "layers": 6}})
    for rank in range(4):
        rows = {r.category: r for r in out["memory"] if r.rank == rank and r.moment == "peak_fwd_bwd"}
        assert rows["activations"].predicted == rows["activations"].measured > 0, rank
    held = [rec["activations_held"]["activation_parts"]["attention"] for rec in out["ranks"]]
    # 1F1B: stage k holds 4 - k micro-batches of its blocks' attention; the two-block stages twice a block's.
    per_block_mb = held[0] / 4
    assert held == [4 * per_block_mb, 3 * 2 * per_block_mb, 2 * 2 * per_block_mb, 1 * per_block_mb]
