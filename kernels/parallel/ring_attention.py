"""Ring attention for context parallelism: each rank keeps its query block and passes key/value blocks around.

Context parallelism (CP) splits every sequence over the ``cp`` ranks of a group. Causal attention
then needs every earlier key, so the ranks form a ring (Liu et al. 2023, "Ring Attention with
Blockwise Transformers"): in ``cp`` steps each rank attends its queries to the key/value block it
holds, sends that block on to the next rank and receives the previous rank's, and merges the
partial results with the log-sum-exp rule (the online softmax of FlashAttention). The transfer of
the next block is posted before the current block is computed, so communication hides behind it.

Load balance is the zig-zag layout (Brandon et al. 2023, "Striped Attention"; the layout of torch's
``context_parallel`` and Megatron-LM's CP): the sequence is cut into ``2*cp`` chunks and rank ``r``
holds chunks ``r`` and ``2*cp-1-r``, so every rank has an early and a late chunk and the same
causal work. Per step a rank computes whole chunk pairs only: a key chunk after a query chunk is
skipped, the diagonal pair is causal, an earlier chunk is attended in full.

Grouped-query attention: key/value travel with their own (fewer) heads and are expanded only for
the compute, as ``F.scaled_dot_product_attention(enable_gqa=True)`` expands them.

Backward is one more pass around the ring, FlashAttention-2's backward (Dao, 2023) as torch's ring
attention runs it: the forward keeps only q, k, v, the output and its log-sum-exp (O(T/cp) per head,
not a score block per chunk pair), and each pair's probabilities are recomputed from its scores and
the final log-sum-exp. Each k/v block travels the ring again with a float32 gradient accumulator to
which every rank adds its queries' share; after the last step it goes on to the block's owner.

Run alone (four CPU ranks: the error against one process's SDPA, and each rank's steps)::

    python -m kernels.parallel.ring_attention
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.parallel.ring_transfer import Ring

PositionsOf = Callable[[int, int, int], torch.Tensor]  # (seq_len, cp, cp_rank) -> global positions held
_forward_depth = threading.local()  # > 0 while this thread runs a ring's forward (``computing_ring``)


def computing_ring() -> bool:
    """Whether this thread is inside a ring attention's forward: selective checkpointing recomputes the ring
    whole, as it does SDPA, instead of keeping its score matmuls (``kernels.parallel.activation_checkpoint``)."""
    return getattr(_forward_depth, "n", 0) > 0


def zigzag_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions rank ``cp_rank`` of ``cp`` holds: chunks ``cp_rank`` and ``2*cp-1-cp_rank`` of ``2*cp``.

    Raises ValueError unless ``seq_len`` splits into ``2*cp`` equal chunks.
    """
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank {cp_rank} is not a rank of cp={cp}")
    if seq_len % (2 * cp):
        raise ValueError(f"context parallelism cp={cp} cuts the sequence into 2*cp={2 * cp} equal chunks, "
                         f"but seq_len={seq_len} is not a multiple of {2 * cp}")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp - 1 - cp_rank)])


def _chunk_starts(positions: torch.Tensor, chunk: int) -> tuple[int, int]:
    """The first positions of a rank's two chunks; each chunk must be a whole aligned chunk of the sequence,
    which makes every (query chunk, key chunk) pair wholly before, wholly after, or the diagonal."""
    starts = []
    for run in positions.split(chunk):
        start = int(run[0])
        if len(run) != chunk or start % chunk or not torch.equal(run, torch.arange(start, start + chunk)):
            raise ValueError(f"a rank's positions must be two aligned runs of {chunk} consecutive positions, "
                             f"got {positions.tolist()}")
        starts.append(start)
    return starts[0], starts[1]


def _layout(seq_len: int, cp: int, positions_of: PositionsOf) -> list[tuple[int, int]]:
    """Every rank's chunk starts, checked to cover the sequence exactly once."""
    chunk = seq_len // (2 * cp)
    starts = [_chunk_starts(positions_of(seq_len, cp, r), chunk) for r in range(cp)]
    if sorted(s for pair in starts for s in pair) != list(range(0, seq_len, chunk)):
        raise ValueError(f"the ranks' positions do not cover the sequence of {seq_len} exactly once: {starts}")
    return starts


@dataclass(frozen=True)
class _Plan:
    """What both passes need: the ring, every rank's chunk starts, the chunk length, query heads per kv head,
    the scale."""

    ring: Ring
    starts: list[tuple[int, int]]
    chunk: int
    kv_groups: int
    scale: float

    def pairs(self, kv_rank: int) -> list[tuple[int, int, bool]]:
        """(query chunk, key chunk, diagonal) this rank computes against ``kv_rank``'s block: a key chunk wholly
        in a query chunk's future is skipped, the diagonal pair is causal, an earlier chunk is attended in full."""
        return [(qi, ki, k_start == q_start) for qi, q_start in enumerate(self.starts[self.ring.rank])
                for ki, k_start in enumerate(self.starts[kv_rank]) if k_start <= q_start]


