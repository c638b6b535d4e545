"""Which model a run trains, built the same way whatever it is: the lab's GPT or a Llama 3.

``RunConfig.model`` is a dict of the model's fields; ``"family": "llama"`` names a Llama
(``kernels.model.llama``), and without it the dict is a GPT's (``kernels.model.gpt``). Both
are built on the meta device and then given the weights their seed fixes, parameter by
parameter, so every rank and the one-process reference hold the same weights without a
broadcast; both cut into pipeline stages along their ``blocks``, keeping each block's name;
both carry their own tensor-parallel plan and the sizes it splits (``tp_plan``, ``tp_sizes``).

Run alone (builds both from run configs and prints their parameter counts)::

    python -m kernels.model.family
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn as nn

from kernels.contract import config_rules
from kernels.contract.layout_combinations import stage_split_problems
from kernels.contract.run_config import RunConfig
from kernels.model.gpt import GPT, GPTConfig, build_gpt, count_parameters
from kernels.model.llama import Llama, LlamaConfig, build_llama, keep_layers

ModelConfig = GPTConfig | LlamaConfig
LLAMA = "llama"


def model_config(run: RunConfig) -> ModelConfig:
    """The config a run names: its model fields with the run's seed."""
    fields = dict(run.model)
    if fields.pop("family", None) == LLAMA:
        return LlamaConfig(seed=run.seed, **fields)
    return GPTConfig(seed=run.seed, **fields)


def model_fields(cfg: ModelConfig) -> dict[str, Any]:
    """What ``RunConfig.model`` holds for ``cfg``: its fields without the seed (the run's), a Llama's family named."""
    if isinstance(cfg, LlamaConfig):
        return {"family": LLAMA, **{k: getattr(cfg, k) for k in config_rules.LLAMA_KEYS if k != "family"}}
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k != "seed"}


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The model with the weights ``cfg.seed`` fixes, in fp32 on ``device`` (the same on every call)."""
    if isinstance(cfg, LlamaConfig):
        return build_llama(cfg, device, torch.float32)
    return build_gpt(cfg, device)


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The model on the meta device: its parameters' names and shapes, nothing allocated, nothing drawn."""
    with torch.device("meta"):
        return Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)


def keep_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """Cut ``model`` in place down to pipeline stage ``stage`` of ``num_stages`` equal stages.

    Stage 0 keeps the embeddings, the last stage the final norm and the head, and each its own
    blocks under their names. ConfigError [pp-layers] when the blocks do not split evenly.
    """
    problems = stage_split_problems(model.config.layers, num_stages)  # the rule lab.Parallel applies
    if problems:
        raise config_rules.ConfigError(problems)
    return keep_layers(model, stage, num_stages)


if __name__ == "__main__":
    for model in ({"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
                  {"family": LLAMA, "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64}):
        cfg = model_config(RunConfig(model=model))
        print(type(cfg).__name__, f"{count_parameters(build_model(cfg)):,} parameters")
