"""Experiments on a warm pool leave nothing behind on the ranks: memory, threads and file
descriptors stay where the first run left them.

Two things used to pile up per run: DTensor's redistribution caches kept every run's meshes
and, through them, its destroyed gloo groups (their threads and sockets); and the run's model,
optimizer and DTensors waited in reference cycles for Python's rare full collection.
"""
from __future__ import annotations

import time

import psutil
import pytest

import lab
from tests.conftest import start_pool

RUNS = 50
RSS_GROWTH_BOUND = 5 * 2**20  # the bound the issue sets for 50 runs after the first (here: after both layouts' first)
# A gloo group's store connections close a moment after the run that dropped it, so a count
# taken at once may still hold them: a leak never settles, a closing socket does within this.
SETTLE_S = 10.0
TINY = lab.GPT(layers=2, d_model=16, heads=2, vocab=32, seq_len=8)
# DTensor layouts: tensor parallel and FSDP2 (ZeRO-3), alternated; each builds and drops its own mesh.
LAYOUTS = (lab.Parallel(tp=2), lab.Parallel(dp=2, zero=3))


def footprint(pool: lab.Cluster) -> dict[int, tuple[int, int, int]]:
    """Per rank: resident bytes (as the pool reports them), threads, open file descriptors."""
    out = {}
    for row in pool.status():
        proc = psutil.Process(row.pid)
        out[row.rank] = (row.rss_bytes, proc.num_threads(), proc.num_fds())
    return out


def settled_footprint(pool: lab.Cluster, first: dict[int, tuple[int, int, int]]) -> dict[int, tuple[int, int, int]]:
    """The footprint once no rank holds more threads or descriptors than at ``first``, or after ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = footprint(pool)
        settled = all(now[r][1:] <= first[r][1:] for r in now)
        if settled or time.monotonic() > deadline:
            return now
        time.sleep(0.5)


@pytest.fixture(scope="module")
def pair():
    with start_pool(2) as pool:  # stopped on leaving, failed tests too
        yield pool


@pytest.mark.slow  # 50 training runs
def test_fifty_experiments_on_a_warm_pool_grow_no_rank_by_5_mib_nor_leak_threads_or_sockets(pair):
    def run(i: int) -> None:
        lab.Experiment(pair, TINY, LAYOUTS[i % len(LAYOUTS)], global_batch=4, steps=1).run()

    for i in range(len(LAYOUTS)):  # each layout's one-off imports and caches
        run(i)
    first = footprint(pair)
    for i in range(len(LAYOUTS), RUNS):
        run(i)
    last = settled_footprint(pair, first)
    for rank, (rss, threads, fds) in last.items():
        rss0, threads0, fds0 = first[rank]
        assert rss - rss0 < RSS_GROWTH_BOUND, f"rank {rank} grew {(rss - rss0) / 2**20:.1f} MiB after the first run"
        assert threads <= threads0 and fds <= fds0, f"rank {rank}: threads {threads0} -> {threads}, fds {fds0} -> {fds}"