def _expand(block: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, kv_heads, n, hd) -> (B, heads, n, hd), each kv head repeated for its query heads (GQA)."""
    return block.repeat_interleave(groups, dim=1) if groups > 1 else block


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of ``_expand``: (B, heads, n, hd) summed back over each kv head's query heads."""
    return grad.unflatten(1, (-1, groups)).sum(2) if groups > 1 else grad


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """One query chunk's scaled scores against one key chunk (float32); ``causal``: the diagonal pair, where both
    chunks hold the same positions, so the lower triangle is kept."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores.float()  # a bf16 log-sum-exp would lose the merge's precision


def _pair_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one query chunk to one key chunk: the output (input dtype) and its log-sum-exp (float32)."""
    scores = _scores(q, k, scale, causal)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.matmul(torch.exp(scores - lse).to(v.dtype), v), lse


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None,
           part: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint keys made one, by the log-sum-exp rule (accumulated in float32)."""
    out, lse = part
    if acc is None:
        return out.float(), lse
    acc_out, acc_lse = acc
    merged = torch.logaddexp(acc_lse, lse)
    return acc_out * torch.exp(acc_lse - merged) + out.float() * torch.exp(lse - merged), merged


def _pair_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d_out: torch.Tensor, delta: torch.Tensor,
                lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pair's share of dq, dk, dv (heads expanded). ``lse`` is the query chunk's log-sum-exp over every key,
    so exp(scores - lse) is this pair's part of the whole softmax; ``delta`` = rowsum(d_out * out)."""
    probs = torch.exp(_scores(q, k, scale, causal) - lse)  # (B, h, c, c) float32
    dv = torch.matmul(probs.to(d_out.dtype).transpose(-2, -1), d_out)
    d_scores = (probs * (torch.matmul(d_out, v.transpose(-2, -1)).float() - delta) * scale).to(q.dtype)
    return torch.matmul(d_scores, k), torch.matmul(d_scores.transpose(-2, -1), q), dv


