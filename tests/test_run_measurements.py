"""Every run through the lab carries its measurements (issue "Measured, not drawn", items 1-6 end to end).

On the 4-rank gloo pool, with the tiny GPT of tests/test_experiment.py:

- PP2×DP2 1F1B, m=4, ``trace=True`` with synthetic action costs: the RunResult's bubble
  (computed on the driver from the ranks' events) is within ±3 pp of (p-1)/(m+p-1) = 0.2,
  as tests/test_bubble.py requires of the traced loop. t = 0.08 s, as there: at
  t = 0.04 s the per-hop overhead on this shared 2-core machine (1-3 ms) came too close
  to the bound. The same run also measures (``measure=True``): with pp, memory at rest.
- DDP on 4 ranks, two micro-batches, with ``measure=True``: memory equals the exact rule at both moments
  (the tolerance logic of tests/test_memory_comm.py) and the all-reduce carries the
  gradient bytes.
- Off means off: with ``trace`` and ``measure`` off the ranks never install a tracer or a
  meter (both are made to fail on the ranks for that run), and the views say what to pass.
"""
from __future__ import annotations

import json
import math

import pytest

import lab
from lab.run.run_result import NotRecordedError

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
T_FORWARD = 0.08  # seconds per micro-batch forward through one rank's share; see the module docstring
TOLERANCE = 0.03  # ±3 percentage points
TIMELINE_TRAITS = ("ranks", "events", "planned", "plan_match", "mean_ms", "span_ms", "bubble")
MEMORY_TRAITS = ("ranks", "moments", "categories", "bars", "scale", "moment")


@pytest.fixture(scope="module")
def traced_pp(cluster):
    exp = lab.Experiment(cluster, TINY, lab.Parallel(pp=2, dp=2, schedule="1f1b", microbatches=4), global_batch=8,
                         steps=2, trace=True, synthetic_forward_s=T_FORWARD, measure=True)
    return exp, exp.run()


@pytest.fixture(scope="module")
def measured_ddp(cluster):
    # Two micro-batches: the probes see a step with gradient accumulation (one all-reduce, on the last).
    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=4, microbatches=2), global_batch=8, steps=2, measure=True)
    return exp, exp.run()


def test_traced_pipeline_bubble_from_the_run_result_matches_theory(traced_pp):
    exp, res = traced_pp
    b = res.bubble
    assert b["synthetic"] and b["schedule"] == "1f1b" and (b["pp"], b["microbatches"]) == (2, 4)
    assert b["theory"] == pytest.approx(1 / 5) and b["ranks"] == [0, 1, 2, 3]
    assert abs(b["mean"] - b["theory"]) <= TOLERANCE, b
    assert res.matches(exp.reference(), rtol=1e-4)  # padding actions and probing leave the maths alone


def test_traced_step_holds_compute_p2p_allreduce_and_optimizer_on_every_rank(traced_pp):
    _, res = traced_pp
    assert [c["rank"] for c in res.clock] == [0, 1, 2, 3] and all(c["uncertainty"] >= 0 for c in res.clock)
    for rank in range(4):
        kinds = {e["kind"] for e in res.events if e["rank"] == rank}
        assert {"forward", "backward", "all_reduce", "optimizer"} <= kinds, (rank, kinds)
        assert kinds & {"send", "recv"}
        stage = res.layout[rank]["stage_ids"][0]
        computed = [(e["stage"], e["action"], e["microbatch"]) for e in sorted(res.events, key=lambda e: e["start"])
                    if e["rank"] == rank and e["kind"] in ("forward", "backward")]
        assert computed == [tuple(a) for a in res.planned[rank]] and res.planned[rank][0][0] == stage
    grads = sum(e["nbytes"] for e in res.events if e["rank"] == 0 and e["kind"] == "all_reduce")
    assert grads == next(m["measured"] for m in res.memory_records
                         if m["rank"] == 0 and m["category"] == "grads" and m["moment"] == "at_rest")
    assert not [w for w in res.warnings if "ranks on" in w]  # synthetic ranks sleep: no core contention


def test_chrome_trace_has_one_track_per_rank(traced_pp, tmp_path):
    _, res = traced_pp
    doc = res.to_chrome_trace(tmp_path / "trace.json")
    assert json.loads((tmp_path / "trace.json").read_text()) == doc
    boxes = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in boxes} == {0, 1, 2, 3} and {e["tid"] for e in boxes} == {0}
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(4)} and len(boxes) == len(res.events)


def _state(widget, traits):
    return {t: getattr(widget, t) for t in traits}


def test_saved_run_replays_the_same_views_without_ranks(traced_pp, tmp_path):
    _, live = traced_pp
    again = lab.RunResult.from_json(live.to_json(tmp_path / "run.json"))
    assert again == live
    assert _state(again.timeline(), TIMELINE_TRAITS) == _state(live.timeline(), TIMELINE_TRAITS)
    assert _state(again.memory(), MEMORY_TRAITS) == _state(live.memory(), MEMORY_TRAITS)
    assert again.timeline().plan_match == {str(r): True for r in range(4)}
    for fig in (again.plot_timeline(), again.plot_memory()):
        assert fig.axes and type(fig).__name__ == "Figure"
    assert again.sharding().rows and str(again.comm()) == str(live.comm())


