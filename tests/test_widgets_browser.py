"""The views draw in a real browser: JupyterLab + anywidget in Chromium, replayed from saved records."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kernels.contract.measure_records import TraceEvent
from lab.measure.timeline import bubble, simulate
from tests.jupyter_browser import ARTIFACTS, browser_session, require_browser, write_code_notebook
from tests.test_widgets import collective_records, layout_records, rank_status
from lab.measure.memory_and_comm import memory_records
from tests.test_widgets_timeline import memory_rank_record, trace_events
from widgets import ShardingView

# Glyphs some system fonts lack (Debian's chromium drew U+23F8 as an empty box): the views use SVG icons.
MISSING_GLYPHS = "\u23f8\u25b6\u25c0\u26a0\u2205\u2260\u23ef\u23f5"

CELLS = [
    "import json\nfrom widgets import ClusterView, CollectiveView, ShardingView\n"
    "saved = json.load(open('records.json'))",
    "cluster = ClusterView(saved['ranks'])\ncluster",
    "CollectiveView(saved['collectives'])",
    "CollectiveView(saved['bad_collectives'])",
    "sharding = ShardingView(saved['layout'])\nsharding",
    "switching = ShardingView(saved['layout_before'])\nswitching",
    "from widgets import MemoryView, PipelineTimeline\n"
    "PipelineTimeline(saved['zbv'], None, saved['zbv_planned'])",
    "PipelineTimeline(saved['f1b'], saved['f1b_bubble'])",
    "MemoryView(saved['memory'])",
    "ShardingView(saved['layout_hsdp'])",
    "ShardingView(saved['layout_tp_fsdp'])",
    "PipelineTimeline(saved['f1b'], saved['f1b_bubble'], present=True)",
    "ShardingView(saved['layout'], present=True)",
    "MemoryView(saved['memory'], present=True)",
    "ClusterView(saved['ranks'], present=True)",
    "CollectiveView(saved['collectives'], present=True)",
    "import time\ntime.sleep(2)\ncluster.update(saved['ranks_later'])\nswitching.set_layout(saved['layout'])\n"
    "print('views are ready')",
]


def zbv_events() -> tuple[list[dict], dict]:
    """A V-shaped schedule on 2 ranks (rank 0 holds stages 0 and 3, rank 1 stages 1 and 2), 2 micro-batches,
    with a recv on rank 1 posted at once and served when rank 0 sends: the planned order and the events."""
    orders = {0: [(0, "F", 0), (0, "F", 1), (3, "F", 0), (3, "F", 1), (3, "B", 0), (3, "B", 1), (0, "B", 0),
                  (0, "B", 1)],
              1: [(1, "F", 0), (1, "F", 1), (2, "F", 0), (2, "F", 1), (2, "B", 0), (2, "B", 1), (1, "B", 0),
                  (1, "B", 1)]}
    compute = simulate(orders, {"F": 0.01, "B": 0.02})
    first = next(e for e in compute if (e.rank, e.stage, e.microbatch) == (0, 0, 0))
    p2p = [TraceEvent(1, 1, "recv", 0, 0.0, first.end, peer=0, nbytes=4096),
           TraceEvent(0, 0, "send", 0, first.end, first.end + 1e-3, peer=1, nbytes=4096)]
    events = sorted([e.to_dict() for e in compute + p2p], key=lambda e: e["start"])
    return events, {r: [list(a) for a in acts] for r, acts in orders.items()}


def predicted_mem_records() -> list[dict]:
    """ZeRO-3 on 4 ranks with the model sizes and micro-batch the rule needs: every activation part has a prediction."""
    model = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "d_ff": 64}
    return [r.to_dict() for k in range(4)
            for r in memory_records({**memory_rank_record(k, 4), "model": model, "micro_batch": 2})]


def write_notebook(tmp_path: Path) -> Path:
    bad = collective_records(4)
    next(r for r in bad if r["op"] == "all_reduce" and r["rank"] == 2)["output"] = [-1.0, 100.0]
    records = {"ranks": rank_status(4), "ranks_later": rank_status(4, failed=3), "collectives": collective_records(4),
               "bad_collectives": bad, "layout": layout_records("zero3"), "layout_before": layout_records("zero1"),
               "layout_hsdp": layout_records("hsdp"), "layout_tp_fsdp": layout_records("tp_fsdp"),
               "memory": predicted_mem_records()}
    records["zbv"], records["zbv_planned"] = zbv_events()
    records["f1b"] = trace_events(pp=4, m=8)
    records["f1b_bubble"] = bubble(records["f1b"], "1f1b", 4, 8, synthetic=True).to_dict()
    (tmp_path / "records.json").write_text(json.dumps(records))
    return write_code_notebook(tmp_path / "src" / "widgets_demo.ipynb", CELLS)


@pytest.mark.slow
def test_views_render_and_step_in_jupyterlab(tmp_path):
    require_browser()
    notebook = write_notebook(tmp_path)
    with browser_session(notebook, tmp_path, done_text="views are ready") as page:
        page.wait_for_selector(".cl-rank[data-state='failed']", timeout=20_000)  # update() reached the browser
        first = page.locator(".cl-cluster").first  # a second one, in present mode, comes later
        assert first.locator(".cl-rank").count() == 4
        assert first.locator(".cl-host").count() == 2

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
        for i, kind in ((0, "zero3"), (2, "hsdp"), (3, "tp_fsdp")):  # the title says what the placements built
            view = page.locator(".cl-sharding").nth(i)
            view.scroll_into_view_if_needed()  # JupyterLab draws a cell's output once it is near the viewport
            view.locator(".cl-sharding-title", has_text="fsdp").wait_for(timeout=10_000)
            assert view.locator(".cl-sharding-title").inner_text() == ShardingView(layout_records(kind)).title
        assert "one box = one whole parameter tensor" in sharding.locator(".cl-sharding-legend").inner_text()
        switched.locator(".cl-sharding-title", has_text="fsdp").wait_for(timeout=10_000)
        slice_ = switched.locator(".cl-shard-row[data-rank='1'] .cl-shard-layer[data-layer='params'] .cl-tensor").first
        assert slice_.locator(".cl-shard").get_attribute("data-start") == "8"  # tok_emb rows 8:16 on dp rank 1
        assert "left" in slice_.locator(".cl-shard").evaluate("e => getComputedStyle(e).transitionProperty")
        check_rank_focus_and_tensor_hover(sharding)
        check_timelines_and_memory(page)
        check_present_mode(page)
        text = page.locator(".jp-OutputArea").evaluate_all("els => els.map((e) => e.innerText).join(' ')")
        assert not set(text) & set(MISSING_GLYPHS), sorted(set(text) & set(MISSING_GLYPHS))
        assert page.locator(".cl-play svg.cl-icon").count() >= 2  # the collective's and the timeline's
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "widgets.png"), full_page=True)
        save_each_view(page)


def save_each_view(page) -> None:
    """One screenshot per view drawn, test-artifacts/widgets_<view>_<n>.png (the paths are printed)."""
    for cls in ("cl-cluster", "cl-collective", "cl-sharding", "cl-timeline", "cl-memory"):
        views = page.locator(f".{cls}")
        for i in range(views.count()):
            # scrolled and clipped by hand: Playwright's own element screenshot waits for the element to stop
            # moving, and a wide view inside JupyterLab's output area keeps nudging by a pixel
            views.nth(i).evaluate("e => e.scrollIntoView({block: 'center'})")
            path = ARTIFACTS / f"widgets_{cls[3:]}_{i}.png"
            page.screenshot(path=str(path), clip=views.nth(i).bounding_box(), full_page=True)
            print(f"screenshot: {path}")


def check_rank_focus_and_tensor_hover(sharding) -> None:
    """Clicking a rank's label keeps its three rows in view and says what it holds; hovering a tensor outlines
    it on every rank and gives its global shape and each rank's slice."""
    sharding.scroll_into_view_if_needed()
    sharding.locator(".cl-shard-row[data-rank='1'] > .cl-shard-label").click()
    assert sharding.locator(".cl-shard-row.cl-focused").count() == 1
    assert sharding.locator(".cl-shard-row.cl-focused").get_attribute("data-rank") == "1"
    said = sharding.locator(".cl-shard-focus").inner_text()
    assert said.startswith("rank 1 holds: parameters") and "gradients" in said and "optimizer state" in said
    faded = sharding.locator(".cl-shard-row[data-rank='0']").evaluate("e => getComputedStyle(e).opacity")
    assert float(faded) < 0.5
    sharding.locator(".cl-shard-row[data-rank='2'] .cl-tensor").first.hover()
    assert sharding.locator(".cl-tensor.cl-same-tensor").count() == 4 * 3  # the tensor on 4 ranks x 3 layers
    said = sharding.locator(".cl-shard-focus").inner_text()
    assert "global shape [" in said and "r0 dim0 0:" in said and "r3 dim0" in said
    tensor = sharding.locator(".cl-shard-row[data-rank='2'] .cl-tensor").first
    assert "local slice dim0" in tensor.get_attribute("title")


