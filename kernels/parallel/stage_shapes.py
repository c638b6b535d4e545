"""What a pipeline stage of the lab's GPT or Llama takes and gives, known before its first step.

Given no shapes, torch's ``PipelineStage`` infers them when the schedule first steps: stage by
stage it runs micro-batch 0 forward and backward once more and sends the shapes to its
neighbours (``_initialize_stage``). That is a micro-batch's forward and backward through every
stage, its collectives included: 35-65 ms of a PP2×TP2 first step on 4 CPU ranks, paid again
by every build. Given example tensors for what a stage takes and gives (and, where a DTensor
crosses, their gradients), torch skips the inference ("static" metadata).

For the lab's own dense GPT and Llama, trained in fp32 without context parallelism, the shapes
follow from the config and the layout alone:

- the first stage takes token ids (b, T), int64; every other stage takes the residual stream
  (b, T, C), or (b, T/tp, C) under sequence parallelism, where the last block leaves it
  sharded on the sequence;
- every stage but the last gives the residual stream in the same shape; the last gives the logits
  (b, T, V), which under TP are a DTensor replicated over the tp mesh (the LM head gathers them,
  ``kernels.model.gpt.outer_tp_plan``);
- a gradient has the shape and placement of what it is the gradient of.

``stage_examples`` builds those as meta tensors (nothing allocated). Anything else (a model the
user brought, a MoE, context parallelism, bf16, a batch that does not split evenly) gets ``{}``
and torch infers as before. ``tests/test_stage_shapes.py`` checks the examples against what
torch infers, stage by stage, for every layout that takes them.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from kernels.contract.strategy import Strategy
from kernels.model.gpt import GPTConfig
from kernels.model.llama import LlamaConfig


def shapes_known(cfg: Any, strategy: Strategy, rank_batch: int) -> bool:
    """Whether ``stage_examples`` knows this layout's stage shapes (else torch infers them)."""
    dense = isinstance(cfg, (GPTConfig, LlamaConfig)) and not getattr(cfg, "experts", 0)
    return (dense and strategy.cp == 1 and strategy.mixed_precision is None
            and rank_batch % strategy.microbatches == 0)


def stage_examples(cfg: GPTConfig | LlamaConfig, strategy: Strategy, rank_batch: int, stage: int, num_stages: int,
                   tp_mesh: DeviceMesh | None) -> dict[str, Any]:
    """``PipelineStage`` keyword arguments (input_args, output_args, input_grads, output_grads) for ``stage``,
    as meta tensors; ``{}`` where ``shapes_known`` says no. ``rank_batch``: the sequences this rank's pipeline
    takes per step, before they are split into micro-batches; ``tp_mesh``: the 1D tp mesh when tp > 1."""
    if not shapes_known(cfg, strategy, rank_batch):
        return {}
    b, seq = rank_batch // strategy.microbatches, cfg.seq_len
    width = cfg.d_model if isinstance(cfg, GPTConfig) else cfg.hidden
    stream_seq = seq // strategy.tp if strategy.sequence_parallel else seq
    stream = _meta((b, stream_seq, width), torch.float32)
    first, last = stage == 0, stage == num_stages - 1
    taken = _meta((b, seq), torch.int64) if first else stream
    given = _meta((b, seq, cfg.vocab), torch.float32) if last else stream
    if last and tp_mesh is not None:
        given = DTensor.from_local(given, tp_mesh, (Replicate(),), run_check=False)
    return {"input_args": _requiring_grad(taken, not first), "output_args": _requiring_grad(given, True),
            "input_grads": (None,) if first else _like(taken), "output_grads": _like(given)}


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _requiring_grad(tensor: torch.Tensor, requires: bool) -> torch.Tensor:
    return tensor.detach().requires_grad_(requires) if tensor.is_floating_point() else tensor


def _like(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach()  # a gradient: same shape, dtype and placements, no grad of its own
