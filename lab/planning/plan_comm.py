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
- tp axis: ``lab.planning.plan_comm_tp``.
- ep axis (experts split over ep ranks, docs/design.md#experts-and-context-parallelism): per MoE layer and
  micro-batch two all-to-alls forward (dispatch, combine) and two backward, of the rank's dispatched
  token copies (tokens·top_k·hidden), two more under full recompute; ep_replicate: one all-reduce of
  the rank's expert gradients over the dp/ep · cp ranks holding the same experts, after accumulation.
- cp axis (ring attention, ``kernels.parallel.ring_attention``): per attention layer and micro-batch
  cp-1 sends of the rank's key/value block forward and cp-1 of its gradient backward (the ring keeps
  the blocks it received, so backward sends no k/v again), cp-1 more under full recompute. Every
  other payload is sized with the rank's s/cp tokens.
- pp axis: per micro-batch and virtual stage, one activation send forward and one
  gradient send backward (of s/tp positions under SP). A middle stage does both; the first and last do one;
  a head tied to the embedding adds one all-reduce of the table's gradient over the pp ranks per step. With
  ``Work.stage_ids`` (one pipeline rank's stages) the sends are that rank's own: a
  forward send for each stage whose successor is on another rank, a backward send for
  each stage whose predecessor is (the V schedules keep the turn on one rank).
Pure Python; no torch.
"""
from __future__ import annotations

from lab.planning.plan_comm_tp import tp_entries
from lab.planning.plan_math import cp_ring_bytes, ep_all_to_all_bytes, pp_p2p_bytes
from lab.planning.plan_mesh import Layout, axis_link, groups_link, hybrid_groups
from lab.planning.plan_work import CommEntry, Work, entry, phases


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


def ep_entries(lay: Layout, w: Work, gpus_per_node: int) -> list[CommEntry]:
    """The MoE layers' all-to-alls over the expert group, and the expert gradients' all-reduce over the ranks
    that hold the same experts (module docstring)."""
    if lay.ep == 1 or w.hidden is None or not w.moe_layers:
        return []
    payload, link = ep_all_to_all_bytes(w.dispatched, w.hidden, w.elem_bytes), axis_link(lay, "ep", gpus_per_node)
    out = [entry("ep", "all_to_all", phase, link, lay.ep, 2 * w.moe_layers * w.microbatches, payload)
           for phase in phases(lay)]
    # Before each forward dispatch the ranks exchange how many tokens go to each expert: E int64 counts.
    out += [entry("ep", "all_to_all", phase, link, lay.ep, w.moe_layers * w.microbatches, 8 * w.experts)
            for phase in phases(lay) if phase != "bwd"]
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
    out = [entry("cp", "p2p", phase, link, lay.cp, (lay.cp - 1) * calls, payload) for phase in phases(lay)]
    grads = cp_ring_bytes(w.micro_batch, w.seq_len, kv_dim, 4)  # accumulated in float32
    return out + [entry("cp", "p2p", "bwd", link, lay.cp, lay.cp * calls, grads)]


def all_entries(lay: Layout, w: Work, gpus_per_node: int) -> tuple[CommEntry, ...]:
    """Every entry of one iteration: dp, tp, pp, then ep and cp."""
    return tuple(dp_entries(lay, w, gpus_per_node) + tp_entries(lay, w, gpus_per_node)
                 + pp_entries(lay, w, gpus_per_node) + ep_entries(lay, w, gpus_per_node)
                 + cp_entries(lay, w, gpus_per_node))
