"""A head tied to the token embedding, across pipeline stages: two copies kept equal by summing their gradients.

In one process the LM head and the token embedding are one tensor, whose gradient is the sum of
what the embedding's lookup and the head's projection contribute. A pipeline puts the embedding
on the first stage and the head on the last, so each holds its own copy (Megatron does the same).
Both start equal (the same seeded weights); after every backward each copy's gradient is replaced
by the sum of both, all-reduced over the pipeline group (the stages in between add zeros), so the
two copies take the same optimizer step and stay equal, as the one tensor of one process does.

Under FSDP or TP the two copies are sharded alike (same global shape, same placements), so the
local shards at one (dp, tp) coordinate hold the same slice and are summed as they are.

Run alone: through the pipeline entry point (the HF GPT-2 ties its head)::

    python -m pytest tests/test_hf_models.py -k "gpt2 and pp"
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from kernels.parallel.mesh import local_part


class TiedGrads:
    """This rank's copies of a tied embedding/head (none on a middle stage) and the group that sums them.

    Every rank of the pipeline group must build it (it agrees on the local shape once, collectively).
    """

    def __init__(self, stages: list[nn.Module], pp_group: dist.ProcessGroup, device: torch.device) -> None:
        self.params = [p for stage in stages for p in getattr(stage, "tied_copies", lambda: [])()]
        self.group, self.device = pp_group, device
        shapes: list = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(shapes, tuple(local_part(self.params[0]).shape) if self.params else None, group=pp_group)
        self.shape = next(s for s in shapes if s is not None)

    @property
    def payload_bytes(self) -> int:
        """The bytes each pipeline rank all-reduces per step (fp32, this rank's shard of the tied tensor)."""
        return 4 * math.prod(self.shape)

    def head_copies(self, stages: list[nn.Module]) -> set[int]:
        """The ids of the last stage's copies: a norm over the pipeline counts the tied tensor once."""
        return {id(p) for stage in stages for p in getattr(stage, "tied_copies", lambda: [])(head_only=True)}

    def sum_gradients(self) -> None:
        """Replace each copy's gradient by the sum over both copies (collective over the pipeline group)."""
        total = torch.zeros(self.shape, device=self.device)
        for p in self.params:
            if p.grad is not None:
                total += local_part(p.grad)
        dist.all_reduce(total, group=self.group)
        for p in self.params:
            if p.grad is not None:
                local_part(p.grad).copy_(total)
