"""FSDP2's ``reshard_after_forward`` per unit: the root and the blocks each choose, and memory and traffic follow.

``lab.Parallel(zero=3, reshard_after_forward={"root": False, "blocks": True})`` keeps the root's gathered
parameters (embeddings, final norm, head) whole from forward to backward and frees each block's; None keeps
what the stage says for every unit. On the 4-rank pool the tiny GPT (2 blocks, Ψ = 21,760 fp32 parameters,
4,672 of them the root's; every dim 0 divides by 4, so FSDP2 pads nothing) trains under ZeRO-3 three ways:

- every unit freed (None): 2 all-gathers per unit and micro-batch, shards between forward and backward;
- the root kept: the root's backward all-gather disappears and its whole parameters stay resident;
- every unit kept (False): ZeRO-2's memory and traffic.

Each run matches one process, and its measured memory and all-gathers equal the driver's prediction.
"""
from __future__ import annotations

import json
import math

import pytest

from kernels.contract.config_rules import ConfigError
from kernels.contract.layout_rules import reshard_units
from kernels.contract.run_config import RunConfig
from kernels.contract.strategy import Strategy, resolve_strategy
from kernels.train.entry import train_rank
from lab.measure.comm_prediction import comm_records
from lab.measure.memory_and_comm import memory_records
from lab.run.parallel import Parallel, ParallelConfigError
from tests.layout_runs import assert_trains_like_one_process

TINY = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "d_ff": 64}
# Two accumulated micro-batches: a kept unit's earlier gradients also stay whole until the last one.
BASE = {"model": TINY, "global_batch": 8, "steps": 3, "lr": 1e-2, "seed": 0, "dp": 4, "zero": 3, "microbatches": 2,
        "measure": True}
ROOT_KEPT = {"root": False, "blocks": True}
SETTINGS = {"all-freed": None, "root-kept": ROOT_KEPT, "all-kept": False}


def test_each_unit_follows_the_stage_unless_named():
    assert reshard_units(3, None) == {"root": True, "blocks": True}
    assert reshard_units(2, None) == {"root": False, "blocks": False}
    assert reshard_units(3, {"root": False}) == ROOT_KEPT
    assert reshard_units(2, {"blocks": True}) == ROOT_KEPT
    assert reshard_units(2, True) == {"root": True, "blocks": True}
    assert Parallel(dp=4, zero=3).strategy().reshard_after_forward is None  # today's behaviour, from the stage
    assert Parallel(dp=4, zero=3, reshard_after_forward={"root": False}).strategy().reshard_units == ROOT_KEPT
    assert Parallel(dp=4, zero=2).strategy().reshard_units == {"root": False, "blocks": False}


def test_describe_names_what_each_unit_does():
    words = Parallel(dp=4, zero=3, reshard_after_forward=ROOT_KEPT).describe()
    assert "the root's kept until backward ends and the blocks' freed after forward" in words
    assert "gathered per block and freed after forward" in Parallel(dp=4, zero=3).describe()
    assert "gathered per block and kept until backward ends" in Parallel(dp=4, zero=3,
                                                                        reshard_after_forward=False).describe()


