"""Expert parallelism for a Hugging Face mixture of experts: each experts module's forward replaced per instance.

An experts module (one its config's ep plan names: ``kernels.model.own_experts``) receives from its MoE block
the block's tokens, each token's k chosen experts and their weights: ``forward(hidden_states (N, d),
top_k_index (N, k), top_k_weights (N, k)) -> (N, d)``. Under ep > 1 its packed parameters keep this rank's
E/ep experts as DTensors on the ep mesh (``place_experts``, exactly as the lab's MoE), and ``ExpertsForward``
takes the place of its forward:

1. flatten: the N·k (token, slot) assignments, assignment t·k + s going to expert top_k_index[t, s];
2. sort them by expert (stable), which groups them by the rank that holds each expert, and count them;
3. exchange (``HFLocalExperts``, the lab's ``ExpertDispatch``): each assignment's row to its expert's rank by
   all-to-all; there the module's OWN forward (transformers' code, with the experts implementation its config
   picks: grouped_mm or eager) runs on the rows that arrived, with local expert ids and unit weights, on the
   local shards with ``num_experts`` = E/ep in place of the whole tensors; the outputs come back in the order
   they left;
4. combine: each output back to its (token, slot) place, weighted by top_k_weights and summed over the k
   slots in slot order (transformers' grouped_mm forward weights and sums its slots the same way).

The router, its top-k and its renormalisation stay the model's own, as does everything outside the experts
module. Gradients as the lab's experts (``kernels.parallel.expert_parallel``): DDP and FSDP leave the packed
parameters alone and ``ExpertGradSync`` sums them over the replicas; the weights' gradient flows through the
combine on the token's own rank.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from kernels.contract.config_rules import ConfigError
from kernels.contract.model_rules import own_expert_problems
from kernels.model.own_experts import expert_plan
from kernels.parallel.expert_dispatch import ExpertDispatch, place_experts


@contextlib.contextmanager
def _as_local(experts: nn.Module, shards: dict[str, torch.Tensor], count: int) -> Iterator[None]:
    """The experts module as its own forward must see it on this rank: the local shards, and their number (what
    its one-hot or histogram over expert ids counts)."""
    whole, total = {name: experts._parameters[name] for name in shards}, experts.num_experts
    experts._parameters.update(shards)
    experts.num_experts = count
    try:
        yield
    finally:
        experts._parameters.update(whole)
        experts.num_experts = total


class HFLocalExperts(ExpertDispatch):
    """``ExpertDispatch`` whose local experts are a Hugging Face experts module's own forward (step 3)."""

    def __init__(self, experts: nn.Module, packed: tuple[str, ...], group: dist.ProcessGroup) -> None:
        super().__init__(experts, group)
        self.packed = packed
        self.own_forward = experts.forward  # taken before ``ExpertsForward`` replaces it on the instance

    def _local_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ids = torch.repeat_interleave(torch.arange(counts.numel(), device=rows.device), counts).unsqueeze(1)
        if not len(rows):  # one zero row keeps the shards in the backward, so each gets a (zero) gradient
            return self._run(rows.sum(dim=0, keepdim=True), ids.new_zeros((1, 1)), counts.numel())[:0]
        return self._run(rows, ids, counts.numel())

    def _run(self, rows: torch.Tensor, ids: torch.Tensor, count: int) -> torch.Tensor:
        shards = {name: getattr(self.experts, name).to_local().to(rows.dtype) for name in self.packed}
        with _as_local(self.experts, shards, count):
            return self.own_forward(rows, ids, rows.new_ones(ids.shape))


class ExpertsForward:
    """An experts module's forward under ep > 1 (module docstring): same arguments and result as its own."""

    def __init__(self, dispatch: HFLocalExperts, experts: int) -> None:
        self.dispatch, self.experts = dispatch, experts

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, k = top_k_index.shape
        expert_of = top_k_index.reshape(-1)  # assignment t*k + s
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=self.experts)
        outputs = self.dispatch(hidden_states[order // k], counts)
        per_slot = torch.empty_like(outputs).index_copy(0, order, outputs)  # back to (token, slot) order
        weighted = per_slot.view(tokens, k, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(hidden_states.dtype)


def apply_hf_ep(model: nn.Module, ep_mesh: DeviceMesh) -> dict[str, nn.Parameter]:
    """Split the experts ``model``'s ep plan names over the "ep" axis of ``ep_mesh``, in place (module docstring);
    call before FSDP or DDP wraps ``model``. Returns the packed parameters (now DTensors) by name.

    Raises ConfigError [ep-plan] where the plan names no experts the lab can split, [ep-experts] where E does not
    divide by ep: the rules the driver applied to the same model on the meta device.
    """
    plan = expert_plan(model)
    problems = own_expert_problems({"ep": plan.summary()}, ep_mesh.size(1))
    if problems:
        raise ConfigError(problems)
    group = ep_mesh.get_group("ep")
    for module in plan.modules.values():
        dispatch = HFLocalExperts(module, plan.packed, group)
        place_experts(module, plan.packed, ep_mesh)
        module.forward = ExpertsForward(dispatch, plan.experts)
    return plan.parameters()
