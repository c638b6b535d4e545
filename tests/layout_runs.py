"""What the expert- and context-parallel parity tests share: each layout trains once per module on the pool,
its one-process reference once per session, and a case runs in the fast tier only when named so."""
from __future__ import annotations

import functools
import json
from typing import Callable

import pytest

from kernels.contract.run_config import RunConfig
from kernels.parallel.warm_meshes import unkept_group_count
from kernels.train.entry import train_rank
from kernels.train.reference import train_reference

Runs = Callable[[str], tuple[dict, list[dict]]]


@functools.lru_cache(maxsize=None)
def _reference(key: str) -> dict:
    return train_reference(RunConfig.from_options(json.loads(key)))


def reference_of(cfg: dict) -> dict:
    """The one-process reference of a run config (its ``world_size`` left out: one process trains it all)."""
    return _reference(json.dumps({k: v for k, v in cfg.items() if k != "world_size"}, sort_keys=True))


def layout_runs(cluster, config_of: Callable[[str], dict]) -> Runs:
    """layout id -> (its config, the records of the ranks that trained): each layout trains once on ``cluster``,
    and every sub-group it made must be gone after (ranks beyond ``world_size`` sit the run out)."""
    runs: dict[str, tuple[dict, list[dict]]] = {}

    def get(layout: str) -> tuple[dict, list[dict]]:
        if layout not in runs:
            cfg = config_of(layout)
            results = cluster.run(train_rank, cfg)
            assert cluster.run(unkept_group_count) == [1] * cluster.world_size, "sub-groups left behind"
            runs[layout] = cfg, results[:cfg.get("world_size", len(results))]
        return runs[layout]

    return get


def tier(layout: str, fast: set[str]):
    """A parametrize case for ``layout``: in the fast tier if ``fast`` names it, else slow."""
    return pytest.param(layout, marks=[] if layout in fast else [pytest.mark.slow], id=layout)


def assert_trains_like_one_process(cfg: dict, results: list[dict]) -> dict:
    """Every rank's losses, gradient norms and gathered parameters equal one process's within the layout
    matrix's fp32 bounds (``tests.test_layout_parity``), and training lowered the loss; returns the reference."""
    from kernels.model.family import build_model, model_config
    from tests.test_layout_parity import FP32, _check_params

    ref = reference_of(cfg)
    init = dict(build_model(model_config(RunConfig.from_options(cfg))).named_parameters())
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref["losses"], rel=FP32["loss_rtol"]), f"rank {rank} losses"
        assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=FP32["norm_rtol"]), f"rank {rank} norms"
        _check_params(rank, res["params"], ref["params"], FP32, init)
    # A pipeline rank holds its stages' parameters only: together the ranks hold every one.
    assert set().union(*(res["params"] for res in results)) == ref["params"].keys(), "parameters missing"
    assert ref["losses"][-1] < ref["losses"][0]
    return ref
