"""The optimizer that steps DTensor parameters' local shards, against torch's optimizer over the DTensors themselves.

On each rank of the 4-rank gloo pool, a 2×2 (dp, tp) mesh holds parameters under the placements
the lab's layouts produce (FSDP2 over TP rows and columns, strided shards, uneven rows, replicated
norms whose gradients are ``Partial`` over tp). Two copies of them train for 3 steps on the same
gradients, one with ``torch.optim.AdamW`` (or SGD with momentum) over the DTensors, one with
``LocalShardOptimizer`` over the same class; the learning rate changes between steps, as a
schedule changes it. Parameters and state must be equal bit for bit, the state on the parameters'
placements, and a state dict of one must load into the other and step on alike.
"""
from __future__ import annotations

import copy

import pytest
import torch


def _step_alike(optimizer_name: str) -> list[str]:
    """On every rank: the differences between torch's optimizer over DTensors and the local-shard one (empty: none)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from kernels.parallel.local_shard_optimizer import LocalShardOptimizer
    from kernels.parallel.mesh import destroy_mesh_groups

    mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    layouts = {  # name: (global shape, parameter placements, gradient placements or None for the same)
        "fsdp over tp columns": ((8, 6), (_StridedShard(0, split_factor=2), Shard(0)), None),
        "fsdp over tp rows": ((8, 6), (Shard(0), Shard(1)), None),
        "uneven rows": ((7, 5), (Shard(0), Shard(0)), None),
        "tp only": ((4, 6), (Replicate(), Shard(0)), None),
        "sequence-parallel norm": ((6,), (Replicate(), Replicate()), (Replicate(), Partial())),
    }
    cls = torch.optim.AdamW if optimizer_name == "adamw" else torch.optim.SGD
    settings = ({"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "foreach": False}
                if cls is torch.optim.AdamW else {"lr": 1e-2, "momentum": 0.9, "foreach": False})
    try:
        g = torch.Generator().manual_seed(0)
        wholes = {name: torch.randn(shape, generator=g) for name, (shape, _, _) in layouts.items()}

        def parameters() -> list[torch.nn.Parameter]:
            return [torch.nn.Parameter(distribute_tensor(wholes[n], mesh, pl, src_data_rank=None))
                    for n, (_, pl, _) in layouts.items()]

        theirs, ours = parameters(), parameters()
        reference, local = cls(theirs, **settings), LocalShardOptimizer(ours, cls, **settings)

        def train(steps: int, seed: int) -> None:
            rg = torch.Generator().manual_seed(seed)
            for step in range(steps):
                for (name, (shape, pl, grad_pl)), a, b in zip(layouts.items(), theirs, ours):
                    whole = torch.randn(shape, generator=rg)
                    if grad_pl is None:
                        a.grad, b.grad = (distribute_tensor(whole, mesh, pl, src_data_rank=None) for _ in "ab")
                    else:  # each tp rank holds a different part of the sum (a clone would reduce it)
                        a.grad, b.grad = (DTensor.from_local(whole * (rank % 2 + 1) / 3, mesh, grad_pl,
                                                             run_check=False) for _ in "ab")
                for opt in (reference, local):
                    opt.param_groups[0]["lr"] = 1e-2 / (step + 1)
                    opt.step()

        def differences(when: str) -> list[str]:
            out = []
            for name, a, b in zip(layouts, theirs, ours):
                if not torch.equal(a.to_local(), b.to_local()):
                    out.append(f"{when}: {name}: parameter")
                sa, sb = reference.state[a], local.state[b]
                if sa.keys() != sb.keys():
                    out.append(f"{when}: {name}: state keys {sorted(sa)} != {sorted(sb)}")
                for key in sa.keys() & sb.keys():
                    x, y = sa[key], sb[key]
                    if type(x) is not type(y) or (isinstance(x, DTensor) and x.placements != y.placements):
                        out.append(f"{when}: {name}: {key} is {type(y).__name__} {getattr(y, 'placements', '')}, "
                                   f"torch keeps {type(x).__name__} {getattr(x, 'placements', '')}")
                    elif not torch.equal(x.to_local() if isinstance(x, DTensor) else x,
                                         y.to_local() if isinstance(y, DTensor) else y):
                        out.append(f"{when}: {name}: {key} values")
            return out

        train(3, seed=1)
        found = differences("after 3 steps")
        settings_theirs = {k for k in reference.state_dict()["param_groups"][0] if k != "params"}
        settings_ours = {k for k in local.state_dict()["param_groups"][0] if k != "params"}
        if settings_theirs != settings_ours:
            found.append(f"state dict settings {sorted(settings_ours)} != torch's {sorted(settings_theirs)}")
        # A load replaces the state tensors: the next step must update what was loaded.
        local = LocalShardOptimizer(ours, cls, **settings)
        local.load_state_dict(copy.deepcopy(reference.state_dict()))  # torch's load keeps the tensors it is given
        train(2, seed=2)
        return found + differences("after a load and 2 more steps")
    finally:
        destroy_mesh_groups(mesh)


@pytest.mark.parametrize("optimizer_name", ["adamw", "sgd"])
def test_stepping_local_shards_equals_torchs_optimizer_over_the_dtensors(cluster, optimizer_name):
    assert cluster.run(_step_alike, optimizer_name) == [[]] * 4
