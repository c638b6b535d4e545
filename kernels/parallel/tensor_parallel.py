"""Megatron tensor parallelism (and sequence parallelism) with DTensor ``parallelize_module``.

Algorithm: Megatron-LM tensor parallelism (Shoeybi et al., 2019, "Megatron-LM:
Training Multi-Billion Parameter Language Models Using Model Parallelism") and its
sequence parallelism (Korthikanti et al., 2022, "Reducing Activation Recomputation
in Large Transformer Models"), written as torchtitan writes them: plain plan dicts.

In each block, on the tp axis of the mesh:

- q/k/v and mlp.fc_in are column-parallel (weight ``Shard(0)``): each rank computes
  heads/tp heads and d_ff/tp hidden units. Forward: identity on the replicated
  input; backward: all_reduce of the input gradient.
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

    torchrun --nproc-per-node 4 -m kernels.train --tp 4
    torchrun --nproc-per-node 4 -m kernels.train --tp 4 --sequence-parallel
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)


def block_plan(sequence_parallel: bool) -> dict[str, Any]:
    """The TP plan of one transformer block (keys are submodule names in kernels.model.Block)."""
    if not sequence_parallel:
        return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.out": RowwiseParallel(), "mlp.fc_in": ColwiseParallel(), "mlp.fc_out": RowwiseParallel()}
    # SP: the residual stream between blocks is (B, T/tp, C) on each rank, Shard(1).
    gather_input = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "attn_norm": SequenceParallel(),  # LayerNorm on (B, T/tp, C)
        "attn": gather_input,  # all_gather to (B, T, C); backward: reduce_scatter
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1)),  # reduce_scatter to (B, T/tp, C)
        "mlp_norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.fc_in": ColwiseParallel(),
        "mlp.fc_out": RowwiseParallel(output_layouts=Shard(1)),
    }


def outer_plan(sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
    """The TP plan for the embeddings, final norm and LM head (kernels.model.GPT names)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, Any] = {
        # Row-parallel embedding: each rank looks up its vocab rows (zeros elsewhere),
        # forward all_reduce (or reduce_scatter over T under SP), backward identity.
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # Positions (T,) -> (T, C): the sequence dim is dim 0 here, so SP shards dim 0.
        "pos_emb": RowwiseParallel(input_layouts=Replicate(),
                                   output_layouts=Shard(0) if sequence_parallel else Replicate()),
        # Column-parallel head: all_gather of the input (SP) then vocab-sharded logits;
        # without loss_parallel the logits are all_gathered to (B, T, V) on every rank.
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                   use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
             loss_parallel: bool = False) -> nn.Module:
    """Shard ``model`` (a whole kernels.model.GPT) over the 1D ``tp_mesh`` in place.

    Every tp rank must hold the same weights (``kernels.model.build_gpt`` from one seed).
    """
    tp = tp_mesh.size()
    cfg = model.config
    sizes = {"heads": cfg.heads, "d_ff": cfg.d_ff, "vocab": cfg.vocab, "seq_len": cfg.seq_len}
    bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(f"apply_tp: {', '.join(bad)} must be divisible by tp={tp}")
    # Every rank built the same weights from the seed, so each slices its shard locally
    # (src_data_rank=None) instead of receiving it from rank 0: no collective per weight.
    for block in model.blocks.values():
        parallelize_module(block, tp_mesh, block_plan(sequence_parallel), src_data_rank=None)
    parallelize_module(model, tp_mesh, outer_plan(sequence_parallel, loss_parallel), src_data_rank=None)
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(_shard_grad_like_param)
    return model


def _shard_grad_like_param(param: nn.Parameter) -> None:
    """Give ``param.grad`` the placements of ``param`` once autograd has accumulated it.

    DTensor's cheapest strategy for the embedding backward, with a replicated
    gradient and replicated indices, is a replicated (whole-table) gradient, so a
    row-parallel embedding would hold its full vocab x C gradient on every tp rank and
    lose TP's memory saving there. Replicate -> Shard is a local slice, no collective.
    Under FSDP2 the hooked parameters are replaced by FSDP's, so this never fires there.
    """
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements:
        param.grad = grad.redistribute(param.device_mesh, param.placements)


def loss_context(enabled: bool) -> contextlib.AbstractContextManager:
    """``loss_parallel()`` when the logits are vocab-sharded DTensors, else a no-op.

    Both the loss and its backward must run inside it.
    """
    return loss_parallel() if enabled else contextlib.nullcontext()
