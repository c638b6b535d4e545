"""Spawned gloo ranks (no ipyparallel), reused across test cases, for testing rank-side code alone.

Importing torch costs seconds of CPU per process, far more than a case's work, so a
pool's ranks stay up between cases and join a fresh world for each. Any failure kills
the pool (its ranks may be hung or out of step); the next case spawns a fresh one.
"""
from __future__ import annotations

import queue as queue_mod
import traceback
from datetime import timedelta
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULT_TIMEOUT_S = 120  # per case: a hung schedule fails the test instead of pytest's 300 s

Work = Callable[[dict], Any]  # runs on every rank inside the case's world; a module-level function


def _rank_loop(rank: int, world: int, work: Work, tasks, results) -> None:
    """A pool worker: for each (port, payload), join a fresh gloo world, run ``work``, report."""
    torch.set_num_threads(1)  # ranks share two cores with each other and other jobs
    while (task := tasks.get()) is not None:
        port, payload = task
        try:
            store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
            results.put((rank, "ok", work(payload)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            if dist.is_initialized():  # closing our connections makes blocked peers fail at once
                dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks that run ``work`` on each payload."""

    def __init__(self, world: int, work: Work) -> None:
        ctx = mp.get_context("spawn")
        self.world, self.results = world, ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.procs = [ctx.Process(target=_rank_loop, args=(r, world, work, self.tasks[r], self.results),
                                  daemon=True) for r in range(world)]
        for proc in self.procs:
            proc.start()

    def run(self, payload: dict) -> tuple[dict[int, Any], list[str]]:
        """Results by rank, and the first failure's remote traceback (or a timeout) if any."""
        # A fresh store per case, on a port the OS picks, so parallel runs never collide.
        store = dist.TCPStore("127.0.0.1", 0, self.world + 1, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=60))
        for q in self.tasks:
            q.put((store.port, payload))
        out, errors = {}, []
        try:
            for _ in range(self.world):
                rank, status, result = self.results.get(timeout=RESULT_TIMEOUT_S)
                if status != "ok":
                    errors.append(f"rank {rank}:\n{result}")
                    break
                out[rank] = result
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


def pooled_runner(work: Work, world_of: Callable[[dict], int]) -> Iterator[Callable[[dict], dict[int, Any]]]:
    """Body of a module-scoped fixture: yields ``run(payload) -> results by rank``, failing the test on
    any rank's error; one pool per world size (``world_of(payload)``), all stopped at the end."""
    pools: dict[int, RankPool] = {}

    def run(payload: dict) -> dict[int, Any]:
        world = world_of(payload)
        pool = pools.get(world) or pools.setdefault(world, RankPool(world, work))
        out, errors = pool.run(payload)
        if errors:
            pools.pop(world).close(kill=True)
        assert not errors, "\n".join(errors)
        return out

    try:
        yield run
    finally:
        for pool in pools.values():
            pool.close()


TRACE_MODEL = {"d_model": 16, "heads": 2, "vocab": 32, "seq_len": 8}  # tiny: the schedule's order, not compute


def traced_pipeline_rank(case: dict) -> dict:
    """One rank's trace record of a pipeline step run by the real loop (``kernels.train.entry.train_rank``).

    ``case``: schedule, pp, dp (default world // pp), microbatches, optional stages_per_rank and
    synthetic_forward_s. One untraced step (it also pays first calls), then the traced one.
    """
    from kernels.contract.layout_rules import default_stages_per_rank
    from kernels.train.entry import train_rank

    pp, schedule = case["pp"], case["schedule"]
    dp = case.get("dp", dist.get_world_size() // pp)
    spr = case.get("stages_per_rank") or default_stages_per_rank(schedule)
    m = case["microbatches"]
    run = {"model": {**TRACE_MODEL, "layers": max(4, pp * spr)}, "pp": pp, "dp": dp, "schedule": schedule,
           "stages_per_rank": spr, "microbatches": m, "global_batch": m * dp, "steps": 2, "lr": 1e-3,
           "trace": True, "synthetic_forward_s": case.get("synthetic_forward_s"),
           "return_params": False, "record_grad_norm": False}
    return train_rank(run)["trace"]