def test_pipeline_memory_equals_its_prediction_and_sends_carry_the_activations(traced_pp):
    _, res = traced_pp
    rows = [m for m in res.memory_records if m["category"] in ("params", "grads", "optimizer")]
    # at rest, and the most held at once over the schedule step (sampled after each traced stage action)
    assert {m["moment"] for m in rows} == {"at_rest", "peak_fwd_bwd"} and len(rows) == 4 * 3 * 2
    for m in rows:
        assert m["measured"] == m["predicted"], m
    sends = [c for c in res.comm_records if c["op"] == "send"]
    assert len(sends) == 4 and all(c["payload_bytes"] == c["predicted_payload_bytes"] for c in sends), sends


def test_ddp_run_measures_memory_equal_to_its_prediction_and_gradient_bytes_all_reduced(measured_ddp):
    exp, res = measured_ddp
    assert res.matches(exp.reference(), rtol=1e-4) and not res.events
    psi = sum(math.prod(i["global_shape"]) for i in res.layout[0]["params"].values())
    for moment in ("at_rest", "peak_fwd_bwd"):
        for rank in range(4):
            rows = {m["category"]: m for m in res.memory_records if m["rank"] == rank and m["moment"] == moment}
            for cat in ("params", "grads", "optimizer"):  # the exact rule, as tests/test_memory_comm.py
                assert rows[cat]["measured"] == rows[cat]["predicted"], (moment, rank, rows[cat])
            total = sum(rows[c]["measured"] for c in ("params", "grads", "optimizer"))
            assert total == pytest.approx(sum(rows[c]["formula"] for c in ("params", "grads", "optimizer")), rel=0.01)
            assert ("activations" in rows) == (moment == "peak_fwd_bwd")  # saved tensors exist only then
            assert moment == "at_rest" or rows["activations"]["measured"] > 0
    table = res.comm()
    assert {(r["rank"], r["op"]) for r in table} == {(r, "all_reduce") for r in range(4)}
    for row in table:  # DDP all-reduces flat buckets of every gradient: 4Ψ bytes in fp32
        assert 4 * psi <= row["payload_bytes"] <= 4 * psi * 1.01 and row["predicted_payload_bytes"] == 4 * psi
        assert row["busbw"] == pytest.approx(row["algbw"] * 1.5)
    assert "all_reduce" in str(table) and "<table" in table._repr_html_()
    assert again_plots_memory(res)


def again_plots_memory(res) -> bool:
    fig = lab.RunResult.from_json(res.to_json()).plot_memory("peak_fwd_bwd")
    return any(p.get_gid() == "measured:activations" for p in fig.axes[0].patches)


_GUARDED = (("kernels.measure.trace", None, "instrument"), ("kernels.measure.trace", "TraceRecorder", "__init__"),
            ("kernels.train.measured_run", "StepProbe", "__init__"), ("kernels.watch.comm", "CommMeter", "__init__"))


def _forbid_measuring() -> None:
    """On a rank: make installing a tracer, a probe or a comm meter fail loudly (originals kept aside)."""
    import importlib

    def refuse(*args, **kwargs):
        raise AssertionError("a tracer or meter was installed with trace and measure off")

    saved = []
    for module, cls, name in _GUARDED:
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, refuse)
    globals()["_saved"] = saved


def _allow_measuring() -> None:
    for owner, name, original in globals().pop("_saved"):
        setattr(owner, name, original)


def test_tracing_and_measuring_off_installs_nothing_and_views_say_what_to_pass(cluster):
    exp = lab.Experiment(cluster, TINY, lab.Parallel(pp=2, dp=2, microbatches=2), global_batch=8, steps=2)
    cluster.run(_forbid_measuring)
    try:
        res = exp.run()
    finally:
        cluster.run(_allow_measuring)
    assert res.events == [] and res.bubble == {} and res.memory_records == [] and res.comm_records == []
    assert res.config["trace"] is False and res.config["measure"] is False
    with pytest.raises(NotRecordedError, match="pass trace=True"):
        res.timeline()
    with pytest.raises(NotRecordedError, match="pass trace=True"):
        res.to_chrome_trace()
    with pytest.raises(NotRecordedError, match="pass measure=True"):
        res.memory()
    with pytest.raises(NotRecordedError, match="pass measure=True"):
        res.comm()


def test_trace_options_that_would_record_nothing_are_refused_before_launch(cluster):
    with pytest.raises(ValueError, match="pp > 1"):
        lab.Experiment(cluster, TINY, lab.Parallel(dp=4), trace=True)
    with pytest.raises(ValueError, match="trace=True"):
        lab.Experiment(cluster, TINY, lab.Parallel(pp=2, dp=2, microbatches=2), synthetic_forward_s=0.05)


def test_real_compute_trace_on_more_ranks_than_cores_carries_the_warning(cluster):
    from kernels.measure.synthetic import usable_cores

    exp = lab.Experiment(cluster, TINY, lab.Parallel(pp=2, dp=2, microbatches=2), global_batch=8, steps=2,
                         trace=True)
    res = exp.run()
    assert not res.bubble["synthetic"] and res.bubble["theory"] == pytest.approx(1 / 3)
    oversubscribed = 4 > min(cluster.run(usable_cores))
    assert any("ranks on" in w and "cores" in w for w in res.warnings) == oversubscribed, res.warnings
