"""The measured bubble taken apart (lab/measure/bubble_parts.py) on hand-built traces whose parts are known.

The live check (parts summing to the bubble, the schedule part within 1.5 points of theory under
synthetic costs) is in tests/test_bubble.py; here each part is computed by hand.
"""
from __future__ import annotations

import pytest

from kernels.contract.measure_records import TraceEvent
from lab.measure.bubble_parts import bubble_parts, hop_latencies, planned_bubble, replicas
from lab.measure.timeline import bubble, planned_order


def _naive_two_stage_trace() -> list[TraceEvent]:
    """p=2, m=1: F=1, B=2; the forward hop takes 0.3, the backward hop 0.2, and rank 0 starts its B 0.1 late."""
    return [TraceEvent(0, 0, "forward", 0, 0.0, 1.0, action="F"),
            TraceEvent(1, 1, "recv", 0, 0.0, 1.3, peer=0),
            TraceEvent(1, 1, "forward", 0, 1.3, 2.3, action="F"),
            TraceEvent(1, 1, "backward", 0, 2.3, 4.3, action="B"),
            TraceEvent(0, 0, "recv", 0, 1.0, 4.5, peer=1),
            TraceEvent(0, 0, "backward", 0, 4.6, 6.6, action="B")]


def test_each_part_is_what_was_built_in():
    events = _naive_two_stage_trace()
    assert hop_latencies(events, last_stage=1) == {(1, "F", 0): pytest.approx(0.3), (0, "B", 0): pytest.approx(0.2)}
    # Zero-latency replay ends at 6.0, with the hops at 6.5; measured makespan 6.6; each rank is busy 3.0.
    parts = bubble_parts(events, 6.6, {0: 3.0, 1: 3.0})
    for rank in (0, 1):
        assert parts["schedule"][rank] == pytest.approx(3.0 / 6.6)
        assert parts["transfer"][rank] == pytest.approx(0.5 / 6.6)
        assert parts["other"][rank] == pytest.approx(0.1 / 6.6)


def test_report_parts_sum_to_the_measured_bubble_per_rank_and_on_average():
    report = bubble(_naive_two_stage_trace(), "gpipe", 2, 1)
    assert sum(report.parts.values()) == pytest.approx(report.mean, abs=1e-12)
    for i, idle in enumerate(report.idle):
        assert sum(v[i] for v in report.rank_parts.values()) == pytest.approx(idle, abs=1e-12)


def test_data_already_there_is_no_transfer():
    # The consumer posts its recv after the producer finished and gets the data at once: the hop costs nothing,
    # and its late start is "other", not "transfer".
    events = [TraceEvent(0, 0, "forward", 0, 0.0, 1.0, action="F"),
              TraceEvent(1, 1, "recv", 0, 1.5, 1.5, peer=0),
              TraceEvent(1, 1, "forward", 0, 1.5, 2.5, action="F")]
    assert hop_latencies(events, last_stage=1) == {(1, "F", 0): 0.0}
    parts = bubble_parts(events, 2.5, {0: 1.0, 1: 1.0})
    assert parts["transfer"][0] == 0.0 and parts["other"][0] == pytest.approx(0.5 / 2.5)


def test_replicas_pair_the_ith_rank_of_each_stage_set():
    # PP2 x DP2 with pp outermost: ranks 0, 1 hold stage 0 and ranks 2, 3 stage 1.
    compute = [TraceEvent(r, r // 2, "forward", 0, 0.0, 1.0, action="F") for r in range(4)]
    assert replicas(compute) == [[0, 2], [1, 3]]
    # dp outermost: ranks 0, 2 hold stage 0.
    compute = [TraceEvent(r, r % 2, "forward", 0, 0.0, 1.0, action="F") for r in range(4)]
    assert replicas(compute) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("schedule, p, m", [("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 2, 5), ("gpipe", 3, 1)])
def test_planned_order_bubble_is_the_closed_form(schedule, p, m):
    orders = [planned_order(schedule, p, m, r) for r in range(p)]
    assert planned_bubble(orders) == pytest.approx((p - 1) / (m + p - 1))
    assert planned_bubble([[], []]) is None
