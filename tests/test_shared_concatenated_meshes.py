"""FSDP over TP builds one (dp, tp) mesh for all its parameters (``kernels.parallel.shared_concatenated_meshes``).

One process plays rank 0 of a 2×2 (dp, tp) mesh on torch's fake process group. ``apply_fsdp`` over TP must
give every TP parameter the same concatenated mesh object, equal in every field FSDP and DTensor read to the
one torch builds itself, and leave torch's ``_concatenate`` as it found it.
"""
from __future__ import annotations

import threading

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from kernels.model.family import build_model
from kernels.model.gpt import GPTConfig
from kernels.model.llama import LlamaConfig
from kernels.parallel.fsdp import apply_fsdp
from kernels.parallel.mesh import clear_dtensor_caches
from kernels.parallel.shared_concatenated_meshes import one_mesh_per_pair
from kernels.parallel.tensor_parallel import apply_tp

MODELS = {"gpt": GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16),
          "llama": LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)}


@pytest.fixture
def mesh():
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    finally:
        clear_dtensor_caches()
        dist.destroy_process_group()


def _fields(mesh: DeviceMesh) -> tuple:
    return (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names, tuple(mesh._dim_group_names),
            mesh.get_coordinate(), mesh._get_root_mesh() is not None)


def _spmd_meshes(model) -> list[DeviceMesh]:
    meshes = []
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", lambda: None)()
        group = getattr(state, "_fsdp_param_group", None) if state is not None else None
        meshes += [p._spmd_mesh for p in (group.fsdp_params if group is not None else []) if p.is_dtensor]
    return meshes


@pytest.mark.parametrize("model_name", MODELS)
def test_every_tp_parameter_shares_one_mesh_equal_to_torchs(mesh, model_name):
    torch_concatenate = DeviceMesh.__dict__["_concatenate"]
    model = apply_fsdp(apply_tp(build_model(MODELS[model_name]), mesh["tp"]), mesh["dp"], zero_stage=3)
    meshes = _spmd_meshes(model)
    assert len(meshes) >= 2 * 4  # every block's TP weights at least
    assert len({id(m) for m in meshes}) == 1, "each TP parameter got a (dp, tp) mesh of its own"
    assert _fields(meshes[0]) == _fields(DeviceMesh._concatenate([mesh["dp"], mesh["tp"]]))
    assert DeviceMesh.__dict__["_concatenate"] is torch_concatenate  # torch's own again after the block


def test_other_lists_and_other_threads_get_their_own(mesh):
    dp, tp = mesh["dp"], mesh["tp"]
    from_thread = []
    with one_mesh_per_pair():
        first, again, reversed_ = (DeviceMesh._concatenate(pair) for pair in ([dp, tp], [dp, tp], [tp, dp]))
        worker = threading.Thread(target=lambda: from_thread.append(DeviceMesh._concatenate([dp, tp])))
        worker.start()
        worker.join()
    assert first is again and reversed_ is not first and from_thread[0] is not first
    assert reversed_.mesh_dim_names == ("tp", "dp")
    assert DeviceMesh._concatenate([dp, tp]) is not first  # the block ended: torch builds a new one again
