"""Memory over the traced step (kernels.measure.memory_timeline): the live count in one process, then a traced pipeline.

- In one process: inside ``LiveActivations.counting`` the live bytes after a forward equal what
  ``SavedActivations`` counts, and fall back to zero as backward frees what autograd saved.
- On the 4-rank pool, PP2×DP2 with m = 4 micro-batches, traced (no synthetic cost: the samples do not
  depend on time): one sample per compute action plus the step's start, the dp all-reduce and the
  optimizer; on every rank the activations are zero at the start and after the last backward. GPipe
  runs every forward before any backward, so pipeline rank 0 holds all four micro-batches at its
  peak; 1F1B holds at most p = 2, so its peak activations are well under GPipe's (the token ids are one
  storage for all micro-batches, so the ratio is under m / p = 2). The view and the figure draw the
  samples as a strip per rank. (The pool tests are slow: two traced runs, about 45 s here.)
"""
from __future__ import annotations

import pytest
import torch

import lab
from kernels.measure.memory import SavedActivations
from kernels.measure.memory_timeline import LiveActivations
from kernels.model.gpt import GPTConfig, build_gpt, loss_fn
from kernels.contract.measure_records import MemorySample
from widgets import MemoryView, plot_memory
from widgets._memory_strip import TITLE, X_LABEL, strip_state

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)


def test_live_activations_equal_the_saved_ones_after_forward_and_are_freed_by_backward():
    model = build_gpt(GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16))
    tokens = torch.randint(0, 64, (4, 17))
    live = LiveActivations(model)
    with live.counting():  # saved-tensor hooks do not nest (the inner ones count): two forwards, counted apart
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    with SavedActivations(model) as saved:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    assert live.bytes == saved.bytes > 0
    loss.backward()
    assert live.bytes == 0


def test_strip_state_stacks_each_ranks_samples_on_one_time_axis_and_marks_its_peak():
    def sample(rank, t, acts, **kw):
        return MemorySample(rank=rank, t=t, kind=kw.pop("kind", "forward"), params=100, grads=0, optimizer=200,
                            activations=acts, **kw).to_dict()
    samples = [sample(0, 1.000, 0, kind="start"), sample(0, 1.010, 50, stage=0, microbatch=0, action="F"),
               sample(0, 1.020, 0, kind="backward", stage=0, microbatch=0, action="B"), sample(1, 1.005, 0, kind="start"),
               sample(1, 1.030, 2048, stage=1, microbatch=0, action="F")]
    state = strip_state(samples)
    assert state["ranks"] == [0, 1] and state["span_ms"] == pytest.approx(30.0) and state["scale"] == 2348
    row = state["rows"][0]
    assert row["t"] == pytest.approx([0.0, 10.0, 20.0]) and row["labels"] == ["start", "F mb0 s0", "B mb0 s0"]
    assert row["stack"]["activations"] == [0, 50, 0] and row["peak"] == {"bytes": 350, "index": 1, "label": "F mb0 s0"}
    fig = plot_memory([], timeline=samples)
    peaks = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert peaks == ["peak 350 B after F mb0 s0", "peak 2.29 KiB after F mb0 s1"]  # as the browser writes bytes
    assert strip_state([]) == {"ranks": [], "span_ms": 0.0, "scale": 0, "rows": []}


@pytest.fixture(scope="module")
def traced(cluster):
    out = {}
    for schedule in ("gpipe", "1f1b"):
        exp = lab.Experiment(cluster, TINY, lab.Parallel(pp=2, dp=2, schedule=schedule, microbatches=4),
                             global_batch=16, steps=2, trace=True)
        out[schedule] = exp.run()
    return out


def _samples(res, rank):
    return [MemorySample.from_dict(s) for s in res.memory_timeline if s["rank"] == rank]


@pytest.mark.slow
def test_each_rank_samples_every_action_and_ends_the_step_holding_no_activations(traced):
    res = traced["1f1b"]
    for rank in range(4):
        samples = _samples(res, rank)
        computes = [e for e in res.events if e["rank"] == rank and e["kind"] in ("forward", "backward")]
        assert [s.kind for s in samples if s.action] == [e["kind"] for e in computes]
        assert samples[0].kind == "start" and samples[0].activations == 0
        assert samples[-1].kind == "optimizer" and samples[-1].optimizer > 0 and samples[-1].activations == 0
        assert [s.t for s in samples] == sorted(s.t for s in samples)
        last_backward = max(i for i, s in enumerate(samples) if s.action == "B")
        assert all(s.activations == 0 for s in samples[last_backward:])
        assert max(s.activations for s in samples) > 0


@pytest.mark.slow
def test_gpipe_holds_every_micro_batch_at_its_peak_and_1f1b_holds_fewer(traced):
    peak = {name: max(s.activations for s in _samples(res, 0)) for name, res in traced.items()}
    gpipe = _samples(traced["gpipe"], 0)
    forwards = [s.activations for s in gpipe if s.action == "F"]
    assert forwards == sorted(forwards) and forwards[-1] == peak["gpipe"]  # each forward adds, none frees
    assert peak["1f1b"] < 0.8 * peak["gpipe"], peak


@pytest.mark.slow
def test_the_view_and_the_figure_draw_a_strip_per_rank(traced):
    res = traced["1f1b"]
    state = strip_state(res.memory_timeline)
    assert state["ranks"] == [0, 1, 2, 3] and state["scale"] == max(r["peak"]["bytes"] for r in state["rows"])
    for row in state["rows"]:
        samples = _samples(res, row["rank"])
        assert row["stack"]["activations"] == [s.activations for s in samples]
        assert row["peak"]["bytes"] == max(s.total for s in samples)
    view = res.memory()
    assert view.strip == state and view.bars == {}
    fig = plot_memory([], timeline=res.memory_timeline)
    gids = {a.get_gid() for ax in fig.axes for a in ax.get_children()}
    assert {f"strip:{r}:activations" for r in range(4)} <= gids and {f"strip-peak:{r}" for r in range(4)} <= gids
    assert fig.axes[0].get_title() == TITLE and fig.axes[-1].get_xlabel() == X_LABEL
    assert [ax.get_ylabel().split("\n")[0] for ax in fig.axes] == [f"rank {r}" for r in range(4)]
    assert MemoryView(timeline=res.memory_timeline).strip == state
