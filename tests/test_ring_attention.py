"""Ring attention (``kernels.parallel.ring_attention``) on spawned gloo ranks equals one process's causal SDPA.

Every rank draws the same whole-sequence q, k, v and upstream gradient, keeps its own positions, and
runs the ring forward and backward; the test process runs ``F.scaled_dot_product_attention`` on the
whole sequence and compares the output and the gradients of q, k and v row by row at each rank's
positions.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.parallel.ring_attention import ring_attention, zigzag_positions
from tests.spawned_ranks import pooled_runner

BATCH, HEAD_DIM = 2, 4


def contiguous_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The unbalanced layout: rank r holds the r-th of ``cp`` consecutive slices."""
    per_rank = seq_len // cp
    return torch.arange(cp_rank * per_rank, (cp_rank + 1) * per_rank)


LAYOUTS = {"zigzag": zigzag_positions, "contiguous": contiguous_positions}


def _whole_sequence(case: dict) -> tuple[torch.Tensor, ...]:
    """q, k, v and the output's upstream gradient over the whole sequence, the same on every process."""
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (BATCH, case["heads"], case["seq_len"], HEAD_DIM)
    kv_shape = (BATCH, case["kv_heads"], case["seq_len"], HEAD_DIM)
    return tuple(torch.randn(s, generator=gen) for s in (shape, kv_shape, kv_shape, shape))


def ring_rank(case: dict) -> dict:
    """This rank's positions, ring output, input gradients and step records (spawned rank body)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, grad_out = _whole_sequence(case)
    positions_of = LAYOUTS[case["layout"]]
    if case["seq_len"] % (2 * cp):  # a sequence zig-zag cannot cut: each rank just takes seq_len // cp rows
        rows = slice(rank * (case["seq_len"] // cp), (rank + 1) * (case["seq_len"] // cp))
        try:
            ring_attention(q[:, :, rows], k[:, :, rows], v[:, :, rows])
        except ValueError as error:  # raised before any transfer, on every rank alike
            return {"error": str(error)}
        return {"error": None}
    mine = positions_of(case["seq_len"], cp, rank)
    q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (q, k, v))
    steps: list[dict] = []
    out = ring_attention(q, k, v, positions_of=positions_of, steps=steps)
    (out * grad_out[:, :, mine]).sum().backward()
    return {"positions": mine, "out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "steps": steps,
            "kv_bytes": k.numel() * k.element_size() + v.numel() * v.element_size()}


@pytest.fixture(scope="module")
def ring_ranks():
    yield from pooled_runner(ring_rank, lambda case: case["cp"])


def _reference(case: dict) -> dict[str, torch.Tensor]:
    q, k, v, grad_out = _whole_sequence(case)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=case["heads"] != case["kv_heads"])
    (out * grad_out).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


CASES = {"cp2": {"cp": 2, "heads": 2, "kv_heads": 2, "seq_len": 8, "layout": "zigzag"},
         "cp4": {"cp": 4, "heads": 2, "kv_heads": 2, "seq_len": 16, "layout": "zigzag"},
         "cp2-gqa": {"cp": 2, "heads": 4, "kv_heads": 2, "seq_len": 8, "layout": "zigzag"},
         "cp4-gqa": {"cp": 4, "heads": 4, "kv_heads": 2, "seq_len": 16, "layout": "zigzag"},
         "cp4-contiguous": {"cp": 4, "heads": 2, "kv_heads": 2, "seq_len": 16, "layout": "contiguous"}}


def _tier(name: str, cp: int):
    """A four-rank ring spawns a second pool of four processes: the slow tier's; the fast tier's ring is two."""
    return pytest.param(name, marks=[pytest.mark.slow] if cp == 4 else [], id=name)


@pytest.mark.parametrize("name", [_tier(name, case["cp"]) for name, case in CASES.items()])
def test_ring_attention_and_its_gradients_equal_causal_sdpa_on_one_process(ring_ranks, name):
    case = {**CASES[name], "seed": 0}
    by_rank = ring_ranks(case)
    reference = _reference(case)
    for rank, got in by_rank.items():
        for key in ("out", "dq", "dk", "dv"):
            expected = reference[key][:, :, got["positions"]]
            torch.testing.assert_close(got[key], expected, rtol=1e-5, atol=1e-5, msg=f"rank {rank} {key}")


@pytest.mark.parametrize("cp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_steps_record_one_step_per_rank_and_the_kv_bytes_of_cp_minus_one_transfers(ring_ranks, cp):
    by_rank = ring_ranks({**CASES[f"cp{cp}-gqa"], "seed": 1})
    for rank, got in by_rank.items():
        steps = got["steps"]
        assert [s["step"] for s in steps] == list(range(cp))
        assert [s["kv_rank"] for s in steps] == [(rank - s) % cp for s in range(cp)]
        assert sum(s["sent_bytes"] for s in steps) == got["kv_bytes"] * (cp - 1)  # k/v unexpanded: kv heads
        assert steps[-1]["sent_bytes"] == 0
        assert all(s["compute_s"] >= 0 and s["wait_s"] >= 0 for s in steps)
    # Zig-zag balance: every rank computes its diagonal chunk pairs and then two pairs per step.
    assert {sum(s["chunk_pairs"] for s in got["steps"]) for got in by_rank.values()} == {2 * cp + 1}


def test_a_sequence_not_cut_into_2cp_chunks_is_refused_on_the_ranks(ring_ranks):
    by_rank = ring_ranks({**CASES["cp2"], "seq_len": 6, "seed": 0})
    assert all("2*cp=4" in (got["error"] or "") for got in by_rank.values()), by_rank


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_positions_cover_every_position_once_with_an_early_and_a_late_chunk_per_rank(cp):
    seq_len = 2 * cp * 3
    held = [zigzag_positions(seq_len, cp, r) for r in range(cp)]
    assert torch.cat(held).sort().values.tolist() == list(range(seq_len))
    for r, positions in enumerate(held):
        assert positions.dtype == torch.long and len(positions) == seq_len // cp
        assert positions[0] == 3 * r and positions[3] == 3 * (2 * cp - 1 - r)


def test_zigzag_positions_refuse_a_sequence_not_cut_into_2cp_equal_chunks():
    with pytest.raises(ValueError, match="not a multiple of 8"):
        zigzag_positions(12, 4, 0)
