"""Context parallelism (``lab.Parallel(cp=...)``, ``kernels.parallel.context_parallel``) trains like one process.

Each parity case runs ``kernels.train.entry.train_rank`` on the 4-rank gloo pool for 3 AdamW steps and
holds the losses, gradient norms and final parameters to the layout matrix's fp32 bounds
(``tests.test_layout_parity``: rtol 1e-4, atol 1e-5). Every cp rank keeps its zig-zag columns of its
replica's samples, so its loss is the mean over T/cp tokens; the loop averages the losses and DDP/FSDP
the gradients over the dp·cp data ranks, which is the global mean only because every rank holds the
same number of tokens: the parity is the numerical check of that reasoning.

The ring records (``RunResult.ring_steps()``) say per rank and attention layer which kv block each ring
step attended, and the bytes sent: the k+v block, cp-1 times. Activation memory per rank is measured at
cp = 1, 2, 4 on one replica (``measure=True``); a checkpoint saved under CP 2 x DP 2 resumes under DP 4.
"""
from __future__ import annotations

import warnings

import pytest

import lab
from kernels.model.family import model_fields
from kernels.parallel.ring_attention import zigzag_positions
from kernels.train.entry import train_rank
from lab.measure.memory_and_comm import memory_records
from lab.run.parallel import ParallelConfigError
from tests.config_draws import RecordingPool
from tests.layout_runs import Runs, assert_trains_like_one_process, layout_runs, tier

TINY = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}
LLAMA = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 64, "vocab": 64, "seq_len": 16}
BASE = {"model": TINY, "global_batch": 8, "steps": 3, "lr": 1e-2, "seed": 0}

LAYOUTS = {  # id -> the run's layout fields (ranks beyond world_size sit the run out)
    "cp2": {"cp": 2, "world_size": 2},
    "cp2-dp2": {"dp": 2, "cp": 2},
    "cp4": {"cp": 4},
    "cp2-tp2": {"cp": 2, "tp": 2},
    "cp2-dp2-zero3": {"dp": 2, "cp": 2, "zero": 3},
    "cp2-dp2-recompute": {"dp": 2, "cp": 2, "activation_checkpointing": True},  # the ring runs again in backward
    "cp2-dp2-selective-recompute": {"dp": 2, "cp": 2, "activation_checkpointing": "selective"},
    "llama-cp2": {"cp": 2, "world_size": 2, "model": model_fields(lab.Llama(**LLAMA))},
    "llama-cp2-tp2": {"cp": 2, "tp": 2, "model": model_fields(lab.Llama(**LLAMA))},  # kv heads split too
    # Every stage's attention is a ring over the same cp ranks; the schedule's micro-batches keep the rank's positions.
    "cp2-pp2": {"cp": 2, "pp": 2, "schedule": "1f1b", "microbatches": 2},
    "llama-cp2-pp2": {"cp": 2, "pp": 2, "schedule": "gpipe", "microbatches": 2, "model": model_fields(lab.Llama(**LLAMA))},
}
FAST = {"cp2", "cp2-dp2"}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def trained(cluster) -> Runs:
    return layout_runs(cluster, lambda layout: {**BASE, **LAYOUTS[layout]})


@pytest.mark.parametrize("layout", [tier(k, FAST) for k in LAYOUTS])
def test_context_parallel_trains_like_one_process(trained, layout):
    cfg, results = trained(layout)
    assert_trains_like_one_process(cfg, results)
    for rank, res in enumerate(results):
        assert res["layout"]["coords"]["cp"] == rank // cfg.get("tp", 1) % cfg["cp"]  # neighbours on the data axis


def _ring_rows_hold(rows: list[dict], *, cp: int, layers: int, kv_block_bytes: int) -> None:
    """Per rank and attention layer: cp ring steps, kv blocks (cp_rank - i) mod cp, the k+v block sent cp-1 times."""
    by_call: dict[tuple[int, str], list[dict]] = {}
    for row in rows:
        by_call.setdefault((row["rank"], row["layer"]), []).append(row)
    assert {layer for _, layer in by_call} == {f"blocks.{i}.attn" for i in range(layers)}
    for (rank, layer), steps in by_call.items():
        cp_rank = steps[0]["cp_rank"]
        assert [s["ring_step"] for s in steps] == list(range(cp)), (rank, layer)
        assert [s["kv_rank"] for s in steps] == [(cp_rank - i) % cp for i in range(cp)], (rank, layer)
        assert sum(s["sent_bytes"] for s in steps) == kv_block_bytes * (cp - 1), (rank, layer)
        assert steps[-1]["sent_bytes"] == 0  # the last step sends nothing on
        assert sum(s["chunk_pairs"] for s in steps) == 2 * cp + 1  # zig-zag: the same causal work on every rank
        assert all(s["compute_s"] >= 0 and s["wait_s"] >= 0 for s in steps)


