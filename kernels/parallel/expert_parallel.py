"""Expert parallelism: ``apply_ep`` splits every MoE layer's experts over groups of ep data-parallel ranks.

Algorithm: GShard's expert sharding with all-to-all dispatch (Lepikhin et al., 2020, "GShard: Scaling Giant
Models with Conditional Computation and Automatic Sharding"), placed inside data parallelism as DeepSpeed-MoE
places it (Rajbhandari et al., 2022, "DeepSpeed-MoE: Advancing Mixture-of-Experts Inference and Training to
Power Next-Generation AI Scale") and as torchtitan's expert parallelism does.

Where the experts live: the ep mesh (``kernels.parallel.mesh.build_ep_mesh``) is 2D, ("ep_replicate", "ep").
Each group of ep dp-neighbour ranks (an "ep" group) splits the E experts of every MoE layer: its rank i keeps
experts i·E/ep .. (i+1)·E/ep - 1 whole. The dp/ep groups hold replicas of those experts ("ep_replicate").
Every rank built the whole model from the seed, so each keeps its slice of the packed expert tensors
(``kernels.model.moe.PackedExperts``, expert index first) as a DTensor with placements (Replicate() on
"ep_replicate", Shard(0) on "ep"): no weight is sent, and a DCP checkpoint holds the global packed tensor under
the same key for every ep (a checkpoint saved under one ep loads under any other, or none).

Dispatch (``kernels.parallel.expert_dispatch.ExpertDispatch``, replacing ``MoE.dispatch`` per instance): the MoE hands over its kept token
assignments sorted by expert, so they are already grouped by the rank that holds each expert.

1. counts: an all_to_all_single of the (E,) per-expert counts tells each rank how many rows it receives from
   each rank of its group for each of its local experts;
2. dispatch: an all_to_all_single sends each expert's rows to its holder (split sizes per rank);
3. the local experts run on the received rows regrouped by local expert (the local shards of the packed
   weights, ``to_local()``, through ``PackedExperts``' own forward);
4. combine: a second all_to_all_single sends the outputs back in the order they came, so the MoE un-sorts
   and weights them as it does in one process.

Gloo on CPU supports ``all_to_all_single`` (not the list form ``all_to_all``). The token exchanges are
differentiable through ``AllToAll``, a small autograd Function over ``dist.all_to_all_single`` whose backward
is the reverse all-to-all (the meter of ``kernels.watch.comm`` sees both directions as ``dist`` calls).

Gradients: DDP and FSDP leave the expert parameters alone (``kernels.parallel.ddp.apply_ddp``'s ``ignored``,
FSDP2's ``ignored_params``). Each rank's loss is the mean over its own tokens, and the all-to-all's backward
brings every rank's share back to the expert's holder, so a holder's gradient is the sum over its ep group of
the per-rank mean losses' gradients. ``ExpertGradSync`` then sums it over the replicas ("ep_replicate") and
divides by dp: the sum over all dp ranks of their mean losses' gradients, / dp, is the global-batch mean's
gradient, as DDP gives the dense parts. A rank whose experts received no token still runs them on an empty
batch, so its shard gets a zero gradient, as the one-process packed tensor does (AdamW treats None and zero
differently).

A Hugging Face mixture of experts built from a config (Mixtral, Qwen3-MoE: the experts modules its config's
``base_model_ep_plan`` names, ``kernels.model.own_experts``) takes the same placement, exchange and gradient
sync; only what runs around the exchange is its own (``kernels.parallel.hf_expert_parallel``).

Run alone (EP 2 on two CPU ranks: a MoE's output and gradients against one process's)::

    python -m kernels.parallel.expert_parallel
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from kernels.contract.config_rules import ConfigError
from kernels.contract.layout_combinations import expert_split_problems
from kernels.model.moe import MoE
from kernels.model.own_experts import expert_plan
from kernels.model.own_model import OwnModel
from kernels.parallel.expert_dispatch import ExpertDispatch, place_experts
from kernels.parallel.hf_expert_parallel import apply_hf_ep


def moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    """The model's MoE modules by name ("blocks.0.mlp", ...)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE)]


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Every packed expert parameter of the model by its full name ("blocks.0.mlp.experts.w_in", ...): the lab's
    MoEs', or those a Hugging Face model's ep plan names ("model.layers.0.mlp.experts.gate_up_proj", ...)."""
    return {f"{name}.experts.{p_name}": p for name, moe in moe_layers(model)
            for p_name, p in moe.experts.named_parameters(recurse=False)} or expert_plan(model).parameters()


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> dict[str, nn.Parameter]:
    """Shard every MoE's experts over the "ep" axis of the 2D ``ep_mesh`` and dispatch by all-to-all, in place;
    call before FSDP or DDP wraps ``model``. Returns the expert parameters (now DTensors) by name, for DDP and
    FSDP to leave alone and for ``ExpertGradSync``.

    Raises ConfigError [ep-experts] for a model without experts, or with a number not divisible by ep; a model the
    user brought goes through ``apply_hf_ep`` (its refusals: [ep-plan], [ep-experts]).
    """
    layers = moe_layers(model)
    if not layers and isinstance(model, OwnModel):  # a model the user brought: the experts its ep plan names
        return apply_hf_ep(model, ep_mesh)
    problems = expert_split_problems(ep_mesh.size(1), layers[0][1].num_experts if layers else 0)  # as lab.Parallel
    if problems:
        raise ConfigError(problems)
    group = ep_mesh.get_group("ep")
    for _, moe in layers:
        place_experts(moe.experts, tuple(name for name, _ in moe.experts.named_parameters(recurse=False)), ep_mesh)
        moe.dispatch = ExpertDispatch(moe.experts, group)
    return expert_parameters(model)


class ExpertGradSync:
    """After the last micro-batch's backward: each expert gradient's local shard all-reduced (SUM) over the
    replicas ("ep_replicate") and divided by the ``dp`` data ranks (module docstring: why SUM / dp)."""

    def __init__(self, experts: dict[str, nn.Parameter], ep_mesh: DeviceMesh, dp: int) -> None:
        self.experts, self.dp = experts, dp
        self.group = ep_mesh.get_group("ep_replicate")
        self.replicas = ep_mesh.size(0)

    def __call__(self) -> None:
        with torch.no_grad():
            for name, p in self.experts.items():
                if p.grad is None:  # every forward runs the local experts, so a backward always reaches them
                    raise RuntimeError(f"expert parallelism: {name} has no gradient after backward on rank "
                                       f"{dist.get_rank()}; the experts' replicas would wait for it")
                grad = p.grad.to_local()  # outside grad mode the shard itself: the in-place ops update p.grad
                if self.replicas > 1:
                    dist.all_reduce(grad, group=self.group)
                grad /= self.dp


def _selftest(rank: int, port: int, world: int) -> None:
    import os

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", torch.arange(world).view(1, world), mesh_dim_names=("ep_replicate", "ep"))
    whole, sharded = (MoE(8, 16, 4, top_k=2) for _ in range(2))
    with torch.no_grad():
        for p in whole.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.5)
    sharded.load_state_dict(whole.state_dict())
    experts = apply_ep(sharded, mesh)
    x = torch.randn(2 * world, 6, 8, generator=torch.Generator().manual_seed(0))
    mine = x.chunk(world)[rank]
    whole(x).pow(2).mean().backward()
    sharded(mine).pow(2).mean().backward()
    ExpertGradSync(experts, mesh, world)()
    with torch.no_grad():
        error = float((sharded(mine) - whole(mine)).abs().max())
    w_in, reference = sharded.experts.w_in.grad.full_tensor(), whole.experts.w_in.grad
    print(f"rank {rank}: max |output - one process's| {error:.1e}, max |w_in grad - one process's| "
          f"{float((w_in - reference).abs().max()):.1e} (of {float(reference.abs().max()):.1e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    from kernels.engine.run_alone import spawn_with_port

    spawn_with_port(_selftest, 2, 2)
