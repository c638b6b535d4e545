"""Lab overhead against raw ipyparallel, measured in one run on this machine.

1. Latency of a no-op on every rank: ``cluster.run(noop)`` vs ``DirectView.apply_sync(noop)``
   on the same engines, interleaved so both see the same machine load (goal ≤ 1.2×). The lab
   sends with cloudpickle (``lab.pool.launch.ship_functions_with_globals``), raw ipyparallel with
   its stock pickle; raw ipyparallel with cloudpickle is timed too, to show what the
   serializer alone costs. ``noop`` is defined in ``__main__`` here, as a notebook's
   functions are, so cloudpickle ships it by value.
2. Start-up: ``lab.start()`` (engines + verified process group + %%px names) vs a raw
   ``ipyparallel.Cluster`` start plus a hand-written ``init_process_group`` and one
   all_reduce (goal ≤ 1.3×).

Run: ``python benchmarks/pool.py [--ranks 4] [--calls 200] [--starts 2]``
"""
from __future__ import annotations

import argparse
import socket
import statistics
import time
import warnings

import ipyparallel as ipp

import lab


def noop() -> None:
    return None


def raw_join(rank: int, world: int, port: int) -> float:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def raw_leave() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_raw_start(n: int) -> float:
    began = time.perf_counter()
    cluster = ipp.Cluster(n=n, log_level=40)
    client = cluster.start_and_connect_sync(activate=False)
    client.wait_for_engines(n, timeout=120)
    ids = sorted(client.ids)
    port = free_port()
    ars = [client[eid].apply_async(raw_join, rank, n, port) for rank, eid in enumerate(ids)]
    [ar.get(timeout=120) for ar in ars]
    elapsed = time.perf_counter() - began
    client[ids].apply_sync(raw_leave)
    cluster.stop_cluster_sync()
    return elapsed


def time_lab_start(n: int) -> float:
    began = time.perf_counter()
    cluster = lab.start(n=n, backend="gloo", activate=False)
    elapsed = time.perf_counter() - began
    cluster.stop()
    return elapsed


def latency(n: int, calls: int) -> tuple[float, float, float]:
    """Median seconds of a no-op on every rank: lab, raw ipyparallel (stock pickle), raw with cloudpickle."""
    with lab.start(n=n, backend="gloo", activate=False) as cluster:
        view = cluster.client[[r.engine_id for r in cluster.rank_map.ranks]]
        paths = {"lab": lambda: cluster.run(noop), "raw": lambda: _with_stock_pickle(view.apply_sync, noop),
                 "raw_cloudpickle": lambda: view.apply_sync(noop)}
        for _ in range(10):  # warm every path (function canning, sockets)
            for call in paths.values():
                call()
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(calls):
            for name, call in paths.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    return tuple(statistics.median(times[name]) for name in paths)  # type: ignore[return-value]


def _with_stock_pickle(fn, *args):
    # ipyparallel's serializer is one switch per process; the lab turned it to cloudpickle.
    ipp.serialize.use_pickle()
    try:
        return fn(*args)
    finally:
        ipp.serialize.use_cloudpickle()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--starts", type=int, default=2, help="start-up comparisons (0 skips them)")
    args = parser.parse_args()
    if args.ranks < 1 or args.calls < 1 or args.starts < 0:
        parser.error("--ranks and --calls must be at least 1, --starts at least 0")
    warnings.simplefilter("ignore", lab.OversubscribedWarning)

    lab_ms, raw_ms, cloud_ms = (1e3 * x for x in latency(args.ranks, args.calls))
    print(f"no-op on {args.ranks} ranks, median of {args.calls}: lab run (cloudpickle) {lab_ms:.2f} ms, "
          f"raw DirectView.apply_sync {raw_ms:.2f} ms, ratio {lab_ms / raw_ms:.2f}x (goal <= 1.2x); "
          f"raw with cloudpickle {cloud_ms:.2f} ms, ratio {cloud_ms / raw_ms:.2f}x")

    if not args.starts:
        return
    lab_starts, raw_starts = [], []
    for _ in range(args.starts):  # alternate so both see the same machine state
        raw_starts.append(time_raw_start(args.ranks))
        lab_starts.append(time_lab_start(args.ranks))
    lab_s, raw_s = min(lab_starts), min(raw_starts)
    print(f"start + process group, {args.ranks} ranks, best of {args.starts}: lab {lab_s:.2f} s, "
          f"raw ipyparallel + init_process_group {raw_s:.2f} s, ratio {lab_s / raw_s:.2f}x (goal <= 1.3x)")


if __name__ == "__main__":
    main()
