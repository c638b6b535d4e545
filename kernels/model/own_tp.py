"""Tensor-parallel plans in transformers' words, turned into DTensor ``ParallelStyle``s.

A Hugging Face config names a style per module pattern (``"layers.*.self_attn.q_proj": "colwise"``);
``kernels.contract.model_rules.TP_STYLES`` lists those the lab applies. Each becomes one of torch's own
styles (``ColwiseParallel``, ``RowwiseParallel``), with the layouts the name means:

- ``colwise`` / ``rowwise``: Megatron's column- and row-parallel Linear (output sharded / summed);
- ``colwise_gather_output``: the LM head, column-parallel with the logits gathered (or, under
  ``loss_parallel``, left sharded over the vocabulary for the parallel cross-entropy);
- ``embedding_rowwise``: the token embedding sharded over vocabulary rows, its output summed;
- ``conv1d_colwise`` / ``conv1d_rowwise``: GPT-2's ``Conv1D``, which stores its weight in x out, so
  a column split shards dim 1 and a row split dim 0;
- ``fused_qkv_colwise``: GPT-2's one ``c_attn`` holding q, k and v side by side. Each rank keeps
  its heads of all three (``_StridedShard(1, split_factor=3)``: the three blocks sharded alike),
  and the attention then splits its local output in three;
- ``replicated_with_grad_allreduce``: a q/k norm over one head's features, applied to this rank's
  heads with its weight replicated and its gradient summed over the heads of every rank.

Run alone (prints the style each plan entry becomes)::

    python -m kernels.model.own_tp
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel


class Conv1DColwise(ColwiseParallel):
    """``ColwiseParallel`` for a module that computes ``x @ weight + bias`` with weight (in, out)."""

    def __init__(self, weight_placement: Placement = Shard(1), bias_placement: Placement = Shard(0)) -> None:
        super().__init__()
        self.weight_placement, self.bias_placement = weight_placement, bias_placement

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = self.weight_placement if pname == "weight" else self.bias_placement
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement],
                                                                            src_data_rank=self.src_data_rank)))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class FusedQKVColwise(Conv1DColwise):
    """GPT-2's ``c_attn``: q, k and v each sharded by heads, so a rank's output is its q, k and v heads side by side."""

    def __init__(self) -> None:
        super().__init__(_StridedShard(1, split_factor=3), _StridedShard(0, split_factor=3))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        # Already what attention needs locally; ColwiseParallel would redistribute it to a plain Shard(-1),
        # a contiguous slice of (q | k | v) that mixes the three.
        return outputs.to_local()


class Conv1DRowwise(RowwiseParallel):
    """``RowwiseParallel`` for ``x @ weight + bias`` with weight (in, out): weight rows sharded, bias whole."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if pname == "weight" else Replicate()
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [placement],
                                                                            src_data_rank=self.src_data_rank)))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)  # what RowwiseParallel sets for a Linear
        return distribute_module(module, device_mesh, self._partition,
                                 partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                                 partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class HeadNormReplicated(ParallelStyle):
    """A norm over each head's features (q/k norms), applied to this rank's heads: its weight replicated, its
    input this rank's heads of a (..., heads, head_dim) tensor. As a DTensor the weight's gradient is a partial
    sum over heads, which ``kernels.parallel.tensor_parallel`` reduces to the whole one (transformers' name for
    this is ``replicated_with_grad_allreduce``)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._heads_in, self._local_out)

    @staticmethod
    def _partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for pname, param in list(module.named_parameters(recurse=False)):
            module.register_parameter(pname, nn.Parameter(distribute_tensor(param, mesh, [Replicate()],
                                                                            src_data_rank=None)))

    @staticmethod
    def _heads_in(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x = inputs[0]
        return (DTensor.from_local(x, mesh, [Shard(x.dim() - 2)], run_check=False), *inputs[1:])

    @staticmethod
    def _local_out(module: nn.Module, outputs: DTensor, mesh: DeviceMesh) -> torch.Tensor:
        return outputs.to_local()


def parallel_style(style: str, loss_parallel: bool = False) -> ParallelStyle:
    """The DTensor style ``style`` (a name in ``kernels.contract.model_rules.TP_STYLES``) stands for."""
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_gather_output":  # the LM head: logits whole, or vocab-sharded for loss_parallel
        return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if loss_parallel \
            else ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    if style == "conv1d_colwise":
        return Conv1DColwise()
    if style == "conv1d_rowwise":
        return Conv1DRowwise()
    if style == "fused_qkv_colwise":
        return FusedQKVColwise()
    if style == "replicated_with_grad_allreduce":
        return HeadNormReplicated()
    raise ValueError(f"unknown tensor-parallel style {style!r}")  # the driver's [tp-style] refuses it first


if __name__ == "__main__":
    for name in ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise", "fused_qkv_colwise"):
        print(f"{name:24} -> {parallel_style(name)!r}")
