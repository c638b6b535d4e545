"""The views draw in a real browser: JupyterLab + anywidget in Chromium, replayed from saved records."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.jupyter_browser import ARTIFACTS, browser_session, require_browser
from tests.test_widgets import collective_records, layout_records, rank_status

CELLS = [
    "import json\nfrom widgets import ClusterView, CollectiveView, ShardingView\n"
    "saved = json.load(open('records.json'))",
    "cluster = ClusterView(saved['ranks'])\ncluster",
    "CollectiveView(saved['collectives'])",
    "CollectiveView(saved['bad_collectives'])",
    "sharding = ShardingView(saved['layout'])\nsharding",
    "switching = ShardingView(saved['layout_before'])\nswitching",
    "import time\ntime.sleep(2)\ncluster.update(saved['ranks_later'])\nswitching.set_layout(saved['layout'])\n"
    "print('views are ready')",
]


def write_notebook(tmp_path: Path) -> Path:
    bad = collective_records(4)
    next(r for r in bad if r["op"] == "all_reduce" and r["rank"] == 2)["output"] = [-1.0, 100.0]
    records = {"ranks": rank_status(4), "ranks_later": rank_status(4, failed=3), "collectives": collective_records(4),
               "bad_collectives": bad, "layout": layout_records("zero3"), "layout_before": layout_records("zero1")}
    (tmp_path / "records.json").write_text(json.dumps(records))
    cells = [{"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": src}
             for src in CELLS]
    notebook = {"cells": cells, "nbformat": 4, "nbformat_minor": 5,
                "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                             "language_info": {"name": "python"}}}
    path = tmp_path / "src" / "widgets_demo.ipynb"
    path.parent.mkdir()
    path.write_text(json.dumps(notebook))
    return path


@pytest.mark.slow
def test_views_render_and_step_in_jupyterlab(tmp_path):
    require_browser()
    notebook = write_notebook(tmp_path)
    with browser_session(notebook, tmp_path, done_text="views are ready") as page:
        page.wait_for_selector(".cl-rank[data-state='failed']", timeout=20_000)  # update() reached the browser
        assert page.locator(".cl-rank").count() == 4
        assert page.locator(".cl-host").count() == 2

        ring = page.locator(".cl-collective").first
        assert ring.locator(".cl-ring-step").count() == 7  # inputs + 3 reduce-scatter + 3 all-gather
        assert ring.locator(".cl-chunk").count() == 16
        assert ring.locator(".cl-ok").count() == 1 and ring.locator(".cl-mismatch").count() == 0
        ring.locator(".cl-next").click()
        ring.locator(".cl-ring-step.cl-current[data-frame='1']").wait_for(timeout=5_000)
        assert ring.locator(".cl-chunk-recv").count() == 4  # every rank received one chunk
        ring.locator(".cl-op-tab[data-op='all_gather']").click()
        ring.locator(".cl-ring-step").nth(3).wait_for(timeout=5_000)
        assert ring.locator(".cl-ring-step").count() == 4
        wrong = page.locator(".cl-collective").nth(1)  # opens on the op whose twin disagrees
        assert "ranks [2]" in wrong.locator(".cl-mismatch").inner_text()
        assert wrong.locator(".cl-io-bad").count() == 1

        sharding = page.locator(".cl-sharding").first
        assert sharding.locator(".cl-shard-row").count() == 4
        assert sharding.locator(".cl-shard").count() == 4 * 3 * 5  # 4 ranks x 3 layers x 5 tensors, all sharded
        sharding.locator(".cl-phase-next").click()  # layout at rest -> step 1: shards only, no gradients yet
        sharding.locator(".cl-phase-next").click()  # -> step 2: all-gather root
        sharding.locator(".cl-phase-label[data-op='all_gather']").wait_for(timeout=5_000)
        assert sharding.locator(".cl-shard.cl-gathered").count() == 4 * 2  # root: tok_emb and lm_head, every rank
        switched = page.locator(".cl-sharding").nth(1)  # zero1 -> zero3 after it was drawn
        switched.locator(".cl-sharding-title", has_text="fsdp").wait_for(timeout=10_000)
        slice_ = switched.locator(".cl-shard-row[data-rank='1'] .cl-shard-layer[data-layer='params'] .cl-tensor").first
        assert slice_.locator(".cl-shard").get_attribute("data-start") == "8"  # tok_emb rows 8:16 on dp rank 1
        assert "left" in slice_.locator(".cl-shard").evaluate("e => getComputedStyle(e).transitionProperty")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "widgets.png"), full_page=True)
