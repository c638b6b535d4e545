"""Collective bandwidth sweep, nccl-tests style: ``bench_rank(cfg) -> [timing rows]``.

Algorithm: the measurement loop of NVIDIA's nccl-tests (doc/PERFORMANCE.md): for
each collective and payload size, one warm-up call, a barrier, then ``iters`` timed
calls back to back; the time per call is the mean, and every rank reports the
*slowest* rank's value (an all_reduce MAX), since a collective ends when its last
rank does. Payload sizes follow nccl-tests:

- all_reduce: the tensor (``size`` bytes) is reduced in place;
- all_gather: the gathered output is ``size`` bytes (each rank gives size/n);
- reduce_scatter: the input is ``size`` bytes (each rank keeps size/n);
- broadcast: ``size`` bytes from rank 0;
- send_recv: every rank sends ``size`` bytes to rank+1 and receives as much from
  rank-1 in one ``batch_isend_irecv`` (nccl-tests' sendrecv ring);
- all_to_all: every rank's ``size``-byte input is cut into n blocks, block j going to rank j
  (``all_to_all_single``, the exchange of expert and Ulysses sequence parallelism).

Bandwidths (algbw = size / time, busbw = algbw * f) are the driver's
(``lab.measure.bench.bench_collectives``, with ``lab.planning.plan_math.busbw_factor``).

Run alone (prints the sweep on 2 ranks)::

    torchrun --nproc-per-node 2 -m kernels.measure.comm_bench
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from kernels.engine.runtime import rank_device

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all")


def _op_call(op: str, numel: int, group: dist.ProcessGroup | None = None) -> Callable[[], Any]:
    """A closure that runs one call of ``op`` on a payload of ``numel`` fp32 elements in ``group`` (None: the world).

    The payload lives on the rank's device: NCCL takes only CUDA tensors, gloo CPU ones.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = rank_device()
    ones, empty = functools.partial(torch.ones, device=device), functools.partial(torch.empty, device=device)
    if op == "all_reduce":
        t = ones(numel)
        return lambda: dist.all_reduce(t, group=group)
    if op == "all_gather":
        out, inp = empty(numel), ones(numel // world)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in 2.13
        return lambda: gather(out, inp, group=group)
    if op == "reduce_scatter":
        out, inp = empty(numel // world), ones(numel)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in 2.13
        return lambda: scatter(out, inp, group=group)
    if op == "broadcast":
        t = ones(numel)
        return lambda: dist.broadcast(t, src=_global(group, 0), group=group)
    if op == "send_recv":
        send, recv = ones(numel), empty(numel)

        def ring() -> None:
            ops = [dist.P2POp(dist.isend, send, _global(group, (rank + 1) % world), group),
                   dist.P2POp(dist.irecv, recv, _global(group, (rank - 1) % world), group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return ring
    if op == "all_to_all":
        out, inp = empty(numel), ones(numel)
        return lambda: dist.all_to_all_single(out, inp, group=group)
    raise ValueError(f"unknown collective {op!r}; use one of {', '.join(OPS)}")


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def time_op(op: str, size_bytes: int, iters: int, group: dist.ProcessGroup | None = None) -> dict[str, Any]:
    """Mean seconds per call of ``op`` on ``size_bytes`` (rounded down to n fp32 elements), slowest rank.

    With ``group``, every group runs at once (so groups crossing one link share it), and
    the time is still the slowest rank's of the whole world.
    """
    world = dist.get_world_size(group)
    numel = max(world, size_bytes // 4 // world * world)  # all_gather/reduce_scatter/all_to_all need n | numel
    call = _op_call(op, numel, group)
    device = rank_device()
    call()  # warm-up: connections and buffers
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    if device.type == "cuda":  # NCCL calls return once queued; the time is the GPU's
        torch.cuda.synchronize(device)
    seconds = torch.tensor((time.perf_counter() - start) / iters, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a collective ends when its last rank does
    return {"op": op, "size_bytes": numel * 4, "world": world, "iters": iters, "seconds": float(seconds)}


def bench_rank(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep ``cfg`` names: ``{"sizes": [bytes], "ops": [names], "iters": int}``; same rows on every rank.

    ``cfg["groups"]`` (lists of global ranks covering the world, e.g. the ranks of each host)
    runs the sweep inside those groups instead of the whole world, all groups at once.
    """
    if dist.get_world_size() < 2:
        raise ValueError("bench_rank needs at least 2 ranks")
    ops = tuple(cfg.get("ops", OPS))
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        raise ValueError(f"unknown collectives {unknown}; use {', '.join(OPS)}")
    iters = int(cfg.get("iters", 5))
    groups = [dist.new_group(list(g)) for g in cfg.get("groups") or ()]  # every rank creates every group
    mine = next((g for g, ranks in zip(groups, cfg.get("groups") or ()) if dist.get_rank() in ranks), None)
    try:
        return [time_op(op, int(size), iters, mine) for op in ops for size in cfg.get("sizes", (1 << 16, 1 << 20))]
    finally:
        for group in groups:
            dist.destroy_process_group(group)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for row in bench_rank({"sizes": [1 << 12, 1 << 20, 1 << 22]}):
        if dist.get_rank() == 0:
            print(f"{row['op']:>15} {row['size_bytes']:>9} B  {row['seconds'] * 1e6:9.1f} us  "
                  f"algbw {row['size_bytes'] / row['seconds'] / 1e9:.3f} GB/s")
    dist.destroy_process_group()
