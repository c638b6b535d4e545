"""Mixtures of experts as the planner counts them: which layers route, their weights, and what they move.

A MoE layer (Shazeer et al. 2017; Mixtral, Jiang et al. 2024) replaces a block's MLP by a bias-free router
(hidden × E) and E expert MLPs of width ``expert_ffn``, of which each token uses ``top_k``; ``shared_experts``
more of the same width run on every token (DeepSeek's, Qwen2-MoE's), and count as dense weights. A ``ModelSpec``
with ``experts`` > 0 routes in layer i when i >= ``dense_first`` and (i + 1) % ``moe_every`` == 0 (HF's
``decoder_sparse_step`` and DeepSeek's ``first_k_dense_replace``); the lab's GPT and Llama route in every layer.

Sizing rules (docs/design.md#experts-and-context-parallelism):

- parameters: total = the shape's count; active per token = total less the (E - top_k) idle routed experts
  of every MoE layer;
- tensor parallelism does not split experts (the lab's TP plan splits the attention of a MoE block and
  keeps the experts whole on every tp rank), expert parallelism does: E/ep experts per rank;
- tokens dispatched per micro-batch: b·s·top_k (dropless), or with ``capacity_factor`` c at most
  E·ceil(c·s·top_k/E) per sequence (``kernels.model.moe.expert_capacity``), whichever is smaller.
Pure Python; no torch.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # ModelSpec counts itself with these functions: a runtime import would be circular
    from lab.planning.plan_models import ModelSpec


def mlp_params(hidden: int, width: int, gated: bool, bias: bool) -> int:
    """Weights of one MLP (or one expert): two matrices, three when gated (SwiGLU), and their biases."""
    return (3 if gated else 2) * hidden * width + ((width + hidden) if bias else 0)


def moe_layer_ids(spec: ModelSpec) -> tuple[int, ...]:
    """The blocks whose MLP is a mixture of experts (module docstring); () for a dense model."""
    if not spec.experts or spec.layers is None:
        return ()
    return tuple(i for i in range(spec.layers) if i >= spec.dense_first and (i + 1) % spec.moe_every == 0)


def routed_layer_params(spec: ModelSpec) -> int:
    """Weights of one MoE layer's E routed experts (what expert parallelism splits)."""
    width = spec.expert_ffn or spec.ffn
    return spec.experts * mlp_params(spec.hidden, width, spec.gated_mlp, spec.bias)


def moe_layer_params(spec: ModelSpec) -> int:
    """Weights of one MoE layer's MLP part: the router, the routed experts and the shared ones."""
    width = spec.expert_ffn or spec.ffn
    shared = spec.shared_experts * mlp_params(spec.hidden, width, spec.gated_mlp, spec.bias)
    return spec.hidden * spec.experts + routed_layer_params(spec) + shared


def idle_params(spec: ModelSpec) -> int:
    """Routed expert weights a token does not use: (E - top_k) experts in every MoE layer."""
    if not spec.experts:
        return 0
    return len(moe_layer_ids(spec)) * routed_layer_params(spec) * (spec.experts - spec.top_k) // spec.experts


def routed_params_in(spec: ModelSpec, blocks: set[int]) -> float:
    """Routed expert weights of the MoE layers among ``blocks``, scaled like the preset's nominal count.

    A preset is sized by its round figure (``ModelSpec.params``), so its experts are that figure's share:
    the shape's routed count times params / shape_params (1 for a model counted from its shape).
    """
    mine = [i for i in moe_layer_ids(spec) if i in blocks]
    if not mine:
        return 0.0
    return routed_layer_params(spec) * len(mine) * spec.params / (spec.shape_params or spec.params)


def dispatched_tokens(micro_batch: int, seq_len: int, top_k: int, experts: int,
                      capacity_factor: float | None = None) -> float:
    """Token copies one rank sends to experts in one MoE layer per micro-batch (module docstring):
    b·s·top_k dropless, at most b·E·ceil(c·s·top_k/E) with a capacity factor c."""
    copies = seq_len * top_k
    if capacity_factor is not None:
        copies = min(copies, experts * math.ceil(capacity_factor * seq_len * top_k / experts))
    return float(micro_batch * copies)


def moe_config_fields(config: Any, ffn: int) -> dict[str, Any]:
    """The ModelSpec fields of a Hugging Face config's experts (Mixtral's ``num_local_experts``; Qwen-MoE's
    ``num_experts``, ``moe_intermediate_size``, ``decoder_sparse_step`` and shared expert); {} for a dense one.

    Qwen2-MoE's gate on its shared expert (hidden weights per layer) and its ``mlp_only_layers`` are not read.
    """
    experts = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)
    if not experts:
        return {}
    width = int(getattr(config, "moe_intermediate_size", None) or ffn)
    return {"experts": experts, "top_k": int(config.num_experts_per_tok), "expert_ffn": width,
            "moe_every": int(getattr(config, "decoder_sparse_step", None) or 1),
            "shared_experts": (getattr(config, "shared_expert_intermediate_size", None) or 0) // width}
