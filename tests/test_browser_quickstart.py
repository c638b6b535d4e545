"""Tried as a new user would: the quickstart notebook, run in JupyterLab in a real browser."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.jupyter_browser import ARTIFACTS, browser_session, require_browser

QUICKSTART = Path(__file__).resolve().parent.parent / "notebooks" / "00_quickstart.ipynb"


@pytest.mark.slow  # JupyterLab in a headless browser
def test_quickstart_renders_the_rank_table_in_jupyterlab(tmp_path):
    require_browser()
    with browser_session(QUICKSTART, tmp_path, done_text="every rank holds") as page:
        table = page.locator(".cluster-lab-ranks table")
        assert table.count() == 1
        assert table.locator("tbody tr").count() == 4
        headers = table.locator("th").all_inner_texts()
        assert headers[:6] == ["rank", "host", "pid", "device", "backend", "threads"]
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "quickstart.png"), full_page=True)
