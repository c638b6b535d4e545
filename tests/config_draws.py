"""Hypothesis strategies for experiment configs, odd ones included, and the one way to build them.

A drawn config is three dicts: the ``lab.GPT`` fields, the ``lab.Parallel`` fields and the
``lab.Experiment`` keyword arguments. ``build`` makes them in that order, on any pool, so a
refusal at any step (the model, the layout, the experiment) is caught where a user would
meet it.
"""
from __future__ import annotations

import math
from typing import Any

from hypothesis import strategies as st

import lab
from kernels.contract.layout_rules import FSDP_STRATEGIES, SCHEDULES

# Values a user might pass by mistake: a float for an int, a string, None, a bool, out of range.
ODD_SIZES = [0, -1, 2.0, "2", None, True, 1.5]
ODD_FLAGS = [1, 0, "yes", None, "False"]
ODD_NUMBERS = [-1.0, 0.0, math.nan, math.inf, "a", None, True]
ODD_SEEDS = [1.5, -1, 2**64, "0", None, True]
WORLD = 4
FACTORS = [(4, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2), (1, 2, 2), (1, 1, 4)]  # dp, tp, pp with dp*tp*pp == 4

# (part, field) -> what may go there by mistake: odd types, and values that break a rule.
ODD = {
    **{("model", name): ODD_SIZES + extra for name, extra in (
        ("layers", [3]), ("d_model", [30, 8.0]), ("heads", [3, 5]), ("vocab", [2, 3, 66, 64.0]),
        ("seq_len", [15, 18, "16"]), ("d_ff", [30, 64.0]))},
    ("model", "bias"): ODD_FLAGS,
    ("model", "seed"): ODD_SEEDS + [1, 7],
    **{("parallel", name): ODD_SIZES + [3, 8] for name in ("dp", "tp", "pp")},
    **{("parallel", name): ODD_SIZES + [3, 16] for name in ("microbatches", "stages_per_rank", "dp_replicate")},
    ("parallel", "zero"): [2.0, True, "1", None, -1, 4],
    ("parallel", "fsdp_strategy"): [*FSDP_STRATEGIES, "ddp", 1, True],
    ("parallel", "schedule"): [*SCHEDULES, "zigzag", None, 1, ["1f1b"]],
    ("parallel", "mixed_precision"): ["bf16", "fp16", 1, True],
    ("parallel", "reshard_after_forward"): [False, {"root": False, "blocks": True}, {"head": True}, {"root": 0},
                                            "yes", 1],
    ("parallel", "mesh_order"): [("pp", "tp", "dp"), ["dp", "tp", "pp"], ("pp", "dp"), ("pp", "dp", "dp"),
                                 "pp,dp,tp", None],
    **{("parallel", name): ODD_FLAGS + [True] for name in ("sequence_parallel", "loss_parallel",
                                                          "activation_checkpointing", "cpu_offload")},
    ("experiment", "global_batch"): ODD_SIZES + ["8", 8.0, 6, 12],
    ("experiment", "steps"): ODD_SIZES,
    ("experiment", "lr"): ODD_NUMBERS,
    ("experiment", "seed"): ODD_SEEDS + [2**63],
    ("experiment", "optimizer"): ["lion", None, "AdamW", "sgd"],
    **{("experiment", name): ODD_FLAGS + [True] for name in ("trace", "measure")},
    ("experiment", "compile"): ODD_FLAGS,  # compile=True runs (slowly): it has its own tests
    ("experiment", "synthetic_forward_s"): [0, -1.0, math.nan, "1", 0.01],
    ("experiment", "hang_after"): [0, -1.0, math.nan, math.inf, True, "3", 30.0],
}


class RecordingPool:
    """A 4-rank pool that records every call it is asked to send to the ranks, and sends none."""

    world_size = WORLD

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(fn)
        raise AssertionError(f"{getattr(fn, '__name__', fn)} was sent to the ranks")


def sometimes_odd(valid: list, odd: list) -> st.SearchStrategy:
    """Mostly a valid value, now and then an odd one; shrinks towards the valid ones.

    Hypothesis draws integers' ends more often than their middle, so the odd branch is
    a middle value: rare in a draw, and away from 0, where a failing example shrinks to.
    """
    return st.integers(0, 20).flatmap(lambda k: st.sampled_from(odd if k == 10 else valid))


@st.composite
def runnable_config(draw: Any) -> tuple[dict, dict, dict]:
    """Configs on 4 ranks that mostly run: tiny models, 2 steps, every layout option (compile and probes off)."""
    dp, tp, pp = draw(st.sampled_from(FACTORS))
    schedule = draw(st.sampled_from(SCHEDULES)) if pp > 1 else "1f1b"
    stages = pp * (1 if schedule in ("gpipe", "1f1b") else 2)
    model = {"layers": stages * draw(st.sampled_from([1, 2])), "d_model": 32, "heads": draw(st.sampled_from([2, 4])),
             "vocab": draw(st.sampled_from([64, 96])), "seq_len": draw(st.sampled_from([8, 16])), "d_ff": 64}
    sharding = draw(st.sampled_from([{}, {"zero": 1}, {"zero": 2}, {"zero": 3}, {"fsdp_strategy": "hybrid"},
                                     {"zero": 3, "cpu_offload": True}, {"zero": 3, "mixed_precision": "bf16"}]))
    parallel = {"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, **sharding,
                "microbatches": draw(st.sampled_from([None, stages, 2 * stages])) if pp > 1
                else draw(st.sampled_from([None, 2])),
                "sequence_parallel": draw(st.booleans()) and tp > 1,
                "loss_parallel": draw(st.booleans()) and tp > 1 and pp == 1,
                "activation_checkpointing": draw(st.booleans())}
    experiment = {"global_batch": 8 if (parallel["microbatches"] or 1) * dp <= 8 else 16, "steps": 2,
                  "lr": draw(st.sampled_from([1e-2, 3e-3])), "seed": draw(st.sampled_from([0, 1]))}
    return model, parallel, experiment


@st.composite
def any_config(draw: Any) -> tuple[dict, dict, dict]:
    """A runnable config with up to four fields replaced by odd values (``ODD``): types, ranges and rules."""
    config = dict(zip(("model", "parallel", "experiment"), draw(runnable_config())))
    for part, name in draw(st.lists(st.sampled_from(sorted(ODD, key=str)), max_size=4, unique=True)):
        config[part][name] = draw(st.sampled_from(ODD[part, name]))
    return config["model"], config["parallel"], config["experiment"]


def build(model: dict, parallel: dict, experiment: dict, pool: Any) -> lab.Experiment:
    """lab.GPT, then lab.Parallel, then lab.Experiment on ``pool``: each may refuse."""
    return lab.Experiment(pool, lab.GPT(**model), lab.Parallel(**parallel), **experiment)
