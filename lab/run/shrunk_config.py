"""A Hugging Face config made small through its own attributes: the same model type, tiny.

Used where a real architecture must run on CPU ranks in seconds: ``benchmarks/hf_coverage.py`` runs
every causal-LM type of the installed transformers tiny, and ``lab.plan(..., measure_on=cluster)``
measures a scaled-down copy of the planned model. A config names its sizes in its own words
(``hidden_size``, GPT-2's ``n_embd``, ``num_local_experts``, ...); ``SHRINK`` lists the words and the
tiny value of each, and ``shrunk_changes`` applies those the config has, cuts per-layer lists to the
depth, and shrinks a composite model's text or vision sub-config the same way.

Run alone (prints the tiny Llama and Mixtral configs' sizes)::

    python -m lab.run.shrunk_config
"""
from __future__ import annotations

from typing import Any

SHRINK = {  # attribute -> tiny value; applied where the config has the attribute
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "dim": 64, "model_dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "hidden_dim": 128,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "head_dim": 16, "kv_channels": 16,
    "vocab_size": 128, "max_position_embeddings": 64, "n_positions": 64,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "sliding_window": 16, "first_k_dense_replace": 1, "rotary_dim": 8,
    # multi-head latent attention (DeepSeek V2/V3 and their kin): the low-rank and split head sizes
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
}
DEPTH = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")  # the words configs use for their depth
_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


def shrunk_changes(fields: dict[str, Any], known: set[str], sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """The changes that make ``fields`` (a config's dict, whose attribute names are ``known``) tiny: the sizes
    of ``SHRINK`` overridden by ``sizes``, per-layer lists cut to the depth, sub-configs shrunk alike."""
    table = {**SHRINK, **(sizes or {})}
    changes = {k: v for k, v in table.items() if k in known}
    depth = next((table[k] for k in DEPTH if k in known), 2)
    for name, value in fields.items():
        if isinstance(value, list) and name.endswith(("layer_types", "_pattern")) and len(value) > depth:
            changes[name] = value[:depth]  # per-layer lists follow the depth
        elif isinstance(value, dict) and "model_type" in value:  # a composite model's text or vision config
            changes[name] = {**value, **shrunk_changes(value, set(value), sizes)}
    return changes


def tiny_config(model_type: str, sizes: dict[str, int] | None = None) -> Any:
    """The type's default config made tiny (``shrunk_changes``)."""
    from transformers import AutoConfig
    default = AutoConfig.for_model(model_type)
    return AutoConfig.for_model(model_type, **_changes(default, sizes))


def shrunk_copy(config: Any, sizes: dict[str, int] | None = None) -> Any:
    """A copy of a transformers ``config`` made tiny (``shrunk_changes``); the original is left as it is."""
    return type(config).from_dict({**config.to_dict(), **_changes(config, sizes)})


def _changes(config: Any, sizes: dict[str, int] | None) -> dict[str, Any]:
    """``shrunk_changes`` of a config, and its special tokens set to 0 where they would not fit the vocabulary."""
    fields = config.to_dict()
    changes = shrunk_changes(fields, set(fields) | set(getattr(config, "attribute_map", {})), sizes)
    vocab = {**SHRINK, **(sizes or {})}["vocab_size"]
    for token in _TOKENS:
        if isinstance(getattr(config, token, None), int) and getattr(config, token) >= vocab:
            changes[token] = 0
    return changes


if __name__ == "__main__":
    for kind in ("llama", "mixtral"):
        tiny = tiny_config(kind)
        print(kind, {k: getattr(tiny, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                  "vocab_size")})
