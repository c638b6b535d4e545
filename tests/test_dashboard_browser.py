"""The training dashboard in a real browser: a row per rank, live updates while a run goes, the stale marker.

One JupyterLab session (a module fixture) runs both parts on one pool: a live run with a replayed,
stale dashboard beside it, then a run started in one cell while the next cell waits for it.
"""
from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from tests.jupyter_browser import ARTIFACTS, notebook_running, require_browser, wait_for_output, write_code_notebook

CELLS = [
    "import time, warnings\nimport lab\nwarnings.simplefilter('ignore')\n"
    "cluster = lab.start(2)\n"
    "exp = lab.Experiment(cluster, lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16), lab.Parallel(dp=2), steps=5000)\n"
    "handle = exp.start()\nlive = handle.dashboard(stale_after=30.0)\nlive",
    "from widgets import TrainingDashboard\n"
    "saved = [dict(rank=r, step=0, steps=2, loss=4.0, step_s=0.01, tokens_per_s=1.0, collective_s=0.0, compute_s=0.01,"
    " memory_bytes=1, memory_kind='rss', sent_at=0.0) for r in range(2)]\n"
    "TrainingDashboard(saved, world_size=2, steps=2, stale_after=60.0, heard_at=[time.time() - 600, time.time()])",
    "began = time.time()\nwhile len(handle.history) < 2 * 400 and time.time() - began < 90:\n    time.sleep(0.2)\n"
    "result = handle.stop()\nprint('dashboard done', result.stopped_at)",
]
BUSY_STEPS = 300
BUSY_CELLS = [
    "exp = lab.Experiment(cluster, lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16), lab.Parallel(dp=2),"
    f" steps={BUSY_STEPS})\n"
    "handle = exp.start()\nhandle.dashboard(stale_after=30.0)",
    "print('second cell:', cluster.run(lambda: rank))",  # waits for the started run, saying so
    "cluster.stop()\nprint('busy notebook done')",
]
BUSY = 2  # the busy run's dashboard: after the live one and the replay


def dashboard_step(nth: int) -> str:
    """JavaScript: rank 0's drawn step in the nth dashboard of the page."""
    return f"Number(document.querySelectorAll('.cl-dash')[{nth}].querySelector('.cl-dash-rank[data-rank=\"0\"]').dataset.step)"


def kill_pool_left_by(tmp_path: Path) -> None:
    """If the notebook did not reach cluster.stop(), its engines outlive the killed kernel: end them by PID."""
    for proc in psutil.process_iter():
        try:
            if str(tmp_path) in proc.environ().get("JPY_SESSION_NAME", "") and "ipyparallel" in " ".join(proc.cmdline()):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


@pytest.fixture(scope="module")
def dashboard_page(tmp_path_factory):
    """The page of the one session, yielded as soon as Run All is pressed; every engine it started ends after."""
    require_browser()
    tmp_path = tmp_path_factory.mktemp("dashboard")
    try:
        notebook = write_code_notebook(tmp_path / "src" / "dashboard_demo.ipynb", CELLS + BUSY_CELLS)
        with notebook_running(notebook, tmp_path) as page:
            yield page
    finally:
        kill_pool_left_by(tmp_path)


@pytest.mark.slow
def test_dashboard_follows_a_run_in_jupyterlab(dashboard_page):
    check_dashboard(dashboard_page)


def check_dashboard(page) -> None:
    live = page.locator(".cl-dash").first
    live.wait_for(timeout=180_000)
    rank0 = live.locator(".cl-dash-rank[data-rank='0']")
    page.wait_for_function(  # records arrived and were drawn while the ranks still train
        "() => { const r = document.querySelector('.cl-dash .cl-dash-rank[data-rank=\"0\"]');"
        " return r && r.dataset.step !== '' && Number(r.dataset.step) >= 2; }", timeout=120_000)
    assert live.locator(".cl-dash-rank").count() == 2
    first = int(rank0.get_attribute("data-step"))
    assert live.locator(".cl-dash-head").inner_text().startswith("running")
    page.wait_for_function(
        f"() => Number(document.querySelector('.cl-dash .cl-dash-rank[data-rank=\"0\"]').dataset.step) > {first}",
        timeout=60_000)  # a later step reached the DOM: the view updates live
    assert live.locator(".cl-dash-rank[data-stale='true']").count() == 0
    replay = page.locator(".cl-dash").nth(1)
    replay.scroll_into_view_if_needed()
    replay.locator(".cl-dash-rank[data-rank='0'][data-stale='true']").wait_for(timeout=10_000)
    assert replay.locator(".cl-dash-rank[data-stale='true']").count() == 1
    assert "s ago" in replay.locator(".cl-dash-rank[data-rank='0'] .cl-dash-age").inner_text()
    wait_for_output(page, "dashboard done", 180, name="dashboard")
    page.locator(".cl-dash-head", has_text="finished").first.wait_for(timeout=20_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)


@pytest.mark.slow
def test_dashboard_updates_while_another_cell_runs_in_jupyterlab(dashboard_page):
    page, step_of_rank0 = dashboard_page, dashboard_step(BUSY)
    wait_for_output(page, "dashboard done", 300, name="dashboard")  # the first part, if run alone
    page.locator(".cl-dash").nth(BUSY).wait_for(state="attached", timeout=180_000)
    wait_for_output(page, "waiting for the run started at", 120, name="busy-dashboard")
    page.wait_for_function(f"() => {step_of_rank0} >= 0", timeout=120_000)
    first = page.evaluate(f"() => {step_of_rank0}")
    page.wait_for_function(f"() => {step_of_rank0} > {first}", timeout=60_000)
    # the view moved while the second cell was still waiting for the run
    assert page.locator(".jp-OutputArea-output", has_text="second cell:").count() == 0
    wait_for_output(page, "busy notebook done", 300, name="busy-dashboard")
    assert "second cell: [0, 1]" in page.locator(".jp-OutputArea-output", has_text="second cell:").inner_text()
    busy = page.locator(".cl-dash").nth(BUSY)
    busy.scroll_into_view_if_needed()  # JupyterLab lays out a cell's text only near the viewport
    assert busy.locator(".cl-dash-head").inner_text().startswith(f"finished · step {BUSY_STEPS}/{BUSY_STEPS}")
    steps = busy.locator(".cl-dash-rank").evaluate_all("rows => rows.map(r => r.dataset.step)")
    assert steps == [str(BUSY_STEPS - 1)] * 2  # every step reached the view, though no one watched the end
