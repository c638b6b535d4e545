"""Data parallelism: torch DDP over the dp axis of the mesh, with gradient accumulation.

Algorithm: synchronous data parallelism with bucketed gradient all-reduce overlapped
with backward (Li et al., 2020, "PyTorch Distributed: Experiences on Accelerating
Data Parallel Training", VLDB). Every dp rank holds the whole model, runs forward and
backward on its own shard of the global batch (``kernels.train.data.shard_batch``), and
DDP's autograd hooks all-reduce each bucket of gradients as soon as it is ready:

- forward: nothing is communicated (the first forward broadcasts rank 0's weights
  once, at construction, so every replica starts equal);
- backward: all_reduce(SUM) of each gradient bucket over the dp group, then a divide
  by dp, so every rank ends with the gradient of the global-batch mean loss.

Gradient accumulation runs the first n-1 micro-batches under ``no_sync()`` (the
gradients only add up locally) and all-reduces once, on the last micro-batch.

Run alone (DDP on 2 ranks, compared with one process)::

    torchrun --nproc-per-node 2 -m kernels.train.entry --dp 2
"""
from __future__ import annotations

import contextlib
from collections.abc import Collection
from typing import Iterator

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, *, bucket_cap_mb: float = 25.0,
              ignored: Collection[str] = ()) -> DDP:
    """Wrap ``model`` in DDP over the 1D ``dp_mesh`` (the model must hold plain tensors).

    DDP cannot average DTensor (TP) gradients: TP layouts replicate with FSDP2 on the dp axis instead.
    ``ignored`` names parameters DDP neither broadcasts nor reduces: expert parallelism's DTensor experts,
    whose gradients ``kernels.parallel.expert_parallel.ExpertGradSync`` reduces.
    """
    if any(isinstance(p, DTensor) for name, p in model.named_parameters() if name not in ignored):
        raise ValueError("apply_ddp replicates plain tensors: this model holds DTensors (TP); use FSDP on dp")
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(model, list(ignored))
    device_ids = None  # CPU / gloo; on CUDA DDP infers the device from the parameters
    # A model the user brought may leave parameters without a gradient in a step (an expert no token
    # reached): DDP then finds them each backward instead of waiting for them forever.
    unused = getattr(model, "may_leave_parameters_unused", False)
    return DDP(model, process_group=dp_mesh.get_group(), device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
               find_unused_parameters=unused)


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (or the model itself)."""
    return model.module if isinstance(model, DDP) else model


@contextlib.contextmanager
def sync_gradients(model: nn.Module, sync: bool) -> Iterator[None]:
    """Skip the gradient all-reduce for this backward when ``sync`` is False (accumulation).

    DDP: ``no_sync()``. FSDP2 modules: ``set_requires_gradient_sync(False)`` keeps
    unsharded gradients and reduce-scatters them on the last micro-batch.
    Other models (TP only, ZeRO-1 without DDP) have nothing to skip.
    """
    if isinstance(model, DDP) and not sync:
        with model.no_sync():
            yield
        return
    set_sync = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 root
    if set_sync is not None:
        set_sync(sync)
    yield
