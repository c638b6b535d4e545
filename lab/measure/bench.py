"""Collective bandwidth sweep on the pool: ``bench_collectives(cluster) -> [BenchRecord]``.

The ranks run ``kernels.measure.comm_bench.bench_rank`` (nccl-tests' loop: warm-up, barrier,
timed calls, slowest rank's time); here each point becomes a record with
algbw = size / time and busbw = algbw × f, f the nccl-tests factor of docs/design.md#bus-bandwidth
(``plan_math.busbw_factor``): all_reduce 2(n-1)/n, all_gather and reduce_scatter
(n-1)/n, broadcast and send/recv 1. busbw is comparable across ops and world sizes:
it is the bandwidth each link would need in a ring.
"""
from __future__ import annotations

from typing import Any, Iterable

from kernels.measure.comm_bench import bench_rank
from kernels.contract.measure_records import BenchRecord
from lab.planning.plan_math import busbw_factor

DEFAULT_SIZES = (1 << 12, 1 << 16, 1 << 20, 1 << 22)
DEFAULT_OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")


def bench_record(row: dict[str, Any], link: str = "") -> BenchRecord:
    """One rank row (op, size_bytes, world, iters, seconds) as a record with its bandwidths."""
    factor = busbw_factor(row["op"], row["world"])
    algbw = row["size_bytes"] / row["seconds"]
    return BenchRecord(op=row["op"], size_bytes=int(row["size_bytes"]), world=int(row["world"]),
                       iters=int(row["iters"]), seconds=float(row["seconds"]), algbw=algbw,
                       busbw=algbw * factor, factor=factor, link=link)


def link_groups(hosts: list[str]) -> dict[str, list[list[int]]]:
    """Groups of ranks (by rank, ``hosts[rank]`` its host) for each link: "intra", each host's ranks;
    "inter", the i-th rank of every host. Only links with groups of at least 2 ranks are given."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    per_host = list(by_host.values())
    out = {"intra": per_host, "inter": [[h[i] for h in per_host] for i in range(min(map(len, per_host)))]}
    return {link: groups for link, groups in out.items()
            if groups and min(map(len, groups)) >= 2 and sum(map(len, groups)) == len(hosts)}


def bench_collectives(cluster: Any, sizes: Iterable[int] = DEFAULT_SIZES,
                      ops: Iterable[str] = DEFAULT_OPS, iters: int = 5,
                      by_link: bool | None = None) -> list[BenchRecord]:
    """Time each op at each payload size on every rank of ``cluster``; one record per (op, size).

    Sizes are bytes of fp32 payload, rounded down to a multiple of 4·world (all_gather
    and reduce_scatter split the payload evenly); the record carries the size used.
    ``by_link`` (default: when the ranks are on more than one host) adds the sweep inside
    each host (records with link "intra") and across hosts, one rank of each host per
    group (link "inter"); the groups of one link run at once, as a layout's groups do.
    """
    cfg = {"sizes": [int(s) for s in sizes], "ops": list(ops), "iters": int(iters)}
    if iters < 1 or not cfg["sizes"] or not cfg["ops"]:
        raise ValueError("bench_collectives needs iters >= 1 and at least one size and one op")
    rows = cluster.run(bench_rank, cfg)[0]  # every rank holds the same rows (slowest rank's times)
    out = [bench_record(row) for row in rows]
    hosts = [r.host for r in cluster.rank_map.ranks]
    if by_link or (by_link is None and len(set(hosts)) > 1):
        for link, groups in link_groups(hosts).items():
            out += [bench_record(row, link) for row in cluster.run(bench_rank, {**cfg, "groups": groups})[0]]
    return out
