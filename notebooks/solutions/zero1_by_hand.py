%%px
import math

import torch


class Zero1:
    """ZeRO-1 by hand: every rank holds every parameter and its whole gradient, as under DDP, but keeps
    the optimizer's state (AdamW's moments, SGD's momentum) for its 1/N flat shard of the parameters only, and
    steps only that shard.

    The parameters are seen as one flat vector of Ψ elements, padded with zeros to N·c, c = ceil(Ψ/N);
    rank r owns the elements [r·c, (r+1)·c).
    """

    def __init__(self, params, optimizer_class=torch.optim.AdamW, **settings):
        self.params = list(params)
        self.numel = sum(p.numel() for p in self.params)  # Ψ
        self.c = math.ceil(self.numel / world)  # each rank's shard, in elements
        # Set self.shard, a (c,) tensor: a copy of this rank's elements of the padded flat parameters,
        # and self.optimizer, an optimizer_class(..., **settings) over [self.shard] alone.
        ### BEGIN SOLUTION
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])  # (Ψ,)
        padded = torch.nn.functional.pad(flat, (0, self.c * world - self.numel))  # (N·c,)
        self.shard = padded[rank * self.c:(rank + 1) * self.c].clone()  # (c,), a leaf the optimizer steps
        self.optimizer = optimizer_class([self.shard], **settings)  # its state: AdamW's two moments of (c,), not (Ψ,)
        ### END SOLUTION

    @torch.no_grad()
    def step(self):
        """Reduce-scatter the gradients (their average over the ranks), step this rank's shard,
        then all-gather the shards so that every rank holds every updated parameter."""
        ### BEGIN SOLUTION
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])  # (Ψ,): this rank's own gradient
        grads = torch.nn.functional.pad(grads, (0, self.c * world - self.numel))  # (N·c,)
        mine = grads.new_empty(self.c)
        dist.reduce_scatter_single(mine, grads)  # shard r of the sum over the ranks lands on rank r, (c,)
        self.shard.grad = mine / world  # the average, as DDP's all-reduce gives it (SUM then divide)
        self.optimizer.step()
        gathered = grads.new_empty(self.c * world)
        dist.all_gather_single(gathered, self.shard)  # every rank's updated shard, in rank order, (N·c,)
        pieces = gathered[:self.numel].split([p.numel() for p in self.params])
        for p, piece in zip(self.params, pieces):
            p.copy_(piece.view_as(p))
        ### END SOLUTION
