"""``parallelize``: apply a ``Strategy`` to a whole GPT or one pipeline stage, in torchtitan's order.

Algorithm: the composition of torchtitan's ``parallelize_llama`` (Megatron TP: Shoeybi
et al., 2019; activation recomputation: Chen et al., 2016; FSDP: Zhao et al., 2023;
DDP: Li et al., 2020). The order is fixed, and each step needs the one before:

0. Context parallelism (cp > 1, ``kernels.parallel.context_parallel``): each attention's function
   becomes a ring over the cp group and the model gets the rank's positions. It changes no
   module or parameter, so TP after it still sees the original Linears.
1. TP first: ``parallelize_module`` turns whole ``nn.Linear`` weights into DTensors
   on the tp axis, and must see the original submodules.
   Expert parallelism (ep > 1, never with TP, ``kernels.parallel.expert_parallel``) takes this place:
   each MoE's packed experts become DTensors on the ep mesh, its dispatch an all-to-all, before
   FSDP or DDP, which are told to leave the experts alone.
2. Activation checkpointing wraps each block's forward, so a block's recompute in
   backward runs the TP collectives again, inside the block (selective checkpointing
   keeps the collectives' outputs instead).
3. Compilation (``compile=True``): each block with ``torch.compile``, after AC so the
   graphs see the checkpointed blocks, before FSDP so FSDP's hooks stay outside them.
4. bf16 autocast (``Strategy.autocast``: bf16 where FSDP2's policy does not apply)
   around the module's forward, outside the compiled blocks and inside DDP.
5. Data parallelism last: FSDP2's ``fully_shard`` shards whatever parameters it finds
   (plain tensors, or TP DTensors, giving 2D (dp, tp) DTensors) and its hooks
   surround the recompute; or DDP wraps the model (ZeRO-1 too: its optimizer comes
   from ``kernels.parallel.zero1.build_zero1_optimizer``; not ZeRO-1 with TP, whose DTensors DDP
   cannot take: ``kernels.parallel.zero1_slices``). Inside a pipeline the
   loop averages gradients itself after the schedule, so no DDP wraps a stage.

Run alone (TP 2 x FSDP 2, beside the one-process reference)::

    torchrun --nproc-per-node 4 -m kernels.train.entry --dp 2 --tp 2 --zero 3
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from kernels.parallel.activation_checkpoint import apply_ac
from kernels.parallel.autocast import apply_autocast
from kernels.parallel.compile_blocks import apply_compile
from kernels.parallel.context_parallel import RingLog, apply_cp
from kernels.parallel.ddp import apply_ddp
from kernels.parallel.expert_parallel import apply_ep
from kernels.parallel.fsdp import apply_fsdp
from kernels.contract.strategy import GradSync, Strategy
from kernels.parallel.tensor_parallel import apply_tp


def parallelize(model: nn.Module, strategy: Strategy, mesh: DeviceMesh, dp_mesh: DeviceMesh | None = None,
                cp_mesh: DeviceMesh | None = None, ring_log: RingLog | None = None,
                ep_mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply ``strategy`` to ``model`` on the (pp, dp, tp) ``mesh``; returns the model to train (maybe DDP-wrapped).

    ``dp_mesh`` is FSDP's mesh: the 2D HSDP mesh (``build_hsdp_mesh``), or by default the
    mesh's dp axis. ``cp_mesh`` (cp > 1) is the rank's ring (``build_cp_mesh``); ``ring_log`` records it.
    ``ep_mesh`` (ep > 1) is the 2D ("ep_replicate", "ep") mesh of the experts (``build_ep_mesh``).
    """
    if strategy.cp > 1:  # 0. CP: ring attention over the cp group, the rank's positions
        apply_cp(model, cp_mesh, ring_log)
    if strategy.tp > 1:  # 1. TP: DTensors on the tp axis
        apply_tp(model, mesh["tp"], sequence_parallel=strategy.sequence_parallel, loss_parallel=strategy.loss_parallel)
    experts = apply_ep(model, ep_mesh) if strategy.ep > 1 else {}  # 1. EP: DTensor experts, all-to-all dispatch
    if strategy.activation_checkpointing:  # 2. AC (full or selective): per block, inside FSDP's units
        apply_ac(model, strategy.activation_checkpointing)
    if strategy.compile:  # 3. torch.compile, per block
        apply_compile(model)
    if strategy.autocast:  # 4. bf16 without FSDP2: autocast around forward
        apply_autocast(model, mesh.device_type)
    if strategy.grad_sync is GradSync.FSDP:  # 5a. FSDP on the dp axis (2D with TP)
        apply_fsdp(model, dp_mesh if dp_mesh is not None else mesh["dp"], zero_stage=strategy.zero,
                   hybrid=strategy.hybrid, mixed_precision=strategy.mixed_precision, cpu_offload=strategy.cpu_offload,
                   prefetch=strategy.pp == 1, ignored_params=set(experts.values()),
                   reshard_after_forward=strategy.reshard_units)
    elif strategy.grad_sync in (GradSync.DDP, GradSync.ZERO1) and strategy.pp == 1 and strategy.data_ranks > 1 \
            and not strategy.zero1_slices:  # 5b (ZeRO-1 with TP: no DDP, the step averages the gradients)
        model = apply_ddp(model, mesh["dp"], ignored=list(experts))
    return model
