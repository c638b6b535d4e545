"""The teaching twin of DDP: average gradients by hand, one all_reduce per parameter.

Algorithm: synchronous data parallelism without buckets or overlap (the "naive" data
parallel of picotron's ``DataParallelNaive``). Every rank runs forward and backward
on its shard of the global batch; then, for every parameter, all_reduce(SUM) of its
gradient over the dp group and a divide by dp. The result must equal both DDP's
bucketed, overlapped all-reduce and the gradient of the global-batch loss in one
process; ``compare_gradient_averaging`` measures both differences on real gradients.

Run alone::

    torchrun --nproc-per-node 4 -m kernels.train.data_parallel_naive
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.train.data import dataset, shard_batch
from kernels.model.gpt import loss_fn
from kernels.model.family import build_model, model_config
from kernels.contract.run_config import RunConfig


def average_gradients_naive(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """all_reduce(SUM) every gradient over ``group``, then divide by its size (in place)."""
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)  # forward of nothing: this is the backward's sync
            p.grad /= world


def flat_grads(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened and joined in ``model.parameters()`` order: (Ψ,)."""
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def compare_gradient_averaging(cfg: dict[str, Any]) -> dict[str, Any]:
    """One step's gradients on this rank: local, hand-averaged, DDP's, and one process's.

    Returns plain numbers: the sample indices this rank trained on, its local loss,
    the norms of each gradient and the largest element-wise differences.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    run = RunConfig.from_options(cfg)
    inputs, targets = dataset(run).global_batch(0, run.global_batch)  # (B, T)
    indices = torch.arange(inputs.size(0))
    mine = indices[rank::world].tolist()  # what shard_batch takes, as DistributedSampler(shuffle=False) does
    x, y = shard_batch(inputs, targets, rank, world)  # (B/world, T)

    naive = build_model(model_config(run))
    loss = loss_fn(naive(x), y)
    loss.backward()
    local = flat_grads(naive).clone()
    average_gradients_naive(naive)

    ddp = DDP(build_model(model_config(run)))
    loss_fn(ddp(x), y).backward()  # DDP's hooks all-reduce bucket by bucket during backward

    whole = build_model(model_config(run))
    loss_fn(whole(inputs), targets).backward()  # the global-batch gradient, in this one process
    hand, library, truth = flat_grads(naive), flat_grads(ddp.module), flat_grads(whole)
    return {"rank": rank, "samples": mine, "local_loss": loss.item(),
            "local_grad_norm": local.norm().item(), "averaged_grad_norm": hand.norm().item(),
            "ddp_grad_norm": library.norm().item(), "one_process_grad_norm": truth.norm().item(),
            "max_diff_naive_vs_ddp": (hand - library).abs().max().item(),
            "max_diff_naive_vs_one_process": (hand - truth).abs().max().item()}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(compare_gradient_averaging({"model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64,
                                                "seq_len": 16}, "global_batch": 8}))
    dist.destroy_process_group()
