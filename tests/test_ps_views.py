"""Parameter-server views from plain records: the timeline's lanes, the figures, a saved PSResult read back."""
from __future__ import annotations

import pytest

from kernels.contract.records import RecordShapeError
from lab.ps.ps_result import PSResult
from widgets.ps_timeline import PSTimeline, _lanes, plot_losses, plot_ps_timeline, plot_staleness

SPANS = [{"rank": 1, "kind": "pull", "step": 0, "start": 10.0, "end": 10.1},
         {"rank": 1, "kind": "compute", "step": 0, "start": 10.1, "end": 10.4},
         {"rank": 1, "kind": "push", "step": 0, "start": 10.4, "end": 10.5},
         {"rank": 0, "kind": "apply", "step": 0, "start": 10.45, "end": 10.5}]


def test_lanes_put_each_rank_on_its_own_lane_from_the_first_span():
    lanes = _lanes(SPANS)
    assert [lane["rank"] for lane in lanes] == [0, 1]
    assert [s["kind"] for s in lanes[1]["spans"]] == ["pull", "compute", "push"]
    assert lanes[1]["spans"][0]["start"] == 0.0
    assert lanes[0]["spans"][0]["start"] == pytest.approx(0.45)


def test_a_span_of_another_shape_or_kind_is_refused():
    with pytest.raises(RecordShapeError, match="PSSpan"):
        _lanes([{**SPANS[0], "stage": 1}])
    with pytest.raises(ValueError, match="unknown span kinds"):
        _lanes([{**SPANS[0], "kind": "sleep"}])


def test_widget_and_figures_draw_the_records():
    assert len(PSTimeline(SPANS).lanes) == 2
    assert len(plot_ps_timeline(SPANS).axes[0].patches) == len(SPANS)
    assert plot_staleness({"async": {0: 3, 2: 1}}).axes[0].patches
    fig = plot_losses({"sync": [4.0, 3.5]}, {"sync": [(0.1, 4.0), (0.2, 3.5)]})
    assert len(fig.axes) == 2


def test_a_saved_ps_result_reads_back_equal():
    ps = {"mode": "async", "max_staleness": None, "optimizer": "adamw", "shards": [["w"]], "wall_s": 1.0,
          "servers": [{"rank": 0, "params": ["w"], "param_bytes": 64, "updates": 2, "pushes": 2, "pulls": 2,
                       "bytes_in": 128, "bytes_out": 128, "staleness": [0, 1], "events": SPANS[3:]}],
          "workers": [{"rank": 1, "losses": [4.0], "staleness": [0], "events": SPANS[:3], "notes": [], "pulls": 1,
                       "pushes": 1, "bytes_sent": 64, "bytes_received": 64, "wait_s": 0.2, "compute_s": 0.3}]}
    result = PSResult(config={}, losses=[4.0], step_times=[[], [0.5]], layout=[{}, {}], ps=ps)
    again = PSResult.from_json(result.to_json())
    assert again == result
    assert again.staleness_histogram() == {0: 1, 1: 1}
    assert again.server_bytes()[0]["measured_per_step"] == 256
    assert again.loss_by_time() == [(pytest.approx(0.5), 4.0)]
