"""Every view reads without a kernel: its display bundle holds its twin's PNG and says what it shows in words."""
from __future__ import annotations

import io

import pytest
from PIL import Image

from lab.measure.timeline import bubble
from tests.test_expert_context_views import all_routing, ring_records
from tests.test_ps_views import SPANS
from tests.test_schedule_gallery import five_runs
from tests.test_training_dashboard import record
from tests.test_widgets import collective_records, layout_records, rank_status
from tests.test_widgets_timeline import mem_records, trace_events
from widgets import (ClusterView, CollectiveView, ExpertRouting, MemoryView, PipelineTimeline, PSTimeline, RingTimeline,
                     ScheduleGallery, ShardingView, TrainingDashboard)
from widgets.static_figure import VIEW_KEY, stack_pngs

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _timeline() -> PipelineTimeline:
    events = trace_events("1f1b", 4, 8)
    return PipelineTimeline(events, bubble(events, "1f1b", 4, 8, synthetic=True))


VIEWS = {  # one view per class, fed records in the shapes the ranks return them (no pool)
    "ClusterView": lambda: ClusterView(rank_status(4, failed=2)),
    "CollectiveView": lambda: CollectiveView(collective_records()),
    "ShardingView": lambda: ShardingView(layout_records("zero3")),
    "PipelineTimeline": _timeline,
    "MemoryView": lambda: MemoryView(mem_records()),
    "ScheduleGallery": lambda: ScheduleGallery(five_runs(pp=2, m=4)),
    "PSTimeline": lambda: PSTimeline(SPANS),
    "TrainingDashboard": lambda: TrainingDashboard([record(r, s) for r in range(4) for s in range(3)], world_size=4,
                                                   steps=4),
    "ExpertRouting": lambda: ExpertRouting(all_routing()),
    "RingTimeline": lambda: RingTimeline(ring_records()),
}
EMPTY = [ClusterView, CollectiveView, ShardingView, PipelineTimeline, MemoryView, PSTimeline, ExpertRouting,
         RingTimeline, lambda: TrainingDashboard(world_size=4)]


def png_size(data: dict) -> tuple[int, int]:
    """The size of the bundle's PNG, decoded (fails on bytes that are no PNG)."""
    image = Image.open(io.BytesIO(data["image/png"]))
    assert image.format == "PNG"
    return image.size


@pytest.mark.parametrize("name", VIEWS)
def test_a_view_bundle_holds_its_twins_png_and_says_what_it_shows(name):
    view = VIEWS[name]()
    data, metadata = view._repr_mimebundle_()
    width, height = png_size(data)
    assert width > 200 and height > 100  # a drawn figure, not the "nothing to show" note
    assert WIDGET_VIEW in data  # the live view still renders as the widget in JupyterLab
    assert metadata[VIEW_KEY] == name
    assert data["text/plain"].startswith(f"{name}: ") and "object at 0x" not in data["text/plain"]
    assert repr(view) == data["text/plain"]


@pytest.mark.parametrize("make", EMPTY, ids=lambda m: getattr(m, "__name__", "TrainingDashboard"))
def test_an_empty_view_still_shows_a_figure_saying_so(make):
    data, _ = make()._repr_mimebundle_()
    assert png_size(data)[1] < 100 and "object at 0x" not in data["text/plain"]


def test_a_figure_that_fails_leaves_the_live_view_and_says_why(monkeypatch):
    view = VIEWS["ClusterView"]()
    monkeypatch.setattr(type(view), "static_figure", lambda self: 1 / 0)
    data, metadata = view._repr_mimebundle_()
    assert "image/png" not in data and WIDGET_VIEW in data and metadata[VIEW_KEY] == "ClusterView"
    assert "no static figure: ZeroDivisionError" in data["text/plain"]


def test_the_figure_follows_the_view_state():
    view = ClusterView(rank_status(2))
    before = view._repr_mimebundle_()[0]
    view.update(rank_status(4, failed=1))
    after = view._repr_mimebundle_()[0]
    assert png_size(after)[0] > png_size(before)[0] and "1 failed" in after["text/plain"]


def test_stacked_pngs_keep_every_figure_top_to_bottom():
    a, b = (VIEWS[n]()._repr_mimebundle_()[0]["image/png"] for n in ("ClusterView", "PSTimeline"))
    sizes = [png_size({"image/png": p}) for p in (a, b)]
    assert png_size({"image/png": stack_pngs([a, b])}) == (max(w for w, _ in sizes), sum(h for _, h in sizes))
