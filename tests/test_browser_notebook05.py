"""Notebook 05 as a student runs it: JupyterLab in Debian's Chromium, Run All, every schedule drawn.

Checks what a teacher projecting it needs: five measured timelines (naive, GPipe, 1F1B,
interleaved 1F1B, ZBV), chunk labels on the boxes of the schedules that hold two chunks per
rank (shortened, never cut, where a box is narrow), idle / waiting / transfer drawn as three
distinct classes, the schedule gallery on one time axis, GPipe's and 1F1B's memory over the traced
step (a strip per rank with its peak), and no glyph that a system font may lack. A screenshot of every view is saved
under test-artifacts/ (the paths are printed).
"""
from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest

from tests.jupyter_browser import ARTIFACTS, browser_session, require_browser
from tests.notebook_runs import EXECUTED
from tests.test_browser_views import done_or_error, fail_on_error, screenshot
from tests.test_widgets_browser import MISSING_GLYPHS

NOTEBOOK = Path(__file__).resolve().parent.parent / "notebooks" / "05_pipeline_parallel.ipynb"
# The last cell's line: every view is drawn and every measured-vs-theory check has passed by then, and a
# traceback from any cell fails here. So tests/test_notebooks.py does not run 05 a second time where
# this test can run (BROWSER_RUNS_IT).
DONE = "every schedule part within 1.5 points of theory"
SCHEDULES = ["gpipe", "gpipe", "1f1b", "interleaved_1f1b", "zbv"]  # naive is GPipe with one micro-batch


def _save(locator, name: str) -> Path:
    locator.scroll_into_view_if_needed()
    path = ARTIFACTS / name
    locator.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


@pytest.mark.slow
def test_notebook_05_draws_every_schedule_in_jupyterlab(tmp_path):
    require_browser()
    ARTIFACTS.mkdir(exist_ok=True)
    with browser_session(NOTEBOOK, tmp_path, done_text=done_or_error(DONE), timeout_s=420) as page:
        fail_on_error(page)
        timelines = page.locator(".cl-timeline")
        for i in range(5):  # JupyterLab draws an output once it is near the viewport
            page.locator(".cl-timeline").nth(i).scroll_into_view_if_needed()
        assert timelines.count() == 5
        heads = [timelines.nth(i).locator(".cl-bubble-head").inner_text() for i in range(5)]
        assert [h.split(" ")[0] for h in heads] == SCHEDULES, heads

        for i in (3, 4):  # interleaved 1F1B and ZBV: two chunks per rank, said on the box, never cut
            view = timelines.nth(i)
            assert view.locator(".cl-box[data-chunk='1']").count() > 0
            labels = view.locator(".cl-box[data-chunk='1']").all_inner_texts()
            assert any(re.fullmatch(r"mb \d+ · chunk 1|\d+·c1|c1", t) for t in labels), labels[:8]
            cut = view.locator(".cl-box").evaluate_all(
                "els => els.filter((e) => e.textContent && e.scrollWidth > e.clientWidth + 1).map((e) => e.textContent)")
            assert not cut, cut[:8]  # a label that does not fit is shortened, or left to the tooltip
        assert "chunk" not in " ".join(timelines.nth(2).locator(".cl-box").all_inner_texts())  # 1F1B: one chunk
        assert timelines.nth(4).locator(".cl-vguide").count() == 1  # ZBV: the V guide
        assert sum(timelines.nth(i).locator(".cl-vguide").count() for i in range(4)) == 0

        styles = {}
        for cls in ("cl-idle", "cl-wait", "cl-transfer"):
            found = page.locator(f".cl-timeline .cl-track .{cls}")
            assert found.count() >= 1, cls
            styles[cls] = found.first.evaluate(
                "e => { const s = getComputedStyle(e); return s.backgroundImage + '|' + s.backgroundColor; }")
        assert len(set(styles.values())) == 3 and "gradient" in styles["cl-wait"], styles
        assert page.locator(".cl-wait.cl-transfer, .cl-idle.cl-wait, .cl-idle.cl-transfer").count() == 0

        text = page.locator(".jp-OutputArea").evaluate_all("els => els.map((e) => e.innerText).join(' ')")
        assert not set(text) & set(MISSING_GLYPHS), sorted(set(text) & set(MISSING_GLYPHS))

        names = ["naive", "gpipe", "1f1b", "interleaved_1f1b", "zbv"]
        for i, name in enumerate(names):
            _save(timelines.nth(i), f"notebook05_timeline_{name}.png")
        check_gallery(page)
        check_memory_strips(page)
        screenshot(page, "notebook05.png")
        save_executed(page, tmp_path / NOTEBOOK.name)


