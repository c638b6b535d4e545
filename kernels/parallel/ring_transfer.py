"""The ring of a context-parallel group and its transfers: each rank sends a block to the next rank while
it receives the previous rank's (``kernels.parallel.ring_attention`` passes k/v blocks and their gradients).

A transfer is posted (``Ring.forward``) before the compute it should hide behind and waited for after it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d


class Transfer:
    """One ring transfer in flight: ``block`` goes to ``to_rank`` while ``received`` fills from ``from_rank``.

    gloo cannot send CUDA tensors, so on a gloo group the block travels through host copies.
    """

    def __init__(self, block: torch.Tensor, to_rank: int, from_rank: int, group: dist.ProcessGroup) -> None:
        self.received = torch.empty_like(block)
        # p2p_staging.needs_staging's rule, not imported: that module pulls in torch's pipelining (seconds).
        staged = block.device.type == "cuda" and dist.get_backend(group) == "gloo"
        self._sent = block.detach().cpu() if staged else block.detach().contiguous()  # alive until done
        self._landing = torch.empty_like(self._sent) if staged else self.received
        # torch's own isend/irecv, which P2POp checks by identity: a meter may wrap the torch.distributed names.
        self._works = dist.batch_isend_irecv([dist.P2POp(distributed_c10d.isend, self._sent, to_rank, group),
                                              dist.P2POp(distributed_c10d.irecv, self._landing, from_rank, group)])
        self.nbytes = block.numel() * block.element_size()

    def wait(self) -> torch.Tensor:
        """The received block, once it has arrived."""
        for work in self._works:
            work.wait()
        if self._landing is not self.received:
            self.received.copy_(self._landing)
        return self.received


class Ring:
    """The ring of a CP group: this rank's place in it and its neighbours' global ranks."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.cp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.cp)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.cp)

    def forward(self, block: torch.Tensor) -> Transfer:
        """Post: send ``block`` to the next rank, receive the previous rank's."""
        return Transfer(block, self.next, self.prev, self.group)
