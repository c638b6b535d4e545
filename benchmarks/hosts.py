"""TP inside a host against TP across hosts, over a capped link, beside the planner's prediction.

On 2 simulated hosts × 2 ranks (``lab.testing.hosts``, needs root) with the link between
hosts capped by ``tc`` (default 0.2 Gbit/s), the same model trains as DP2×TP2 twice
(``lab.measure.placement.compare_tp_placement``):

- "TP inside hosts": the default mesh order (pp, dp, tp): each tp pair on one host, the
  dp all-reduce crosses the link;
- "TP across hosts": ``mesh_order=("pp", "tp", "dp")``: each tp pair spans both hosts,
  so every block's all-reduces cross the link, and dp stays inside a host.

Printed: each placement's step time (median over steps after the first, slowest rank; the
median over ``--rounds`` runs of the two placements in turn),
their ratio and difference, the planner's communication time for each by the α–β model fitted
to an all-reduce size sweep on each link (latency per ring step α and busbw; the latency term
shown apart), and the bytes the kernel counted between hosts per step.

Run (as root): ``PYTHONPATH=. python benchmarks/hosts.py [--link-gbit 0.2] [--steps 8] [--rounds 3]``
"""
from __future__ import annotations

import argparse
import json
import time

from lab.measure.placement import PLACEMENTS, compare_tp_placement
from lab.testing import hosts

MODEL = {"layers": 2, "d_model": 64, "heads": 4, "d_ff": 128, "vocab": 64, "seq_len": 128}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-gbit", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="runs of the two placements in turn; each keeps its median")
    a = ap.parse_args()
    cfg = {"model": MODEL, "dp": 2, "tp": 2, "global_batch": a.global_batch, "steps": a.steps, "lr": 1e-2,
           "seed": 0, "return_params": False, "record_grad_norm": False}
    t0 = time.perf_counter()
    with hosts(2, 2, link_gbit=a.link_gbit) as cluster:
        net = cluster.network
        print(f"hosts up in {time.perf_counter() - t0:.1f} s: {net.hostnames} at {net.addresses}; link "
              f"{a.link_gbit} Gbit/s by {net.shaping or 'nothing (' + net.shaping_problem + ')'}, "
              f"measured {net.measured_gbit:.3f} Gbit/s")
        out = compare_tp_placement(cluster, cfg, rounds=a.rounds)
        print("all_reduce α–β fit: " + ", ".join(
            f"{k} α {f['alpha_s'] * 1e6:.0f} us/step, busbw {f['busbw'] / 1e6:.1f} MB/s (rms {f['rel_rms']:.0%})"
            for k, f in out["links"].items()))
        for name in PLACEMENTS:
            r, pl = out[name], out[name]["planned"]
            rounds = "/".join(f"{t * 1e3:.0f}" for t in r["step_s_rounds"])
            print(f"{name:>16}: step {r['step_s'] * 1e3:7.1f} ms measured ({rounds}); planner: "
                  f"{pl['wire_bytes']['inter'] / 1e6:.2f} MB/rank inter, {pl['wire_bytes']['intra'] / 1e6:.2f} MB/rank "
                  f"intra, comm {pl['seconds'] * 1e3:.1f} ms ({pl['latency_s'] * 1e3:.1f} ms latency); kernel counted "
                  f"{r['kernel_inter_bytes'] / a.steps / 1e6:.2f} MB between hosts per step")
        print(f"TP across / TP inside hosts: {out['ratio']:.2f}x step time; difference {out['gap_s'] * 1e3:.1f} ms "
              f"measured, {out['planned_gap_s'] * 1e3:.1f} ms predicted by the planner "
              f"({out['planned_gap_s'] / out['gap_s'] - 1:+.0%})")
        print(json.dumps({"link_gbit": a.link_gbit, "measured_gbit": net.measured_gbit, **out}))


if __name__ == "__main__":
    main()