def check_present_mode(page) -> None:
    """Present mode: larger type and the Okabe-Ito palette (F is #0072b2)."""
    plain, present = page.locator(".cl-timeline").nth(1), page.locator(".cl-timeline").nth(2)
    present.scroll_into_view_if_needed()
    present.locator(".cl-box").first.wait_for(timeout=10_000)
    assert "cl-present" in present.get_attribute("class")
    size = [v.locator(".cl-box").first.evaluate("e => parseFloat(getComputedStyle(e).fontSize)")
            for v in (plain, present)]
    assert size[1] > size[0]
    colour = present.locator(".cl-box[data-kind='F']").first.evaluate("e => getComputedStyle(e).backgroundColor")
    assert colour == "rgb(0, 114, 178)"
    sharding = page.locator(".cl-sharding.cl-present")
    sharding.scroll_into_view_if_needed()
    assert sharding.count() == 1
    held = sharding.locator(".cl-shard-layer[data-layer='params'] .cl-shard").first
    assert held.evaluate("e => getComputedStyle(e).backgroundColor") == "rgb(0, 114, 178)"
    plain, present = page.locator(".cl-memory").first, page.locator(".cl-memory.cl-present")
    present.scroll_into_view_if_needed()
    params = [v.locator(".cl-mem-measured .cl-mem-seg[data-category='params']").first for v in (plain, present)]
    assert [p.evaluate("e => getComputedStyle(e).backgroundColor") for p in params] == [
        "rgb(78, 121, 167)", "rgb(0, 114, 178)"]  # #4e79a7 as ever; Okabe-Ito blue when presenting
    for cls in ("cl-cluster", "cl-collective"):
        plain, present = page.locator(f".{cls}").first, page.locator(f".{cls}.cl-present")
        present.scroll_into_view_if_needed()
        sizes = [v.evaluate("e => parseFloat(getComputedStyle(e).fontSize)") for v in (plain, present)]
        assert sizes[1] > sizes[0], (cls, sizes)


