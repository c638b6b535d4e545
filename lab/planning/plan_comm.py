"""Per-iteration communication of one rank, by collective, phase, axis and link.

Every entry is counted as nccl-tests counts it: ``payload_bytes`` is the tensor a call
works on (the whole gathered tensor for all_gather, the whole input for
reduce_scatter), and the bytes one rank puts on the wire are payload × the busbw
factor (all_reduce 2(n-1)/n, all_gather/reduce_scatter (n-1)/n, p2p 1; docs/design.md#bus-bandwidth).

What is counted, per iteration with M micro-batches per dp rank:

- dp axis (the data axis: dp · cp ranks, whose gradients meet), on the ZeRO-sharded parameters: the
  dense ones, and the experts too without expert parallelism. ZeRO-0 (DDP): one gradient
  all-reduce after accumulation.
- ZeRO-1: one gradient reduce-scatter, one all-gather of the updated parameters
  (the ZeRO paper's 2Ψ; torch's ZeroRedundancyOptimizer all-reduces instead, 3Ψ).
- ZeRO-2 / FSDP grad_op: a parameter all-gather per micro-batch; ZeRO-3 / FSDP full: another in backward.
  In a pipeline a stage keeps its units whole from their first backward to the step's end: one gather
  (ZeRO-2), 1 + M (ZeRO-3). One gradient reduce-scatter per step: the lab defers FSDP's gradient sync to the
  last micro-batch, as torch's pipeline stages do (unlike DeepSpeed, whose per-micro-batch reduce-scatters
  make ZeRO-2 and PP mix badly, Hugging Face's multi-GPU guide, "ZeRO DP+PP+TP").
- FSDP hybrid: ZeRO-2/3 inside each of the dp_replicate shard groups of dp_shard ranks,
  plus an all-reduce of the gradient shard across the groups after the reduce-scatter.
- tp axis (Megatron): two all-reduces of b·s·h per block forward (attention out, MLP
  out) and two backward (their conjugates); under full recompute one more per block (torch's
  checkpoint stops before the block's last, which backward does not need).
  A per-projection plan (an HF model's, ``ModelSpec.one_tp_input=False``) wraps each
  column-parallel Linear's input itself, so it all-reduces the attention input's gradient
  once per projection: 4 backward all-reduces per block instead of 2; separate gate and up
  projections of a gated MLP (Llama's) add one more. The lab's models enter each half once.
- tp axis outside the blocks, for a model whose plan splits its ends (``Work.sharded_ends``:
  the lab's GPT and Llama, HF Llama): the row-parallel token and position embeddings all-reduce their
  outputs b·s·h and s·h forward; the column-parallel LM head all-reduces its input gradient b·s·h
  backward and all-gathers the logits b·s·V forward. Under loss_parallel the logits stay sharded:
  three b·s all-reduces forward instead (row max, sum of exponentials, target logit), none backward.
- tp axis under sequence parallelism (s/tp positions between the TP regions): each half's all-reduce
  becomes an all-gather of its input and a reduce-scatter of its output (backward: their conjugates);
  the norms' replicated weights and biases get partial gradients, one all-reduce each per micro-batch.
  Megatron's SP (the lab's models) also cuts the ends' traffic and the final norm; a model the user
  brought (``Work.sp_between_blocks``) runs its ends and final norm whole, all-reduces each TP input's
  gradient as without SP, and cuts the stream after the first block's input (all-gather backward) and
  gathers it after the last block (forward). docs/design.md#communication-volume has the details.
- ep axis (experts split over ep ranks, docs/design.md#experts-and-context-parallelism): per MoE layer and
  micro-batch two all-to-alls forward (dispatch, combine) and two backward, of the rank's dispatched
  token copies (tokens·top_k·hidden), two more under full recompute; ep_replicate: one all-reduce of
  the rank's expert gradients over the dp/ep · cp ranks holding the same experts, after accumulation.
- cp axis (ring attention, ``kernels.parallel.ring_attention``): per attention layer and micro-batch
  cp-1 sends of the rank's key/value block forward and cp-1 of its gradient backward (the ring keeps
  the blocks it received, so backward sends no k/v again), cp-1 more under full recompute. Every
  other payload is sized with the rank's s/cp tokens.
- A MoE block under TP all-reduces only its attention's output forward (and the q/k/v input gradient
  backward): the experts are whole on every tp rank.
- pp axis: per micro-batch and virtual stage, one activation send forward and one
  gradient send backward (of s/tp positions under SP). A middle stage does both; the first and last do one;
  a head tied to the embedding adds one all-reduce of the table's gradient over the pp ranks per step. With
  ``Work.stage_ids`` (one pipeline rank's stages) the sends are that rank's own: a
  forward send for each stage whose successor is on another rank, a backward send for
  each stage whose predecessor is (the V schedules keep the turn on one rank).
Pure Python; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass

from lab.planning.plan_math import busbw_factor, cp_ring_bytes, ep_all_to_all_bytes, pp_p2p_bytes, tp_allreduce_bytes
from lab.planning.plan_mesh import Layout, axis_link, groups_link, hybrid_groups


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

    def to_dict(self) -> dict[str, object]:
        """JSON-able fields."""
        return dict(self.__dict__)


def entry(axis: str, op: str, phase: str, link: str, n: int, count: int, payload: float) -> CommEntry:
    """A CommEntry with totals filled in."""
    total = count * payload
    return CommEntry(axis, op, phase, link, n, count, payload, total, total * busbw_factor(op, n))


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


def sharded_psi(lay: Layout, w: Work) -> float:
    """Parameters the data axis syncs and ZeRO shards: the dense ones, and the experts too without EP
    (with EP each rank's experts are its own, synced over ep_replicate only)."""
    return w.psi_local + (w.expert_psi if lay.ep == 1 else 0.0)


def dp_entries(lay: Layout, w: Work, gpus_per_node: int) -> list[CommEntry]:
    """Gradient/parameter traffic on the data axis (dp · cp ranks) of the ZeRO-sharded parameters."""
    if lay.data_ranks == 1:
        return []
    if lay.fsdp_strategy == "hybrid":
        return _hybrid_entries(lay, w, gpus_per_node)
    link = axis_link(lay, "dp", gpus_per_node)
    return _sharded_entries("dp", lay, lay.data_ranks, link, w, sharded_psi(lay, w))


def _sharded_entries(axis: str, lay: Layout, n: int, link: str, w: Work, psi: float) -> list[CommEntry]:
    full, m, zero = psi * w.elem_bytes, w.microbatches, lay.zero
    if n == 1:
        return []
    if zero == 0:
        return [entry(axis, "all_reduce", "bwd", link, n, 1, full)]
    if zero == 1:
        return [entry(axis, "reduce_scatter", "bwd", link, n, 1, full),
                entry(axis, "all_gather", "step", link, n, 1, full)]
    # A pipeline stage keeps a unit whole from its first backward to the step's end; gradients are reduced once.
    if lay.pp > 1:
        gathers = {"fwd": m, "bwd": 1} if zero == 3 else {"fwd": 1}
    else:
        gathers = {"fwd": m, "bwd": m} if zero == 3 else {"fwd": m}
    out = [entry(axis, "all_gather", phase, link, n, count, full) for phase, count in gathers.items()]
    return out + [entry(axis, "reduce_scatter", "bwd", link, n, 1, full)]


def _hybrid_entries(lay: Layout, w: Work, gpus_per_node: int) -> list[CommEntry]:
    shard, replicate = hybrid_groups(lay)
    s, r = len(shard[0]), len(replicate[0])
    psi = sharded_psi(lay, w)
    out = _sharded_entries("dp_shard", lay, s, groups_link(shard, gpus_per_node), w, psi)
    if r > 1:
        grad_shard = psi * w.elem_bytes / s
        out.append(entry("dp_replicate", "all_reduce", "bwd", groups_link(replicate, gpus_per_node), r, 1, grad_shard))
    return out


def tp_entries(lay: Layout, w: Work, gpus_per_node: int) -> list[CommEntry]:
    """Megatron's block-output all-reduces (or SP's all-gather + reduce-scatter pairs),
    then the embedding and head collectives of a per-tensor model."""
    if lay.tp == 1 or w.hidden is None or w.layers_on_rank is None:
        return []
    link = axis_link(lay, "tp", gpus_per_node)
    payload = tp_allreduce_bytes(w.micro_batch, w.seq_len, w.hidden, w.elem_bytes)
    halves = 2 * w.layers_on_rank - w.moe_layers  # a MoE block's experts are whole on every tp rank: no MLP collective
    input_grads = (w.layers_on_rank - w.moe_layers) * w.mlp_allreduces + w.layers_on_rank * w.qkv_allreduces
    m, n, sp, out = w.microbatches, lay.tp, lay.sequence_parallel, []
    # Recomputing a block, torch's checkpoint stops once backward has what it saved: a dense block's last output
    # collective, its MLP's, is not run again (a MoE block's one, its attention's, is: the experts need it).
    outputs = {"fwd": halves, "recompute": w.layers_on_rank}
    for phase in _phases(lay):
        if not halves:
            continue
        if not sp:
            out.append(entry("tp", "all_reduce", phase, link, n, outputs.get(phase, input_grads) * m, payload))
            continue
        out.append(entry("tp", "all_gather", phase, link, n, halves * m, payload))
        if phase == "bwd" and w.sp_between_blocks:
            out.append(entry("tp", "all_reduce", phase, link, n, input_grads * m, payload))
        else:
            out.append(entry("tp", "reduce_scatter", phase, link, n, outputs.get(phase, halves) * m, payload))
    if sp:
        out += _sp_stream_entries(w, link, n, payload)
    return out + _tp_outer_entries(lay, w, link, payload)


def _sp_stream_entries(w: Work, link: str, n: int, payload: float) -> list[CommEntry]:
    """Under SP, the norms' partial gradients and, for a model the user brought, the stream's cut and gather."""
    m, out = w.microbatches, []
    norms = 2 * w.layers_on_rank + (w.last_stage and not w.sp_between_blocks)  # the final norm, when it is cut
    if norms:
        out.append(entry("tp", "all_reduce", "bwd", link, n, norms * (1 + w.norm_bias) * m, w.hidden * w.elem_bytes))
    if w.sp_between_blocks and w.layers_on_rank:
        if w.first_stage:  # the first block's input cut from the whole stream: its gradient gathered
            out.append(entry("tp", "all_gather", "bwd", link, n, m, payload))
        if w.last_stage:  # the last block's output gathered whole for the final norm
            out.append(entry("tp", "all_gather", "fwd", link, n, m, payload))
    return out


def _tp_outer_entries(lay: Layout, w: Work, link: str, payload: float) -> list[CommEntry]:
    """The row-parallel embeddings' outputs and the column-parallel head's input and logits."""
    m, n, out = w.microbatches, lay.tp, []
    cut = lay.sequence_parallel and not w.sp_between_blocks  # Megatron's SP: the ends meet a cut stream
    if w.sharded_ends and w.first_stage:  # the token embedding (b, s, h), then the positions (s, h)
        for size in (payload, payload / w.micro_batch) if w.learned_pos else (payload,):
            if cut:
                out += [entry("tp", "reduce_scatter", "fwd", link, n, m, size),
                        entry("tp", "all_gather", "bwd", link, n, m, size)]
            else:
                out.append(entry("tp", "all_reduce", "fwd", link, n, m, size))
    if w.sharded_ends and w.last_stage and w.vocab is not None:
        if cut:  # the head's input (b, s/tp, h) is gathered, its gradient scattered
            out += [entry("tp", "all_gather", "fwd", link, n, m, payload),
                    entry("tp", "reduce_scatter", "bwd", link, n, m, payload)]
        else:
            out.append(entry("tp", "all_reduce", "bwd", link, n, m, payload))  # input gradient (b, s, h)
        if lay.loss_parallel:  # max, sum of exp and target logit, each (b, s)
            out.append(entry("tp", "all_reduce", "fwd", link, n, 3 * m, payload / w.hidden))
        else:
            logits = payload / w.hidden * w.vocab
            out.append(entry("tp", "all_gather", "fwd", link, n, m, logits))  # (b, s, V/tp) -> (b, s, V)
    return out


def pp_entries(lay: Layout, w: Work, gpus_per_node: int) -> list[CommEntry]:
    """Stage-boundary sends: a middle stage's (activations forward, gradients backward),
    or with ``w.stage_ids`` exactly this pipeline rank's."""
    if lay.pp == 1 or w.hidden is None:
        return []
    link = axis_link(lay, "pp", gpus_per_node)
    # Under SP a stage hands over its s/tp positions of the stream, cut as it is.
    payload = pp_p2p_bytes(w.micro_batch, w.seq_len, w.hidden, w.elem_bytes) / (lay.tp if lay.sequence_parallel else 1)
    fwd = bwd = w.microbatches * lay.stages_per_rank
    if w.stage_ids:
        mine, last = set(w.stage_ids), w.num_stages - 1
        fwd = w.microbatches * sum(1 for s in mine if s < last and s + 1 not in mine)
        bwd = w.microbatches * sum(1 for s in mine if s > 0 and s - 1 not in mine)
    out = []
    if fwd:
        out.append(entry("pp", "p2p", "fwd", link, lay.pp, fwd, payload))
    if bwd:
        out.append(entry("pp", "p2p", "bwd", link, lay.pp, bwd, payload))
    if w.tied_table:  # the first and last stages' copies of a tied table: their gradients summed, every pp rank
        out.append(entry("pp", "all_reduce", "step", link, lay.pp, 1, w.tied_table * w.elem_bytes))
    return out


def _phases(lay: Layout) -> list[str]:
    """The passes a block's forward collectives run in: selective checkpointing keeps their outputs, so only a
    full recompute runs them again."""
    return ["fwd", "bwd"] + (["recompute"] if lay.activation_checkpointing is True else [])


def ep_entries(lay: Layout, w: Work, gpus_per_node: int) -> list[CommEntry]:
    """The MoE layers' all-to-alls over the expert group, and the expert gradients' all-reduce over the ranks
    that hold the same experts (module docstring)."""
    if lay.ep == 1 or w.hidden is None or not w.moe_layers:
        return []
    payload, link = ep_all_to_all_bytes(w.dispatched, w.hidden, w.elem_bytes), axis_link(lay, "ep", gpus_per_node)
    out = [entry("ep", "all_to_all", phase, link, lay.ep, 2 * w.moe_layers * w.microbatches, payload)
           for phase in _phases(lay)]
    # Before each forward dispatch the ranks exchange how many tokens go to each expert: E int64 counts.
    out += [entry("ep", "all_to_all", phase, link, lay.ep, w.moe_layers * w.microbatches, 8 * w.experts)
            for phase in _phases(lay) if phase != "bwd"]
    replicas = lay.data_ranks // lay.ep
    if replicas > 1:
        out.append(entry("ep_replicate", "all_reduce", "bwd", axis_link(lay, "ep_replicate", gpus_per_node),
                         replicas, 1, w.expert_psi * w.elem_bytes))
    return out


def cp_entries(lay: Layout, w: Work, gpus_per_node: int) -> list[CommEntry]:
    """Ring attention's sends per attention layer and micro-batch: cp-1 key/value blocks forward (and in a full
    recompute); backward, the blocks go round again (cp-1 sends) beside their float32 gradient, which travels cp
    steps to end at the block's owner (``kernels.parallel.ring_attention``, FlashAttention-2's backward on a ring)."""
    if lay.cp == 1 or w.kv_dim is None or w.layers_on_rank is None:
        return []
    kv_dim = w.kv_dim // lay.tp  # TP leaves each rank its kv_heads/tp heads, and the ring carries only those
    payload = cp_ring_bytes(w.micro_batch, w.seq_len, kv_dim, w.elem_bytes)
    calls, link = w.layers_on_rank * w.microbatches, axis_link(lay, "cp", gpus_per_node)
    out = [entry("cp", "p2p", phase, link, lay.cp, (lay.cp - 1) * calls, payload) for phase in _phases(lay)]
    grads = cp_ring_bytes(w.micro_batch, w.seq_len, kv_dim, 4)  # accumulated in float32
    return out + [entry("cp", "p2p", "bwd", link, lay.cp, lay.cp * calls, grads)]


def all_entries(lay: Layout, w: Work, gpus_per_node: int) -> tuple[CommEntry, ...]:
    """Every entry of one iteration: dp, tp, pp, then ep and cp."""
    return tuple(dp_entries(lay, w, gpus_per_node) + tp_entries(lay, w, gpus_per_node)
                 + pp_entries(lay, w, gpus_per_node) + ep_entries(lay, w, gpus_per_node)
                 + cp_entries(lay, w, gpus_per_node))
