"""Which model a run trains, built the same way whatever it is: the lab's GPT, a Llama 3, or the user's own.

``RunConfig.model`` is a dict of the model's fields; ``"family": "llama"`` names a Llama
(``kernels.model.llama``), ``"hf"`` or ``"module"`` a model the user brought (``kernels.model.own_model``:
a Hugging Face config or a ``lab.Model`` factory), and without a family the dict is a GPT's
(``kernels.model.gpt``). Every one is built with the weights its seed fixes, so every rank and
the one-process reference hold the same weights without a broadcast; every one cuts into pipeline
stages along its ``blocks``, keeping each block's name, and carries its tensor-parallel plan and
the sizes it splits (``tp_plan``, ``tp_sizes``).

Run alone (builds both from run configs and prints their parameter counts)::

    python -m kernels.model.family
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from kernels.contract import config_rules
from kernels.contract.layout_combinations import stage_split_problems
from kernels.contract.model_rules import is_own_model, own_expert_problems
from kernels.contract.run_config import RunConfig
from kernels.model.gpt import GPT, GPTConfig, build_gpt, count_parameters, loss_fn
from kernels.model.llama import Llama, LlamaConfig, build_llama, keep_layers
from kernels.model.own_model import OwnModel, build_own, meta_own, own_loss, split_sizes

LLAMA = "llama"


@dataclass(frozen=True)
class OwnConfig:
    """A model the user brought: its ``RunConfig.model`` dict (``kernels.contract.model_rules``) and the seed."""

    spec: dict[str, Any]
    seed: int = 0

    @property
    def layers(self) -> int | None:
        return self.spec.get("layers")

    @property
    def vocab(self) -> int | None:
        return self.spec.get("vocab")

    @property
    def seq_len(self) -> int:
        return self.spec["seq_len"]

    def tp_sizes(self, sequence_parallel: bool = False) -> dict[str, int]:
        """What tp must divide (``kernels.model.own_model.split_sizes``)."""
        return split_sizes(self.spec, sequence_parallel)

    def expert_problems(self, ep: int) -> list[config_rules.Problem]:
        """[ep-plan], [ep-experts]: what ep > 1 asks of the experts the model's ep plan names
        (``kernels.contract.model_rules.own_expert_problems``)."""
        return own_expert_problems(self.spec, ep)


ModelConfig = GPTConfig | LlamaConfig | OwnConfig


def model_config(run: RunConfig) -> ModelConfig:
    """The config a run names: its model fields with the run's seed."""
    if is_own_model(run.model):
        return OwnConfig(dict(run.model), run.seed)
    fields = dict(run.model)
    if fields.pop("family", None) == LLAMA:
        return LlamaConfig(seed=run.seed, **fields)
    return GPTConfig(seed=run.seed, **fields)


def model_fields(cfg: ModelConfig) -> dict[str, Any]:
    """What ``RunConfig.model`` holds for ``cfg``: its fields without the seed (the run's), a Llama's family named;
    a dense model (experts=0) without the mixture-of-experts fields, so its dict is what it was before them."""
    if isinstance(cfg, OwnConfig):
        return dict(cfg.spec)
    if isinstance(cfg, LlamaConfig):
        fields = {"family": LLAMA, **{k: getattr(cfg, k) for k in config_rules.LLAMA_KEYS if k != "family"}}
    else:
        fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "seed"}
    return {k: v for k, v in fields.items() if cfg.experts or k not in config_rules.MOE_KEYS}


def build_model(cfg: ModelConfig, device: torch.device | str = "cpu") -> nn.Module:
    """The model with the weights ``cfg.seed`` fixes, in fp32 on ``device`` (the same on every call)."""
    if isinstance(cfg, OwnConfig):
        return build_own(cfg.spec, cfg.seed, device)
    if isinstance(cfg, LlamaConfig):
        return build_llama(cfg, device, torch.float32)
    return build_gpt(cfg, device)


def meta_model(cfg: ModelConfig) -> nn.Module:
    """The model on the meta device: its parameters' names and shapes, nothing allocated, nothing drawn."""
    if isinstance(cfg, OwnConfig):
        return meta_own(cfg.spec)
    with torch.device("meta"):
        return Llama(cfg) if isinstance(cfg, LlamaConfig) else GPT(cfg)


def keep_stage(model: nn.Module, stage: int, num_stages: int, stage_layers: Sequence[int] | None = None) -> nn.Module:
    """Cut ``model`` in place down to pipeline stage ``stage`` of ``num_stages`` stages: equal ones, or
    ``stage_layers[s]`` blocks on stage s (contiguous, in order).

    Stage 0 keeps the embeddings, the last stage the final norm and the head, and each its own
    blocks under their names, so a stage's parameter names (and a checkpoint's keys) are the same
    under any split. For the lab's GPT and Llama, ConfigError [pp-layers] when equal stages do not
    divide the blocks, [stage-layers-sum] when ``stage_layers`` does not add up to them (a model the
    user brought is cut by ``layout_rules.layer_split``, which raises ValueError for a bad split).
    """
    if isinstance(model, OwnModel):
        return model.cut_stage(stage, num_stages, stage_layers)
    problems = stage_split_problems(model.config.layers, num_stages, stage_layers)  # the rule lab.Parallel applies
    if problems:
        raise config_rules.ConfigError(problems)
    return keep_layers(model, stage, num_stages, stage_layers)


def model_loss(cfg: ModelConfig) -> Callable:
    """The loss of (logits, targets): a ``lab.Model``'s own, else cross-entropy over all tokens
    (``kernels.model.gpt.loss_fn``, which also takes tensor-parallel logits)."""
    own = own_loss(cfg.spec) if isinstance(cfg, OwnConfig) else None
    return own or loss_fn


if __name__ == "__main__":
    for model in ({"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16},
                  {"family": LLAMA, "layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64}):
        cfg = model_config(RunConfig(model=model))
        print(type(cfg).__name__, f"{count_parameters(build_model(cfg)):,} parameters")
