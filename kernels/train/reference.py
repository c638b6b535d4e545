"""The one-process reference every parallel layout must reproduce.

Algorithm: plain minibatch AdamW (Loshchilov & Hutter, 2019, "Decoupled Weight Decay
Regularization"), or plain SGD with ``optimizer="sgd"``, on the whole global batch in one
process: the same initial weights (``kernels.model.family.build_model`` with the seed), the same global batch per step
(``kernels.train.data.dataset(run).global_batch``), the same loss (mean over all B*T target tokens,
or over the answers of a task) and the
same optimizer hyper-parameters as ``kernels.train.entry.train_rank``. A parallel layout is
correct when its per-step global losses and final gathered parameters match these.

``mixed_precision="bf16"`` emulates what the layout does (``Strategy.autocast``): where
FSDP2 syncs gradients, its ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``,
so each step runs forward and backward on a bf16 copy of the fp32 master weights and
AdamW updates the fp32 masters with the upcast gradients; everywhere else the model's
forward runs under bf16 ``torch.autocast``, as on the ranks.

Run alone (prints the reference losses for the default tiny model)::

    python -m kernels.train.reference
"""
from __future__ import annotations

import copy
from typing import Any

import torch

from kernels.train.data import dataset, microbatches
from kernels.model.family import build_model, model_config, model_loss
from kernels.model.moe import scale_aux_gradient
from kernels.model.moe_routing import RoutingLog
from kernels.train.optimizer import build_optimizer
from kernels.train.poisoned_loss import poisoned
from kernels.train.update_rules import UpdateRules, torch_clip
from kernels.parallel.autocast import apply_autocast
from kernels.contract.run_config import RunConfig


def train_reference(run: RunConfig) -> dict[str, Any]:
    """Train on one process; returns losses and gradient norms per step, and the final parameters.

    ``{"losses": [float], "grad_norms": [float], "params": {name: fp32 tensor}, "first_step": int,
    "routing": [RoutingStep dicts], "lrs": [float], "spikes": [SpikeEvent dicts]}``: with experts, every step's
    routing per MoE layer (rank 0, ep 1; ``kernels.model.moe_routing``), else []; each step's lr, and the steps
    a spike guard skipped (``kernels.train.update_rules``: guard, ``clip_grad_norm_``, step, schedule).

    ``run.strategy.microbatches`` > 1 accumulates gradients as the layouts do (it does not
    change the maths, only the summation order). ``run.resume_from`` starts from a
    checkpoint any layout saved (or a safetensors file), at its step: the one process
    reads the whole model and optimizer state.
    """
    model = build_model(model_config(run))
    optimizer = build_optimizer(model.parameters(), run)
    first = resume_point(run, model, optimizer)
    loss_fn, update = _update_rules(run, model, optimizer, first)
    data = dataset(run)
    autocast = run.strategy.autocast
    if autocast:
        apply_autocast(model, "cpu")
    fsdp_bf16 = run.strategy.mixed_precision == "bf16" and not autocast  # FSDP2's bf16 parameters
    n_micro = run.strategy.microbatches if run.strategy.pp == 1 else 1
    scale_aux_gradient(model, 1 / n_micro)  # a MoE's balance-loss gradient, divided as the loss is below
    routing = RoutingLog([model])  # a bf16 copy made below carries its hooks along
    losses, norms = [], []
    for step in range(first, run.steps):
        inputs, targets = data.global_batch(step, run.global_batch)  # (B, T) each
        update.begin()
        compute = _bf16_copy(model) if fsdp_bf16 else model
        total = 0.0
        for x, y in zip(microbatches(inputs, n_micro), microbatches(targets, n_micro)):
            loss = loss_fn(compute(x), y) / n_micro
            loss.backward()
            total += loss.item()
        if fsdp_bf16:
            for p, q in zip(model.parameters(), compute.parameters()):
                p.grad = q.grad.float()
        # A parameter the batch did not reach (an expert no token was routed to) has no gradient, as on the ranks.
        norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                                 if p.grad is not None]))))
        update.apply(total)  # guard, clip, optimizer step, schedule
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        routing.end_step(step)
    routing.close()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"losses": losses, "grad_norms": norms, "params": params, "first_step": first, "routing": routing.rows,
            **update.take()}


def _update_rules(run: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  first: int) -> tuple[Any, UpdateRules]:
    """The run's loss (poisoned at ``lab.PoisonBatch``'s steps, as on the ranks) and its update rules from step
    ``first``: the spike guard, ``clip_grad_norm_`` itself and the lr schedule (``kernels.train.update_rules``)."""
    loss_fn, poison = poisoned(model_loss(model_config(run)), run.poison)
    update = UpdateRules(optimizer, run, torch_clip(list(model.parameters())), poison)
    update.seek(first)
    return loss_fn, update


def resume_point(run: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load ``run.resume_from`` into the one-process model and optimizer; returns the step to start at (0 without)."""
    if not run.resume_from:
        return 0
    from kernels.checkpoint.save_load import load_checkpoint, load_weights  # DCP only when resuming
    from kernels.checkpoint.files import WEIGHTS_SUFFIX, resolve

    if run.resume_from.endswith(WEIGHTS_SUFFIX):
        load_weights(run.resume_from, model)
        return 0
    return int(load_checkpoint(str(resolve(run.resume_from)), model, optimizer)["step"])


def _bf16_copy(model: torch.nn.Module) -> torch.nn.Module:
    return copy.deepcopy(model).to(torch.bfloat16)


if __name__ == "__main__":
    tiny = RunConfig(model={"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16})
    print("reference losses:", [round(v, 5) for v in train_reference(tiny)["losses"]])
