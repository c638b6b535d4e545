"""TP inside a host against TP across hosts: the same DP×TP run in two rank orders, measured and planned.

``compare_tp_placement(cluster, cfg)`` trains ``cfg`` (a ``RunConfig``, or its options, with dp and tp)
twice on a pool of several hosts: with the default mesh order (pp, dp, tp), each tp group
on one host, and with ``mesh_order=("pp", "tp", "dp")``, each tp group across hosts.
For each it gives the median over steps (the first left out) of the slowest rank's step
time, and the planner's prediction: its wire bytes per rank and step (``lab.plan(...).comm``,
given the placement's ``mesh_order``), each axis on the link the planner puts it on, over
the all-reduce busbw measured on that link (``lab.bench_collectives``).
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from kernels.contract.run_config import RunConfig
from kernels.train.entry import train_rank
from lab.measure.bench import bench_collectives
from lab.planning.planner import plan

PLACEMENTS = {"TP inside hosts": ("pp", "dp", "tp"), "TP across hosts": ("pp", "tp", "dp")}
BUSBW_BYTES = 1 << 20  # the all-reduce size whose busbw stands for each link


def link_busbw(cluster: Any) -> dict[str, float]:
    """All-reduce busbw (bytes/s) inside a host ("intra") and across hosts ("inter") at BUSBW_BYTES."""
    records = bench_collectives(cluster, sizes=(BUSBW_BYTES,), ops=("all_reduce",), iters=5, by_link=True)
    return {r.link: r.busbw for r in records if r.link}


def step_time(cluster: Any, run: RunConfig) -> float:
    """Median over steps (the first left out) of the slowest rank's step time, seconds."""
    per_rank = [r["step_times"] for r in cluster.run(train_rank, run.to_dict())]
    return statistics.median(max(step) for step in list(zip(*per_rank))[1:])


def planned(run: RunConfig, hosts: list[str], bw: dict[str, float]) -> dict[str, Any]:
    """The planner's wire bytes per rank and step on each link for ``run``'s placement on ``hosts``, and their time."""
    s = run.strategy
    parallel = {"dp": s.dp, "tp": s.tp, "mesh_order": s.mesh_order}
    p = plan(run.model, gpus=len(hosts), gpus_per_node=len(hosts) // len(set(hosts)), parallel=parallel,
             global_batch=run.global_batch, dtype="fp32", optimizer="adam")
    wire = {"intra": 0.0, "inter": 0.0}
    for e in p.comm:
        wire[e.link] += e.wire_bytes
    return {"wire_bytes": wire, "seconds": sum(wire[link] / bw[link] for link in wire)}


def compare_tp_placement(cluster: Any, cfg: RunConfig | Mapping[str, Any]) -> dict[str, Any]:
    """Both placements of ``cfg`` (dp > 1, tp > 1, no pp): measured step time, planned comm, kernel byte count.

    Returns {"busbw": {link: bytes/s}, placement name: {"step_s", "planned", "kernel_inter_bytes"}, "ratio"
    (across / inside step time), "gap_s" (measured difference), "planned_gap_s" (the planner's)}.
    ``kernel_inter_bytes`` is what the simulated hosts' counters saw cross the link in the whole run
    (headers included; None on real hosts).
    """
    base = RunConfig.from_options(cfg)
    s = base.strategy
    if s.pp != 1 or s.dp < 2 or s.tp < 2:
        raise ValueError(f"compare_tp_placement needs dp >= 2, tp >= 2 and no pp, got dp={s.dp}, tp={s.tp}, pp={s.pp}")
    hosts = [r.host for r in cluster.rank_map.ranks]
    bw = link_busbw(cluster)
    out: dict[str, Any] = {"busbw": bw}
    counters = getattr(cluster.network, "inter_host_bytes", lambda: None)
    for name, order in PLACEMENTS.items():
        run = replace(base, strategy=replace(s, mesh_order=tuple(order)))
        before = counters()
        measured = step_time(cluster, run)
        after = counters()
        out[name] = {"step_s": measured, "planned": planned(run, hosts, bw),
                     "kernel_inter_bytes": sum(after) - sum(before) if before and after else None}
    inside, across = (out[n] for n in PLACEMENTS)
    out["ratio"] = across["step_s"] / inside["step_s"]
    out["gap_s"] = across["step_s"] - inside["step_s"]
    out["planned_gap_s"] = across["planned"]["seconds"] - inside["planned"]["seconds"]
    return out
