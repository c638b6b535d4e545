"""PipelineTimeline and MemoryView are pure functions of records: state, replay from JSON, size, the comm."""
from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import matplotlib
import pytest
from matplotlib.figure import Figure

from lab.measure.memory_and_comm import memory_records, predicted_memory
from kernels.contract.measure_records import MemoryRecord, TraceEvent
from kernels.contract.records import RecordShapeError
from lab.measure.timeline import bubble, planned_order, simulate
from tests.test_widgets import RecordingComm, fake_comm  # noqa: F401  (the shared fake comm fixture)
from widgets.memory_view import CATEGORIES, MemoryView, _memory_state, plot_memory
from widgets._timeline import _columns, _idle, _mean_ms, _planned_layout, _rows, _timeline_state
from widgets.pipeline_timeline import PipelineTimeline, _box_label, plot_timeline

matplotlib.use("Agg")
TIMELINE_TRAITS = ["ranks", "events", "idle", "planned", "plan_match", "mean_ms", "span_ms", "bubble"]
MEMORY_TRAITS = ["ranks", "moments", "categories", "bars", "scale", "moment"]
COSTS = {"F": 0.0101234567, "B": 0.0203456789, "I": 0.0101111111, "W": 0.0099999999}


# --- records, in the shapes the ranks return them ---------------------------------------------------
def zb_orders(pp: int, m: int) -> dict[int, list[tuple]]:
    """1F1B with each backward split into I then W (three compute kinds, as zero-bubble schedules run)."""
    return {r: [a for s, k, mb in planned_order("1f1b", pp, m, r)
                for a in ([(s, "F", mb)] if k == "F" else [(s, "I", mb), (s, "W", mb)])] for r in range(pp)}


def trace_events(schedule: str = "1f1b", pp: int = 4, m: int = 8, *, split: bool = False, step: int = 0,
                 epoch: float = 12.3456789) -> list[dict]:
    """TraceEvent dicts as kernels.measure.trace returns them: compute with torch's letters, p2p waits, the dp
    all-reduce and the optimizer, on clocks aligned to rank 0 (an offset epoch, several decimals)."""
    orders = zb_orders(pp, m) if split else {r: planned_order(schedule, pp, m, r) for r in range(pp)}
    compute = simulate(orders, COSTS)
    out = [TraceEvent(e.rank, e.stage, e.kind, e.microbatch, epoch + e.start, epoch + e.end, action=e.action,
                      step=step) for e in compute]
    for e in compute:  # the activation goes down the pipe after F, its gradient up after B/I
        peer = e.rank + 1 if e.action == "F" else e.rank - 1
        if e.action in ("F", "B", "I") and 0 <= peer < pp:
            t = epoch + e.end
            out.append(TraceEvent(e.rank, e.stage, "send", e.microbatch, t, t + 2e-5, step=step, peer=peer,
                                  nbytes=4096))
            # the receiving stage tags its recv (kernels/measure/trace.py): one stage per rank here
            out.append(TraceEvent(peer, peer, "recv", e.microbatch, t, t + 3e-5, step=step, peer=e.rank,
                                  nbytes=4096))
    end = epoch + max(e.end for e in compute)
    for r in range(pp):
        out.append(TraceEvent(r, None, "all_reduce", None, end, end + 1e-3, step=step, nbytes=1 << 20))
        out.append(TraceEvent(r, None, "optimizer", None, end + 1e-3, end + 2e-3, step=step))
    return [e.to_dict() for e in sorted(out, key=lambda e: (e.start, e.rank))]


def rank_records(pp: int = 4, m: int = 8) -> list[dict]:
    """What a traced pipeline run of kernels.train.entry.train_rank returns per rank (two traced steps)."""
    events = trace_events(pp=pp, m=m, step=0) + trace_events(pp=pp, m=m, step=1, epoch=13.5)
    return [{"rank": r, "pp_rank": r, "dp_rank": 0, "schedule": "1f1b", "pp": pp, "dp": 1, "stages_per_rank": 1,
             "microbatches": m, "stage_ids": [r], "synthetic": True,
             "events": [e for e in events if e["rank"] == r],
             "clock": {"rank": r, "offset": 0.0, "uncertainty": 2e-5, "rtt": 4e-5, "rounds": 8, "epoch": 1.0},
             "planned": None} for r in range(pp)]


def plans(schedule: str, pp: int, m: int) -> dict[int, list[list]]:
    return {r: [list(a) for a in planned_order(schedule, pp, m, r)] for r in range(pp)}


