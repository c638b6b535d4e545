"""Per-iteration tensor-parallel traffic of one rank (the tp axis of ``lab.planning.plan_comm``).

Counted as ``lab.planning.plan_comm`` counts every axis (nccl-tests' payloads), per iteration with M
micro-batches:

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
- A MoE block under TP all-reduces only its attention's output forward (and the q/k/v input gradient
  backward): the experts are whole on every tp rank.

Every payload is in the run's one dtype. Under ``torch.autocast`` (bf16 compute over fp32 weights, no FSDP)
only what a matmul outputs is bf16: the row-parallel outputs forward, under SP their gradients gathered
backward, and the logits; the embeddings' outputs, the gathered norm outputs and the input gradients
(cast back to the fp32 input's dtype before they are summed) stay fp32. Those entries say
``matmul_output``, so a caller can size them apart (``lab.measure.comm_prediction``). Pure Python; no torch.
"""
from __future__ import annotations

from lab.planning.plan_math import tp_allreduce_bytes
from lab.planning.plan_mesh import Layout, axis_link
from lab.planning.plan_work import CommEntry, Work, entry, phases


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
    for phase in phases(lay):
        if not halves:
            continue
        backward = phase == "bwd"  # the input gradients, or under SP also the outputs' gradients gathered
        if not sp:
            out.append(entry("tp", "all_reduce", phase, link, n, outputs.get(phase, input_grads) * m, payload,
                             matmul_output=not backward))
            continue
        out.append(entry("tp", "all_gather", phase, link, n, halves * m, payload, matmul_output=backward))
        if backward and w.sp_between_blocks:
            out.append(entry("tp", "all_reduce", phase, link, n, input_grads * m, payload))
        else:
            out.append(entry("tp", "reduce_scatter", phase, link, n, outputs.get(phase, halves) * m, payload,
                             matmul_output=not backward))
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
            out.append(entry("tp", "all_gather", "fwd", link, n, m, logits, matmul_output=True))  # -> (b, s, V)
    return out
