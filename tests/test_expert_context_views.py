"""ExpertRouting and RingTimeline from hand-made records: the numbers, the figures, the widgets, the checks."""
from __future__ import annotations

import pytest
from matplotlib.colors import to_rgba

from kernels.contract.expert_context_records import RingStep, RoutingStep
from kernels.contract.records import RecordShapeError
from widgets import ExpertRouting, RingTimeline, plot_ring, plot_routing
from widgets.expert_routing import routing_matrix
from widgets.ring_timeline import ring_lanes

TOKENS, TOP_K, EXPERTS, EP = 16, 2, 8, 2
# 4 ranks in two ep groups ({0, 1}, {2, 3}): ep rank = rank % 2; experts 0-3 on ep rank 0, 4-7 on ep rank 1.
ASSIGNED = {0: (8, 4, 4, 4, 4, 4, 2, 2), 1: (4, 4, 4, 4, 4, 4, 4, 4),
            2: (6, 2, 4, 4, 4, 4, 4, 4), 3: (10, 2, 4, 0, 4, 4, 4, 4)}
CAPACITY = 6  # per rank and expert: only expert 0 overflows, on ranks 0 (by 2) and 3 (by 4)
LAYERS = ("blocks.2.mlp", "blocks.10.mlp")  # model order, not string order


def routing_records(step: int = 1, layer: str = LAYERS[0], assigned: dict | None = None) -> list[RoutingStep]:
    """One MoE layer's routing on 4 ranks, 8 experts, ep 2, top_k 2."""
    return [RoutingStep(rank=r, step=step, layer=layer, tokens=TOKENS, top_k=TOP_K, assigned=row,
                        kept=tuple(min(n, CAPACITY) for n in row), aux_loss=1.0 + 0.1 * r, ep_rank=r % EP, ep=EP)
            for r, row in (assigned or ASSIGNED).items()]


def all_routing() -> list[RoutingStep]:
    return [rec for step in (0, 1) for layer in reversed(LAYERS) for rec in routing_records(step, layer)]


CP, STEP_MS, COMPUTE_MS, WAIT_MS, BLOCK_BYTES = 4, 10.0, 8.0, 2.0, 4096


def ring_records(step: int = 0, layer: str = "blocks.0.attn") -> list[RingStep]:
    """One ring-attention forward on 4 cp ranks: own block first (3 chunk pairs, zig-zag), then 2 pairs per block."""
    return [RingStep(rank=r, step=step, layer=layer, ring_step=i, kv_rank=(r - i) % CP, start_s=i * STEP_MS / 1e3,
                     compute_s=COMPUTE_MS / 1e3, wait_s=WAIT_MS / 1e3 if i < CP - 1 else 0.0,
                     sent_bytes=BLOCK_BYTES if i < CP - 1 else 0, chunk_pairs=3 if i == 0 else 2, cp_rank=r, cp=CP)
            for r in range(CP) for i in range(CP)]


def gids(fig, prefix: str) -> list:
    """The artists of ``fig`` whose gid starts with ``prefix``."""
    return [a for ax in fig.axes for a in ax.findobj() if str(a.get_gid() or "").startswith(prefix)]


