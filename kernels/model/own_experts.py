"""The experts of a Hugging Face mixture of experts, found where its config's expert-parallel plan says they are.

transformers ships an expert-parallel plan with each MoE config (``base_model_ep_plan``, patterns relative to
the base model, ``*`` for a block's index): ``"layers.*.mlp.experts": "ep_dispatch_experts"`` names each experts
module, ``"layers.*.mlp.experts.gate_up_proj": "grouped_gemm"`` each of its packed parameters, expert index
first. Such a module (``MixtralExperts``, ``Qwen3MoeExperts``) runs ``forward(hidden_states (N, d),
top_k_index (N, k), top_k_weights (N, k)) -> (N, d)``: every token through its k experts, weighted and summed;
its ``num_experts`` tells that forward how many experts its packed tensors hold.

``expert_plan(model)`` reads the plan of a model the lab built from a config (``OwnModel``) or of the
transformers model itself, and says what stops the lab from splitting those experts over ranks
(``why_not``): no plan, a style the lab does not apply, a module without that forward, a parameter the
plan leaves whole. The driver reads it on the meta device before launch; the ranks read it again where
expert parallelism is applied (``kernels.parallel.hf_expert_parallel``), and the routing records watch
the same modules (``kernels.model.moe_routing``).

Run alone (what the plan of a tiny Mixtral names)::

    python -m kernels.model.own_experts
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from kernels.model.own_model import OwnModel, matches

EXPERTS_STYLE = "ep_dispatch_experts"  # the plan's style for an experts module
PACKED_STYLE = "grouped_gemm"  # the plan's style for one of its packed parameters (expert index first)
EXPERTS_FORWARD = ("hidden_states", "top_k_index", "top_k_weights")


@dataclass(frozen=True)
class ExpertPlan:
    """The experts modules a model's ep plan names (by full name), the packed parameters each holds, and E."""

    modules: dict[str, nn.Module]
    packed: tuple[str, ...]  # parameter names inside each experts module, expert index first
    experts: int  # E: dim 0 of the packed parameters (their global shape, also once sharded as DTensors)
    why_not: str | None  # what stops expert parallelism on this model; None: the lab can split its experts

    def summary(self) -> dict[str, Any]:
        """What the layout rules need (``RunConfig.model["ep"]``): ``{"experts": E}``, or ``{"why_not": ...}``."""
        return {"why_not": self.why_not} if self.why_not else {"experts": self.experts}

    def parameters(self) -> dict[str, nn.Parameter]:
        """Every packed parameter by its full name ("model.layers.0.mlp.experts.gate_up_proj", ...)."""
        return {f"{name}.{p}": getattr(module, p) for name, module in self.modules.items() for p in self.packed}


def expert_plan(model: nn.Module) -> ExpertPlan:
    """What ``model``'s ep plan names, checked (module docstring); no modules and a reason without a plan."""
    inner = model.inner if isinstance(model, OwnModel) else model
    config = getattr(inner, "config", None)
    plan = getattr(config, "base_model_ep_plan", None)
    if not plan:
        what = f"its config ({type(config).__name__})" if config is not None else "it (not built from a config)"
        return ExpertPlan({}, (), 0, f"{what} has no base_model_ep_plan, the plan where transformers names the "
                          "experts of its mixture-of-experts models")
    unknown = sorted({style for style in plan.values() if style not in (EXPERTS_STYLE, PACKED_STYLE)})
    prefix = f"{inner.base_model_prefix}." if inner.base_model_prefix else ""
    patterns = [prefix + k for k, style in plan.items() if style == EXPERTS_STYLE]
    modules = {name: m for name, m in model.named_modules() if any(matches(name, p) for p in patterns)}
    packed = tuple(sorted({k.rpartition(".")[2] for k, style in plan.items() if style == PACKED_STYLE}))
    first = next(iter(modules.values()), None)
    experts = getattr(first, packed[0]).shape[0] if first is not None and packed and hasattr(first, packed[0]) else 0
    why_not = f"its ep plan uses styles the lab does not apply: {unknown}" if unknown else \
        next((why for name, m in modules.items() if (why := _module_problem(name, m, packed, experts))), None)
    if not modules and why_not is None:
        why_not = f"its ep plan names no module of the model ({patterns})"
    return ExpertPlan(modules, packed, experts, why_not)


def _module_problem(name: str, module: nn.Module, packed: tuple[str, ...], experts: int) -> str | None:
    """Why the lab cannot run ``module`` on a rank's share of its experts, or None."""
    held = {n for n, _ in module.named_parameters()}
    arguments = tuple(inspect.signature(type(module).forward).parameters)[1:]
    if arguments != EXPERTS_FORWARD:
        return f"{name} ({type(module).__name__}) has forward{arguments}, not forward{EXPERTS_FORWARD}"
    if held != set(packed):
        return (f"{name} holds the parameters {sorted(held)}, and the plan packs {sorted(packed)}: a parameter "
                "left whole would meet the local experts' ids")
    if getattr(module, "num_experts", None) != experts or any(getattr(module, p).shape[0] != experts for p in packed):
        return f"{name}'s num_experts and its packed parameters' first dimension disagree (E={experts})"
    return None


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
    found = expert_plan(AutoModelForCausalLM.from_config(config))
    print(list(found.modules), found.packed, found.experts, found.why_not)
