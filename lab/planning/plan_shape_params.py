"""A pipeline rank's dense parameters counted from a model's shape, after tensor parallelism.

For a model the planner sizes from its shape (a preset, a ``lab.Llama``, a Hugging Face config) rather than
tensor by tensor (the lab's GPT: ``lab.planning.plan_tensors``), each part of a block and each end of the
model is divided by tp only where the TP plan splits it:

- split: the matrices (q, k, v and the MLP's up projections by columns, the output projections by rows)
  and the column-parallel biases;
- whole on every tp rank: the norms (and q/k norms), the row-parallel biases, and a MoE block's router and
  shared experts (the lab's plan splits a MoE block's attention only; the routed experts are EP's, counted
  apart in ``plan_moe.routed_params_in``);
- the embeddings and the head split by vocabulary rows, unless the model's plan leaves them whole
  (``ModelSpec.whole_ends``: GPT-2 under the lab's plan).

Under a pipeline the first stage holds the embeddings, the last the final norm and the head (a tied head
as its own copy of the table). A preset's parts are scaled by its round figure over its shape's count.
Pure Python; no torch.
"""
from __future__ import annotations

from lab.planning.plan_models import ModelSpec
from lab.planning.plan_moe import mlp_params, moe_layer_ids


def held_dense(spec: ModelSpec, tp: int, blocks: set[int], first: bool, last: bool) -> float | None:
    """Dense (non-routed) parameters on one tp rank of the pipeline rank holding ``blocks`` and, when ``first`` /
    ``last``, the model's first / last stage; None for a model without a shape to count."""
    count = spec.shape_params
    if count is None:
        return None
    h, heads = spec.hidden, spec.heads or 1
    head_dim = spec.head_dim or h // heads
    q_dim, kv_dim = heads * head_dim, (spec.kv_heads or heads) * head_dim
    attn_split = 2 * h * q_dim + 2 * h * kv_dim + (q_dim + 2 * kv_dim if spec.bias or spec.qkv_bias else 0)
    block_whole = (4 if spec.bias else 2) * h + (2 * head_dim if spec.qk_norm else 0) + (h if spec.bias else 0)
    mlp_whole = h if spec.bias else 0  # the down projection's bias, added after its reduce
    mlp_split = mlp_params(h, spec.ffn, spec.gated_mlp, spec.bias) - mlp_whole
    width = spec.expert_ffn or spec.ffn
    moe_whole = h * spec.experts + spec.shared_experts * mlp_params(h, width, spec.gated_mlp, spec.bias)
    routed = len(blocks & set(moe_layer_ids(spec)))
    held = len(blocks) * (attn_split / tp + block_whole) + (len(blocks) - routed) * (mlp_split / tp + mlp_whole)
    held += routed * moe_whole
    ends = 1 if spec.whole_ends else tp
    table = spec.vocab * h
    if first:
        held += (table + (spec.seq_len * h if spec.learned_pos else 0)) / ends
    if last:  # the final norm, and the head unless it is the table the first stage already holds here
        held += (2 if spec.bias else 1) * h + (0 if spec.tied_embeddings and first else table / ends)
    return held * spec.params / count
