"""What expert parallelism and context parallelism record on each rank: routing per step, and ring steps.

- ``RoutingStep``: one MoE layer's routing on one rank in one training step (summed over the step's
  micro-batches): how many token assignments this rank's router sent to each expert, how many the
  experts kept (capacity), and the load-balancing loss (None where it is not recorded). The rows of all ranks make the all-to-all
  matrix (rank x expert) a heatmap draws.
- ``RingStep``: one step of one ring-attention call on one rank (forward): which cp rank's key/value
  block it attended, when it began, how long it computed and then waited for the next block, and
  the bytes it sent on. A timeline draws compute of block i beside the transfer of block i+1.

Shapes and rules of every record: ``kernels.contract.records``. Standard library only: the widgets import it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.contract.records import Record


@dataclass(frozen=True)
class RoutingStep(Record):
    """One MoE layer's routing on one rank in one training step."""

    rank: int
    step: int
    layer: str  # the MoE module's name, e.g. "blocks.0.mlp"
    tokens: int  # tokens this rank routed (batch share x sequence, summed over micro-batches)
    top_k: int
    assigned: tuple[int, ...]  # per expert: assignments this rank's router made, before any capacity drop
    kept: tuple[int, ...]  # per expert: the assignments kept (equal to assigned when dropless)
    # The load-balancing loss of this rank's tokens (mean over micro-batches); None where the model computes none
    # the lab reads (a Hugging Face MoE computes its router loss only when asked for router logits).
    aux_loss: float | None
    ep_rank: int = 0  # this rank's place in its expert-parallel group (0 without ep)
    ep: int = 1  # ranks the experts are split over

    @property
    def dropped(self) -> int:
        """Assignments beyond an expert's capacity."""
        return sum(self.assigned) - sum(self.kept)


@dataclass(frozen=True)
class RingStep(Record):
    """One step of one ring-attention call on one rank (forward)."""

    rank: int
    step: int  # the training step
    layer: str  # the attention module's name, e.g. "blocks.0.attn"
    ring_step: int  # 0 .. cp-1
    kv_rank: int  # the cp rank whose key/value block was attended: (cp_rank - ring_step) mod cp
    start_s: float  # seconds from the call's start to this ring step's start
    compute_s: float
    wait_s: float  # waiting for the next block after the compute
    sent_bytes: int  # the key/value block sent on (0 on the last ring step)
    chunk_pairs: int  # query x key chunk pairs computed (zig-zag: every rank computes the same total)
    cp_rank: int = 0
    cp: int = 1
