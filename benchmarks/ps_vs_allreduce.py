"""Synchronous parameter server (1 and 2 servers) against DDP's all-reduce, same model, in one run.

On a 4-rank CPU pool (gloo; RPC over TensorPipe for the parameter server):

- DDP over all 4 ranks (``lab.Experiment(..., lab.Parallel(dp=4), measure=True)``): step time
  (median over steady steps of the slowest rank) and the wire bytes one rank's gradient
  all-reduce sends per step, as measured (``RunResult.comm_records``), beside 2(n-1)/n * size;
- ``lab.ParameterServer(servers=1)`` (3 workers) and ``servers=2`` (2 workers), sync: step time
  (median over steady steps of the slowest worker's pull + compute + push) and the payload bytes
  through the busiest server per step, measured (every push in and pull out), beside 2 * W * shard.

The losses of all three runs are printed too: sync PS equals DDP, so only the cost differs.

Run: ``python benchmarks/ps_vs_allreduce.py [--steps 12]``
"""
from __future__ import annotations

import argparse
import statistics
import warnings

import lab
from lab.ps.ps_result import allreduce_bytes_per_rank

MODEL = lab.GPT(layers=2, d_model=128, heads=4, vocab=256, seq_len=32)
GLOBAL_BATCH, WARMUP = 12, 2


def steady(step_times: list[list[float]]) -> float:
    """Median over the steps after warm-up of the slowest rank's step time (ranks without steps ignored)."""
    ranks = [r for r in step_times if r]
    return statistics.median(max(r[s] for r in ranks) for s in range(WARMUP, len(ranks[0])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.OversubscribedWarning)
        pool = lab.start(n=4, backend="gloo", activate=False)
    try:
        run = dict(global_batch=GLOBAL_BATCH, steps=args.steps)
        ddp = lab.Experiment(pool, MODEL, lab.Parallel(dp=4), measure=True, **run).run(progress=False)
        ring = sum(c["wire_bytes"] for c in ddp.comm_records if c["rank"] == 0 and c["op"] == "all_reduce")
        rows = [("DDP dp=4", steady(ddp.step_times), ring, ddp.losses[-1])]
        size = None
        for servers in (1, 2):
            ps = lab.ParameterServer(pool, MODEL, servers=servers, mode="sync", **run).run()
            size = ps.model_bytes
            rows.append((f"PS {servers} server(s), {4 - servers} workers", steady(ps.step_times),
                         ps.busiest_server_bytes(), ps.losses[-1]))
    finally:
        pool.stop()
    print(f"model: {size:,} parameter bytes; {args.steps} steps, global batch {GLOBAL_BATCH}, 4 CPU ranks")
    print(f"all-reduce formula 2(n-1)/n*size, n=4: {allreduce_bytes_per_rank(size, 4):,.0f} bytes per rank")
    base_time, base_bytes = rows[0][1], rows[0][2]
    print(f"{'run':<28}{'step ms':>9}{'x DDP':>7}{'bytes/step (busiest)':>22}{'x DDP':>7}{'last loss':>11}")
    for name, step, nbytes, loss in rows:
        print(f"{name:<28}{step * 1e3:>9.1f}{step / base_time:>7.2f}{nbytes:>22,.0f}{nbytes / base_bytes:>7.2f}"
              f"{loss:>11.5f}")


if __name__ == "__main__":
    main()