def _ring_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan,
                  steps: list[dict] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's output (q's dtype) and log-sum-exp (float32) over every key, in cp steps around the ring."""
    ring, chunk = plan.ring, plan.chunk
    q_chunks = q.split(chunk, dim=2)
    acc: list[tuple[torch.Tensor, torch.Tensor] | None] = [None, None]
    kv = torch.stack([k, v])  # one block, one message per step; it travels with kv_heads, not heads
    began = time.perf_counter()
    for step in range(ring.cp):
        kv_rank = (ring.rank - step) % ring.cp
        transfer = ring.forward(kv) if step < ring.cp - 1 else None  # posted first, so it overlaps the compute
        computed_at = time.perf_counter()
        k_chunks, v_chunks = (_expand(t, plan.kv_groups).split(chunk, dim=2) for t in kv.unbind(0))
        pairs = plan.pairs(kv_rank)
        for qi, ki, diagonal in pairs:
            acc[qi] = _merge(acc[qi], _pair_attention(q_chunks[qi], k_chunks[ki], v_chunks[ki], plan.scale, diagonal))
        waited_at = time.perf_counter()
        if transfer is not None:
            kv = transfer.wait()
        if steps is not None:
            done = time.perf_counter()
            steps.append({"step": step, "kv_rank": kv_rank, "start_s": computed_at - began,
                          "compute_s": waited_at - computed_at, "wait_s": done - waited_at,
                          "sent_bytes": transfer.nbytes if transfer else 0, "chunk_pairs": len(pairs)})
    # Each query chunk attends at least its own diagonal (step 0), so both accumulators are set. The output is laid
    # out (B, T/cp, heads, hd), as SDPA lays out its own: the caller's transpose to (B, T/cp, C) is then a view,
    # and the tensor this node keeps is the one the output projection keeps.
    out = torch.cat([out.transpose(1, 2) for out, _ in acc], dim=1).to(q.dtype).transpose(1, 2)
    return out, torch.cat([lse for _, lse in acc], dim=2)


def _ring_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   d_out: torch.Tensor, plan: _Plan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv of the rank's blocks: each k/v block goes around the ring again with its gradient (float32),
    every rank adds its queries' share, and after the last step the gradient goes home to the block's owner."""
    ring, chunk = plan.ring, plan.chunk
    delta = (d_out.float() * out.float()).sum(-1, keepdim=True)  # (B, h, T/cp, 1)
    q_c, do_c, delta_c, lse_c = (t.split(chunk, dim=2) for t in (q, d_out, delta, lse))
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = torch.stack([k, v])
    dkv = torch.zeros_like(kv, dtype=torch.float32)
    for step in range(ring.cp):
        kv_rank = (ring.rank - step) % ring.cp
        transfer = ring.forward(kv) if step < ring.cp - 1 else None  # the next block, while this one's grads compute
        k_chunks, v_chunks = (_expand(t, plan.kv_groups).split(chunk, dim=2) for t in kv.unbind(0))
        dq_c, (dk_c, dv_c) = dq.split(chunk, dim=2), (t.split(chunk, dim=2) for t in dkv.unbind(0))  # views
        for qi, ki, diagonal in plan.pairs(kv_rank):
            dq_p, dk_p, dv_p = _pair_grads(q_c[qi], k_chunks[ki], v_chunks[ki], do_c[qi], delta_c[qi], lse_c[qi],
                                           plan.scale, diagonal)
            dq_c[qi].add_(dq_p)
            dk_c[ki].add_(_fold(dk_p, plan.kv_groups))
            dv_c[ki].add_(_fold(dv_p, plan.kv_groups))
        if ring.cp > 1:  # on with the block; after the last step, from the owner's predecessor to the owner
            dkv = ring.forward(dkv).wait()
        if transfer is not None:
            kv = transfer.wait()
    dk, dv = dkv.unbind(0)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring attention as one autograd node: it keeps q, k, v, the output and its log-sum-exp, no score blocks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: _Plan,
                steps: list[dict] | None) -> torch.Tensor:
        _forward_depth.n = getattr(_forward_depth, "n", 0) + 1
        try:
            out, lse = _ring_forward(q, k, v, plan, steps)
        finally:
            _forward_depth.n -= 1
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (*_ring_backward(*ctx.saved_tensors, d_out, ctx.plan), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                   positions_of: PositionsOf = zigzag_positions, scale: float | None = None,
                   steps: list[dict] | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence for this rank's query block, by ring attention over ``group``.

    ``q``: (B, heads, T/cp, head_dim); ``k``, ``v``: (B, kv_heads, T/cp, head_dim) with ``heads`` a multiple
    of ``kv_heads``; all three hold this rank's positions ``positions_of(T, cp, cp_rank)`` in that order (the
    zig-zag layout by default; any layout of aligned whole chunks, two per rank, works). ``group``: the CP
    group (default: the world). ``scale``: SDPA's (default 1/sqrt(head_dim)). Returns (B, heads, T/cp,
    head_dim): full causal ``F.scaled_dot_product_attention`` at this rank's positions, differentiable.

    ``steps``: if given, one dict per ring step is appended (forward only): ``step``, ``kv_rank`` (the CP rank
    whose block was attended), ``start_s`` (seconds from the call's start to the step's start, when the next
    block's transfer is posted and the compute begins), ``compute_s``, ``wait_s`` (waiting for the next block
    after the compute), ``sent_bytes`` (the k/v block; 0 on the last step, which sends nothing) and
    ``chunk_pairs`` (query/key chunk pairs computed). Times are host clocks: on a GPU, ``compute_s`` is the
    kernels' launch unless the device is synchronized.
    """
    group = group or dist.group.WORLD
    ring = Ring(group)
    same_but_heads = (k.shape[0], *k.shape[2:]) == (q.shape[0], *q.shape[2:])
    if q.dim() != 4 or k.shape != v.shape or not same_but_heads or q.shape[1] % k.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} and k, v {tuple(k.shape)}, {tuple(v.shape)} must be "
                         "(B, heads, T/cp, head_dim) with heads a multiple of k and v's heads")
    seq_len = q.shape[2] * ring.cp
    zigzag_positions(seq_len, ring.cp, ring.rank)  # the same divisibility rule, whatever the layout
    plan = _Plan(ring, _layout(seq_len, ring.cp, positions_of), seq_len // (2 * ring.cp), q.shape[1] // k.shape[1],
                 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)
    return _RingAttention.apply(q, k, v, plan, steps)


def _selftest(rank: int, port: int, world: int) -> None:
    import os

    torch.set_num_threads(1)  # four ranks share the machine's cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 16 * world, 8, generator=gen) for heads in (4, 2, 2))
    mine = zigzag_positions(q.shape[2], world, rank)
    steps: list[dict] = []
    out = ring_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], steps=steps)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, mine]
    print(f"rank {rank}: max error {float((out - full).abs().max()):.2e}; steps:", *steps, sep="\n  ")
    dist.destroy_process_group()


if __name__ == "__main__":
    from kernels.engine.run_alone import spawn_with_port

    spawn_with_port(_selftest, 4, 4)