@pytest.mark.parametrize("fields, rule", [
    (dict(dp=4, zero=3, reshard_after_forward={"head": False}), "reshard-after-forward"),  # no such unit
    (dict(dp=4, zero=3, reshard_after_forward={"root": 1}), "reshard-after-forward"),  # not a bool
    (dict(dp=4, zero=3, reshard_after_forward="no"), "reshard-after-forward"),
    (dict(dp=4, reshard_after_forward=True), "reshard-fsdp"),  # DDP
    (dict(dp=4, zero=1, reshard_after_forward=False), "reshard-fsdp"),  # ZeroRedundancyOptimizer
    (dict(dp=4, fsdp_strategy="no_shard", reshard_after_forward=False), "reshard-fsdp"),
    (dict(dp=2, tp=2, reshard_after_forward=ROOT_KEPT), "reshard-fsdp"),  # FSDP2 replicating: nothing to free
    # A unit that reshards after forward is what ZeRO-3 does, and gives wrong gradients under split backward.
    (dict(pp=2, dp=2, zero=2, schedule="zbv", reshard_after_forward={"blocks": True}), "zero3-split-backward"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_reshard_setting_that_makes_no_sense_is_refused_by_its_rule(fields, rule):
    with pytest.raises(ParallelConfigError) as err:
        Parallel(**fields)
    assert err.value.rules == (rule,) and f"[{rule}]" in str(err.value)
    with pytest.raises(ConfigError):  # the ranks' side refuses it too
        resolve_strategy(**fields)


def test_no_unit_resharding_runs_under_split_backward_schedules():
    s = Parallel(pp=2, dp=2, zero=3, schedule="zbv", reshard_after_forward=False).strategy()
    assert s.reshard_units == {"root": False, "blocks": False}


@pytest.mark.parametrize("value", [None, True, False, ROOT_KEPT, {"blocks": True}])
def test_parallel_strategy_and_run_config_round_trip_through_json_exactly(value):
    par = Parallel(dp=4, zero=3, reshard_after_forward=value)
    assert Parallel.from_dict(json.loads(json.dumps(par.to_dict()))) == par
    s = par.strategy()
    assert Strategy.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    run = RunConfig.from_options({"model": TINY, "dp": 4, "zero": 3, "reshard_after_forward": value})
    back = RunConfig.from_dict(json.loads(json.dumps(run.to_dict())))
    assert back == run and back.strategy.reshard_units == s.reshard_units


def test_configs_saved_before_the_field_load_with_the_stage_deciding():
    par = Parallel(dp=4, zero=3).to_dict()
    del par["reshard_after_forward"]
    assert Parallel.from_dict(par).reshard_after_forward is None
    run = RunConfig.from_options({"model": TINY, "dp": 4, "zero": 2}).to_dict()
    del run["strategy"]["reshard_after_forward"]
    assert RunConfig.from_dict(run).strategy.reshard_units == {"root": False, "blocks": False}


def _root_numel(record: dict) -> int:
    """The root unit's parameters: every one outside the blocks (embeddings, final norm, head)."""
    return sum(math.prod(p["global_shape"]) for name, p in record["params"].items() if not name.startswith("blocks."))


def _memory(record: dict) -> dict[tuple[str, str], object]:
    return {(r.moment, r.category): r for r in memory_records(record) if r.category in ("params", "grads", "optimizer")}


@pytest.mark.slow
def test_root_kept_whole_drops_its_backward_all_gather_and_stays_resident(cluster):
    runs = {}
    for name, value in SETTINGS.items():
        cfg = {**BASE, "reshard_after_forward": value}
        results = cluster.run(train_rank, cfg)
        # Every setting trains exactly as one process (one reference serves all: the setting changes no maths).
        assert_trains_like_one_process(BASE, results)
        runs[name] = [res["measure"] for res in results], cfg
    psi, m, blocks = 21760, BASE["microbatches"], TINY["layers"]
    root = _root_numel(runs["all-freed"][0][0])
    assert root == 4672
    peak_params = {"all-freed": 4 * psi // 4, "root-kept": 4 * (psi - root) // 4 + 4 * root, "all-kept": 4 * psi}
    # Per micro-batch, a freed unit is gathered in forward and again in backward, a kept one in forward only.
    gathers = {"all-freed": m * 2 * (1 + blocks), "root-kept": m * (1 + 2 * blocks), "all-kept": m * (1 + blocks)}
    gathered = {"all-freed": m * 2 * 4 * psi, "root-kept": m * 4 * (2 * psi - root), "all-kept": m * 4 * psi}
    for name, (records, cfg) in runs.items():
        for rec in records:
            assert rec["reshard_after_forward"] == reshard_units(3, SETTINGS[name])
            memory = _memory(rec)
            for (moment, category), row in memory.items():
                assert row.measured == row.predicted, (name, rec["rank"], moment, category)
            assert memory[("peak_fwd_bwd", "params")].measured == peak_params[name], name
            assert memory[("at_rest", "params")].measured == 4 * psi // 4  # every unit sharded again after backward
            ops = {r.op: r for r in comm_records(rec, cfg)}
            assert set(ops) == {"all_gather", "reduce_scatter"} and rec["comm_unmetered"] == {}
            assert ops["all_gather"].count == gathers[name], name
            assert ops["all_gather"].payload_bytes == ops["all_gather"].predicted_payload_bytes == gathered[name]
            assert ops["reduce_scatter"].payload_bytes == ops["reduce_scatter"].predicted_payload_bytes == 4 * psi
