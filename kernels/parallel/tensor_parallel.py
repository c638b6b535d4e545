"""Megatron tensor parallelism (and sequence parallelism) with DTensor ``parallelize_module``.

Algorithm: Megatron-LM tensor parallelism (Shoeybi et al., 2019, "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism") and its
sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation
in Large Transformer Models"), written as torchtitan writes them: plain plan dicts, kept beside each model
(``kernels.model.gpt.GPT.tp_plan``, ``kernels.model.llama.Llama.tp_plan``).

In each block, on the tp axis of the mesh:

- q/k/v and mlp.fc_in are column-parallel (weight ``Shard(0)``): each rank computes
  heads/tp heads and d_ff/tp hidden units. Forward: identity on the replicated
  input; backward: all_reduce of the input gradient, once per attention and once per
  MLP (a ``PrepareModuleInput`` makes each half's input one DTensor, so q, k and v sum
  their gradients before the all_reduce, as Megatron's one f does).
- attn.out and mlp.fc_out are row-parallel (weight ``Shard(1)``): each rank's output
  is a partial sum. Forward: all_reduce (to Replicate), or reduce_scatter over the
  sequence dim under SP; backward: identity (or all_gather under SP).
- With sequence parallelism the LayerNorms run on a sequence shard (T/tp, ``Shard(1)``);
  attention and MLP inputs are all_gathered to Replicate in forward (backward:
  reduce_scatter of their gradient).

Outside the blocks: the token and position embeddings are row-parallel over their
rows (vocab / positions), the LM head column-parallel over the vocab. With
``loss_parallel`` the logits stay sharded on the vocab dim and the cross-entropy
is computed without gathering them (``torch.distributed.tensor.parallel.loss_parallel``).

Run alone (TP on 4 ranks, then with sequence parallelism)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --tp 4
    torchrun --nproc-per-node 4 -m kernels.train.entry --tp 4 --sequence-parallel
"""
from __future__ import annotations

import contextlib
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

from kernels.contract.config_rules import ConfigError
from kernels.contract.layout_combinations import tp_split_problems


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` (a whole model or a pipeline stage) over the 1D ``tp_mesh`` in place.

    The plan is the model's own (``tp_plan``, beside the model: ``kernels.model.gpt.GPT``,
    ``kernels.model.llama.Llama``, ``kernels.model.own_model.OwnModel``), as are the sizes that must divide by tp (``tp_sizes``).
    Every tp rank must hold the same weights (built from one seed, or on the meta device).
    """
    tp = tp_mesh.size()
    problems = tp_split_problems(tp, model.tp_sizes(sequence_parallel), sequence_parallel)  # the rules lab.Parallel applies
    if problems:
        raise ConfigError(problems)
    block_plan, outer_plan = model.tp_plan(sequence_parallel, loss_parallel)
    # Every rank built the same weights from the seed, so each slices its shard locally
    # (src_data_rank=None) instead of receiving it from rank 0: no collective per weight.
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, block_plan, src_data_rank=None)
    # A pipeline stage lacks the embeddings or the head: their entries are left out.
    outer_plan = {k: v for k, v in outer_plan.items() if getattr(model, k.split(".")[0], None) is not None}
    if outer_plan:
        parallelize_module(model, tp_mesh, outer_plan, src_data_rank=None)
    if hasattr(model, "after_tp"):  # a model the user brought: its tied head, its fused q/k/v (kernels.model.own_model)
        model.after_tp(tp_mesh, sequence_parallel)
    for param in model.parameters():
        _shard_grads_of(param)
    for module in model.modules():  # FSDP2 registers other parameters in these modules' place: hooked as they come
        if any(isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            module.register_forward_pre_hook(_hook_params_computed_with)
    return model


def _hook_params_computed_with(module: nn.Module, args: object) -> None:
    """Under FSDP2, the unsharded parameters it registers for forward and backward (built once, after its
    first all-gather) in place of the ones ``apply_tp`` hooked."""
    for param in module.parameters(recurse=False):
        _shard_grads_of(param)


def _shard_grads_of(param: nn.Parameter) -> None:
    """Hook ``_shard_grad_like_param`` on ``param`` once (a frozen table takes no gradient and no hook)."""
    if param.requires_grad and not getattr(param, "_grad_sharded_like_param", False):
        param.register_post_accumulate_grad_hook(_shard_grad_like_param)
        param._grad_sharded_like_param = True


def _shard_grad_like_param(param: nn.Parameter) -> None:
    """Give ``param.grad`` the placements of ``param`` once autograd has accumulated it.

    DTensor's cheapest strategy for the embedding backward, with a replicated
    gradient and replicated indices, is a replicated (whole-table) gradient, so a
    row-parallel embedding would hold its full vocab x C gradient on every tp rank and
    lose TP's memory saving there: for the whole step, or under FSDP2 with gradient
    accumulation until the last micro-batch reduce-scatters it. Replicate -> Shard is a
    local slice, no collective.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when the logits are vocab-sharded DTensors, else a no-op.

    Both the loss and its backward must run inside it.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
