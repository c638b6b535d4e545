"""Measured timelines: orders, clock alignment, zero-cost tracing off, Chrome trace export.

Rank cases reuse tests/test_bubble.py's pool of 4 spawned gloo ranks and run real
(tiny) compute: the order of actions does not depend on their cost.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import kernels.measure.synthetic as synthetic
from kernels.measure.trace import _offset_bounds
from kernels.contract.measure_records import BubbleReport, TraceEvent
from lab.measure.timeline import (bubble, bubble_from_records, clock_syncs, events_from, measured_order, planned_order, simulate,
                          to_chrome_trace)
from tests.test_bubble import WORLD, rank_runner

trace_ranks = pytest.fixture(scope="module", name="trace_ranks")(rank_runner)
_cache: dict[tuple, dict] = {}


def _records(trace_ranks, schedule: str, pp: int, m: int) -> dict[int, dict]:
    key = (schedule, pp, m)
    if key not in _cache:
        _cache[key] = trace_ranks({"schedule": schedule, "pp": pp, "dp": WORLD // pp, "microbatches": m})
    return _cache[key]


# --- pure: theory, our planned orders, simulation, records ------------------------------------
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, m", [(2, 4), (4, 4), (4, 8), (4, 16)])
def test_our_planned_order_simulates_to_the_theoretical_bubble(schedule, pp, m):
    orders = {r: planned_order(schedule, pp, m, r) for r in range(pp)}
    report = bubble(simulate(orders, {"F": 1.0, "B": 2.0}), schedule, pp, m)
    assert report.mean == pytest.approx((pp - 1) / (m + pp - 1))
    assert max(report.idle) - min(report.idle) == pytest.approx(0.0, abs=1e-12)


def test_1f1b_plan_keeps_at_most_p_minus_stage_microbatches_in_flight():
    order = planned_order("1f1b", 4, 8, 1)
    assert order[:4] == [(1, "F", 0), (1, "F", 1), (1, "F", 2), (1, "B", 0)]
    in_flight = peak = 0
    for _, letter, _ in order:
        in_flight += 1 if letter == "F" else -1
        peak = max(peak, in_flight)
    assert peak == 3 and in_flight == 0


def test_bubble_report_and_events_round_trip_through_json():
    event = TraceEvent(rank=1, stage=1, kind="forward", microbatch=0, start=0.0, end=0.5, action="F")
    report = bubble([event, TraceEvent(0, 0, "forward", 0, 0.0, 1.0, action="F")], "gpipe", 2, 1)
    assert report.idle == (0.0, 0.5) and report.ranks == (0, 1)
    assert BubbleReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert TraceEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event


def test_driver_timeline_module_never_imports_torch():
    # It shares the torch-free kernels.contract.layout_rules and kernels.contract.schedule_simulation with the views.
    code = "import sys, lab.measure.timeline; assert not {'torch', 'widgets'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_real_compute_with_more_ranks_than_cores_warns(monkeypatch):
    monkeypatch.setattr(synthetic, "usable_cores", lambda: 2)
    with pytest.warns(synthetic.OversubscribedComputeWarning, match="4 ranks on 2 cores"):
        assert "4 ranks on 2 cores" in synthetic.oversubscription_warning(4, synthetic=False)
    assert synthetic.oversubscription_warning(4, synthetic=True) is None  # sleeping ranks share fine


# --- tracing off is free ------------------------------------------------------------------------
@pytest.fixture
def one_rank_world():
    """A 1-rank gloo world in this process (a 1-stage pipeline needs no peers)."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_tracing_off_installs_no_wrappers(one_rank_world):
    from torch.distributed.pipelining import schedules

    from kernels.model.gpt import GPTConfig, loss_fn
    from kernels.parallel.pipeline import build_pipeline, pipeline_step
    from kernels.measure.trace import TraceRecorder, is_instrumented, traced

    rt = build_pipeline(GPTConfig(layers=2, d_model=16, heads=2, vocab=32, seq_len=8),
                        "gpipe", 0, 1, 1, 2, None, "cpu", loss_fn)
    original_p2p = schedules._batch_p2p
    x = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))  # (B, T) token ids
    pipeline_step(rt, x, x)  # tracing off: plain class methods, torch's own p2p function
    stage = rt.stages[0]
    assert not is_instrumented(stage) and schedules._batch_p2p is original_p2p
    assert stage.forward_one_chunk.__func__ is type(stage).forward_one_chunk
    rec = TraceRecorder(0)
    with traced(rt.stages, rec):
        assert is_instrumented(stage) and schedules._batch_p2p is not original_p2p
        pipeline_step(rt, x, x)
    assert not is_instrumented(stage) and schedules._batch_p2p is original_p2p  # removed again
    actions = [(e["action"], e["microbatch"]) for e in rec.events()]
    assert actions == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


