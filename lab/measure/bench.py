"""Collective bandwidth sweep on the pool: ``bench_collectives(cluster) -> [BenchRecord]``.

The ranks run ``kernels.measure.comm_bench.bench_rank`` (nccl-tests' loop: warm-up, barrier,
timed calls, slowest rank's time); here each point becomes a record with
algbw = size / time and busbw = algbw × f, f the nccl-tests factor of docs/design.md#bus-bandwidth
(``plan_math.busbw_factor``): all_reduce 2(n-1)/n, all_gather, reduce_scatter and all_to_all
(n-1)/n, broadcast and send/recv 1. busbw is comparable across ops and world sizes:
it is the bandwidth each link would need in a ring. all_to_all is swept when ``ops`` names it
(``DEFAULT_OPS`` are the five ring collectives).

Each (op, link) series of two or more sizes is also fitted to the α–β model
(``lab.planning.plan_latency.fit_alpha_beta``: seconds = ring steps · α + wire bytes / busbw), and
its records carry the fit (``alpha_s``, ``fit_busbw``); ``planner_links`` turns the all-reduce fits
into ``lab.plan``'s link options.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable

from kernels.measure.comm_bench import bench_rank
from kernels.contract.measure_records import BenchRecord
from lab.planning.plan_latency import AlphaBeta, fit_alpha_beta
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
    return with_fits(out)


def fit_records(records: Iterable[BenchRecord]) -> dict[tuple[str, str, int], AlphaBeta]:
    """The α–β fit of every (op, link, world) series with at least two sizes, by that key.

    A series whose time does not grow with its size (noise on a busy machine can do that to a
    sweep of few small sizes) has no bandwidth to fit and is left out.
    """
    series: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    for r in records:
        series.setdefault((r.op, r.link, r.world), []).append((r.size_bytes, r.seconds))
    out = {}
    for key, points in series.items():
        try:
            out[key] = fit_alpha_beta(points, key[0], key[2], key[1])
        except ValueError:
            continue  # one size, or no growth with size: no fit, the records keep alpha_s None
    return out


def with_fits(records: list[BenchRecord]) -> list[BenchRecord]:
    """``records`` with each one's series fit filled in (``alpha_s``, ``fit_busbw``; None for a single size)."""
    fits = fit_records(records)
    out = []
    for r in records:
        fit = fits.get((r.op, r.link, r.world))
        out.append(dataclasses.replace(r, alpha_s=fit.alpha_s, fit_busbw=fit.busbw) if fit else r)
    return out


def planner_links(records: Iterable[BenchRecord]) -> dict[str, float]:
    """``lab.plan`` keywords from the all-reduce fits: {"intra_bw", "intra_alpha_us", "inter_bw", "inter_alpha_us"}.

    GB/s and µs per ring step. The whole world's series stands for "intra" when the sweep has no
    per-link series (one host). A link with no all-reduce series of two sizes is left out (the plan
    keeps its default).
    """
    fits = {link: fit for (op, link, _), fit in fit_records(records).items() if op == "all_reduce"}
    if "intra" not in fits and "inter" not in fits:
        fits["intra"] = fits.get("")
    out: dict[str, float] = {}
    for link in ("intra", "inter"):
        if fits.get(link) is not None:
            out[f"{link}_bw"] = fits[link].busbw / 1e9
            out[f"{link}_alpha_us"] = fits[link].alpha_s * 1e6
    return out