def memory_rank_record(rank: int, dp: int = 4, cuda: int | None = None) -> dict:
    """kernels.train.entry.measure_rank's shape for ZeRO-3 on dp ranks: the layout and two memory snapshots."""
    params = {"tok_emb.weight": [32, 16], "blocks.0.attn.q.weight": [16, 16], "blocks.0.attn.q.bias": [16],
              "lm_head.weight": [32, 16]}
    record = {"rank": rank, "strategy": "fsdp", "zero": 3, "dims": {"dp": dp, "tp": 1, "pp": 1},
              "coords": {"dp": rank, "tp": 0, "pp": 0},
              "params": {n: {"global_shape": s, "local_shape": s, "dtype": "torch.float32", "mesh_axes": ["dp"],
                             "placements": ["S(0)"]} for n, s in params.items()}}
    pred = predicted_memory(record)
    record["memory"] = {moment: {**{k: int(v) + 8 * rank for k, v in pred[moment].items()},
                                 "activations": 0 if moment == "at_rest" else 20_000 + rank,
                                 "cuda_max_allocated": cuda} for moment in ("at_rest", "peak_fwd_bwd")}
    record["memory"]["peak_fwd_bwd"]["activation_parts"] = {  # kernels.measure.activation_parts: the 20_000 + rank again
        "attention": 9_000, "mlp": 7_000, "norms": 3_000, "projection": 600, "cross-entropy": 400 + rank}
    return record


def mem_records(dp: int = 4, cuda: int | None = None) -> list[dict]:
    return [r.to_dict() for k in range(dp) for r in memory_records(memory_rank_record(k, dp, cuda))]


def replay(data, tmp_path: Path):
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(data))
    return json.loads(path.read_text())


# --- the columnar transform -------------------------------------------------------------------------
def test_columns_round_trip_to_the_trace_events_at_microsecond_precision():
    events = trace_events(split=True)
    cols = _columns(events)
    assert json.loads(json.dumps(cols)) == cols
    back = _rows(cols)
    assert len(back) == len(events)
    for got, want in zip(back, sorted(events, key=lambda e: (e["start"], e["rank"]))):
        assert {k: v for k, v in got.items() if k not in ("start", "end")} == \
               {k: v for k, v in want.items() if k not in ("start", "end")}
        assert got["start"] == pytest.approx(want["start"], abs=1e-6)
        assert got["end"] == pytest.approx(want["end"], abs=1e-6)
        assert TraceEvent.from_dict(got).kind == want["kind"]


def test_columns_count_time_from_the_steps_first_event_in_ms():
    cols = _columns(trace_events(pp=2, m=2))
    assert cols["start"][0] == 0.0 and cols["t0_ms"] == pytest.approx(12345.6789)
    assert cols["kind"][:2] == ["F", "F"] and cols["end"][0] == pytest.approx(10.123, abs=1e-3)
    assert set(cols["kind"]) == {"F", "B", "send", "recv", "all_reduce", "optimizer"}
    assert all(len(str(t).split(".")[-1]) <= 3 for t in cols["start"] + cols["end"])  # µs


def test_one_step_is_shown_the_bubbles_step_else_the_last():
    records = rank_records()
    assert _columns(records)["step"] == 1
    report = bubble([e for r in records for e in r["events"]], "1f1b", 4, 8, step=0)
    state = _timeline_state(records, report)
    assert state["events"]["step"] == 0 and len(state["events"]["rank"]) == len(trace_events())


def test_mean_durations_per_letter_are_the_measured_ones():
    assert _mean_ms(_columns(trace_events(split=True))) == pytest.approx(
        {k: v * 1e3 for k, v in COSTS.items() if k != "B"}, abs=1e-3)


# --- state size ------------------------------------------------------------------------------------
def test_state_for_8_ranks_32_microbatches_3_kinds_stays_under_200_kb(capsys):
    events = trace_events(pp=8, m=32, split=True)
    state = _timeline_state(events, bubble(events, "zb", 8, 32), {r: [list(a) for a in o]
                                                                  for r, o in zb_orders(8, 32).items()})
    assert sum(k in "FIW" for k in state["events"]["kind"]) == 8 * 32 * 3
    size = len(json.dumps(state))
    with capsys.disabled():
        print(f"\nPipelineTimeline state, 8 ranks x 32 micro-batches x F/I/W + {len(events) - 768} comm events "
              f"+ planned overlay: {size / 1000:.1f} kB")
    assert size < 200_000


