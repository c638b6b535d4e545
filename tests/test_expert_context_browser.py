"""ExpertRouting and RingTimeline draw in JupyterLab in a real browser, and their selectors reach the kernel.

Replayed from hand-made records (tests/test_expert_context_views.py), no ranks: a healthy routing, one whose
rank 3 made 30 assignments for 16 tokens x top_k 2, and a ring-attention call on 4 cp ranks.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.jupyter_browser import ARTIFACTS, browser_session, require_browser, write_code_notebook
from tests.test_expert_context_views import ASSIGNED, CP, EXPERTS, all_routing, ring_records, routing_records

DONE = "expert and context views are ready"
CELLS = [
    "import json\nfrom widgets import ExpertRouting, RingTimeline\nsaved = json.load(open('records.json'))",
    "ExpertRouting(saved['routing'])",
    "ExpertRouting(saved['short'])",
    "RingTimeline(saved['ring'])",
    f"print({DONE!r})",
]


def write_notebook(tmp_path: Path) -> Path:
    short = routing_records(assigned={**ASSIGNED, 3: (8, 2, 4, 0, 4, 4, 4, 4)})
    records = {"routing": [r.to_dict() for r in all_routing()], "short": [r.to_dict() for r in short],
               "ring": [r.to_dict() for r in ring_records()]}
    (tmp_path / "records.json").write_text(json.dumps(records))
    return write_code_notebook(tmp_path / "src" / "expert_context.ipynb", CELLS)


@pytest.mark.slow
def test_routing_heatmap_and_ring_timeline_draw_and_their_selectors_reach_the_kernel(tmp_path):
    require_browser()
    with browser_session(write_notebook(tmp_path), tmp_path, done_text=DONE, timeout_s=120) as page:
        routing = page.locator(".cl-moe").first
        routing.locator(".cl-moe-cell").nth(4 * EXPERTS - 1).wait_for(timeout=10_000)
        assert routing.locator(".cl-moe-cell").count() == 4 * EXPERTS
        assert routing.locator(".cl-moe-cell[data-local='true']").count() == 4 * EXPERTS // 2
        assert routing.locator(".cl-moe-cell[data-rank='3'][data-expert='0']").inner_text() == "10"
        assert routing.locator(".cl-moe-bar").count() == EXPERTS
        assert routing.locator(".cl-moe-bar[data-dropped='6']").count() == 1
        assert "== tokens 64 × top_k 2" in routing.locator(".cl-moe-ok").inner_text()
        assert "blocks.2.mlp" in routing.locator(".cl-moe-title").inner_text()
        routing.locator(".cl-moe-layer").select_option("blocks.10.mlp")  # the kernel recomputes the view
        routing.locator(".cl-moe-title", has_text="blocks.10.mlp").wait_for(timeout=10_000)
        routing.locator(".cl-moe-step").select_option("0")
        routing.locator(".cl-moe-title", has_text="step 0").wait_for(timeout=10_000)

        short = page.locator(".cl-moe").nth(1)
        short.scroll_into_view_if_needed()
        assert "rank 3: assigned 30 != tokens 16 × top_k 2 = 32" in short.locator(".cl-moe-mismatch").inner_text()
        colour = short.locator(".cl-moe-mismatch").evaluate("e => getComputedStyle(e).backgroundColor")
        assert colour == "rgb(198, 40, 40)"
        assert short.locator(".cl-moe-step option").first.inner_text() == "1 (mismatch)"

        ring = page.locator(".cl-cp").first
        ring.scroll_into_view_if_needed()
        ring.locator(".cl-cp-lane").nth(CP - 1).wait_for(timeout=10_000)
        assert ring.locator(".cl-cp-lane").count() == CP
        assert ring.locator(".cl-cp-compute").count() == CP * CP
        assert ring.locator(".cl-cp-wait").count() == CP * (CP - 1)
        assert ring.locator(".cl-cp-transfer").count() == CP * (CP - 1)
        kv = ring.locator(".cl-cp-lane[data-rank='1'] .cl-cp-compute").evaluate_all(
            "els => els.map((e) => e.dataset.kvRank)")
        assert kv == ["1", "0", "3", "2"]
        assert "12.00 KiB per rank" in ring.locator(".cl-cp-head").inner_text()
        assert ring.locator(".cl-cp-mismatch").count() == 0

        ARTIFACTS.mkdir(exist_ok=True)
        for name, view in (("expert_routing", routing), ("expert_routing_mismatch", short), ("ring_timeline", ring)):
            view.evaluate("e => e.scrollIntoView({block: 'center'})")
            page.screenshot(path=str(ARTIFACTS / f"widgets_{name}.png"), clip=view.bounding_box(), full_page=True)
