"""A save before the first step changes nothing: the run, and a run resumed from it, train as one without it.

torch's ``get_state_dict`` makes a fresh optimizer's state by stepping it once at lr 0, which
counts a step (``kernels.checkpoint.fresh_optimizer``). One process, a gloo world of one: the
same three steps with and without a save at step 0, and from a load of that save, must give
the same parameters, bit for bit. ``tests/test_training.py`` checks it under DP4 and TP2×DP2 ZeRO-3.
"""
from __future__ import annotations

import pytest
import torch

from kernels.checkpoint.save_load import load_checkpoint, save_checkpoint
from kernels.model.gpt import GPTConfig, build_gpt

CONFIG = GPTConfig(layers=1, d_model=16, heads=2, d_ff=32, vocab=32, seq_len=8)
OPTIMIZERS = {"adamw": lambda params: torch.optim.AdamW(params, lr=0.01, foreach=False),
              "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=False)}


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len + 1), generator=generator)
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_save_before_the_first_step_trains_and_resumes_as_a_run_without_it(world_of_one, tmp_path, name):
    make = OPTIMIZERS[name]
    plain = build_gpt(CONFIG)
    expected = _train(plain, make(plain.parameters()))

    saved = build_gpt(CONFIG)
    optimizer = make(saved.parameters())
    save_checkpoint(str(tmp_path / "step_0"), saved, optimizer, {"step": 0})
    assert all(int(s.get("step", 0)) == 0 for s in optimizer.state.values())  # torch made the state, not a step
    got = _train(saved, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))

    resumed = build_gpt(GPTConfig(**{**CONFIG.__dict__, "seed": 1}))  # other weights, which the load replaces
    optimizer = make(resumed.parameters())
    load_checkpoint(str(tmp_path / "step_0"), resumed, optimizer)
    got = _train(resumed, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
