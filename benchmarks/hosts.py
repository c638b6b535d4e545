"""TP inside a host against TP across hosts, over a capped link, beside the planner's prediction.

On 2 simulated hosts × 2 ranks (``lab.testing.hosts``, needs root) with the link between
hosts capped by ``tc`` (default 0.2 Gbit/s), the same model trains as DP2×TP2 twice:

- "TP inside hosts": the default mesh order (pp, dp, tp): each tp pair on one host, the
  dp all-reduce crosses the link;
- "TP across hosts": ``mesh_order=("pp", "tp", "dp")``: each tp pair spans both hosts,
  so every block's all-reduces cross the link, and dp stays inside a host.

Measured: the median over steps (after the first) of the slowest rank's step time, for
each, and their ratio; busbw inside a host and across hosts (``lab.bench_collectives``).
Predicted: the planner's wire bytes per rank and step (``lab.plan(...).comm``), each axis
on the link it uses in that placement (``lab.host_traffic.crosses_hosts``), over the
measured all-reduce busbw of that link: the communication time of each placement and
their difference. Also printed: the kernel's count of bytes between hosts for each run.

Run (as root): ``python benchmarks/hosts.py [--link-gbit 0.2] [--steps 8]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from kernels.train import train_rank
from lab.bench import bench_collectives
from lab.host_traffic import crosses_hosts
from lab.planner import plan
from lab.testing import hosts

MODEL = {"layers": 2, "d_model": 64, "heads": 4, "d_ff": 128, "vocab": 64, "seq_len": 128}
PLACEMENTS = {"TP inside hosts": ("pp", "dp", "tp"), "TP across hosts": ("pp", "tp", "dp")}
BUSBW_BYTES = 1 << 20  # the all-reduce size whose busbw stands for each link


def step_time(cluster, cfg: dict) -> float:
    """Median over steps (the first left out) of the slowest rank's step time, seconds."""
    per_rank = [r["step_times"] for r in cluster.run(train_rank, cfg)]
    return statistics.median(max(step) for step in list(zip(*per_rank))[1:])


def busbw(cluster) -> dict[str, float]:
    """All-reduce busbw (bytes/s) of each link at BUSBW_BYTES."""
    records = bench_collectives(cluster, sizes=(BUSBW_BYTES,), ops=("all_reduce",), iters=5, by_link=True)
    return {r.link: r.busbw for r in records if r.link}


def planned_seconds(cfg: dict, order: tuple[str, ...], hostnames: list[str], bw: dict[str, float]) -> dict:
    """The planner's wire bytes per rank and step on each link in this placement, and their time at ``bw``."""
    p = plan(cfg["model"], gpus=4, gpus_per_node=2, parallel={"dp": 2, "tp": 2}, global_batch=cfg["global_batch"],
             dtype="fp32", optimizer="adam")
    dims = {"dp": 2, "tp": 2, "pp": 1}
    wire = {"intra": 0.0, "inter": 0.0}
    for e in p.comm:
        wire["inter" if crosses_hosts(dims, e.axis, hostnames, order) else "intra"] += e.wire_bytes
    return {"wire_bytes": wire, "seconds": sum(wire[link] / bw[link] for link in wire)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-gbit", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    a = ap.parse_args()
    base = {"model": MODEL, "dp": 2, "tp": 2, "global_batch": a.global_batch, "steps": a.steps, "lr": 1e-2,
            "seed": 0, "return_params": False, "record_grad_norm": False}
    t0 = time.perf_counter()
    with hosts(2, 2, link_gbit=a.link_gbit) as cluster:
        net = cluster.network
        print(f"hosts up in {time.perf_counter() - t0:.1f} s: {net.hostnames} at {net.addresses}; link "
              f"{a.link_gbit} Gbit/s by {net.shaping or 'nothing (' + net.shaping_problem + ')'}, "
              f"measured {net.measured_gbit:.3f} Gbit/s")
        bw = busbw(cluster)
        print("all_reduce busbw at 1 MiB: " + ", ".join(f"{k} {v / 1e6:.1f} MB/s" for k, v in bw.items()))
        hostnames = [r.host for r in cluster.rank_map.ranks]
        out = {}
        for name, order in PLACEMENTS.items():
            cfg = {**base, "mesh_order": list(order)}
            before = net.inter_host_bytes() or [0]
            measured = step_time(cluster, cfg)
            sent = sum(net.inter_host_bytes() or [0]) - sum(before)
            out[name] = {"step_s": measured, "planned": planned_seconds(cfg, order, hostnames, bw),
                         "kernel_inter_bytes_per_step": sent / a.steps}
            pl = out[name]["planned"]
            print(f"{name:>16}: step {measured * 1e3:7.1f} ms measured; planner: "
                  f"{pl['wire_bytes']['inter'] / 1e6:.2f} MB/rank inter, {pl['wire_bytes']['intra'] / 1e6:.2f} MB/rank "
                  f"intra, comm {pl['seconds'] * 1e3:.1f} ms; kernel counted {sent / a.steps / 1e6:.2f} MB between "
                  "hosts per step")
        inside, across = (out[n] for n in PLACEMENTS)
        ratio = across["step_s"] / inside["step_s"]
        gap = across["step_s"] - inside["step_s"]
        planned_gap = across["planned"]["seconds"] - inside["planned"]["seconds"]
        print(f"TP across / TP inside hosts: {ratio:.2f}x step time; difference {gap * 1e3:.1f} ms measured, "
              f"{planned_gap * 1e3:.1f} ms predicted by the planner")
        print(json.dumps({"link_gbit": a.link_gbit, "measured_gbit": net.measured_gbit, "busbw": bw,
                          "ratio": ratio, "gap_s": gap, "planned_gap_s": planned_gap, **out}))


if __name__ == "__main__":
    main()
