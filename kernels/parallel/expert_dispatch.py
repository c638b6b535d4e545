"""What every expert-parallel layer shares: its experts' place on the ep mesh, and the all-to-all that reaches them.

``place_experts`` keeps this rank's E/ep experts of a packed parameter (expert index first) as a DTensor on the
2D ("ep_replicate", "ep") mesh; ``ExpertDispatch`` sends each expert's rows to the rank that holds it, runs the
local experts on what arrives and sends the outputs back, through ``AllToAll`` (steps, gradients and why:
``kernels.parallel.expert_parallel``). The lab's MoE (``kernels.parallel.expert_parallel.apply_ep``) and a
Hugging Face experts module (``kernels.parallel.hf_expert_parallel``) differ only in how their local experts run.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.func import functional_call


class AllToAll(torch.autograd.Function):
    """Rows of ``x`` to the ranks of ``group``: ``send[j]`` rows to rank j, ``receive[i]`` rows from rank i.

    Backward is the reverse all-to-all of the output's gradient (the roles of the split sizes swapped).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.receive, ctx.send, ctx.group = receive, send, group
        return _exchange(x, receive, send, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.send, ctx.receive, ctx.group), None, None, None


def _exchange(x: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(receive), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), receive, send, group=group)
    return out


class ExpertDispatch:
    """``MoE.dispatch`` under expert parallelism: the rows of each expert to the rank that holds it, the local
    experts on what arrives, the outputs back. Same signature as ``MoE.dispatch``; ``experts`` a
    ``PackedExperts`` (a subclass runs other experts by overriding ``_local_experts``)."""

    def __init__(self, experts: nn.Module, group: dist.ProcessGroup) -> None:
        self.experts, self.group = experts, group
        self.ep = dist.get_world_size(group)

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ep = self.ep
        local = counts.numel() // ep
        arriving = torch.empty_like(counts)  # (ep * local,): [source rank][local expert]
        dist.all_to_all_single(arriving, counts, group=self.group)
        send = counts.view(ep, local).sum(dim=1).tolist()
        grid = arriving.view(ep, local)
        receive = grid.sum(dim=1).tolist()
        received = AllToAll.apply(tokens, receive, send, self.group)
        # The rows arrive by source rank, then local expert: regroup them by local expert for the experts' loop.
        by_source = received.split(grid.flatten().tolist())
        by_expert = torch.cat([by_source[s * local + e] for e in range(local) for s in range(ep)])
        outputs = self._local_experts(by_expert, grid.sum(dim=0))
        pieces = outputs.split(grid.t().flatten().tolist())  # [local expert][source rank]
        back = torch.cat([pieces[e * ep + s] for s in range(ep) for e in range(local)])
        return AllToAll.apply(back, send, receive, self.group)

    def _local_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``PackedExperts``' forward over this rank's shards (cast to the rows' dtype, as FSDP2's bf16 casts
        the dense parts); an expert with no row still runs, so its shard gets a (zero) gradient."""
        shards = {name: p.to_local().to(rows.dtype) for name, p in self.experts.named_parameters(recurse=False)}
        return functional_call(self.experts, shards, (rows, counts))


def place_experts(module: nn.Module, names: tuple[str, ...], ep_mesh: DeviceMesh) -> None:
    """Each packed parameter ``names`` of ``module`` -> this rank's slice of whole experts (dim 0 chunk ``ep`` rank)
    as a DTensor, Replicate() on "ep_replicate" and Shard(0) on "ep", in place. Every rank built the whole tensor
    from the seed, so nothing is sent."""
    ep, index = ep_mesh.size(1), ep_mesh.get_local_rank("ep")
    for name in names:
        p = getattr(module, name)
        shard = p.detach().chunk(ep, dim=0)[index].clone()  # a copy: the whole tensor's storage is freed
        placed = DTensor.from_local(shard, ep_mesh, [Replicate(), Shard(0)], run_check=False, shape=p.shape,
                                    stride=p.stride())
        module.register_parameter(name, nn.Parameter(placed, requires_grad=p.requires_grad))