def test_state_message_through_the_comm_stays_under_200_kb(fake_comm):
    events = trace_events(pp=8, m=32, split=True)
    view = PipelineTimeline(events, bubble(events, "zb", 8, 32), zb_orders(8, 32))
    state = view.comm.request_state()["state"]
    assert len(json.dumps({k: state[k] for k in TIMELINE_TRAITS})) < 200_000
    assert state["_esm"].startswith("//") and ".cl-timeline" in state["_css"]


# --- chunks, waiting, idle ------------------------------------------------------------------------
def ev(rank, kind, start_ms, end_ms, stage=None, mb=None, peer=None, action=""):
    return TraceEvent(rank, stage, kind, mb, start_ms / 1e3, end_ms / 1e3, action=action, peer=peer).to_dict()


def test_each_box_knows_which_of_its_ranks_stages_it_is():
    # interleaved, p=2, v=2: rank 0 holds stages 0 and 2, rank 1 holds 1 and 3
    events = [ev(0, "forward", 0, 1, 0, 0, action="F"), ev(1, "forward", 1, 2, 1, 0, action="F"),
              ev(0, "forward", 2, 3, 2, 0, action="F"), ev(1, "forward", 3, 4, 3, 0, action="F"),
              ev(0, "optimizer", 5, 6)]
    cols = _columns(events)
    assert [(r, s, c) for r, s, c in zip(cols["rank"], cols["stage"], cols["chunk"])] == \
        [(0, 0, 0), (1, 1, 0), (0, 2, 1), (1, 3, 1), (0, None, None)]
    plan = _planned_layout({0: [[0, "F", 0], [2, "F", 0]], 1: [[1, "F", 0], [3, "F", 0]]}, {"F": 1.0})
    assert sorted(zip(plan["stage"], plan["chunk"])) == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_a_recv_waits_until_its_peer_sends_and_a_collective_until_the_last_rank_enters():
    events = [ev(1, "recv", 0, 6, 1, 0, peer=0), ev(0, "send", 5, 5.5, 0, 0, peer=1),
              ev(0, "all_reduce", 10, 13), ev(1, "all_reduce", 12, 13), ev(1, "optimizer", 13, 14)]
    cols = _columns(events)
    ready = {(r, k): v for r, k, v in zip(cols["rank"], cols["kind"], cols["ready"])}
    assert ready[(1, "recv")] == 5.0  # blocked 0..5 ms waiting, data moving 5..6 ms
    assert ready[(0, "send")] == 5.0  # the recv was already posted: no wait on the sender
    assert ready[(0, "all_reduce")] == 12.0 and ready[(1, "all_reduce")] == 12.0
    assert ready[(1, "optimizer")] is None  # rank-wide work, not communication


def test_idle_gaps_are_the_time_between_compute_actions_within_the_makespan():
    events = [ev(0, "forward", 0, 2, 0, 0, action="F"), ev(1, "forward", 3, 5, 1, 0, action="F"),
              ev(0, "forward", 4, 6, 0, 1, action="F")]
    idle = _idle(_columns(events))
    assert list(zip(idle["rank"], idle["start"], idle["end"])) == [(0, 2.0, 4.0), (1, 0.0, 3.0), (1, 5.0, 6.0)]
    busy = {0: 4.0, 1: 2.0}  # what BubbleReport counts: idle = makespan - busy per rank
    for r in (0, 1):
        assert sum(e - s for rr, s, e in zip(*idle.values()) if rr == r) == pytest.approx(6.0 - busy[r])


# --- bubble and plan ----------------------------------------------------------------------------------
def test_bubble_numbers_pass_through_unchanged():
    events = trace_events(pp=4, m=8)
    report = bubble(events, "1f1b", 4, 8, synthetic=True, clock_uncertainty=2e-5)
    view = PipelineTimeline(events, report)
    assert view.bubble == json.loads(json.dumps(report.to_dict()))
    assert view.bubble["idle"] == list(report.idle) and view.bubble["mean"] == report.mean
    assert (view.bubble["theory"], view.bubble["theory_megatron"]) == (3 / 11, 3 / 8)
    assert view.bubble["synthetic"] is True
    assert PipelineTimeline(events).bubble == {}


