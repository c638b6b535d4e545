"""TP inside a host against TP across hosts: the same DP×TP run in two rank orders, measured and planned.

``compare_tp_placement(cluster, cfg)`` trains ``cfg`` (a ``RunConfig``, or its options, with dp and tp)
twice on a pool of several hosts: with the default mesh order (pp, dp, tp), each tp group
on one host, and with ``mesh_order=("pp", "tp", "dp")``, each tp group across hosts.
For each it gives the median over steps (the first left out) of the slowest rank's step
time, and the planner's prediction: its wire bytes per rank and step (``lab.plan(...).comm``,
given the placement's ``mesh_order``), each axis on the link the planner puts it on, and their
time on each link by the α–β model (docs/design.md#collective-latency) whose α and busbw are fitted
to an all-reduce size sweep on that link (``lab.bench_collectives``, ``planner_links``).
"""
from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

from kernels.contract.measure_records import BenchRecord
from kernels.contract.run_config import RunConfig
from kernels.train.entry import train_rank
from lab.measure.bench import bench_collectives, fit_records, planner_links
from lab.planning.planner import plan

PLACEMENTS = {"TP inside hosts": ("pp", "dp", "tp"), "TP across hosts": ("pp", "tp", "dp")}
# The all-reduce sizes the α–β fit of each link sees: 4 KiB, where latency is all, up to 4 MiB, where
# bandwidth is; the TP all-reduces of benchmarks/hosts.py carry 256 KiB.
SWEEP_BYTES = tuple(1 << k for k in range(12, 23, 2))


def link_costs(cluster: Any, repeats: int = 3) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """``lab.plan``'s link keywords fitted on ``cluster`` (``planner_links``), and each link's all-reduce fit.

    The sweep runs ``repeats`` times and each size keeps its median time: on a shared machine
    one sweep's small sizes can land on another process's time slice, and one such point bends the fit.
    """
    sweeps = [bench_collectives(cluster, sizes=SWEEP_BYTES, ops=("all_reduce",), iters=5, by_link=True)
              for _ in range(repeats)]
    points: dict[tuple[str, str, int, int], list[BenchRecord]] = {}
    for record in (r for sweep in sweeps for r in sweep):
        points.setdefault((record.op, record.link, record.world, record.size_bytes), []).append(record)
    records = [sorted(same, key=lambda r: r.seconds)[len(same) // 2] for same in points.values()]
    fits = {link: asdict(fit) for (_, link, _), fit in fit_records(records).items() if link}
    return planner_links(records), fits


def step_time(cluster: Any, run: RunConfig) -> float:
    """Median over steps (the first left out) of the slowest rank's step time, seconds."""
    per_rank = [r["step_times"] for r in cluster.run(train_rank, run.to_dict())]
    return statistics.median(max(step) for step in list(zip(*per_rank))[1:])


def planned(run: RunConfig, hosts: list[str], links: dict[str, float]) -> dict[str, Any]:
    """The planner's wire bytes per rank and step on each link for ``run``'s placement on ``hosts``, and their
    time (``links``: ``lab.plan``'s bandwidth and latency keywords), of which the latency term."""
    s = run.strategy
    parallel = {"dp": s.dp, "tp": s.tp, "mesh_order": s.mesh_order}
    p = plan(run.model, gpus=len(hosts), gpus_per_node=len(hosts) // len(set(hosts)), parallel=parallel,
             global_batch=run.global_batch, dtype="fp32", optimizer="adam", **links)
    return {"wire_bytes": {load.link: load.wire_bytes for load in p.links},
            "seconds": sum(load.time_s for load in p.links), "latency_s": sum(load.latency_s for load in p.links)}


def compare_tp_placement(cluster: Any, cfg: RunConfig | Mapping[str, Any], rounds: int = 1) -> dict[str, Any]:
    """Both placements of ``cfg`` (dp > 1, tp > 1, no pp): measured step time, planned comm, kernel byte count.

    Returns {"links": {link: its all-reduce α–β fit}, "plan_links": the planner's link keywords,
    placement name: {"step_s", "planned", "kernel_inter_bytes"}, "ratio"
    (across / inside step time), "gap_s" (measured difference), "planned_gap_s" (the planner's)}.
    ``rounds`` runs the two placements in turn that many times and keeps each one's median step
    time, so a burst of load from outside falls on both alike. ``kernel_inter_bytes`` is what the
    simulated hosts' counters saw cross the link in one run (headers included; None on real hosts).
    """
    base = RunConfig.from_options(cfg)
    s = base.strategy
    if s.pp != 1 or s.dp < 2 or s.tp < 2:
        raise ValueError(f"compare_tp_placement needs dp >= 2, tp >= 2 and no pp, got dp={s.dp}, tp={s.tp}, pp={s.pp}")
    hosts = [r.host for r in cluster.rank_map.ranks]
    links, fits = link_costs(cluster)
    out: dict[str, Any] = {"links": fits, "plan_links": links}
    counters = getattr(cluster.network, "inter_host_bytes", lambda: None)
    runs = {name: replace(base, strategy=replace(s, mesh_order=tuple(order))) for name, order in PLACEMENTS.items()}
    steps: dict[str, list[float]] = {name: [] for name in runs}
    counted: dict[str, int | None] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            before = counters()
            steps[name].append(step_time(cluster, run))
            after = counters()
            counted[name] = sum(after) - sum(before) if before and after else None
    for name, run in runs.items():
        out[name] = {"step_s": statistics.median(steps[name]), "planned": planned(run, hosts, links),
                     "kernel_inter_bytes": counted[name], "step_s_rounds": steps[name]}
    inside, across = (out[n] for n in PLACEMENTS)
    out["ratio"] = across["step_s"] / inside["step_s"]
    out["gap_s"] = across["step_s"] - inside["step_s"]
    out["planned_gap_s"] = across["planned"]["seconds"] - inside["planned"]["seconds"]
    return out