def save_executed(page, path: Path, timeout_s: float = 60) -> None:
    """Save the notebook from JupyterLab (Ctrl+S), outputs and all, and copy it to build/executed/: the course
    book (tests/test_book.py) is built from it, so CI does not run notebook 05 a second time."""
    page.keyboard.press("Control+s")
    deadline = time.monotonic() + timeout_s
    while True:
        last = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"][-1]
        if any(DONE in o.get("text", "") for o in last.get("outputs", [])):
            break
        assert time.monotonic() < deadline, f"JupyterLab did not save {path.name} within {timeout_s} s"
        time.sleep(0.5)
    EXECUTED.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, EXECUTED / path.name)


def check_gallery(page) -> None:
    """The gallery: one panel per schedule on one shared time axis, each with its bubble and theory."""
    gallery = page.locator(".cl-gallery").first
    gallery.scroll_into_view_if_needed()
    gallery.locator(".cl-gallery-panel").nth(4).wait_for(timeout=10_000)
    assert gallery.locator(".cl-gallery-panel").count() == 5
    assert gallery.locator(".cl-gallery-axis .cl-tick").count() >= 3
    assert gallery.locator(".cl-gallery-bubble-mean").count() == 5
    assert gallery.locator(".cl-gallery-panel[data-name='ZBV zero bubble'] .cl-vguide").count() == 1
    assert gallery.locator(".cl-gallery-panel .cl-box").count() > 0
    # The naive run does the others' work in one micro-batch, so its panel sets a time axis about 3x longer than
    # theirs and ZBV's boxes are narrow there: each says its chunk in the short label where that fits, and always
    # in its tooltip.
    zbv = gallery.locator(".cl-gallery-panel[data-name='ZBV zero bubble'] .cl-box[data-chunk='1']")
    labels, tips = zbv.all_inner_texts(), zbv.evaluate_all("els => els.map((e) => e.title)")
    assert labels and all(re.fullmatch(r"\d+·c1|c1|", t) for t in labels), labels[:8]
    assert all("(chunk 1 of this rank)" in tip for tip in tips), tips[:4]
    cut = gallery.locator(".cl-box").evaluate_all(
        "els => els.filter((e) => e.textContent && e.scrollWidth > e.clientWidth + 1).map((e) => e.textContent)")
    assert not cut, cut[:8]
    _save(gallery, "notebook05_gallery.png")


def check_memory_strips(page) -> None:
    """GPipe's and 1F1B's memory over the traced step: a strip per rank, each with its measured peak; rank 0's
    peak is higher under GPipe (every micro-batch's activations held at once)."""
    peaks = []
    for i, name in enumerate(("gpipe", "1f1b")):
        view = page.locator(".cl-memory").nth(i)
        view.scroll_into_view_if_needed()
        view.locator(".cl-mem-strip-rank").nth(3).wait_for(timeout=10_000)
        assert view.locator(".cl-mem-strip-rank").count() == 4
        for category in ("params", "grads", "optimizer", "activations"):
            assert view.locator(f".cl-mem-strip-rank[data-rank='0'] path[data-category='{category}']").count() == 1
        peak = view.locator(".cl-mem-strip-rank[data-rank='0'] .cl-mem-strip-peak")
        assert re.match(r"peak [\d.]+ KiB after [FB] mb\d+ s\d+", peak.inner_text()), peak.inner_text()
        peaks.append(int(peak.get_attribute("data-bytes")))
        plot = view.locator(".cl-mem-strip-rank[data-rank='0'] .cl-mem-strip-plot")
        box = plot.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        assert view.locator(".cl-mem-strip-readout").inner_text().startswith("rank 0 after ")
        _save(view, f"notebook05_memory_{name}.png")
    assert peaks[0] > peaks[1], peaks