def test_planned_overlay_lays_the_plan_out_with_the_measured_mean_durations():
    events = trace_events(pp=4, m=8)
    state = _timeline_state(events, None, plans("1f1b", 4, 8))
    plan, cols = state["planned"], state["events"]
    assert sorted(plan) == ["chunk", "end", "kind", "mb", "rank", "stage", "start"]
    assert len(plan["rank"]) == 4 * 16
    # the measured run followed the plan at the same costs, so the overlay lands on the measured boxes
    measured = sorted((r, s, k, m, a, b) for r, s, k, m, a, b in zip(*(cols[c] for c in
                      ("rank", "stage", "kind", "mb", "start", "end"))) if k in "FB")
    laid = sorted(zip(*(plan[c] for c in ("rank", "stage", "kind", "mb", "start", "end"))))
    assert [x[:4] for x in laid] == [x[:4] for x in measured]
    assert all(a[4] == pytest.approx(b[4], abs=2e-3) for a, b in zip(laid, measured))
    assert state["plan_match"] == {str(r): True for r in range(4)}


def test_a_run_that_left_its_plan_is_flagged_per_rank():
    state = _timeline_state(trace_events(pp=4, m=8), None, plans("gpipe", 4, 8))
    assert state["plan_match"]["3"] is False  # 1F1B ran; GPipe's rank 3 would run all forwards first
    assert _timeline_state(trace_events(), None, None)["plan_match"] == {}


def test_a_plan_that_would_wait_forever_is_still_drawn_whole():
    stuck = {0: [[0, "B", 0], [0, "F", 0]], 1: [[1, "F", 0], [1, "B", 0]]}  # rank 0 wants B before F
    plan = _planned_layout(stuck, {"F": 1.0, "B": 2.0})
    assert len(plan["rank"]) == 4
    assert all(b >= a for a, b in zip(plan["start"], plan["end"]))


def test_torchs_multi_stage_plan_from_a_rank_record_is_accepted():
    orders = {0: [(0, "F", 0), (3, "F", 0), (3, "B", 0), (0, "B", 0)], 1: [(1, "F", 0), (2, "F", 0), (2, "B", 0),
                                                                          (1, "B", 0)]}  # a V: stages r, 2p-1-r
    plan = _planned_layout(json.loads(json.dumps(orders)), {"F": 1.0, "B": 2.0})
    starts = {(s, k): t for s, k, t in zip(plan["stage"], plan["kind"], plan["start"])}
    assert starts == {(0, "F"): 0.0, (1, "F"): 1.0, (2, "F"): 2.0, (3, "F"): 3.0, (3, "B"): 4.0, (2, "B"): 6.0,
                      (1, "B"): 8.0, (0, "B"): 10.0}


# --- the widget: replay, the comm ---------------------------------------------------------------------
def test_timeline_replayed_from_a_saved_json_file_equals_the_live_one(tmp_path):
    records = rank_records()
    report = bubble([e for r in records for e in r["events"]], "1f1b", 4, 8, synthetic=True)
    live = PipelineTimeline(records, report, plans("1f1b", 4, 8)).get_state(TIMELINE_TRAITS)
    saved = replay({"ranks": records, "bubble": report.to_dict(), "planned": plans("1f1b", 4, 8)}, tmp_path)
    again = PipelineTimeline(saved["ranks"], saved["bubble"], saved["planned"]).get_state(TIMELINE_TRAITS)
    assert again == live
    flat = [e for r in saved["ranks"] for e in r["events"]]  # a flat event list works the same
    assert PipelineTimeline(flat, saved["bubble"], saved["planned"]).get_state(TIMELINE_TRAITS) == live


def test_timeline_opens_with_its_state_and_takes_the_browsers_cursor_and_toggle(fake_comm):
    view = PipelineTimeline(trace_events(), None, plans("1f1b", 4, 8))
    opened = view.comm.opened["data"]["state"]
    assert opened["events"]["rank"] == view.events["rank"] and opened["ranks"] == [0, 1, 2, 3]
    view.comm.from_browser({"cursor_ms": 12.5, "show_planned": True})
    assert view.cursor_ms == 12.5 and view.show_planned is True
    view.comm.sent.clear()
    view.update(trace_events(pp=2, m=4))
    assert len(view.comm.sent) == 1 and view.comm.sent[0]["state"]["ranks"] == [0, 1]
    assert view.cursor_ms == -1.0 and view.planned["rank"] == []


