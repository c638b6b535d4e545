"""The rules a model the user brings must meet for a layout: a Hugging Face config or a ``lab.Model`` (torch-free).

``RunConfig.model`` names such a model by its ``family``: ``"hf"`` (a transformers causal LM built from
its config on every rank) or ``"module"`` (any ``nn.Module`` a pickled factory builds). Beside what
builds it, the driver puts in the dict what the layout needs to know, read once from the model on the
meta device: ``layers`` (the blocks a pipeline cuts), ``tp_sizes`` (what tensor parallelism splits),
``tp_plan`` (module pattern -> style, or None), ``pp_plan`` (which top-level modules go before and after
the blocks, or None), ``tied`` (the head reuses the token embedding), and the ``vocab`` and training
window ``seq_len`` the data needs, and ``sp``: what sequence parallelism does with the model's modules
(``kernels.model.own_sequence_parallel.sequence_parallel_layout``), or why it cannot run on a sequence
shard (``why_not``), or None without a plan; ``ep``: the experts its config's expert-parallel plan names
(``{"experts": E}``, ``kernels.model.own_experts``) or why expert parallelism cannot split them (``why_not``).
The ranks check the same
dict again, so a run started from a saved config meets the same rules.

Run alone (prints the problems of a plan-less module under TP2×PP2)::

    python -m kernels.contract.model_rules
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernels.contract.config_rules import Problem
from kernels.contract.layout_combinations import expert_split_problems

HF = "hf"
MODULE = "module"
OWN_FAMILIES = (HF, MODULE)

# The tensor-parallel styles the lab applies (kernels.model.own_tp), as transformers' plans spell them.
# "fused_qkv_colwise" is the lab's own, for GPT-2's one c_attn (q, k and v side by side, sharded by heads).
TP_STYLES = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "fused_qkv_colwise",
             "conv1d_rowwise", "conv1d_colwise", "replicated_with_grad_allreduce")
_SHARED_KEYS = ("family", "layers", "tp_sizes", "tp_plan", "pp_plan", "tied", "vocab", "seq_len", "sp", "ep")
OWN_KEYS = {HF: (*_SHARED_KEYS, "config"), MODULE: (*_SHARED_KEYS, "factory", "name")}


def is_own_model(model: Any) -> bool:
    """Whether a run's model dict names a model the user brought (an HF config or a ``lab.Model``)."""
    return isinstance(model, Mapping) and model.get("family") in OWN_FAMILIES


def own_model_problems(model: Mapping[str, Any]) -> list[Problem]:
    """[model-keys]: the dict has its family's keys, a positive block count and, where given, plans of strings."""
    family = model.get("family")
    bad = sorted(set(model) - set(OWN_KEYS[family]), key=str)
    missing = [k for k in OWN_KEYS[family] if k not in model and k != "name"]
    if bad or missing:
        return [("model-keys", f"a {family} model dict has the keys {list(OWN_KEYS[family])}; "
                 f"unknown {bad}, missing {missing}")]
    layers = model["layers"]
    if layers is not None and not (isinstance(layers, int) and layers >= 1):
        return [("model-keys", f"layers={layers!r} must be an int >= 1 or None (no block list)")]
    return []


def own_layout_problems(model: Mapping[str, Any], *, tp: int, pp: int, sequence_parallel: bool,
                        cp: int = 1) -> list[Problem]:
    """The rules a layout meets on a model the user brought, each named.

    - [tp-plan]: tp > 1 needs a tensor-parallel plan (an HF config's own, the lab's for GPT-2, or ``tp_plan=``);
    - [tp-style]: every style in the plan is one the lab applies (``TP_STYLES``), named when it is not;
    - [tp-sp-model]: sequence parallel needs blocks of norms and planned regions, then norms and a head (``sp``);
    - [pp-blocks]: pp > 1 needs the block list (``blocks=``, or the config's pipeline plan);
    - [cp-model]: cp > 1 is refused: context parallelism swaps each attention for a ring and gives the model
      the rank's positions, which the lab can do in its own models only (``kernels.parallel.context_parallel``).
    """
    out: list[Problem] = []
    name = model.get("name") or "this model"
    if tp > 1:
        plan = model.get("tp_plan")
        if not plan:
            out.append(("tp-plan", f"tp={tp} needs a tensor-parallel plan, and {name} has none: pass "
                        "tp_plan={'blocks.*.fc_in': 'colwise', ...} (lab.Model) or use tp=1"))
        else:
            unknown = sorted({f"{style!r} ({pattern})" for pattern, style in plan.items() if style not in TP_STYLES})
            if unknown:
                out.append(("tp-style", f"the plan of {name} uses styles the lab does not apply: "
                            f"{', '.join(unknown)}; applied: {list(TP_STYLES)}"))
        why_not = (model.get("sp") or {"why_not": "no plan"}).get("why_not")
        if sequence_parallel and why_not:
            out.append(("tp-sp-model", f"sequence_parallel runs a block's norms on a sequence shard and gathers it "
                        f"for what the plan splits column- then row-wise; {name} cannot: {why_not}. "
                        "Use sequence_parallel=False"))
    if pp > 1 and not model.get("pp_plan"):
        out.append(("pp-blocks", f"pp={pp} needs the model's block list, and {name} names none: pass "
                    "blocks='layers' (the nn.ModuleList; the modules before it run on the first stage, "
                    "those after on the last)"))
    elif pp > 1 and model["pp_plan"].get("unplaced"):
        out.append(("pp-blocks", f"pp={pp}: the pipeline plan of {name} leaves out "
                    f"{', '.join(model['pp_plan']['unplaced'])}, which holds parameters, so no stage is known "
                    "to run it; use pp=1"))
    if cp > 1:
        out.append(("cp-model", f"cp={cp} needs the lab's own attention: context parallelism swaps every attention "
                    f"for ring attention and gives the model each rank's positions, which the lab can do in lab.GPT "
                    f"and lab.Llama only, not in {name}; use cp=1"))
    return out


def own_expert_problems(model: Mapping[str, Any], ep: int) -> list[Problem]:
    """[ep-plan], [ep-experts]: ep > 1 splits the experts modules a Hugging Face config's ``base_model_ep_plan``
    names (``model["ep"]``, read on the meta device): a model without such experts is refused with the reason,
    and E must divide by ep. The ranks apply it again to the model they built."""
    if ep == 1:
        return []
    why_not = (model.get("ep") or {"why_not": "no ep plan was read"}).get("why_not")
    if why_not:
        return [("ep-plan", f"ep={ep} splits the experts modules an expert-parallel plan names (a Hugging Face MoE "
                 f"config's base_model_ep_plan, e.g. Mixtral's or Qwen3-MoE's), and cannot split "
                 f"{model.get('name') or 'this model'}'s: {why_not}; use ep=1")]
    return expert_split_problems(ep, model["ep"]["experts"])


if __name__ == "__main__":
    print(own_layout_problems({"family": MODULE, "name": "MLP", "tp_plan": None, "pp_plan": None},
                              tp=2, pp=2, sequence_parallel=False))