def check_timelines_and_memory(page) -> None:
    """Chunk labels and shades, idle/wait/transfer as three classes, the legend order, the bubble in words,
    and the memory view's byte axis."""
    zbv = page.locator(".cl-timeline").nth(0)
    zbv.scroll_into_view_if_needed()
    zbv.locator(".cl-box").nth(15).wait_for(state="attached", timeout=10_000)
    assert zbv.locator(".cl-box").count() == 16
    assert zbv.locator(".cl-box[data-chunk='1']").count() == 8
    # the long label where it fits, else the short one; never cut (a box keeps its whole label or none)
    assert zbv.locator(".cl-lane[data-rank='0'] .cl-box[data-stage='3']").first.inner_text() in ("mb 0 · chunk 1",
                                                                                                "0·c1")
    assert zbv.locator(".cl-lane[data-rank='1'] .cl-box[data-stage='1']").first.inner_text() in ("mb 0 · chunk 0",
                                                                                                "0·c0")
    assert zbv.locator(".cl-box").evaluate_all(
        "els => els.filter((e) => e.textContent && e.scrollWidth > e.clientWidth + 1).length") == 0
    shade = [zbv.locator(f".cl-box[data-kind='F'][data-chunk='{c}']").first.evaluate(
        "e => getComputedStyle(e).backgroundColor") for c in (0, 1)]
    assert shade[0] != shade[1]
    zbv.locator(".cl-planned-toggle").click()
    zbv.locator(".cl-planned-box").nth(15).wait_for(state="attached", timeout=5_000)
    assert re.fullmatch(r"mb 0 · chunk 1|0·c1", zbv.locator(".cl-planned-box[data-chunk='1']").first.inner_text())
    for cls in ("cl-idle", "cl-wait", "cl-transfer"):
        assert zbv.locator(f".cl-track .{cls}").count() >= 1, cls
    assert zbv.locator(".cl-wait.cl-transfer, .cl-idle.cl-wait, .cl-idle.cl-transfer").count() == 0
    styles = [zbv.locator(f".cl-track .{cls}").first.evaluate(
        "e => { const s = getComputedStyle(e); return s.backgroundImage + '|' + s.backgroundColor; }")
        for cls in ("cl-idle", "cl-wait", "cl-transfer")]
    assert len(set(styles)) == 3 and "gradient" in styles[1]  # blank, hatched, solid
    legend = zbv.locator(".cl-legend-item").evaluate_all("els => els.map((e) => e.dataset.kind)")
    assert [k for k in legend if k] == ["F", "B", "wait", "transfer", "idle", "vguide"]
    assert "waiting" in zbv.locator(".cl-legend").inner_text() and "chunk 1" in zbv.locator(".cl-legend").inner_text()
    zbv.locator(".cl-planned-toggle").click()  # the V guide shows over lanes of the measured height only
    points = zbv.locator(".cl-vguide polyline").get_attribute("points").split()
    assert [float(p.split(",")[1]) for p in points] == [0.5, 1.5, 1.5, 0.5]  # rank 0, 1, 1, 0: down and back up
    assert zbv.locator(".cl-vguide").is_visible()

    page.locator(".cl-timeline").nth(1).scroll_into_view_if_needed()
    words = page.locator(".cl-timeline").nth(1).locator(".cl-bubble").inner_text()
    for said in ("bubble fraction (p-1)/(m+p-1)", "bubble time / ideal time (Megatron's ratio form)",
                 "= schedule ", " + transfer ", " + other ", "makespan", "first compute start to last compute end", "whole step", "optimizer"):
        assert said in words, said

    memory = page.locator(".cl-memory").first
    memory.scroll_into_view_if_needed()
    memory.locator(".cl-mem-table").nth(3).wait_for(timeout=10_000)
    ticks = memory.locator(".cl-mem-axis .cl-mem-tick")
    assert ticks.count() >= 3 and ticks.first.inner_text().startswith("0 ")
    assert "KiB" in ticks.last.inner_text() and "bytes" in memory.locator(".cl-mem-axis-label").inner_text()
    assert memory.locator(".cl-mem-table").count() == 4
    assert memory.locator(".cl-mem-table tr[data-category='params'] .cl-mem-predicted-bytes").count() == 4
    memory.locator(".cl-mem-moment[data-moment='peak_fwd_bwd']").click()  # activations are saved only then
    memory.locator(".cl-mem-parts").nth(3).wait_for(timeout=5_000)
    rows = memory.locator(".cl-mem-rank[data-rank='0'] .cl-mem-parts tr[data-part]")
    assert rows.evaluate_all("els => els.map((e) => e.dataset.part)") == [
        "attention", "mlp", "norms", "projection", "cross-entropy"]  # largest first
    assert "saved-tensor hooks" in rows.first.locator(".cl-mem-part-bytes").get_attribute("title")
    predicted = rows.first.locator(".cl-mem-part-predicted")  # beside each measured part, the rule's number
    assert rows.locator(".cl-mem-part-predicted[data-bytes]").count() == 5
    assert "KiB" in predicted.inner_text() and "activation_rules" in predicted.get_attribute("title")
    assert "predicted: the GPT rule" in memory.locator(".cl-mem-rank[data-rank='0'] .cl-mem-parts caption").inner_text()
    assert memory.locator(".cl-mem-rank[data-rank='0'] .cl-mem-predicted .cl-mem-seg[data-category='activations']"
                          ).count() == 1