def _kv_block_bytes(samples: int, kv_heads: int, seq_len: int, cp: int, head_dim: int) -> int:
    """k and v of one rank: (samples, kv_heads, seq_len/cp, head_dim) each, fp32."""
    return 2 * samples * kv_heads * (seq_len // cp) * head_dim * 4


def test_the_result_says_what_each_ring_step_attended_and_sent(cluster):
    exp = lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=2, cp=2), steps=2)
    result = exp.run(progress=False)
    steps = result.ring_steps()
    assert {s.rank for s in steps} == set(range(4)) and {s.step for s in steps} == {1}  # the last step only
    assert {(s.rank, s.cp_rank) for s in steps} == {(r, r % 2) for r in range(4)}
    _ring_rows_hold([s.to_dict() for s in steps], cp=2, layers=2, kv_block_bytes=_kv_block_bytes(4, 4, 16, 2, 8))
    assert lab.RunResult.from_json(result.to_json()).ring_steps() == steps
    with pytest.raises(lab.NotRecordedError, match="cp=2"):
        lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(dp=4), steps=1).run(progress=False).ring_steps()


@pytest.mark.slow
def test_cp4_records_four_ring_steps_per_layer_and_rank(trained):
    _, results = trained("cp4")
    _ring_rows_hold([row for r in results for row in r["ring_steps"]], cp=4, layers=2,
                    kv_block_bytes=_kv_block_bytes(8, 4, 16, 4, 8))


def test_the_batch_columns_are_the_zigzag_chunks():
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]


# --- refused before launch, each by its rule -------------------------------------------------------------
def _refused(make) -> tuple[str, ...]:
    pool = RecordingPool()
    with warnings.catch_warnings(), pytest.raises(ParallelConfigError) as err:
        warnings.simplefilter("ignore", lab.LayoutWarning)
        make(pool)
    assert pool.calls == [], "a refused config reached the ranks"
    return err.value.rules


def test_a_sequence_zigzag_cannot_cut_is_refused_by_cp_chunks():
    rules = _refused(lambda pool: lab.Experiment(pool, lab.GPT(**{**TINY, "seq_len": 20}), lab.Parallel(cp=4)))
    assert rules == ("cp-chunks",)


def test_cp_with_sequence_parallel_is_refused_by_cp_combination():
    assert _refused(lambda pool: lab.Parallel(cp=2, tp=2, sequence_parallel=True)) == ("cp-combination",)


def test_cp_on_a_model_the_user_brought_is_refused_by_cp_model():
    from tests.test_own_module import TokenMLP

    rules = _refused(lambda pool: lab.Experiment(pool, lab.Model(TokenMLP, seq_len=16), lab.Parallel(dp=2, cp=2)))
    assert rules == ("cp-model",)


# --- activation memory per rank --------------------------------------------------------------------------
@pytest.mark.slow
def test_activation_memory_per_rank_shrinks_with_cp(cluster):
    """One replica's 8 samples of 64 tokens over cp = 1, 2, 4 ranks: each rank holds 1/cp of the activations.

    The token-wise parts (embeddings, norms, q/k/v, MLP, logits, loss) are 1/cp of cp=1's, and so is attention:
    the ring keeps q, k, v, the output and its log-sum-exp, as SDPA does, and recomputes each chunk pair's
    scores in backward (a ring that let autograd keep them would hold (2cp+1) score blocks of (T/2cp)^2 per head).
    Measured: 1,880,580 bytes at cp=1; ratios 0.500001 (cp=2) and 0.250002 (cp=4); the per-part rule
    (``kernels.contract.activation_rules``) at s/cp tokens predicts each exactly.
    """
    cfg = {**BASE, "model": {**TINY, "seq_len": 64}, "steps": 2, "measure": True, "return_params": False}
    held = {}
    for cp in (1, 2, 4):
        ranks = cluster.run(train_rank, {**cfg, "cp": cp, "world_size": cp})[:cp]  # the others sit it out
        rows = [r for rank in ranks for r in memory_records(rank["measure"])
                if r.moment == "peak_fwd_bwd" and r.category == "activations"]
        assert len(rows) == cp and len({r.measured for r in rows}) == 1, rows  # every cp rank holds the same
        assert all(r.predicted == r.measured for r in rows), rows  # the lab GPT's rule at s/cp tokens, exact
        held[cp] = rows[0].measured
    ratios = {cp: held[cp] / held[1] for cp in (2, 4)}
    print(f"activation bytes per rank {held}; ratio to cp=1 {ratios}")
    for cp, ratio in ratios.items():
        assert ratio == pytest.approx(1 / cp, rel=0.01), (cp, ratio)


# --- checkpoints -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_checkpoint_saved_under_cp2_resumes_under_cp1(cluster, tmp_path):
    def experiment(layout: dict, **options) -> lab.Experiment:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", lab.LayoutWarning)
            return lab.Experiment(cluster, lab.GPT(**TINY), lab.Parallel(**layout), steps=4, **options)

    whole = experiment({"dp": 2, "cp": 2}, checkpoint_dir=str(tmp_path), checkpoint_every=2).run(progress=False)
    saved = {c.step: c for c in lab.checkpoints(str(tmp_path))}[2]
    resumed = experiment({"dp": 4}, resume_from=saved).run(progress=False)
    assert resumed.steps_ran == [3, 4]
    assert resumed.losses == pytest.approx(whole.losses[2:], rel=1e-4)
    assert whole.losses == pytest.approx(experiment({"dp": 2, "cp": 2}).reference().losses, rel=1e-4)