# --- MemoryView -------------------------------------------------------------------------------------
def test_memory_sums_per_category_per_rank_equal_the_records():
    records = mem_records()
    state = _memory_state(records)
    assert state["ranks"] == [0, 1, 2, 3] and state["moments"] == ["at_rest", "peak_fwd_bwd"]
    for moment, bars in state["bars"].items():
        for bar in bars:
            mine = [r for r in records if r["rank"] == bar["rank"] and r["moment"] == moment]
            for cat in ("params", "grads", "optimizer", "activations"):
                assert bar["measured"][cat] == sum(r["measured"] for r in mine if r["category"] == cat)
            assert bar["measured"]["other"] == 0 and bar["cuda_max_allocated"] is None
            assert bar["predicted"] == {r["category"]: r["predicted"] for r in mine if r["predicted"] is not None}
            assert bar["total"] == sum(bar["measured"].values())
            assert bar["formula_total"] == pytest.approx(sum(r["formula"] or 0 for r in mine))
    assert state["scale"] == max(max(b["total"], b["predicted_total"], b["formula_total"])
                                 for bars in state["bars"].values() for b in bars)


def test_cuda_max_allocated_beyond_the_categories_shows_as_other():
    bar = _memory_state(mem_records(cuda=10_000_000))["bars"]["peak_fwd_bwd"][1]
    assert bar["cuda_max_allocated"] == 10_000_000 and bar["total"] == 10_000_000
    assert "cuda max allocated" in bar["notes"]["other"]
    extra = MemoryRecord(rank=0, moment="at_rest", category="allocator_cache", measured=512, predicted=None,
                         formula=None).to_dict()
    assert _memory_state(mem_records() + [extra])["bars"]["at_rest"][0]["measured"]["other"] == 512


def test_memory_view_replayed_from_json_equals_the_live_one_and_switches_moment(tmp_path, fake_comm):
    live = MemoryView(mem_records())
    assert MemoryView(replay(mem_records(), tmp_path)).get_state(MEMORY_TRAITS) == live.get_state(MEMORY_TRAITS)
    assert live.comm.opened["data"]["state"]["categories"] == list(CATEGORIES)
    live.comm.from_browser({"moment": "peak_fwd_bwd"})
    assert live.moment == "peak_fwd_bwd"
    with pytest.raises(ValueError, match="not in the records"):
        MemoryView(mem_records(), moment="after_backward")


# --- matplotlib fallbacks ---------------------------------------------------------------------------
def test_plot_timeline_draws_one_lane_per_rank_and_a_box_per_compute_action():
    events = trace_events(pp=4, m=8, split=True)
    fig = plot_timeline(events, bubble(events, "zb", 4, 8))
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert [t.get_text().split("\n")[0] for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(4)]
    boxes = [p for p in ax.patches if (p.get_gid() or "").startswith("box:")]
    assert len(boxes) == 4 * 8 * 3
    assert {p.get_gid() for p in boxes} == {"box:F", "box:I", "box:W"}
    comm = [e for e in events if e["kind"] not in ("forward", "backward", "backward_weight", "optimizer")]
    assert len([p for p in ax.patches if p.get_gid() in ("wait", "transfer")]) >= len(comm)
    assert len([p for p in ax.patches if p.get_gid() == "comm"]) == 4  # the optimizer step on each rank
    assert "measured bubble" in ax.get_title() and "synthetic" not in ax.get_title()
    assert "bubble fraction (no closed form)" in ax.get_title() and "bubble time / ideal time" in ax.get_title()
    assert "= schedule 0." in ax.get_title() and " + transfer " in ax.get_title() and " + other " in ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:3] == ["F forward", "I backward, input grad", "W backward, weight grad"]


def test_box_labels_shorten_to_fit_and_the_figure_says_what_the_browser_says():
    assert _box_label(3, 1, 2) == "mb 3 · chunk 1" and _box_label(3, None, 1) == "mb 3"
    assert _box_label(3, 1, 2, width=10, span=1000) == "3·c1"  # too narrow for the long form
    assert _box_label(3, 1, 2, width=4, span=1000) == "c1"  # the chunk, which the shade alone does not say
    assert _box_label(3, 1, 2, width=1, span=1000) is None  # too narrow for any: the tooltip only
    assert _box_label(12, None, 1, width=4, span=1000) == "12"
    events = trace_events(pp=4, m=8, split=True)
    texts = [t.get_text() for t in plot_timeline(events).axes[0].texts if t.get_gid() == "label"]
    assert texts and all(re.fullmatch(r"mb \d+|\d+", t) for t in texts)