def test_routing_matrix_groups_experts_by_the_ep_rank_holding_them_and_adds_up_the_load():
    view = routing_matrix(all_routing())
    assert (view["step"], view["layer"]) == (1, "blocks.2.mlp")  # last step, first layer in model order
    assert view["layers"] == list(LAYERS) and view["steps"] == [0, 1]
    assert view["ranks"] == [0, 2, 1, 3] and view["ep_ranks"] == [0, 0, 1, 1]  # rows grouped by the sender's ep rank
    assert view["owner"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert view["rows"][1] == list(ASSIGNED[2])
    assert view["totals"] == [28, 12, 16, 12, 16, 16, 14, 14]
    assert sum(view["totals"]) == 4 * TOKENS * TOP_K == view["tokens"] * view["top_k"]
    assert view["imbalance"] == pytest.approx(28 / 16)
    assert view["dropped"] == 6 and view["dropped_per_expert"] == [6, 0, 0, 0, 0, 0, 0, 0]
    assert view["kept"][0] == 22
    assert view["aux_loss"] == pytest.approx(1.15)
    assert (view["local"], view["remote"]) == (20 + 16 + 16 + 16, 128 - 68)  # diagonal blocks stay on the rank
    assert view["ok"] and view["header"].startswith("checked: total assignments 128 == tokens 64 × top_k 2")
    assert routing_matrix(all_routing(), step=0, layer="blocks.10.mlp")["layer"] == "blocks.10.mlp"


def test_routing_matrix_refuses_records_it_cannot_lay_out():
    with pytest.raises(ValueError, match="no records for step 5"):
        routing_matrix(all_routing(), step=5)
    odd = routing_records()
    odd[1] = RoutingStep(**{**odd[1].to_dict(), "assigned": (32,), "kept": (32,)})
    with pytest.raises(ValueError, match="ranks disagree on the number of experts"):
        routing_matrix(odd)
    three = [RoutingStep(**{**r.to_dict(), "ep": 3}) for r in routing_records()]
    with pytest.raises(ValueError, match="8 experts cannot be split over ep=3"):
        routing_matrix(three)


def test_plot_routing_draws_one_cell_and_one_count_per_rank_and_expert_with_ep_separators():
    fig = plot_routing(all_routing())
    assert len(gids(fig, "cell:")) == 4 * EXPERTS
    assert len(gids(fig, "cell:local")) == 4 * EXPERTS // 2
    counts = gids(fig, "count")
    assert len(counts) == 4 * EXPERTS and counts[0].get_text() == "8"
    assert len(gids(fig, "separator")) == 2  # between the ep groups of experts, and of source ranks
    assert len(gids(fig, "kept")) == EXPERTS and len(gids(fig, "dropped")) == EXPERTS
    assert "== tokens 64 × top_k 2" in fig._suptitle.get_text()
    assert to_rgba(fig._suptitle.get_color()) == to_rgba("black")
    assert "imbalance max/mean 1.75 · dropped 6 · aux loss (mean over ranks) 1.15" in fig.axes[1].get_title()


def test_a_large_matrix_is_drawn_as_colour_without_counts():
    wide = {r: (1,) * 64 for r in range(8)}
    recs = [RoutingStep(rank=r, step=0, layer="moe", tokens=32, top_k=2, assigned=row, kept=row, aux_loss=1.0,
                        ep_rank=r, ep=8) for r, row in wide.items()]
    fig = plot_routing(recs)
    assert len(gids(fig, "cell:")) == 8 * 64 and not gids(fig, "count")
    assert len(gids(fig, "cell:local")) == 64  # 8 diagonal blocks of 8 experts
    assert not routing_matrix(recs)["numbers"]


def test_a_routing_mismatch_is_shown_in_red_and_drawn_as_measured():
    short = {**ASSIGNED, 3: (8, 2, 4, 0, 4, 4, 4, 4)}  # 30 assignments for 16 tokens x top_k 2
    recs = routing_records(assigned=short) + routing_records(step=0)
    view = routing_matrix(recs)
    assert not view["ok"]
    assert view["problems"] == ["rank 3: assigned 30 != tokens 16 × top_k 2 = 32"]
    assert view["header"].startswith("MISMATCH: total assignments 126 != tokens 64 × top_k 2")
    assert view["rows"][3] == list(short[3])  # the row as the rank recorded it
    fig = plot_routing(recs)
    assert to_rgba(fig._suptitle.get_color()) == to_rgba("#c62828")
    assert "rank 3: assigned 30" in fig._suptitle.get_text()
    other = plot_routing(recs, step=0)  # a healthy step still says where the records disagree
    assert "also failing: step 1 blocks.2.mlp" in other._suptitle.get_text()
    assert to_rgba(other._suptitle.get_color()) == to_rgba("#c62828")
    over = routing_records()
    over[0] = RoutingStep(**{**over[0].to_dict(), "kept": (9, 4, 4, 4, 4, 4, 2, 2)})
    assert "rank 0: kept more than assigned at experts [0]" in routing_matrix(over)["problems"]


def test_expert_routing_widget_takes_records_or_dicts_and_recomputes_on_a_new_choice():
    recs = all_routing()
    from_records, from_dicts = ExpertRouting(recs), ExpertRouting([r.to_dict() for r in recs])
    assert from_records.view == from_dicts.view
    assert (from_dicts.step, from_dicts.layer) == (1, "blocks.2.mlp")
    assert from_dicts.view["summary"].startswith("load imbalance max/mean 1.75")
    from_dicts.layer = "blocks.10.mlp"  # what the browser's selector writes
    assert from_dicts.view["layer"] == "blocks.10.mlp" and from_dicts.view["ok"]
    from_dicts.step = 7
    assert "no records for step 7" in from_dicts.view["error"] and from_dicts.view["steps"] == [0, 1]
    assert ExpertRouting(recs, step=0, layer="blocks.10.mlp").view["step"] == 0
    assert ExpertRouting().view["header"] == "no routing records"


def test_a_dict_of_another_shape_is_refused_naming_the_record():
    with pytest.raises(RecordShapeError, match="RoutingStep: unknown key 'experts'"):
        ExpertRouting([{**routing_records()[0].to_dict(), "experts": 8}])
    with pytest.raises(RecordShapeError, match="RingStep: missing key 'kv_rank'"):
        RingTimeline([{k: v for k, v in ring_records()[0].to_dict().items() if k != "kv_rank"}])
    with pytest.raises(RecordShapeError, match="RoutingStep"):
        plot_routing([{"rank": 0}])


def test_ring_lanes_put_each_cp_rank_on_a_lane_with_its_blocks_waits_and_bytes():
    view = ring_lanes(ring_records() + ring_records(step=1))
    assert view["step"] == 1 and view["cp"] == CP
    assert [lane["rank"] for lane in view["lanes"]] == [0, 1, 2, 3]
    lane = view["lanes"][1]
    assert [b["kv_rank"] for b in lane["boxes"]] == [1, 0, 3, 2]  # (cp_rank - ring_step) mod cp
    assert [b["to_cp_rank"] for b in lane["boxes"]] == [2] * CP
    assert lane["boxes"][2]["start_ms"] == pytest.approx(20.0)
    assert lane["sent_bytes"] == 3 * BLOCK_BYTES and lane["chunk_pairs"] == 9
    assert lane["end_ms"] == pytest.approx(3 * STEP_MS + COMPUTE_MS)
    assert lane["wait_ms"] == pytest.approx(3 * WAIT_MS)
    assert view["wait_share"] == pytest.approx(6 / 38)
    assert view["span_ms"] == pytest.approx(38.0)
    assert view["ok"] and view["header"] == ("step 1 · blocks.0.attn · cp=4: sent 12.00 KiB per rank · waiting 16% "
                                             "of the call time (all ranks) · chunk pairs per rank 9 (balanced)")


def test_plot_ring_draws_compute_wait_and_transfer_per_ring_step():
    fig = plot_ring(ring_records())
    assert len(gids(fig, "compute")) == CP * CP
    assert len(gids(fig, "wait")) == CP * (CP - 1)  # the last ring step waits for nothing
    assert len(gids(fig, "transfer_label")) == CP * (CP - 1)
    assert len([a for a in gids(fig, "transfer") if a.get_gid() == "transfer"]) == CP * (CP - 1)
    assert sorted(t.get_text() for t in gids(fig, "label"))[:4] == ["kv 0"] * 4
    assert "12.00 KiB per rank" in fig.axes[0].get_title()


def test_a_ring_step_off_the_ring_is_shown_in_red():
    recs = ring_records()
    recs[5] = RingStep(**{**recs[5].to_dict(), "kv_rank": 2})  # rank 1, ring step 1 should attend rank 0's block
    recs = recs[:-1]  # and rank 3 lost its last ring step
    view = ring_lanes(recs)
    assert not view["ok"] and view["disagree_at"] == [[0, "blocks.0.attn"]]
    assert view["problems"] == ["rank 1 ring step 1: kv_rank 2 != (cp_rank 1 - ring_step) mod 4 = 0",
                                "rank 3: ring steps [0, 1, 2] for cp=4"]
    assert view["lanes"][1]["boxes"][1]["kv_rank"] == 2  # drawn as recorded
    ax = plot_ring(recs).axes[0]
    assert to_rgba(ax.title.get_color()) == to_rgba("#c0392b") and "MISMATCH: rank 1 ring step 1" in ax.get_title()


def test_ring_timeline_widget_takes_records_or_dicts_and_recomputes_on_a_new_choice():
    recs = ring_records() + ring_records(layer="blocks.1.attn")
    widget = RingTimeline([r.to_dict() for r in recs])
    assert widget.view == RingTimeline(recs).view
    assert widget.layer == "blocks.0.attn" and len(widget.view["lanes"]) == CP
    widget.layer = "blocks.1.attn"
    assert widget.view["layer"] == "blocks.1.attn"
    assert RingTimeline().view["header"] == "no ring-attention records"
