"""Five communication patterns of distributed training, each run once with inputs anyone can check by hand.

The sixth, all_to_all, is what expert parallelism exchanges (``kernels.parallel.expert_parallel``).

Every rank builds its input from its rank number alone, runs the collective, and
returns a plain record ``{op, rank, input, output}``. The driver checks each output
against the value computed from all ranks' inputs (``lab.demo``), so nothing here
trusts torch's answer.

- all_reduce: every rank ends with the element-wise sum of all inputs (one element per rank,
  so a ring all-reduce's chunks are visible).
- all_gather: every rank ends with all inputs, concatenated in rank order.
- reduce_scatter: rank r ends with the sum over ranks of chunk r of their inputs.
- broadcast: every rank ends with rank 0's input.
- send/recv: a ring, rank r sends to r+1 and receives from r-1 (a ring of one sends nothing).

Run alone under torchrun::

    torchrun --nproc-per-node 4 -m kernels.engine.collectives
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from kernels.engine.runtime import rank_device


def collective_inputs(op: str, rank: int, world: int) -> list[float]:
    """The input a rank contributes to ``op``: a pure function of (op, rank, world)."""
    if op == "all_reduce":
        return [(rank + 1.0) * (chunk + 1) for chunk in range(world)]  # one chunk per rank, as a ring splits it
    if op == "reduce_scatter":
        return [100.0 * rank + chunk for chunk in range(world)]  # one element per destination rank
    if op == "broadcast":
        return [7.0 + rank]
    return [float(rank)]  # all_gather and send_recv


def run_collectives() -> list[dict[str, Any]]:
    """Run every collective once on the default group, on this rank's device (NCCL takes only GPU tensors),
    and return one record each."""
    rank, world, device = dist.get_rank(), dist.get_world_size(), rank_device()
    records = []
    for op, step in (("all_reduce", _all_reduce), ("all_gather", _all_gather),
                     ("reduce_scatter", _reduce_scatter), ("broadcast", _broadcast),
                     ("send_recv", _send_recv)):
        data = collective_inputs(op, rank, world)
        output = step(torch.tensor(data, device=device), rank, world)
        records.append({"op": op, "rank": rank, "input": data, "output": output.tolist()})
    return records


def _all_reduce(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    dist.all_reduce(x)  # in place: (world,) on every rank
    return x


def _all_gather(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x)
    return torch.cat(parts)  # (world,)


def _reduce_scatter(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    out = torch.empty(1, device=x.device)
    dist.reduce_scatter(out, list(x.chunk(world)))  # chunk r of every rank is summed into rank r
    return out


def _broadcast(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    dist.broadcast(x, src=0)
    return x


def _send_recv(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    if world == 1:  # a ring of one rank hands the value to itself; gloo cannot pair a rank with itself
        return x.clone()
    received = torch.empty_like(x)
    # Posting both sides at once lets every rank send and receive without a deadlock.
    ops = [dist.P2POp(dist.isend, x, (rank + 1) % world), dist.P2POp(dist.irecv, received, (rank - 1) % world)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


if __name__ == "__main__":
    dist.init_process_group("gloo")
    for record in run_collectives():
        print(record)
    dist.destroy_process_group()