def test_plot_memory_states_each_activation_part_measured_and_predicted():
    model = {"layers": 2, "d_model": 32, "heads": 4, "vocab": 64, "seq_len": 16, "d_ff": 64}
    records = [r.to_dict() for k in range(2)
               for r in memory_records({**memory_rank_record(k, 2), "model": model, "micro_batch": 2})]
    ax = plot_memory(records, "peak_fwd_bwd").axes[0]
    parts = next(t.get_text() for t in ax.texts if t.get_gid() == "parts:0")
    assert parts.startswith("activations by part: measured | predicted")
    assert "attention: 8.79 KiB | 41.00 KiB" in parts  # measured 9000 B beside the rule's 2·(20·b·s·h + 4·b·a·s)
    assert sum((p.get_gid() or "") == "predicted:activations" for p in ax.patches) == 2


def test_plot_memory_draws_a_measured_and_a_predicted_bar_per_rank():
    fig = plot_memory(mem_records(), "peak_fwd_bwd")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.get_xticks()) == 4
    gids = [p.get_gid() or "" for p in ax.patches]
    assert sum(g.startswith("measured:") for g in gids) == 4 * len(CATEGORIES)
    assert sum(g.startswith("predicted:") for g in gids) == 4 * 3  # params, grads, optimizer
    assert ax.get_ylabel() == "bytes (KiB)"  # the unit the browser's axis picks for these sizes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[:2] == ["parameters", "gradients"] and legend[-2:] == ["predicted (hatched)", "ZeRO formula (dashed)"]
    with pytest.raises(ValueError, match="not in the records"):
        plot_memory(mem_records(), "after_backward")


# --- the rules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["widgets/pipeline_timeline.py", "widgets/memory_view.py"])
def test_views_never_import_torch_lab_or_rank_code(module):
    tree = ast.parse(Path(module).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m.split(".")[0] for m in imported} & {"torch", "lab"}
    assert all(m.startswith("kernels.contract.") for m in imported if m.split(".")[0] == "kernels")  # torch-free


@pytest.mark.parametrize("js, classes", [
    ("pipeline_timeline.js", ["cl-timeline", "cl-lane", "cl-box", "cl-comm", "cl-axis", "cl-scrub", "cl-play",
                              "cl-bubble", "cl-planned-toggle", "cl-planned-box"]),
    ("memory_view.js", ["cl-memory", "cl-mem-rank", "cl-mem-seg", "cl-mem-predicted", "cl-mem-moment"])])
def test_the_esm_creates_the_stable_class_names_the_browser_test_uses(js, classes):
    text = (Path("widgets/static") / js).read_text()
    made = set(re.findall(r'"(cl-[a-z-]+)', text)) | set(re.findall(r"`(cl-[a-z-]+)", text))
    assert set(classes) <= made
    assert "export default" in text and "performance.now()" in text if js.startswith("pipeline") else True


def test_views_of_no_records_are_empty_not_errors():
    view = PipelineTimeline()
    assert view.ranks == [] and view.events["rank"] == [] and view.span_ms == 0.0 and view.bubble == {}
    memory = MemoryView()
    assert memory.ranks == [] and memory.bars == {} and memory.moment == "at_rest"


@pytest.mark.parametrize("view, record", [
    (lambda bad: PipelineTimeline(bad), "TraceEvent"), (lambda bad: plot_timeline(bad), "TraceEvent"),
    (lambda bad: MemoryView(bad), "MemoryRecord"), (lambda bad: plot_memory(bad), "MemoryRecord")])
def test_a_record_of_another_shape_fails_naming_the_record_and_the_key(view, record):
    good = trace_events(pp=2, m=2) if record == "TraceEvent" else mem_records()
    renamed = [{**{k: v for k, v in good[0].items() if k != "rank"}, "rank_id": good[0]["rank"]}] + good[1:]
    with pytest.raises(RecordShapeError, match=f"{record}: unknown key 'rank_id'"):
        view(renamed)
    with pytest.raises(RecordShapeError, match=f"{record}: missing key 'rank'"):
        view([{k: v for k, v in r.items() if k != "rank"} for r in good])


def test_bubble_of_another_shape_fails_naming_the_key():
    report = bubble(trace_events("1f1b", 2, 2), "1f1b", 2, 2).to_dict()
    with pytest.raises(RecordShapeError, match="BubbleReport: unknown key 'idle_mean'"):
        PipelineTimeline(trace_events(pp=2, m=2), {**report, "idle_mean": report["mean"]})


def test_memory_view_update_shows_another_run_and_keeps_a_moment_it_has():
    view = MemoryView(mem_records(dp=4), moment="peak_fwd_bwd")
    view.update(mem_records(dp=2))
    assert view.ranks == [0, 1] and view.moment == "peak_fwd_bwd"
    assert view.bars == _memory_state(mem_records(dp=2))["bars"]
