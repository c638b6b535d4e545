"""ZeRO-1 beside tensor and pipeline parallelism (``kernels.parallel.zero1_slices``) trains like one process,
holds exactly the ZeRO-1 rule's optimizer state, and checkpoints.

- TP2×DP2 and PP2×DP2 (4 ranks) and PP2×TP2×DP2 (8 ranks) with ``zero=1`` match the one-process
  reference at the layout matrix's fp32 bounds (``tests.layout_runs``), measured on their last step.
- Memory: each rank's optimizer state is a 1/dp slice of every local shard, so it holds exactly
  K·Ψ_local/dp bytes (AdamW: K = 8; Ψ_local = the elements of its tp shards of its pp stage; every
  tensor here divides by dp) plus AdamW's 4-byte ``step`` per tensor, the dp ranks of one (pp, tp)
  place together hold the whole state once, and ``lab.measure`` predicts it byte for byte. The
  all-gather of the updated slices is measured at its predicted payload.
- Checkpoints: a TP2×DP2 ZeRO-1 run saved at step 2 resumes bit for bit under its own layout and,
  from the same logical state, under PP2×DP2 ZeRO-1; a held ``lab.Training`` relayouts from
  TP2×DP2 ZeRO-1 to PP2×DP2 ZeRO-1 and to ZeroRedundancyOptimizer's DP4 and goes on as one run.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

import lab
from kernels.contract.strategy import resolve_strategy
from kernels.parallel.zero1_slices import slice_bounds
from kernels.train.entry import train_rank
from lab.measure.comm_prediction import comm_records
from lab.measure.memory_and_comm import memory_records
from tests.layout_runs import assert_trains_like_one_process

TINY = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}
BASE = {"model": TINY, "global_batch": 8, "steps": 3, "lr": 1e-2, "seed": 0, "measure": True, "return_params": True}
PIPE = {"schedule": "1f1b", "microbatches": 2}
LAYOUTS = {"tp2-dp2": {"dp": 2, "tp": 2, "zero": 1},
           "pp2-dp2": {"pp": 2, "dp": 2, "zero": 1, **PIPE},
           "pp2-tp2-dp2": {"pp": 2, "tp": 2, "dp": 2, "zero": 1, **PIPE}}
K_ADAMW, STEP_BYTES = 8, 4

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_zero1_with_tp_or_pp_is_a_layout_and_steps_by_slices():
    for fields in LAYOUTS.values():
        lab.Parallel(**fields)  # no rule refuses it any more
        assert resolve_strategy(**fields).zero1_slices
    assert "1/dp of every local tensor" in resolve_strategy(**LAYOUTS["tp2-dp2"]).describe()
    assert not resolve_strategy(dp=4, zero=1).zero1_slices  # flat DP keeps DDP and ZeroRedundancyOptimizer


@pytest.mark.parametrize("n, dp", [(12, 2), (13, 4), (3, 4), (1, 2)])
def test_slices_cover_each_tensor_once_in_chunks_of_ceil_n_over_dp(n, dp):
    bounds = [slice_bounds(n, dp, r) for r in range(dp)]
    assert [b - a for a, b in bounds if b > a] == [len(c) for c in torch.arange(n).chunk(dp)]
    assert [i for a, b in bounds for i in range(a, b)] == list(range(n))


@pytest.fixture(scope="module")
def runs():
    """layout id -> (its config, every rank's record): each layout trains once per module."""
    done: dict[str, tuple[dict, list[dict]]] = {}

    def get(pool, layout: str) -> tuple[dict, list[dict]]:
        if layout not in done:
            cfg = {**BASE, **LAYOUTS[layout]}
            done[layout] = cfg, pool.run(train_rank, cfg)
        return done[layout]

    return get


def _pool(request, layout: str):
    return request.getfixturevalue("cluster8" if layout == "pp2-tp2-dp2" else "cluster")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero1_trains_like_one_process_and_holds_the_zero1_rule(request, runs, layout):
    cfg, results = runs(_pool(request, layout), layout)
    assert_trains_like_one_process(cfg, results)
    dp, places = cfg["dp"], {}
    for res in results:
        record = res["measure"]
        assert set(record["optimizer_slices"]) == set(record["params"])  # a slice of every parameter
        local = [math.prod(info["local_shape"]) for info in record["params"].values()]
        assert all(n % dp == 0 for n in local)  # so the rule is exact, not within a chunk
        rule = K_ADAMW * sum(local) // dp + STEP_BYTES * len(local)
        rows = [r for r in memory_records(record) if r.category == "optimizer"]
        assert rows and all(r.measured == r.predicted == rule for r in rows), (record["rank"], rule, rows)
        place = (record["coords"]["pp"], record["coords"]["tp"])
        places.setdefault(place, [0, K_ADAMW * sum(local)])[0] += rows[0].measured - STEP_BYTES * len(local)
        gathers = [c for c in comm_records(record, cfg) if c.op == "all_gather" and c.source == "dist"]
        assert [c.payload_bytes for c in gathers] == [c.predicted_payload_bytes for c in gathers] == [4 * sum(local)]
    assert all(held == whole for held, whole in places.values()), places  # split over dp exactly once


def _experiment(pool, layout: str, **kwargs) -> lab.Experiment:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.LayoutWarning)
        return lab.Experiment(pool, lab.GPT(**TINY), lab.Parallel(**LAYOUTS[layout]), steps=4, **kwargs)


@pytest.mark.slow
def test_a_zero1_checkpoint_resumes_bit_for_bit_and_under_another_layout(cluster, tmp_path):
    root = str(tmp_path / "tp2-dp2-zero1")
    whole = _experiment(cluster, "tp2-dp2", checkpoint_dir=root, checkpoint_every=2).run(return_params=True)
    again = _experiment(cluster, "tp2-dp2", resume_from=root + "/step_000002").run(return_params=True)
    assert again.losses == whole.losses[2:] and again.grad_norms == whole.grad_norms[2:]
    assert again.params == whole.params
    moved = _experiment(cluster, "pp2-dp2", resume_from=root + "/step_000002").run(return_params=True)
    assert moved.losses == pytest.approx(whole.losses[2:], rel=1e-4)


@pytest.mark.slow
def test_a_held_zero1_training_relayouts_and_goes_on_as_one_run(cluster):
    model = lab.GPT(**TINY)
    whole = lab.Experiment(cluster, model, lab.Parallel(dp=4), steps=4).run(progress=False)
    with lab.Training(cluster, model, lab.Parallel(**LAYOUTS["tp2-dp2"])) as training:
        training.step(2)
        training.relayout(lab.Parallel(**LAYOUTS["pp2-dp2"]))
        training.step(1)
        training.relayout(lab.Parallel(dp=4, zero=1))  # flat DP: ZeroRedundancyOptimizer's partition
        training.step(1)
    assert training.losses == pytest.approx(whole.losses, rel=1e-4)
