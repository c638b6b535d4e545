"""A model the user brings: a Hugging Face config, or ``lab.Model`` around any ``nn.Module`` factory.

``own_config(model)`` reads the model once on the meta device (nothing allocated) and writes what
every rank needs into one plain dict (``kernels.contract.model_rules``): how to build it (the HF
config's ``to_dict``, or the factory pickled by value), its block list and the modules before and
after it (the pipeline cut), its tensor-parallel plan and the widths that plan splits, and the experts its
expert-parallel plan names (``kernels.model.own_experts``). The plans are:

- an HF model's own (``_tp_plan``, from its config's ``base_model_tp_plan``), and its block list from
  ``base_model_pp_plan``; for GPT-2, which ships neither, the lab's (``GPT2_TP_PLAN``: the fused
  q/k/v sharded by heads, the MLP Megatron-style; blocks ``transformer.h``);
- a ``lab.Model``'s ``tp_plan=`` and ``blocks=``, checked against its modules here.

Run alone (prints what a tiny HF Llama config becomes)::

    python -m lab.run.own_models
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from kernels.contract.config_rules import ConfigError, Problem
from kernels.contract.model_rules import HF, MODULE
from kernels.model.family import OwnConfig
from kernels.model.own_experts import expert_plan
from kernels.model.own_model import encode_factory, matches
from kernels.model.own_sequence_parallel import sequence_parallel_layout

GPT2_TP_PLAN = {"transformer.h.*.attn.c_attn": "fused_qkv_colwise", "transformer.h.*.attn.c_proj": "conv1d_rowwise",
                "transformer.h.*.mlp.c_fc": "conv1d_colwise", "transformer.h.*.mlp.c_proj": "conv1d_rowwise"}
GPT2_BLOCKS = "transformer.h"
DEFAULT_SEQ_LEN = 32
_SHARDED_DIM = {"colwise": 0, "rowwise": 1, "colwise_gather_output": 0, "embedding_rowwise": 0,
                "conv1d_colwise": 1, "conv1d_rowwise": 0, "fused_qkv_colwise": 1}


@dataclasses.dataclass(frozen=True)
class Model:
    """Any model to train: ``factory()`` builds an ``nn.Module`` (called on every rank, under the run's seed)
    whose forward maps token ids (B, T) to logits (B, T, V); or ``factory`` is a Hugging Face config.

    ``tp_plan`` maps module patterns (``"blocks.*.fc_in"``, ``*`` for a block's index) to styles
    (``"colwise"``, ``"rowwise"``, ...: ``kernels.contract.model_rules.TP_STYLES``); tp > 1 needs one.
    ``blocks`` names the ``nn.ModuleList`` a pipeline cuts: the modules registered before it run on the
    first stage, those after on the last; pp > 1 needs it. ``loss(logits, targets)`` replaces the
    cross-entropy over all tokens. ``seq_len`` is the training window; ``vocab`` defaults to the first
    embedding's size. The factory and the loss travel pickled by value (cloudpickle): a lambda or a
    notebook function works, an open file or a lock does not.
    """

    factory: Any
    tp_plan: dict[str, str] | None = None
    blocks: str | None = None
    loss: Callable | None = None
    seq_len: int = DEFAULT_SEQ_LEN
    vocab: int | None = None
    name: str | None = None


def is_hf_config(obj: Any) -> bool:
    """Whether ``obj`` is a transformers config (checked without importing transformers)."""
    return any(c.__name__ in ("PreTrainedConfig", "PretrainedConfig") and c.__module__.startswith("transformers") for c in type(obj).__mro__)


def own_config(model: Any) -> OwnConfig:
    """The run's view of a user's model (module docstring); ``ConfigError`` names what stops it."""
    spec = model if isinstance(model, Model) else Model(model)
    hf = is_hf_config(spec.factory)
    if not hf and not callable(spec.factory):
        raise ConfigError([("argument-types", "model must be a lab.GPT, a lab.Llama, a Hugging Face config or a "
                            f"lab.Model(factory), got {type(spec.factory).__name__}")])
    meta = _meta_build(spec, hf)
    tp_plan = _tp_plan(spec, meta, hf)
    blocks = spec.blocks or (_hf_blocks(meta) if hf else None)
    problems = _plan_problems(meta, tp_plan, blocks)
    if problems:
        raise ConfigError(problems)
    fields = {"family": HF if hf else MODULE, "layers": len(meta.get_submodule(blocks)) if blocks else None,
              "tp_plan": tp_plan, "pp_plan": _pp_plan(meta, blocks, hf) if blocks else None,
              "tp_sizes": _tp_sizes(meta, tp_plan, hf), "tied": _tied(meta),
              "vocab": spec.vocab or _vocab(meta, hf), "seq_len": _seq_len(spec, meta, hf),
              "sp": sequence_parallel_layout(meta, tp_plan, blocks) if tp_plan else None,
              "ep": expert_plan(meta).summary()}
    if hf:
        fields["config"] = spec.factory.to_dict()
    else:
        fields["factory"] = _pickled(spec)
        fields["name"] = spec.name or getattr(spec.factory, "__name__", type(meta).__name__)
    return OwnConfig(fields)


def _meta_build(spec: Model, hf: bool) -> nn.Module:
    if hf:
        try:
            from transformers import AutoModelForCausalLM
        except ImportError as error:
            raise ConfigError([("model-build", f"a Hugging Face model needs transformers: pip install "
                                f"'cluster-lab[hf]' ({error})")]) from error
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(spec.factory) if hf else spec.factory()
    except Exception as error:  # whatever the user's factory or config raises: named, before any rank sees it
        raise ConfigError([("model-build", f"building the model failed: {type(error).__name__}: {error}")]) from error


def _pickled(spec: Model) -> str:
    try:
        return encode_factory(spec.factory, spec.loss)
    except Exception as error:  # cloudpickle raises what the unpicklable object raises
        raise ConfigError([("model-pickle", f"the factory (or the loss) cannot be pickled, so no rank can build "
                            f"the model: {type(error).__name__}: {error}")]) from error


def _tp_plan(spec: Model, meta: nn.Module, hf: bool) -> dict[str, str] | None:
    if spec.tp_plan is not None:
        return dict(spec.tp_plan)
    if not hf:
        return None
    if getattr(meta.config, "model_type", None) == "gpt2":
        return dict(GPT2_TP_PLAN)
    plan = dict(getattr(meta, "_tp_plan", None) or {})
    # Some models list their base model's plan unprefixed; and a plan lists every module its model type may
    # have, so entries for what this config does not build (dense MLPs of an all-MoE config) are left out.
    prefix = f"{meta.base_model_prefix}."
    named = {(k if _matching(meta, k) else prefix + k): v for k, v in plan.items()}
    checked = {k: _head_norm_checked(meta, k, v) for k, v in named.items() if _matching(meta, k)}
    return {**checked, **_whole_head_parameters(meta, checked)} or None


def _whole_head_parameters(meta: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """A module whose children the plan splits column-wise (an attention, by heads) may hold a parameter of one
    value per head (doge's ``A``, attention sinks) that the plan leaves whole: the split heads would then meet
    all heads' values, and the forward fails on the ranks. Such a parameter is named here, as a style the lab
    does not apply, so [tp-style] refuses the plan before launch."""
    config = meta.config.get_text_config()
    heads = {_config_int(config, "num_attention_heads"), _config_int(config, "num_key_value_heads")} - {None, 1}
    out = {}
    for parent in {k.rpartition(".")[0] for k, v in plan.items() if "colwise" in v and "." in k}:
        for name, param in _named_parameters_of(meta, parent):
            if param.dim() == 1 and param.numel() in heads and f"{parent}.{name}" not in plan:
                out[f"{parent}.{name}"] = "none: one value per head, left whole while the plan splits the heads"
    return out


def _named_parameters_of(meta: nn.Module, pattern: str) -> list[tuple[str, nn.Parameter]]:
    """The parameters held directly by the first module a plan pattern names."""
    module = next((m for m in _matching(meta, pattern) if isinstance(m, nn.Module)), None)
    return list(module.named_parameters(recurse=False)) if module is not None else []


def _head_norm_checked(meta: nn.Module, pattern: str, style: str) -> str:
    """The lab applies ``replicated_with_grad_allreduce`` to a norm over one head's features; on a norm over a
    wider (head-sharded) vector it would be wrong, so such an entry is named for [tp-style] to refuse."""
    if style != "replicated_with_grad_allreduce":
        return style
    config = meta.config.get_text_config()  # a composite model's sizes are its text config's
    heads, hidden = _config_int(config, "num_attention_heads"), _config_int(config, "hidden_size")
    head_dim = _config_int(config, "head_dim") or (hidden // heads if hidden and heads else None)
    if head_dim is None:
        return f"{style} (no one head size)"
    weight = getattr(_matching(meta, pattern)[0], "weight", None)
    return style if weight is not None and weight.numel() == head_dim else f"{style} over more than one head"


def _hf_blocks(meta: nn.Module) -> str | None:
    """The decoder's block list as the model's pipeline plan names it (``_pp_plan``, else the config's
    ``base_model_pp_plan`` under the base model), or the lab's for GPT-2; None without a plan."""
    if getattr(meta.config, "model_type", None) == "gpt2":
        return GPT2_BLOCKS
    prefix = meta.base_model_prefix
    names = [*(getattr(meta, "_pp_plan", None) or {}),
             *(f"{prefix}.{k}" for k in getattr(meta.config, "base_model_pp_plan", None) or {})]
    for name in names:
        try:
            if isinstance(meta.get_submodule(name), (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                return name
        except AttributeError:
            continue
    return None


def _matching(meta: nn.Module, pattern: str) -> list[nn.Module | nn.Parameter]:
    """The modules (or parameters: an MoE plan shards packed expert weights) a plan pattern names."""
    return [m for name, m in [*meta.named_modules(), *meta.named_parameters()] if matches(name, pattern)]


def _plan_problems(meta: nn.Module, tp_plan: dict[str, str] | None, blocks: str | None) -> list[Problem]:
    out: list[Problem] = []
    if blocks is not None:
        try:
            container = meta.get_submodule(blocks)
        except AttributeError:
            container = None
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) or not len(container):
            out.append(("pp-blocks", f"blocks={blocks!r} must name a non-empty nn.ModuleList of the model"))
    for pattern in tp_plan or {}:
        if not _matching(meta, pattern):
            out.append(("tp-plan", f"the tp_plan entry {pattern!r} matches no module or parameter of the model"))
    return out


def _pp_plan(meta: nn.Module, blocks: str, hf: bool) -> dict[str, Any]:
    """Which modules go before the blocks (first stage) and after them (last stage).

    An HF model's pipeline plan lists its base model's stage modules in forward order (the embedding,
    the blocks, the final norm, which may hold no parameter); the LM head follows. Elsewhere (a
    ``lab.Model``, GPT-2): the modules with parameters in registration order at each level on the way
    down to the blocks. Modules the plan does not name and that hold no parameters (rotary tables,
    dropout) stay on every stage."""
    order = list(getattr(meta.config, "base_model_pp_plan", None) or {}) if hf else []
    prefix = f"{meta.base_model_prefix}." if hf else ""
    if f"{prefix}{blocks.rpartition('.')[2]}" == blocks and blocks.rpartition(".")[2] in order:
        at = order.index(blocks.rpartition(".")[2])
        heads = [n for n, child in meta.named_children() if n != meta.base_model_prefix
                 and any(True for _ in child.parameters())]
        # A module with parameters the plan does not name (a hyper-connection head) has no known stage.
        unplaced = [prefix + n for n, child in meta.get_submodule(meta.base_model_prefix).named_children()
                    if n not in order and any(True for _ in child.parameters())]
        return {"first": [prefix + k for k in order[:at]], "blocks": blocks,
                "last": [prefix + k for k in order[at + 1:]] + heads, "unplaced": unplaced}
    first, last, module, prefix = [], [], meta, ""
    for part in blocks.split("."):
        names = list(module._modules)
        for name in names:
            child = module._modules[name]
            if name == part or child is None or not any(True for _ in child.parameters()):
                continue
            (first if names.index(name) < names.index(part) else last).append(prefix + name)
        module, prefix = module._modules[part], f"{prefix}{part}."
    return {"first": first, "blocks": blocks, "last": last}


def _tp_sizes(meta: nn.Module, tp_plan: dict[str, str] | None, hf: bool) -> dict[str, int]:
    """What tp must divide: an HF model's head counts (and FFN width), and every planned module's split width."""
    sizes: dict[str, int] = {}
    if hf:
        config = meta.config
        heads = _config_int(config, "num_attention_heads") or _config_int(config, "n_head")
        kv = _config_int(config, "num_key_value_heads") or heads
        sizes.update({k: v for k, v in (("heads", heads), ("kv_heads", kv)) if isinstance(v, int)})
    for pattern, style in (tp_plan or {}).items():
        for module in _matching(meta, pattern)[:1]:
            weight = getattr(module, "weight", None) if isinstance(module, nn.Module) else None
            if weight is not None and style in _SHARDED_DIM and weight.dim() > _SHARDED_DIM[style]:
                sizes[f"width of {pattern}"] = weight.shape[_SHARDED_DIM[style]] // (3 if style == "fused_qkv_colwise" else 1)
    return sizes


def _config_int(config: Any, name: str) -> int | None:
    """``config.<name>`` when it is one int; None when absent or per layer (a heterogeneous config raises its
    own error for a global read of a per-layer size)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # transformers' AmbiguousGlobalPerLayerAttributeError, and its kin
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _tied(meta: nn.Module) -> bool:
    try:
        head, embedding = meta.get_output_embeddings(), meta.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    return head is not None and embedding is not None and head.weight is embedding.weight


def _vocab(meta: nn.Module, hf: bool) -> int | None:
    """The ids the data may use: an HF model's input embedding rows and logits width, the smaller (a composite
    model holds other embeddings, for image patches or positions), else the first ``nn.Embedding``'s rows."""
    if hf:  # the ids must fit both the embedding and the logits (a model may embed more ids than it predicts)
        head = meta.get_output_embeddings()
        sizes = [getattr(meta.get_input_embeddings(), "num_embeddings", None), getattr(head, "out_features", None)]
        return min((n for n in sizes if isinstance(n, int)), default=None)
    return next((m.num_embeddings for m in meta.modules() if isinstance(m, nn.Embedding)), None)


def _seq_len(spec: Model, meta: nn.Module, hf: bool) -> int:
    longest = getattr(meta.config, "max_position_embeddings", None) if hf else None
    return min(spec.seq_len, longest) if isinstance(longest, int) and longest > 0 else spec.seq_len


if __name__ == "__main__":
    from transformers import LlamaConfig
    cfg = own_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2))
    print({k: v for k, v in cfg.spec.items() if k != "config"})
