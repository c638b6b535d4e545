"""Tried as a new user would: the quickstart notebook, run in JupyterLab in a real browser."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.jupyter_browser import ARTIFACTS, notebook_running, require_browser, wait_for_output

QUICKSTART = Path(__file__).resolve().parent.parent / "notebooks" / "00_quickstart.ipynb"
START_S = 180  # JupyterLab, the kernel and 4 engines on two shared cores
# From the %%px cell's output to the output of the cell after the failing one: the failure, the
# world's rebuild and one all_reduce. Before the lab had its own %%px, that next cell hung 168 s.
AFTER_ERROR_S = 60


@pytest.mark.slow  # JupyterLab in a headless browser
def test_quickstart_shows_rank_table_px_outputs_and_a_px_error_then_goes_on(tmp_path):
    require_browser()
    with notebook_running(QUICKSTART, tmp_path) as page:
        table = page.locator(".cluster-lab-ranks table")
        table.wait_for(timeout=START_S * 1000)
        assert table.locator("tbody tr").count() == 4
        assert table.locator("th").all_inner_texts()[:6] == ["rank", "host", "pid", "device", "backend", "threads"]

        px_out = wait_for_output(page, "[rank 3] Out: tensor(", START_S, name="quickstart")
        shown = time.monotonic()
        assert px_out.inner_text().splitlines() == [f"[rank {r}] Out: tensor([6., 6., 6., 6.])" for r in range(4)]

        error = wait_for_output(page, "RankError", AFTER_ERROR_S, name="quickstart").inner_text()
        assert "rank 3 on host" in error and "ValueError: rank 3 gives up" in error
        assert "raise ValueError('rank 3 gives up')" in error  # the rank's own traceback, with its line
        started = wait_for_output(page, "[rank 0] rank 0 starts", 5, name="quickstart").inner_text()
        assert started.splitlines() == [f"[rank {r}] rank {r} starts" for r in range(4)]

        wait_for_output(page, "[6.0, 6.0, 6.0, 6.0]", AFTER_ERROR_S, name="quickstart")
        after_error_s = time.monotonic() - shown
        assert after_error_s < AFTER_ERROR_S
        wait_for_output(page, "every rank holds", 60, name="quickstart")
        ARTIFACTS.mkdir(exist_ok=True)
        px_out.scroll_into_view_if_needed()  # the %%px outputs and the error, for a person to look at
        page.screenshot(path=str(ARTIFACTS / "quickstart.png"), full_page=True)
        print(f"%%px output to the next cell's output, across the failing cell: {after_error_s:.1f} s")
