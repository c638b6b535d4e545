"""What one rank's traffic depends on (``Work``), one kind of call it makes (``CommEntry``), and the passes a
block's collectives run in: the vocabulary ``lab.planning.plan_comm`` and ``lab.planning.plan_comm_tp`` count
in. Pure Python; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from lab.planning.plan_math import busbw_factor
from lab.planning.plan_mesh import Layout


@dataclass(frozen=True)
class CommEntry:
    """One kind of call one rank makes per iteration."""

    axis: str  # "dp", "dp_shard", "dp_replicate", "tp", "pp", "ep", "ep_replicate" or "cp"
    op: str  # "all_reduce", "all_gather", "reduce_scatter", "all_to_all" or "p2p"
    phase: str  # "fwd", "bwd", "recompute" or "step" (after backward, at the optimizer)
    link: str  # "intra" (inside a node) or "inter" (between nodes)
    group_size: int
    count: int  # calls per iteration
    payload_bytes: float  # per call
    total_payload: float  # count × payload_bytes
    wire_bytes: float  # bytes this rank sends: total_payload × busbw factor
    # A matmul's output, or that output's gradient: in the matmul's dtype, so bf16 under torch.autocast, where
    # the rest (norm outputs, embeddings, the input gradients autocast casts back) stays in the weights' fp32.
    matmul_output: bool = False

    def to_dict(self) -> dict[str, object]:
        """JSON-able fields."""
        return dict(self.__dict__)


def entry(axis: str, op: str, phase: str, link: str, n: int, count: int, payload: float,
          matmul_output: bool = False) -> CommEntry:
    """A CommEntry with totals filled in."""
    total = count * payload
    return CommEntry(axis, op, phase, link, n, count, payload, total, total * busbw_factor(op, n), matmul_output)


@dataclass(frozen=True)
class Work:
    """The sizes a rank's traffic depends on."""

    psi_local: float  # dense (non-expert) parameters on this rank after TP and PP (before dp sharding)
    elem_bytes: int  # bytes per parameter, gradient and activation element
    micro_batch: int
    microbatches: int  # M, per iteration and dp rank
    seq_len: int  # tokens of a sequence on this rank: seq_len / cp
    hidden: int | None  # None for a count-only model: no TP/PP traffic can be sized
    layers_on_rank: int | None
    sharded_ends: bool = False  # ModelSpec.sharded_ends: the embeddings' and head's TP collectives count
    vocab: int | None = None
    qkv_allreduces: int = 1  # backward all-reduces of the attention input: 1 entered once, 3 per projection
    mlp_allreduces: int = 1  # backward all-reduces of the MLP input: 2 for separate gate and up projections
    learned_pos: bool = True  # a row-parallel position table beside the token embedding
    stage_ids: tuple[int, ...] = ()  # this pipeline rank's stages; () = a middle stage
    num_stages: int = 1
    expert_psi: float = 0.0  # routed expert parameters on this rank: its E/ep experts of its MoE layers
    moe_layers: int = 0  # MoE layers among this rank's blocks
    experts: int = 0  # routed experts per MoE layer (the router's width)
    dispatched: float = 0.0  # token copies one MoE layer routes per micro-batch (plan_moe.dispatched_tokens)
    kv_dim: int | None = None  # kv_heads · head_dim: the width of k and of v, which the CP ring passes
    first_stage: bool = True  # holds the pipeline's first stage (its first block), or there is no pipeline
    last_stage: bool = True  # holds the last stage (the last block, the final norm)
    norm_bias: bool = False  # each norm has a bias beside its weight (LayerNorm with biases: GPT)
    sp_between_blocks: bool = False  # ModelSpec.sp_between_blocks: SP cuts the stream only inside the blocks
    tied_table: float = 0.0  # elements of a head tied to the embedding, on this rank (a pipeline sums its 2 copies)


def phases(lay: Layout) -> list[str]:
    """The passes a block's forward collectives run in: selective checkpointing keeps their outputs, so only a
    full recompute runs them again."""
    return ["fwd", "bwd"] + (["recompute"] if lay.activation_checkpointing is True else [])
