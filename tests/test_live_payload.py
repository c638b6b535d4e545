"""An asynchronous save's payload is built once and reused only while it still holds the live tensors.

``LivePayload`` hands DCP the first save's tensors again (the parameters and AdamW state the
optimizer updates in place), with the settings and RNG state read fresh. Each case compares what
it returns, save after save, with a payload built from scratch at that moment, and counts the builds:
one while nothing moves; a new one when the optimizer's state was reallocated, when the state dict
holds a copy, or when the parameters' settings differ. One process, a gloo world of one.
"""
from __future__ import annotations

import pytest
import torch

from kernels.checkpoint.live_payload import LivePayload
from kernels.checkpoint.save_load import SHARED_SETTINGS, checkpoint_payload
from kernels.model.gpt import GPTConfig, build_gpt

CONFIG = GPTConfig(layers=1, d_model=16, heads=2, d_ff=32, vocab=32, seq_len=8)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    tokens = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len + 1))
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _assert_same(payload: dict, fresh: dict) -> None:
    assert payload.keys() == fresh.keys()
    for part in ("model", "optim"):
        assert payload[part].keys() == fresh[part].keys()
        for key, value in fresh[part].items():  # tensors, and per-parameter settings where they differ
            same = torch.equal(payload[part][key], value) if isinstance(value, torch.Tensor) else payload[part][key] == value
            assert same, key
    assert payload.get(SHARED_SETTINGS) == fresh.get(SHARED_SETTINGS)
    assert torch.equal(payload["rng"]["0"], fresh["rng"]["0"])


def test_saves_reuse_the_live_tensors_with_fresh_settings(world_of_one):
    model = build_gpt(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, optimizer)
    payload = LivePayload()
    for lr in (0.01, 0.005, 0.002):  # an lr schedule changes the settings between saves
        optimizer.param_groups[0]["lr"] = lr
        _assert_same(payload(model, optimizer, 0), checkpoint_payload(model, optimizer, 0))
        _step(model, optimizer)
    assert payload.builds == 1


def test_reallocated_state_builds_the_payload_anew(world_of_one):
    model = build_gpt(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, optimizer)
    payload = LivePayload()
    payload(model, optimizer, 0)
    state = next(iter(optimizer.state.values()))
    state["exp_avg"] = state["exp_avg"] + 1.0  # a new tensor where the payload holds the old one
    _assert_same(payload(model, optimizer, 0), checkpoint_payload(model, optimizer, 0))
    assert payload.builds == 2


def test_a_payload_holding_a_copy_is_never_reused(world_of_one):
    model = build_gpt(CONFIG)
    model._register_state_dict_hook(lambda module, state, prefix, local: state.update(
        {k: v.clone() for k, v in list(state.items())[:1]}))  # like a strided shard made whole for DCP
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, optimizer)
    payload = LivePayload()
    for _ in range(2):
        _assert_same(payload(model, optimizer, 0), checkpoint_payload(model, optimizer, 0))
        _step(model, optimizer)
    assert payload.builds == 2


def test_settings_that_differ_by_parameter_build_every_payload(world_of_one):
    model = build_gpt(CONFIG)
    plain = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2]},
                                   {"params": plain, "weight_decay": 0.0}], lr=0.01)
    _step(model, optimizer)
    payload = LivePayload()
    for _ in range(2):
        _assert_same(payload(model, optimizer, 0), checkpoint_payload(model, optimizer, 0))
    assert payload.builds == 2
