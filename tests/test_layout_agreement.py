"""One rule set: over a grid of layouts, ``lab.Parallel`` on the driver and the ranks' own checks
(``RunConfig``, ``resolve_strategy``, ``apply_tp``'s size rule) accept the same layouts, and refuse
the others under the same rule names (``kernels.contract.layout_combinations``).

Each side is run here, without ranks: the driver's ``Parallel(...).problems(...)``, and what a
rank checks as it reads its run config and resolves it to a strategy. A sample of the accepted
layouts trains one step on the pool, beside one process (tests/test_layout_parity.py trains
one of each family over three steps).
"""
from __future__ import annotations

import json
import itertools
import warnings

import pytest
import torch

import lab
from kernels.contract.config_rules import ConfigError
from kernels.contract.layout_combinations import tp_split_problems
from kernels.contract.run_config import RunConfig
from kernels.model.gpt import GPT
from kernels.model.family import keep_stage, model_config

MODEL = {"layers": 4, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16}
WORLD, GLOBAL_BATCH = 4, 8
SIZES = [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]  # (dp, tp, pp)
SHARDING = [dict(zero=0), dict(zero=1), dict(zero=2), dict(zero=3), dict(fsdp_strategy="hybrid"),
            dict(zero=2, fsdp_strategy="full")]
SWITCHES = [dict(), dict(cpu_offload=True), dict(mixed_precision="bf16"), dict(sequence_parallel=True),
            dict(loss_parallel=True), dict(activation_checkpointing=True)]
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zbv"]


def grid() -> list[dict]:
    """Every (sizes, sharding, switch) triple; pipelines also under each schedule."""
    out = []
    for (dp, tp, pp), sharding, switch in itertools.product(SIZES, SHARDING, SWITCHES):
        for schedule in SCHEDULES if pp > 1 else ["1f1b"]:
            out.append({"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, **sharding, **switch})
    return out


def driver_rules(fields: dict) -> set[str]:
    """The rules ``lab.Parallel`` names for the layout against the model and the world (empty: accepted)."""
    try:
        parallel = lab.Parallel(**fields)
    except lab.ParallelConfigError as error:
        return set(error.rules)
    return {rule for rule, _ in parallel.problems(lab.GPT(**MODEL), WORLD, GLOBAL_BATCH)}


def rank_rules(fields: dict) -> set[str]:
    """What a rank refuses as it reads the run config, resolves its strategy, checks the TP split and cuts its stage."""
    try:
        sent = RunConfig.from_options({"model": MODEL, "global_batch": GLOBAL_BATCH, **fields}).to_dict()
        run = RunConfig.from_dict(json.loads(json.dumps(sent)))  # as a rank reads it back
    except ConfigError as error:
        return set(error.rules)
    strategy = run.strategy
    with torch.device("meta"):
        model = GPT(model_config(run))
    found = {rule for rule, _ in tp_split_problems(strategy.tp, model.tp_sizes(strategy.sequence_parallel), strategy.sequence_parallel)}
    if strategy.pp > 1:  # each pp rank cuts its stages out of the model
        try:
            keep_stage(model, 0, strategy.num_stages)
        except ConfigError as error:
            found |= set(error.rules)
    return found


GRID = grid()


def test_the_grid_has_both_accepted_and_refused_layouts_of_every_kind():
    verdicts = [bool(driver_rules(f)) for f in GRID]
    assert len(GRID) > 300 and any(verdicts) and not all(verdicts)


@pytest.mark.parametrize("fields", GRID, ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
def test_driver_and_ranks_accept_and_refuse_the_same_layouts_by_the_same_rules(fields):
    assert driver_rules(fields) == rank_rules(fields)


def test_cpu_offload_with_zero_2_is_refused_by_both_sides_by_one_rule():
    fields = dict(dp=4, zero=2, cpu_offload=True)
    assert driver_rules(fields) == rank_rules(fields) == {"cpu-offload"}


def accepted_sample() -> list[dict]:
    """One accepted layout per (sizes, sharding) pair, the first switch that is accepted: a spread, not all."""
    seen, out = set(), []
    for fields in GRID:
        key = (fields["dp"], fields["tp"], fields["pp"], fields.get("zero"), fields.get("fsdp_strategy"))
        if key not in seen and not driver_rules(fields):
            seen.add(key)
            out.append(fields)
    return out


@pytest.mark.slow  # about 25 one-step runs on the pool
@pytest.mark.parametrize("fields", accepted_sample(), ids=lambda f: "-".join(f"{k}{v}" for k, v in f.items()))
def test_an_accepted_layout_trains_a_step_like_one_process(cluster, fields):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.LayoutWarning)
        exp = lab.Experiment(cluster, lab.GPT(**MODEL), lab.Parallel(**fields), global_batch=GLOBAL_BATCH, steps=1)
    result, reference = exp.run(progress=False), exp.reference()
    rtol = 2e-3 if fields.get("mixed_precision") == "bf16" else 1e-4
    assert result.losses == pytest.approx(reference.losses, rel=rtol)
