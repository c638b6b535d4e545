"""The planner's view of a model given as a config: a ``lab.Llama`` or a Hugging Face config (no torch).

``lab.plan(model=...)`` sizes a layout from a model's shape. Given a config, the shape is read from
the config's own fields: layers, hidden width, query and key/value heads, FFN width, vocabulary, and
the switches that change the count (a gated MLP, a tied head, a learned position table, biases, a head
width other than hidden / heads, q/k norms), and a mixture of experts' fields (``plan_moe.moe_config_fields``:
Mixtral's, Qwen-MoE's, DeepSeek's names; a ``lab.Llama``'s experts, top_k and capacity_factor).
A Hugging Face config is read through its own attribute names (``hidden_size`` is GPT-2's
``n_embd`` by the config's ``attribute_map``). The parameter count is derived from that shape
(``plan_models.ModelSpec.shape_params``): exact for Llama- and GPT-2-style decoders, whose tensors
are the ones the formula counts.

Run alone (prints the spec of Llama-3-8B's shape as a transformers config would give it)::

    python -m lab.planning.plan_own_models
"""
from __future__ import annotations

import dataclasses
from typing import Any

from lab.planning.plan_models import ModelSpec, experts_of, get_model
from lab.planning.plan_moe import moe_config_fields

# Decoders whose MLP is two matrices with a GELU and whose positions are a learned table (GPT-2's lineage).
_GPT_STYLE = {"gpt2", "gpt_neo", "gpt_bigcode", "opt", "biogpt", "codegen", "gptj"}
_QKV_BIAS = {"qwen2", "qwen2_moe"}  # biases on q, k and v, none elsewhere
_QK_NORM = {"qwen3", "qwen3_moe"}  # an RMSNorm over each head's q and k
# The HF types whose every tensor the shape formula counts, so the count (and the per-stage plan) is the model's.
COUNTED_TYPES = frozenset({"llama", "mistral", "qwen2", "gpt2"})


def is_config(model: Any) -> bool:
    """A transformers config, or a ``lab.Llama`` (``kernels.model.llama.LlamaConfig``), read without importing either."""
    return hasattr(model, "model_type") and hasattr(model, "to_dict") or (
        type(model).__name__ == "LlamaConfig" and hasattr(model, "kv_heads"))


def spec_from_config(model: Any, name: str | None = None) -> ModelSpec:
    """The ``ModelSpec`` of a ``lab.Llama`` or a Hugging Face config (module docstring)."""
    if hasattr(model, "kv_heads"):  # lab.Llama: its fields are the planner's
        spec = ModelSpec(name or f"lab Llama L{model.layers} h{model.hidden}", 0.0, model.layers, model.hidden,
                         model.heads, model.kv_heads, model.ffn, model.vocab, seq_len=model.seq_len,
                         gated_mlp=model.gated_mlp, tied_embeddings=model.tied_embeddings,
                         learned_pos=model.learned_pos, bias=model.bias, sharded_ends=True,
                         **experts_of(lambda k, d=None: getattr(model, k, d)))
    else:
        kind = getattr(model, "model_type", "")
        hidden, heads = int(model.hidden_size), int(model.num_attention_heads)
        gpt_style = kind in _GPT_STYLE
        ffn = getattr(model, "intermediate_size", None) or getattr(model, "n_inner", None) or 4 * hidden
        positions = getattr(model, "max_position_embeddings", None) or getattr(model, "n_positions", None) or 2048
        spec = ModelSpec(name or f"{kind} L{model.num_hidden_layers} h{hidden}", 0.0, int(model.num_hidden_layers),
                         hidden, heads, int(getattr(model, "num_key_value_heads", None) or heads), int(ffn),
                         int(model.vocab_size), seq_len=int(positions), gated_mlp=not gpt_style,
                         tied_embeddings=bool(getattr(model, "tie_word_embeddings", False)), learned_pos=gpt_style,
                         bias=gpt_style or bool(getattr(model, "attention_bias", False)), one_tp_input=gpt_style,
                         qkv_bias=kind in _QKV_BIAS, sharded_ends=not gpt_style, whole_ends=gpt_style,
                         sp_between_blocks=True,
                         head_dim=getattr(model, "head_dim", None) or None, qk_norm=kind in _QK_NORM,
                         **moe_config_fields(model, int(ffn)))
    return dataclasses.replace(spec, params=spec.shape_params)


def model_spec(model: Any) -> ModelSpec:
    """What ``lab.plan`` sizes: a config read here, anything else as ``plan_models.get_model`` reads it."""
    return spec_from_config(model) if is_config(model) else get_model(model)


if __name__ == "__main__":
    from types import SimpleNamespace
    llama3_8b = SimpleNamespace(model_type="llama", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                                intermediate_size=14336, num_hidden_layers=32, vocab_size=128256,
                                max_position_embeddings=8192, tie_word_embeddings=False, to_dict=dict)
    print(spec_from_config(llama3_8b))
