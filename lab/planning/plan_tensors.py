"""The lab GPT's parameter tensors as the planner sizes them: shapes, TP split, pipeline owner, experts.

``gpt_tensors(spec)`` lists ``kernels.model.gpt.GPT.named_parameters()`` for a ``ModelSpec.from_gpt`` spec
(``per_tensor=True``), each with the dim ``kernels.parallel.tensor_parallel``'s plan shards and the stage
that holds it; ``lab.planning.plan_stages`` sums them per rank instead of taking an even Ψ/(tp·pp).
A mixture-of-experts block (``kernels.model.moe``) holds a router and packed expert tensors (E, in, out):
TP keeps them whole (the lab's TP plan splits a MoE block's attention only) and EP splits dim 0, the experts.
Pure Python; no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lab.planning.plan_models import ModelSpec
from lab.planning.plan_moe import moe_layer_ids

@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of a per-tensor model: its shape, TP split and pipeline owner."""

    name: str  # as in kernels.model.gpt.GPT.named_parameters()
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim TP shards (kernels.parallel.tensor_parallel's plans); None = replicated
    owner: str  # "embed" (first stage), "block" (stage of its block), "head" (last stage)
    block: int | None = None  # the block index, for owner "block"
    expert: bool = False  # packed experts (E, ...): expert parallelism splits dim 0, ZeRO leaves them whole under it

    @property
    def numel(self) -> int:
        """Elements of the whole tensor."""
        return math.prod(self.shape)

    def tp_numel(self, tp: int, tp_index: int = 0) -> int:
        """Elements on tp rank ``tp_index``: the tp dim chunked as torch.chunk does (ceil, the last fewer)."""
        if self.tp_dim is None or tp == 1:
            return self.numel
        d = self.shape[self.tp_dim]
        c = math.ceil(d / tp)
        return self.numel // d * max(0, min(c, d - tp_index * c))


def _linear(prefix: str, d_out: int, d_in: int, bias: bool, style: str, **where: Any) -> list[TensorSpec]:
    """nn.Linear's weight (out, in) and bias (out,): colwise shards dim 0 of both, rowwise
    dim 1 of the weight and replicates the bias (it is added after the all-reduce)."""
    out = [TensorSpec(f"{prefix}.weight", (d_out, d_in), {"col": 0, "row": 1}.get(style), **where)]
    if bias:
        out.append(TensorSpec(f"{prefix}.bias", (d_out,), 0 if style == "col" else None, **where))
    return out


def gpt_tensors(m: ModelSpec) -> tuple[TensorSpec, ...]:
    """The lab GPT's parameters in model order, with kernels.parallel.tensor_parallel's TP plan.

    Embeddings are row-parallel (Shard(0): vocab rows, position rows), the LM head
    column-parallel (Shard(0): vocab), q/k/v/fc_in column-parallel, out/fc_out
    row-parallel; LayerNorms are replicated (sequence parallelism shards their input,
    not their weights). A MoE block's router and experts are replicated over tp.
    """
    if not m.has_shape or m.ffn is None or m.vocab is None or m.gated_mlp or m.tied_embeddings:
        raise ValueError(f"{m.name}: per-tensor sizing needs the lab GPT's shape (untied, GELU MLP)")
    h, kv = m.hidden, (m.kv_heads or m.heads or 1) * (m.hidden // (m.heads or 1))
    out = [TensorSpec("tok_emb.weight", (m.vocab, h), 0, "embed")]
    if m.learned_pos:
        out.append(TensorSpec("pos_emb.weight", (m.seq_len, h), 0, "embed"))
    routed = set(moe_layer_ids(m))
    for i in range(m.layers):
        blk, b = {"owner": "block", "block": i}, f"blocks.{i}."
        out += _norm(b + "attn_norm", h, m.bias, **blk)
        for name, width in (("q", h), ("k", kv), ("v", kv)):
            out += _linear(b + "attn." + name, width, h, m.bias, "col", **blk)
        out += _linear(b + "attn.out", h, h, m.bias, "row", **blk)
        out += _norm(b + "mlp_norm", h, m.bias, **blk)
        out += _experts(m, **blk) if i in routed else (_linear(b + "mlp.fc_in", m.ffn, h, m.bias, "col", **blk)
                                                     + _linear(b + "mlp.fc_out", h, m.ffn, m.bias, "row", **blk))
    out += _norm("norm", h, m.bias, owner="head")
    return tuple(out + _linear("lm_head", m.vocab, h, False, "col", owner="head"))


def _norm(prefix: str, h: int, bias: bool, **where: Any) -> list[TensorSpec]:
    return [TensorSpec(f"{prefix}.{k}", (h,), None, **where) for k in (("weight", "bias") if bias else ("weight",))]


def _experts(m: ModelSpec, **blk: Any) -> list[TensorSpec]:
    """A MoE block's router (E, h), then ``kernels.model.moe.PackedExperts``' w_in (E, h, f) and w_out (E, f, h),
    each followed by its bias when the model has biases."""
    b, e, h, f = f"blocks.{blk['block']}.mlp.", m.experts, m.hidden, m.expert_ffn or m.ffn
    out = [TensorSpec(b + "router.weight", (e, h), None, **blk)]
    for part, (fan_in, fan_out) in (("in", (h, f)), ("out", (f, h))):
        out.append(TensorSpec(f"{b}experts.w_{part}", (e, fan_in, fan_out), None, **blk, expert=True))
        if m.bias:
            out.append(TensorSpec(f"{b}experts.b_{part}", (e, fan_out), None, **blk, expert=True))
    return out
