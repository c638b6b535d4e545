"""An experiment checks its layout before launch, trains on the ranks, equals one process, and leaves nothing behind."""
from __future__ import annotations

import dataclasses
import json

import pytest

import lab
from kernels.contract.strategy import resolve_strategy
from kernels.contract.run_config import RunConfig

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)


class RefusingCluster:
    """Stands in for a pool: any attempt to launch work fails the test."""

    world_size = 4

    def run(self, *args, **kwargs):
        raise AssertionError("a bad layout reached the ranks")


@pytest.mark.parametrize("parallel, rule", [
    (lab.Parallel(dp=2, tp=1), "world-size"),
    (lab.Parallel(tp=4, dp=1), None),  # heads=4 divides: valid, for contrast
    (lab.Parallel(dp=1, tp=1, pp=4, microbatches=4), "pp-layers"),
])
def test_bad_layouts_are_refused_before_anything_launches(parallel, rule):
    if rule is None:
        lab.Experiment(RefusingCluster(), TINY, parallel, global_batch=8)
        return
    with pytest.raises(lab.ParallelConfigError, match=rule):
        lab.Experiment(RefusingCluster(), TINY, parallel, global_batch=8)


def test_wasteful_layouts_run_with_a_warning():
    with pytest.warns(lab.LayoutWarning, match="wasteful"):
        lab.Experiment(RefusingCluster(), TINY, lab.Parallel(dp=2, pp=2, zero=3, microbatches=2), global_batch=8)


def test_the_rank_config_is_typed_and_round_trips_through_json():
    model = lab.GPT(layers=4, d_model=32, heads=4, vocab=64, seq_len=16)
    exp = lab.Experiment(RefusingCluster(), model, lab.Parallel(dp=2, pp=2, schedule="zbv", microbatches=4),
                         global_batch=8)
    run = exp.run_config()
    s = run.strategy
    assert s.stages_per_rank == 2 and s.dp_replicate == 1 and s.schedule == "zbv" and s.microbatches == 4
    assert RunConfig.from_dict(json.loads(json.dumps(run.to_dict()))) == run
    assert exp.config() == run.to_dict()


@pytest.mark.parametrize("fields, words", [
    ({"dp": 0}, r"\[positive-sizes\] sizes must be positive ints: dp=0"),
    ({"zero": 4}, "zero must be 0, 1, 2 or 3"),
    ({"fsdp_strategy": "half"}, "unknown fsdp_strategy 'half'"),
    ({"schedule": "pipedream"}, "unknown schedule"),
    ({"model": {"layers": 2, "width": 3}}, "unknown model keys"),
    ({"virtual_stages": 2}, "unknown key 'virtual_stages'"),
])
def test_a_bad_rank_config_is_refused_in_words(fields, words):
    with pytest.raises(ValueError, match=words):
        RunConfig.from_options(fields)


@pytest.mark.parametrize("sizes, options, kind, hybrid", [
    ({"dp": 4}, {}, "ddp", False),
    ({"dp": 4}, {"zero": 1}, "zero1", False),
    ({"dp": 4}, {"fsdp_strategy": "hybrid"}, "fsdp", True),
    ({"dp": 2, "tp": 2}, {}, "fsdp", True),  # DDP cannot take TP's DTensors: FSDP2 replication
    ({"tp": 4}, {}, "tp", False),
    ({"pp": 2, "dp": 2}, {}, "allreduce", False),
    ({"pp": 4}, {}, "pp", False),
])
def test_a_layout_resolves_to_one_typed_strategy(sizes, options, kind, hybrid):
    strategy = resolve_strategy(**sizes, **options)
    assert (strategy.kind, strategy.hybrid) == (kind, hybrid)
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.zero = 3


def test_unknown_optimizer_is_refused():
    with pytest.raises(ValueError, match="adamw"):
        lab.Experiment(RefusingCluster(), TINY, lab.Parallel(dp=4), optimizer="lion")


def process_groups_and_rss() -> tuple[int, int]:
    """Groups the rank holds beyond the meshes it keeps warm (1: the default group alone), and its resident bytes."""
    import psutil

    from kernels.parallel.warm_meshes import unkept_group_count

    return unkept_group_count(), psutil.Process().memory_info().rss


@pytest.mark.slow  # fast tier: one case per capability; measured 16.6 s; test_warm_pool_memory covers 50 runs
def test_repeated_runs_on_a_warm_pool_leak_no_groups_or_memory(cluster):
    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=2, tp=2, zero=3), global_batch=8, steps=2)
    exp.run()
    before = cluster.run(process_groups_and_rss)
    for _ in range(3):
        exp.run()
    after = cluster.run(process_groups_and_rss)
    assert [g for g, _ in after] == [g for g, _ in before] == [1] * 4  # beyond the warm meshes, only the default group
    growth_mb = max(a[1] - b[1] for a, b in zip(after, before)) / 2**20
    assert growth_mb < 30, f"a rank grew by {growth_mb:.1f} MB over 3 runs"


def test_run_result_equals_the_reference_and_round_trips_through_json(cluster, tmp_path):
    exp = lab.Experiment(cluster, TINY, lab.Parallel(pp=2, dp=2, microbatches=2), global_batch=8, steps=3)
    result, reference = exp.run(), exp.reference()
    assert result.matches(reference, rtol=1e-4), result.loss_table(reference)
    assert result.world_size == 4 and all(len(t) == 3 for t in result.step_times)
    assert {tuple(r["stage_ids"]) for r in result.layout} == {(0,), (1,)}
    again = lab.RunResult.from_json(result.to_json(tmp_path / "run.json"))
    assert again == result


def test_a_mesh_order_puts_the_ranks_where_the_planner_counts_them(cluster):
    order = ("pp", "tp", "dp")  # each tp group is ranks dp apart: 0 and 2, 1 and 3
    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=2, tp=2, mesh_order=list(order)), global_batch=8, steps=2)
    assert exp.run_config().strategy.mesh_order == order
    result = exp.run(progress=False)
    assert result.matches(exp.reference(), rtol=1e-4), result.loss_table(exp.reference())
    tp_of = {r["rank"]: r["coords"]["tp"] for r in result.layout}
    assert [r for r in range(4) if tp_of[r] == 0] == [0, 1]  # the default order would give ranks 0 and 2
    planned = lab.plan(TINY, gpus=4, gpus_per_node=2, parallel=exp.parallel, global_batch=8)
    assert {e.axis: e.link for e in planned.comm} == {"tp": "inter", "dp": "intra"}


def test_loss_falls_over_fifty_steps(cluster):
    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=4), global_batch=8, steps=50, lr=1e-2)
    losses = exp.run().losses
    assert losses[-1] < 0.6 * losses[0], losses[::10]
