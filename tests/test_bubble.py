"""Measured pipeline bubbles match theory in synthetic-cost mode (DESIGN §3, issue "Measured, not drawn").

Four spawned gloo ranks (no ipyparallel) run ``kernels.pipeline_trace.trace_pipeline_step``
with every action padded to a fixed cost: F = t, B = 2t (I = W = t when split), t per
rank-share of the model. p=4 is one pipeline over the 4 ranks; p=2 is PP2 x DP2 (two
pipelines side by side, makespan over all 4 ranks). What the measurement adds beyond
theory is the per-action overhead on the critical path (gloo p2p, Python, sleep wake-up:
about 1-3 ms per hop on this shared 2-core machine, two hops per 3t slot). Measured at
t = 40 ms that added +1.2 to +5.2 percentage points, too close to the ±3 pp bound;
t = 80 ms measured +0.4 to +1.5 pp, and the module runs in about 80 s.
"""
from __future__ import annotations

import queue as queue_mod
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kernels.pipeline_trace import trace_pipeline_step
from lab.timeline import bubble_from_records

WORLD = 4
T_FORWARD = 0.08  # seconds; see the module docstring
T_ZERO_BUBBLE = 0.04  # zero bubble vs 1F1B differ by ~20 pp; a shorter t keeps those runs quick
# Interleaved: v=2 stages per rank, each action lasts t/v. Doubling t keeps each action at
# 40 ms, so the per-hop overhead (twice as many hops) weighs the same as in 1F1B.
T_INTERLEAVED = 2 * T_FORWARD
TOLERANCE = 0.03  # ±3 percentage points, the acceptance bound
RESULT_TIMEOUT_S = 120


def _rank_loop(rank: int, world: int, tasks, results) -> None:
    """A pool worker: for each (port, cfg), join a fresh gloo world, trace, report."""
    torch.set_num_threads(1)  # ranks share two cores with each other and other jobs
    while (task := tasks.get()) is not None:
        port, cfg = task
        try:
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
            results.put((rank, "ok", trace_pipeline_step(cfg)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            if dist.is_initialized():  # closing our connections makes blocked peers fail at once
                dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks reused across cases, as tests/test_pipeline_kernel.py does:
    importing torch costs seconds of CPU per process. A failure kills the pool."""

    def __init__(self, world: int = WORLD) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.results = world, ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_rank_loop, args=(r, world, self.tasks[r], self.results), daemon=True)
                      for r in range(world)]
        for proc in self.procs:
            proc.start()

    def run(self, cfg: dict) -> tuple[dict[int, dict], list[str]]:
        store = dist.TCPStore("127.0.0.1", 0, self.world + 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60))
        for q in self.tasks:
            q.put((store.port, cfg))
        out, errors = {}, []
        try:
            for _ in range(self.world):
                rank, status, payload = self.results.get(timeout=RESULT_TIMEOUT_S)
                if status != "ok":
                    errors.append(f"rank {rank}:\n{payload}")
                    break
                out[rank] = payload
        except queue_mod.Empty:
            errors.append(f"no result within {RESULT_TIMEOUT_S} s (hung schedule?)")
        return out, errors

    def close(self, kill: bool = False) -> None:
        for q in self.tasks:
            q.put(None)
        for proc in self.procs:
            proc.join(timeout=0 if kill else 2)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


def rank_runner():
    """Generator behind the ``trace_ranks`` fixtures: ``run(cfg) -> records by rank``."""
    pools: list[RankPool] = []

    def run(cfg: dict) -> dict[int, dict]:
        if not pools:
            pools.append(RankPool(WORLD))
        out, errors = pools[0].run(cfg)
        if errors:
            pools.pop().close(kill=True)  # its ranks may be hung or out of step
        assert not errors, "\n".join(errors)
        return out

    try:
        yield run
    finally:
        for pool in pools:
            pool.close()


trace_ranks = pytest.fixture(scope="module", name="trace_ranks")(rank_runner)

_cache: dict[tuple, dict] = {}


def synthetic_bubble(trace_ranks, schedule: str, pp: int, m: int, **extra):
    """Measured BubbleReport of one synthetic-cost step (cached: several tests share runs)."""
    key = (schedule, pp, m, tuple(sorted(extra.items())))
    if key not in _cache:
        cfg = {"schedule": schedule, "pp": pp, "dp": WORLD // pp, "microbatches": m,
               "synthetic_forward_s": T_FORWARD}
        cfg.update(extra)
        _cache[key] = trace_ranks(cfg)
    return bubble_from_records(_cache[key])


def _assert_near_theory(report) -> None:
    assert report.synthetic
    detail = (f"{report.schedule} p={report.pp} m={report.microbatches}: measured {report.mean:.3f} "
              f"(per rank {[round(i, 3) for i in report.idle]}) vs theory {report.theory:.3f}")
    assert abs(report.mean - report.theory) <= TOLERANCE, detail


@pytest.mark.parametrize("m", [4, 8, 16])
@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_matches_theory_in_synthetic_mode(trace_ranks, schedule, pp, m):
    _assert_near_theory(synthetic_bubble(trace_ranks, schedule, pp, m))


@pytest.mark.parametrize("pp, m", [(4, 8), (2, 8)])
def test_interleaved_1f1b_bubble_matches_theory_in_synthetic_mode(trace_ranks, pp, m):
    report = synthetic_bubble(trace_ranks, "interleaved_1f1b", pp, m, synthetic_forward_s=T_INTERLEAVED)
    assert report.stages_per_rank == 2 and report.theory == pytest.approx((pp - 1) / (2 * m + pp - 1))
    _assert_near_theory(report)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv"])
def test_zero_bubble_schedules_idle_less_than_1f1b(trace_ranks, schedule):
    zero = synthetic_bubble(trace_ranks, schedule, 4, 8, synthetic_forward_s=T_ZERO_BUBBLE)
    one_f_one_b = synthetic_bubble(trace_ranks, "1f1b", 4, 8, synthetic_forward_s=T_ZERO_BUBBLE)
    assert zero.mean < one_f_one_b.mean, (f"{schedule}: {zero.mean:.3f} (per rank {zero.idle}) "
                                          f"not below 1f1b's {one_f_one_b.mean:.3f}")


def test_synthetic_records_say_synthetic_and_give_the_targets(trace_ranks):
    synthetic_bubble(trace_ranks, "1f1b", 4, 8)
    records = _cache[("1f1b", 4, 8, ())]
    for rec in records.values():
        assert rec["synthetic"] and rec["warnings"] == []  # sleeping ranks do not compete for cores
        assert rec["synthetic_cost"]["targets_s"] == {"F": T_FORWARD, "B": 2 * T_FORWARD,
                                                      "I": T_FORWARD, "W": T_FORWARD}
        durations = [e["end"] - e["start"] for e in rec["events"] if e["kind"] == "forward"]
        assert min(durations) >= T_FORWARD and max(durations) < T_FORWARD + 0.02
