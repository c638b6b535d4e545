"""The schedule gallery and the V guide: several traced steps on one time axis, from saved records."""
from __future__ import annotations

import json

import pytest
from matplotlib.figure import Figure

from lab import compare_schedules, plot_schedules
from lab.run.run_result import NotRecordedError, RunResult
from lab.measure.timeline import bubble
from tests.test_widgets import RecordingComm, fake_comm  # noqa: F401  (the shared fake comm fixture)
from tests.test_widgets_browser import zbv_events
from tests.test_widgets_timeline import ev, trace_events
from widgets import PipelineTimeline, ScheduleGallery, plot_gallery, plot_timeline
from widgets._gallery import _gallery_state
from widgets._timeline import _columns
from widgets._vshape import v_path

GALLERY_TRAITS = ("panels", "span_ms")


def five_runs(pp: int = 4, m: int = 8) -> dict[str, tuple]:
    """GPipe, 1F1B, zero-bubble (F/I/W), a V schedule and 1F1B again, each with its measured bubble."""
    runs = {"GPipe": ("gpipe", trace_events("gpipe", pp, m)), "1F1B": ("1f1b", trace_events("1f1b", pp, m)),
            "ZB": ("zb", trace_events(pp=pp, m=m, split=True)), "V": ("zbv", zbv_events()[0]),
            "1F1B again": ("1f1b", trace_events("1f1b", pp, m, epoch=40.0))}
    return {name: (events, bubble(events, schedule, pp if schedule != "zbv" else 2, m if schedule != "zbv" else 2,
                                  synthetic=True).to_dict()) for name, (schedule, events) in runs.items()}


def test_the_v_guide_follows_one_microbatch_down_the_ranks_and_back_up():
    events, _ = zbv_events()  # rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    guide = v_path(_columns(events))
    assert guide["stage"] == [0, 1, 2, 3] and guide["rank"] == [0, 1, 1, 0]
    assert guide["mid"] == sorted(guide["mid"])  # each forward after the one before it


def test_no_v_guide_where_the_stages_are_not_a_v():
    interleaved = [ev(0, "forward", 0, 1, stage=0, mb=0, action="F"), ev(1, "forward", 1, 2, stage=1, mb=0, action="F"),
                   ev(0, "forward", 2, 3, stage=2, mb=0, action="F"), ev(1, "forward", 3, 4, stage=3, mb=0, action="F")]
    assert v_path(_columns(interleaved))["rank"] == []  # rank 0 holds 0 and 2: a loop, not a V
    assert v_path(_columns(trace_events("1f1b", 4, 8)))["rank"] == []


def test_gallery_panels_keep_their_order_and_start_at_their_first_compute():
    runs = five_runs()
    state = _gallery_state(runs)
    assert [p["name"] for p in state["panels"]] == list(runs)
    for panel, (events, report) in zip(state["panels"], runs.values()):
        compute = [e for e in events if e["kind"] in ("forward", "backward", "backward_weight")]
        assert len(panel["boxes"]["kind"]) == len(compute)  # compute only: no send, recv, all-reduce
        assert min(panel["boxes"]["start"]) == 0
        assert panel["span_ms"] == pytest.approx(report["makespan"] * 1e3, abs=2e-3)
        assert panel["bubble"]["mean"] == report["mean"] and panel["bubble"]["theory"] == report["theory"]
    assert state["span_ms"] == max(p["span_ms"] for p in state["panels"])
    assert [bool(p["vguide"]["rank"]) for p in state["panels"]] == [False, False, False, True, False]
    assert state["panels"][3]["chunks"] == 2 and state["panels"][1]["chunks"] == 1


def test_a_gallery_of_five_8x32x3_timelines_stays_under_200_kb(fake_comm, capsys):
    events = trace_events(pp=8, m=32, split=True)
    report = bubble(events, "zb", 8, 32, synthetic=True).to_dict()
    view = ScheduleGallery({f"run {i}": (events, report) for i in range(5)})
    state = view.comm.request_state()["state"]
    data = len(json.dumps({k: state[k] for k in GALLERY_TRAITS}))
    whole = len(json.dumps({k: v for k, v in state.items() if isinstance(v, (str, int, float, list, dict))}))
    with capsys.disabled():
        print(f"\nScheduleGallery, 5 x (8 ranks x 32 micro-batches x F/I/W): state {whole / 1000:.1f} kB "
              f"({data / 1000:.1f} kB of data)")
    assert sum(len(p["boxes"]["kind"]) for p in state["panels"]) == 5 * 8 * 32 * 3
    assert whole < 200_000


def test_gallery_needs_traced_runs_and_says_which_option_records_them():
    traced = RunResult(config={}, losses=[], step_times=[], layout=[], events=zbv_events()[0])
    untraced = RunResult(config={}, losses=[], step_times=[], layout=[])
    with pytest.raises(NotRecordedError, match="'plain'.*trace=True"):
        compare_schedules({"v": traced, "plain": untraced})
    with pytest.raises(TypeError, match="expected a RunResult"):
        compare_schedules({"v": zbv_events()[0]})
    with pytest.raises(ValueError, match="at least one"):
        compare_schedules({})
    runs = five_runs()
    results = [RunResult(config={}, losses=[], step_times=[], layout=[], events=e, bubble=b) for e, b in runs.values()]
    with pytest.raises(ValueError, match="both named '1f1b m=8'"):
        compare_schedules(results)
    gallery = compare_schedules(dict(zip(runs, results)), present=True)
    assert [p["name"] for p in gallery.panels] == list(runs) and gallery.present


def test_plot_gallery_draws_one_panel_per_run_on_a_shared_axis():
    runs = five_runs()
    fig = plot_gallery(runs)
    assert isinstance(fig, Figure) and len(fig.axes) == 5
    assert len({ax.get_xlim() for ax in fig.axes}) == 1  # one shared time axis
    for ax, (name, (events, report)) in zip(fig.axes, runs.items()):
        compute = [e for e in events if e["kind"] in ("forward", "backward", "backward_weight")]
        assert len([p for p in ax.patches if (p.get_gid() or "").startswith("box:")]) == len(compute)
        assert ax.get_title(loc="left").startswith(f"{name}: ") and f"measured bubble {report['mean']:.3f}" in \
            ax.get_title(loc="left")
        assert len([ln for ln in ax.lines if ln.get_gid() == "vguide"]) == (name == "V")
    assert "F forward" in [t.get_text() for t in fig.legends[0].get_texts()]
    assert isinstance(plot_schedules({"V": RunResult(config={}, losses=[], step_times=[], layout=[],
                                                     events=zbv_events()[0])}), Figure)


def test_the_timeline_of_a_v_schedule_carries_its_guide():
    events, planned = zbv_events()
    assert PipelineTimeline(events, None, planned).vguide["stage"] == [0, 1, 2, 3]
    assert PipelineTimeline(trace_events("1f1b", 4, 8)).vguide["rank"] == []
    assert [ln for ln in plot_timeline(events).axes[0].lines if ln.get_gid() == "vguide"]
