"""Collective bandwidth sweep on the pool: ``bench_collectives(cluster) -> [BenchRecord]``.

The ranks run ``kernels.comm_bench.bench_rank`` (nccl-tests' loop: warm-up, barrier,
timed calls, slowest rank's time); here each point becomes a record with
algbw = size / time and busbw = algbw × f, f the nccl-tests factor of docs/design.md#bus-bandwidth
(``plan_math.busbw_factor``): all_reduce 2(n-1)/n, all_gather and reduce_scatter
(n-1)/n, broadcast and send/recv 1. busbw is comparable across ops and world sizes:
it is the bandwidth each link would need in a ring.
"""
from __future__ import annotations

from typing import Any, Iterable

from kernels.comm_bench import bench_rank
from kernels.records import BenchRecord
from lab.plan_math import busbw_factor

DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def bench_record(row: dict[str, Any]) -> BenchRecord:
    """One rank row (op, size_bytes, world, iters, seconds) as a record with its bandwidths."""
    factor = busbw_factor(row["op"], row["world"])
    algbw = row["size_bytes"] / row["seconds"]
    return BenchRecord(op=row["op"], size_bytes=int(row["size_bytes"]), world=int(row["world"]),
                       iters=int(row["iters"]), seconds=float(row["seconds"]), algbw=algbw,
                       busbw=algbw * factor, factor=factor)


def bench_collectives(cluster: Any, sizes: Iterable[int] = DEFAULT_SIZES,
                      ops: Iterable[str] = DEFAULT_OPS, iters: int = 5) -> list[BenchRecord]:
    """Time each op at each payload size on every rank of ``cluster``; one record per (op, size).

    Sizes are bytes of fp32 payload, rounded down to a multiple of 4·world (all_gather
    and reduce_scatter split the payload evenly); the record carries the size used.
    """
    cfg = {"sizes": [int(s) for s in sizes], "ops": list(ops), "iters": int(iters)}
    if iters < 1 or not cfg["sizes"] or not cfg["ops"]:
        raise ValueError("bench_collectives needs iters >= 1 and at least one size and one op")
    rows = cluster.run(bench_rank, cfg)[0]  # every rank holds the same rows (slowest rank's times)
    return [bench_record(row) for row in rows]
