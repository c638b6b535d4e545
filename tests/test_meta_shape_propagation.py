"""DTensor's output shapes from meta tensors (``kernels.parallel.meta_shape_propagation``) against torch's own.

One process plays rank 0 of a 2×2 (dp, tp) mesh on torch's fake process group (no peers, collectives do
nothing) and trains the lab's GPT and Llama for a step under TP, SP, loss parallel and FSDP over TP, with
DTensor's caches emptied first, so that every op signature the step meets reaches the propagator. Each one
is answered twice, by torch (fake tensors) and on meta: the answers must be equal, and meta must answer
nearly all of them (else the speed-up is gone while the tests still pass).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.testing._internal.distributed.fake_pg import FakeStore

from kernels.model.family import build_model, model_loss
from kernels.model.gpt import GPTConfig
from kernels.model.llama import LlamaConfig
from kernels.parallel import meta_shape_propagation as meta_prop
from kernels.parallel.fsdp import apply_fsdp
from kernels.parallel.mesh import clear_dtensor_caches
from kernels.parallel.tensor_parallel import apply_tp, loss_context

MODELS = {"gpt": GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16),
          "llama": LlamaConfig(layers=2, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64)}
LAYOUTS = {"tp": {}, "sp": {"sequence_parallel": True}, "loss parallel": {"loss_parallel": True},
           "fsdp over tp": {"zero": 3}}


def _signatures_of_one_step(monkeypatch, model_name: str, layout: dict) -> list:
    """(propagator, op schema) of every signature a step propagates, the meta propagator not installed."""
    seen: list = []

    def recording(self, op_schema):
        seen.append((self, op_schema))
        return meta_prop.torch_tensor_meta(self, op_schema)

    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", recording)
    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        clear_dtensor_caches()
        cfg = MODELS[model_name]
        model = apply_tp(build_model(cfg), mesh["tp"], sequence_parallel=layout.get("sequence_parallel", False),
                         loss_parallel=layout.get("loss_parallel", False))
        if layout.get("zero"):
            apply_fsdp(model, mesh["dp"], zero_stage=3)
        sharded = [p for p in model.parameters() if isinstance(p, DTensor)]  # TP leaves the norms plain
        whole = [p for p in model.parameters() if not isinstance(p, DTensor)]
        optimizer = torch.optim.AdamW([{"params": sharded}, {"params": whole}], lr=1e-3, foreach=True)
        tokens = torch.randint(0, 64, (2, 16))
        with loss_context(layout.get("loss_parallel", False)):
            model_loss(cfg)(model(tokens), tokens).backward()
        optimizer.step()
    finally:
        clear_dtensor_caches()
        dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_meta_answers_as_torch_does_for_every_signature_of_a_step(monkeypatch, model_name, layout):
    assert not dist.is_initialized(), "a process group leaked into the test process"
    seen = _signatures_of_one_step(monkeypatch, model_name, LAYOUTS[layout])
    assert len(seen) > 20, "the step met too few DTensor ops to say anything"
    answered = 0
    for propagator, op_schema in seen:
        try:
            on_meta = meta_prop.meta_tensor_meta(op_schema)
        except meta_prop.NoMetaAnswer:
            continue  # torch answers these itself
        answered += 1
        assert on_meta == meta_prop.torch_tensor_meta(propagator, op_schema), op_schema
    assert answered >= 0.9 * len(seen), f"meta answered {answered} of {len(seen)} signatures"


def test_the_installed_propagator_hands_torch_what_meta_does_not_answer(monkeypatch):
    method = "_propagate_tensor_meta_non_cached"
    monkeypatch.setattr(ShardingPropagator, method, getattr(ShardingPropagator, method))  # put back after the test
    handed: list = []
    monkeypatch.setattr(meta_prop, "_torch_propagate", lambda self, op_schema: handed.append(op_schema) or "torch's")
    meta_prop.install()
    assert meta_prop.installed()
    factory = type("Schema", (), {"args_schema": ((2, 3),), "kwargs_schema": {"device": torch.device("cpu")},
                                  "op": torch.ops.aten.zeros.default})()
    assert getattr(ShardingPropagator, method)(ShardingPropagator(), factory) == "torch's" and handed == [factory]
    meta_prop.uninstall()
    assert not meta_prop.installed()
