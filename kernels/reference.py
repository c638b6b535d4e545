"""The one-process reference every parallel layout must reproduce.

Algorithm: plain minibatch AdamW (Loshchilov & Hutter, 2019, "Decoupled Weight Decay
Regularization") on the whole global batch in one process: the same initial weights
(``build_gpt`` with the seed), the same global batch per step
(``SyntheticTokens.global_batch``), the same loss (mean over all B*T tokens) and the
same optimizer hyper-parameters as ``kernels.train.train_rank``. A parallel layout is
correct when its per-step global losses and final gathered parameters match these.

``mixed_precision="bf16"`` emulates FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``: each step runs forward and backward on a bf16 copy of the fp32
master weights, and AdamW updates the fp32 masters with the upcast gradients.

Run alone (prints the reference losses for the default tiny model)::

    python -m kernels.reference
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from kernels.data import SyntheticTokens, microbatches
from kernels.model import GPTConfig, build_gpt, loss_fn

MODEL_KEYS = ("layers", "d_model", "heads", "vocab", "seq_len", "d_ff", "bias")
DEFAULTS: dict[str, Any] = {"global_batch": 8, "steps": 3, "lr": 1e-2, "weight_decay": 0.0,
                            "betas": (0.9, 0.95), "eps": 1e-8, "seed": 0, "data_seed": None}


def model_config(cfg: dict[str, Any]) -> GPTConfig:
    """The GPTConfig a run config names: cfg["model"] (a dict) with the run's seed."""
    model = dict(cfg.get("model", {}))
    kwargs = {k: model[k] for k in MODEL_KEYS if k in model}
    return GPTConfig(seed=int(cfg.get("seed", DEFAULTS["seed"])), **kwargs)


def run_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's training settings with defaults filled in."""
    out = {k: cfg.get(k, v) for k, v in DEFAULTS.items()}
    out["betas"] = tuple(out["betas"])
    if out["data_seed"] is None:
        out["data_seed"] = out["seed"]
    return out


def adamw_kwargs(settings: dict[str, Any]) -> dict[str, Any]:
    """AdamW hyper-parameters, shared by the reference and every layout (foreach off: same kernel everywhere)."""
    return {"lr": settings["lr"], "betas": settings["betas"], "eps": settings["eps"],
            "weight_decay": settings["weight_decay"], "foreach": False}


def dataset(cfg: dict[str, Any]) -> SyntheticTokens:
    mcfg, settings = model_config(cfg), run_settings(cfg)
    return SyntheticTokens(mcfg.vocab, mcfg.seq_len, seed=settings["data_seed"])


def train_reference(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train on one process; returns losses and gradient norms per step, and the final parameters.

    ``{"losses": [float], "grad_norms": [float], "params": {name: fp32 tensor}}``.

    ``cfg["microbatches"]`` > 1 accumulates gradients as the layouts do (it does not
    change the maths, only the summation order).
    """
    mcfg, settings = model_config(cfg), run_settings(cfg)
    model = build_gpt(mcfg)
    optimizer = torch.optim.AdamW(model.parameters(), **adamw_kwargs(settings))
    data = dataset(cfg)
    bf16 = cfg.get("mixed_precision") == "bf16"
    n_micro = int(cfg.get("microbatches") or 1) if int(cfg.get("pp", 1)) == 1 else 1
    losses, norms = [], []
    for step in range(settings["steps"]):
        inputs, targets = data.global_batch(step, settings["global_batch"])  # (B, T) each
        compute = _bf16_copy(model) if bf16 else model
        total = 0.0
        for x, y in zip(microbatches(inputs, n_micro), microbatches(targets, n_micro)):
            loss = loss_fn(compute(x), y) / n_micro
            loss.backward()
            total += loss.item()
        if bf16:
            for p, q in zip(model.parameters(), compute.parameters()):
                p.grad = q.grad.float()
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params}


def _bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).to(torch.bfloat16)


if __name__ == "__main__":
    tiny = {"model": {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16},
            "global_batch": 8, "steps": 3}
    print("reference losses:", [round(v, 5) for v in train_reference(tiny)["losses"]])