# --- on 4 ranks -----------------------------------------------------------------------------------
# 6-8 s a case: the fast tier checks the measured order against torch's plans below, and the bubble in
# tests/test_bubble.py
@pytest.mark.slow
@pytest.mark.parametrize("schedule, pp, m", [("gpipe", 4, 4), ("1f1b", 4, 8), ("1f1b", 2, 4)])
def test_measured_order_matches_our_plan_for_gpipe_and_1f1b(trace_ranks, schedule, pp, m):
    records = _records(trace_ranks, schedule, pp, m)
    for rank, rec in records.items():
        assert measured_order([rec], rank) == planned_order(schedule, pp, m, rec["pp_rank"]), f"rank {rank}"


@pytest.mark.parametrize("schedule, m", [("interleaved_1f1b", 8), ("interleaved_zero_bubble", 8), ("zbv", 8)])
def test_measured_order_matches_torchs_plan_for_multi_stage_schedules(trace_ranks, schedule, m):
    records = _records(trace_ranks, schedule, 4, m)
    for rank, rec in records.items():
        assert rec["planned"], f"torch gave no pipeline_order for {schedule}"
        assert measured_order([rec], rank) == [tuple(a) for a in rec["planned"]], f"rank {rank}"
    if schedule != "interleaved_1f1b":
        assert {a[1] for a in measured_order(events_from(records), 0)} >= {"F", "I", "W"}  # split backward


def test_barrier_round_trips_bound_a_known_clock_offset():
    # Two ranks, rank 1's clock 0.25 s ahead. In round k the barrier releases at R_k;
    # the rank arriving last enters 10 us before it, the other 2 ms before; each leaves
    # 20/30 us after. The bound must hold the true offset and be as narrow as those latencies.
    offset, releases = 0.25, [1.0, 2.0, 3.0, 4.0]
    ref, mine = [], []
    for k, release in enumerate(releases):
        rank0_last = k % 2 == 0
        ref.append((release - (10e-6 if rank0_last else 2e-3), release + 20e-6))
        mine.append((release + offset - (2e-3 if rank0_last else 10e-6), release + offset + 30e-6))
    low, high = _offset_bounds(torch.tensor(mine, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64))
    assert low <= offset <= high
    assert low == pytest.approx(offset - 30e-6) and high == pytest.approx(offset + 40e-6)


def test_clock_alignment_reports_a_residual_within_which_the_offset_holds(trace_ranks):
    records = _records(trace_ranks, "1f1b", 4, 8)
    clocks = clock_syncs(records)
    assert [c.rank for c in clocks] == list(range(WORLD))
    assert clocks[0].offset == 0.0 and clocks[0].uncertainty == 0.0  # the reference
    for c in clocks[1:]:
        assert 0 < c.uncertainty == pytest.approx(c.rtt / 2) and c.uncertainty < 0.01 and c.rounds == 4
        # One host shares one monotonic clock, so the true offset is 0: the estimate must
        # lie within its reported uncertainty (the barriers' bound), not merely be small.
        assert abs(c.offset) <= c.uncertainty + 1e-9
    assert len({c.epoch for c in clocks}) == 1  # rank 0's epoch, broadcast
    assert bubble_from_records(records).clock_uncertainty == max(c.uncertainty for c in clocks)


def test_real_compute_records_carry_the_oversubscription_warning(trace_ranks):
    if synthetic.usable_cores() >= WORLD:
        pytest.skip("enough cores for every rank")
    for rec in _records(trace_ranks, "1f1b", 4, 8).values():
        assert not rec["synthetic"] and "ranks on" in rec["warnings"][0]


def test_chrome_trace_of_pp2_dp2_has_one_track_per_rank(trace_ranks, tmp_path):
    records = _records(trace_ranks, "1f1b", 2, 4)
    assert sorted((rec["pp_rank"], rec["dp_rank"]) for rec in records.values()) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    path = tmp_path / "pp2_dp2.json"
    to_chrome_trace(records, path)
    doc = json.loads(path.read_text())  # valid JSON, as chrome://tracing and Perfetto load it
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    tracks = {}
    for e in spans:
        assert e["dur"] >= 0 and isinstance(e["ts"], float)
        tracks.setdefault(e["args"]["rank"], set()).add((e["pid"], e["tid"]))
    assert sorted(tracks) == list(range(WORLD))
    assert all(len(t) == 1 for t in tracks.values())  # one track per rank...
    assert len({next(iter(t)) for t in tracks.values()}) == WORLD  # ...and no two ranks share one
    kinds = {e["cat"] for e in spans}
    assert {"forward", "backward", "send", "recv", "all_reduce", "optimizer"} <= kinds
    p2p = [e for e in spans if e["cat"] in ("send", "recv")]
    assert all(e["args"]["nbytes"] > 0 and "peer" in e["args"] for e in p2p)
