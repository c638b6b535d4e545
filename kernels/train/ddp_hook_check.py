"""Check a DDP communication hook: its gradients beside torch's ``allreduce_hook`` and one process.

Algorithm: DDP (Li et al., 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
VLDB, arXiv:2006.15704) packs the gradients into flat buckets, in about the reverse order of
``model.parameters()``, and as soon as every gradient of a bucket is ready during backward it calls the
registered communication hook ``hook(state, bucket) -> Future[Tensor]``; the tensor the future yields
becomes the bucket's averaged gradients. torch's own ``default_hooks.allreduce_hook`` divides the bucket
by the world size and all-reduces it (SUM), the maths of DDP's C++ default. Torch 2.13's DDP puts every
gradient in one bucket for the first backward, then rebuilds its buckets (at most ``bucket_cap_mb`` each)
in the order that backward produced the gradients; so ``compare_comm_hook`` runs two backwards with the
hook under test and looks at the second, then the same with ``allreduce_hook``, and the whole global
batch in this process. It returns the differences, the bucket sizes the hook was given and the bytes
this rank wrote to its sockets during the hooked backward (``kernels.measure.socket_bytes``).

Run alone (torch's own hook checked against itself on 4 ranks)::

    torchrun --nproc-per-node 4 -m kernels.train.ddp_hook_check
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from kernels.engine.runtime import rank_device
from kernels.measure.socket_bytes import bytes_written
from kernels.model.family import build_model, model_config
from kernels.model.gpt import loss_fn
from kernels.train.data import dataset, shard_batch
from kernels.train.data_parallel_naive import flat_grads
from kernels.contract.run_config import RunConfig

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]


def _hooked_backward(run: RunConfig, hook: CommHook, x: torch.Tensor, y: torch.Tensor,
                     bucket_cap_mb: float) -> tuple[nn.Module, list[int], int | None]:
    """One DDP backward with ``hook``: the model, the size of each bucket it was given, the bytes written."""
    sizes: list[int] = []

    def watched(state, bucket):  # unannotated: DDP compares annotations with its types, and these would be strings
        sizes.append(bucket.buffer().numel())
        return hook(state, bucket)

    ddp = DDP(build_model(model_config(run), x.device), bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(None, watched)  # state None: the hook reduces over the default (whole) group
    loss_fn(ddp(x), y).backward()  # the first backward: torch 2.13's DDP holds every gradient in one bucket
    ddp.zero_grad(set_to_none=False)
    sizes.clear()
    loss = loss_fn(ddp(x), y)  # this forward rebuilds the buckets in the order backward made the gradients
    before = bytes_written()
    loss.backward()  # returns once every bucket's future has completed and its result is copied back
    after = bytes_written()
    counted = before is not None and after is not None and dist.get_backend() == "gloo"  # NCCL writes no socket
    return ddp.module, sizes, after - before if counted else None


def compare_comm_hook(cfg: dict[str, Any], hook: CommHook, bucket_cap_mb: float = 25.0) -> dict[str, Any]:
    """One step's gradients on this rank through DDP with ``hook``, beside ``allreduce_hook`` and one process.

    Returns plain numbers: the global-batch samples this rank trained on, the largest element-wise
    differences, Ψ (parameters), the element count of each bucket the hook received on the second
    backward (in call order), and the bytes written to sockets during it (None where they cannot be counted).
    """
    run = RunConfig.from_options(cfg)
    device = rank_device()
    inputs, targets = (t.to(device) for t in dataset(run).global_batch(0, run.global_batch))  # (B, T)
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = shard_batch(inputs, targets, rank, world)  # (B/world, T): samples rank, rank + world, ...
    samples = list(range(inputs.size(0)))[rank::world]
    yours, buckets, wire = _hooked_backward(run, hook, x, y, bucket_cap_mb)
    torch_hook, _, _ = _hooked_backward(run, default_hooks.allreduce_hook, x, y, bucket_cap_mb)
    whole = build_model(model_config(run), device)
    loss_fn(whole(inputs), targets).backward()  # the global-batch gradient, in this one process
    mine, library, truth = flat_grads(yours), flat_grads(torch_hook), flat_grads(whole)
    return {"rank": rank, "samples": samples, "params": mine.numel(), "buckets": buckets, "wire_bytes": wire,
            "max_diff_vs_allreduce_hook": (mine - library).abs().max().item(),
            "max_diff_vs_one_process": (mine - truth).abs().max().item()}


if __name__ == "__main__":
    dist.init_process_group("gloo")
    print(compare_comm_hook({"model": {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
                             "global_batch": 16}, default_hooks.allreduce_hook, bucket_cap_mb=0.05))
    dist.destroy_process_group()
