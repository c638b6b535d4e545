"""The training dashboard in a real browser: a row per rank, live updates while a run goes, the stale marker."""
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
    "result = handle.stop()\ncluster.stop()\nprint('dashboard done', result.stopped_at)",
]


def write_notebook(tmp_path: Path) -> Path:
    return write_code_notebook(tmp_path / "src" / "dashboard_demo.ipynb", CELLS)


def kill_pool_left_by(tmp_path: Path) -> None:
    """If the notebook did not reach cluster.stop(), its engines outlive the killed kernel: end them by PID."""
    for proc in psutil.process_iter():
        try:
            if str(tmp_path) in proc.environ().get("JPY_SESSION_NAME", "") and "ipyparallel" in " ".join(proc.cmdline()):
                proc.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


@pytest.mark.slow
def test_dashboard_follows_a_run_in_jupyterlab(tmp_path):
    require_browser()
    try:
        check_dashboard(tmp_path)
    finally:
        kill_pool_left_by(tmp_path)


def check_dashboard(tmp_path: Path) -> None:
    with notebook_running(write_notebook(tmp_path), tmp_path) as page:
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
