"""``lab.Parallel(loss_parallel=True)`` reaches the ranks: the logits are never gathered, and training equals one process.

Without loss parallelism the column-parallel LM head all-gathers its vocab-sharded logits,
(B/dp, T, V) float32 per rank and step; with it the cross-entropy runs on the shards
(``torch.distributed.tensor.parallel.loss_parallel``), so exactly that all_gather is gone
from the measured collectives (in its place a few small all-reduces of per-token maxima and
sums). Losses and gradient norms meet the parity bounds of tests/test_layout_parity.py.
"""
from __future__ import annotations

import pytest

import lab

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
GLOBAL_BATCH, STEPS = 8, 2


def _gathered_bytes(result: lab.RunResult) -> int:
    """Bytes rank 0 all-gathered over the tp axis (funcol: DTensor's collectives) in the measured step."""
    return sum(c["payload_bytes"] for c in result.comm_records
               if c["rank"] == 0 and c["source"] == "funcol" and c["op"] == "all_gather")


# Loss parallel in the fast tier: test_llama_training's TP x DP with sequence and loss parallel.
@pytest.mark.parametrize("layout", [pytest.param({"tp": 4}, marks=pytest.mark.slow),  # 3 s
                                    pytest.param({"dp": 2, "tp": 2, "sequence_parallel": True},
                                                 marks=pytest.mark.slow)],  # 14 s
                         ids=["tp4", "dp2-tp2-sequence-parallel"])
def test_loss_parallel_drops_the_logits_gather_and_trains_like_one_process(cluster, layout):
    runs = {}
    for on in (False, True):
        exp = lab.Experiment(cluster, TINY, lab.Parallel(**layout, loss_parallel=on), global_batch=GLOBAL_BATCH,
                             steps=STEPS, measure=True)
        assert exp.config()["strategy"]["loss_parallel"] is on
        runs[on] = exp.run()
    reference = exp.reference()
    for on, result in runs.items():
        assert result.losses == pytest.approx(reference.losses, rel=1e-4), (on, result.loss_table(reference))
        assert result.grad_norms == pytest.approx(reference.grad_norms, rel=1e-4), on
    logits = GLOBAL_BATCH // layout.get("dp", 1) * TINY.seq_len * TINY.vocab * 4  # (B/dp, T, V) float32
    assert _gathered_bytes(runs[False]) - _gathered_bytes(runs[True]) == logits
