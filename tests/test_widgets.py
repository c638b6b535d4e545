"""The views are pure functions of records: state from records, replay from JSON, the transforms, the comm."""
from __future__ import annotations

import json

import comm
import matplotlib
import pytest
from matplotlib.figure import Figure

from kernels.contract.measure_records import LayoutRecord
from kernels.contract.records import RecordShapeError
from kernels.contract.strategy import resolve_strategy
from widgets import ClusterView, CollectiveView, ShardingView, plot_cluster, plot_collective, plot_sharding
from widgets._layout import _extent, _sharding_view
from widgets._ring import _cells_at, _collective_view, _simulate, _split

matplotlib.use("Agg")
DATA_TRAITS = {"ClusterView": ["ranks", "summary"], "CollectiveView": ["records", "ops", "op", "frame"],
               "ShardingView": ["strategy", "zero", "sizes", "tensors", "rows", "phases", "phase"]}


# --- records, in the shapes the ranks really return them -------------------------------------------
def rank_status(n: int = 4, failed: int | None = None) -> list[dict]:
    """kernels.contract.pool_records.RankStatus.to_dict() rows."""
    return [{"rank": r, "host": f"node{r // 2}", "pid": 1000 + r, "device": "cpu", "backend": "gloo",
             "threads": 2, "state": "failed" if r == failed else "idle", "detail": "boom" if r == failed else "",
             "rss_bytes": (300 + r) * 2**20, "last_heard_s": None} for r in range(n)]


def collective_records(n: int = 4) -> list[dict]:
    """What kernels.engine.collectives.run_collectives returns on each of n ranks (outputs computed by hand)."""
    ar = [[r + 1.0, 10.0 * (r + 1)] for r in range(n)]
    rs = [[100.0 * r + c for c in range(n)] for r in range(n)]
    out = []
    for r in range(n):
        total = [sum(x[0] for x in ar), sum(x[1] for x in ar)]
        out += [{"op": "all_reduce", "rank": r, "input": ar[r], "output": total},
                {"op": "all_gather", "rank": r, "input": [float(r)], "output": [float(i) for i in range(n)]},
                {"op": "reduce_scatter", "rank": r, "input": rs[r], "output": [sum(x[r] for x in rs)]},
                {"op": "broadcast", "rank": r, "input": [7.0 + r], "output": [7.0]},
                {"op": "send_recv", "rank": r, "input": [float(r)], "output": [float((r - 1) % n)]}]
    return out


def _param(shape, local, placements=(), axes=()):
    return {"global_shape": list(shape), "local_shape": list(local), "placements": list(placements),
            "mesh_axes": list(axes), "dtype": "torch.float32"}


def layout_records(kind: str) -> list[dict]:
    """kernels.train.entry.train_rank()["layout"] per rank, as dumped from real 4-rank gloo runs (2 blocks, trimmed)."""
    names = ["tok_emb.weight", "blocks.0.attn.q.weight", "blocks.0.attn.q.bias", "blocks.1.attn.q.weight",
             "lm_head.weight"]
    shapes = [[32, 16], [16, 16], [16], [16, 16], [32, 16]]
    out = []
    for r in range(4):
        if kind == "zero3":  # dp=4, fully_shard: Shard(0) over dp
            coords, extra = {"pp": 0, "dp": r, "tp": 0}, {"strategy": "fsdp", "zero": 3, "hybrid": False}
            params = {n: _param(s, [s[0] // 4] + s[1:], ["S(0)"], ["dp"]) for n, s in zip(names, shapes)}
        elif kind == "tp_fsdp":  # dp=2 x tp=2, TP Shard(0) then FSDP's strided shard inside it
            coords, extra = {"pp": 0, "dp": r // 2, "tp": r % 2}, {"strategy": "fsdp", "zero": 3, "hybrid": False}
            params = {n: _param(s, [s[0] // 4] + s[1:], ["_S(0, 2)", "S(0)"], ["dp", "tp"])
                      for n, s in zip(names, shapes)}
        elif kind == "hsdp":  # dp=4 as 2 replicas x 2 shards
            coords, extra = {"pp": 0, "dp": r, "tp": 0}, {"strategy": "fsdp", "zero": 3, "hybrid": True}
            params = {n: _param(s, [s[0] // 2] + s[1:], ["R", "S(0)"], ["dp_replicate", "dp_shard"])
                      for n, s in zip(names, shapes)}
        elif kind == "tp_replicate":  # dp=2 x tp=2 at ZeRO 0: FSDP2 on a (dp, 1) HSDP mesh, one shard per replica
            coords, extra = {"pp": 0, "dp": r // 2, "tp": r % 2}, {"strategy": "fsdp", "zero": 2, "hybrid": True,
                                                                  "describe": resolve_strategy(dp=2, tp=2).describe()}
            axes = ["dp_replicate", "dp_shard", "tp"]
            params = {n: _param(s, [s[0] // 2] + s[1:], ["R", "_S(0, 2)", "S(0)"], axes) for n, s in zip(names, shapes)}
        elif kind == "zero1":  # dp=4 DDP, ZeroRedundancyOptimizer owns whole parameters
            owned = [names[r]] + ([names[4]] if r == 0 else [])
            coords = {"pp": 0, "dp": r, "tp": 0}
            extra = {"strategy": "zero1", "zero": 1, "hybrid": False, "optimizer_params": owned}
            params = {n: _param(s, s) for n, s in zip(names, shapes)}
        else:  # pp=2 x dp=2: stage 0 holds the embedding and block 0, stage 1 the rest
            coords = {"pp": r // 2, "dp": r % 2, "tp": 0}
            extra = {"strategy": "pp-1f1b", "stage_ids": [r // 2]}
            held = names[:3] if r < 2 else names[3:]
            params = {n: _param(s, s) for n, s in zip(names, shapes) if n in held}
        out.append({"rank": r, "coords": coords, **extra, "params": params})
    return out


# --- a fake comm: records what the kernel would send to the browser --------------------------------
class RecordingComm:
    """Stands in for the kernel's comm: keeps the open message and every ``send``."""

    def __init__(self, **kwargs):
        self.comm_id = f"comm-{id(self)}"
        self.kernel = "fake"
        self.opened = kwargs
        self.sent: list[dict] = []
        self.handler = None

    def send(self, data=None, metadata=None, buffers=None):
        self.sent.append(data)

    def on_msg(self, callback):
        self.handler = callback

    def open(self, *args, **kwargs):
        pass

    def close(self, *args, **kwargs):
        pass

    def from_browser(self, state: dict) -> None:
        """Deliver an ``update`` message as the front end sends it."""
        self.handler({"content": {"data": {"method": "update", "state": state, "buffer_paths": []}}, "buffers": []})

    def request_state(self) -> dict:
        """Ask for the whole state, as a freshly opened browser view does; returns the reply."""
        self.handler({"content": {"data": {"method": "request_state"}}, "buffers": []})
        return self.sent[-1]


@pytest.fixture
def fake_comm(monkeypatch):
    made: list[RecordingComm] = []

    def create_comm(**kwargs):
        made.append(RecordingComm(**kwargs))
        return made[-1]

    monkeypatch.setattr(comm, "create_comm", create_comm)
    return made


def data_state(widget) -> dict:
    return widget.get_state(DATA_TRAITS[type(widget).__name__])


def replayed(widget_cls, data, tmp_path):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(data))
    return widget_cls(json.loads(path.read_text()))


# --- ClusterView -------------------------------------------------------------------------------------
def test_cluster_view_state_holds_every_rank_in_order():
    view = ClusterView(list(reversed(rank_status(4, failed=2))))
    assert [r["rank"] for r in view.ranks] == [0, 1, 2, 3]
    assert view.ranks[2]["state"] == "failed" and view.ranks[2]["detail"] == "boom"
    assert view.summary == "4 ranks on 2 hosts: 3 idle, 1 failed"


def test_cluster_view_takes_rank_status_records_as_they_are():
    from kernels.contract.pool_records import RankStatus

    view = ClusterView([RankStatus(**r) for r in rank_status(2, failed=0)])
    assert view.ranks == rank_status(2, failed=0)


def test_cluster_view_rejects_an_unknown_state():
    with pytest.raises(ValueError, match="not one of"):
        ClusterView([{**rank_status(1)[0], "state": "sleepy"}])


def test_cluster_view_opens_with_its_ranks_and_sends_one_update_per_snapshot(fake_comm):
    view = ClusterView(rank_status(4))
    assert view.comm in fake_comm and view.comm.opened["data"]["state"]["ranks"] == rank_status(4)
    view.update(rank_status(4, failed=1))
    assert len(view.comm.sent) == 1 and view.comm.sent[0]["method"] == "update"
    state = view.comm.sent[0]["state"]
    assert state["ranks"][1]["state"] == "failed" and state["summary"].endswith("1 failed")


def test_cluster_view_replayed_from_json_equals_the_live_one(tmp_path):
    live = data_state(ClusterView(rank_status(4, failed=3)))
    assert data_state(replayed(ClusterView, rank_status(4, failed=3), tmp_path)) == live


# --- CollectiveView: the ring twin -------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_all_reduce_ends_with_the_direct_sum_on_every_rank(n):
    inputs = [[float(r + k * n) for k in range(5)] for r in range(n)]
    frames, final = _simulate("all_reduce", inputs)
    direct = [sum(x[k] for x in inputs) for k in range(5)]
    assert final == [direct] * n
    assert [f["phase"] for f in frames] == ["input"] + ["reduce-scatter"] * (n - 1) + ["all-gather"] * (n - 1)
    assert all(cell["from"] == list(range(n)) for row in _cells_at(frames, len(frames) - 1) for cell in row)
    assert [[x for c in row for x in c["v"]] for row in _cells_at(frames, len(frames) - 1)] == final


def test_ring_reduce_scatter_leaves_rank_r_with_the_sum_of_chunk_r():
    inputs = [[100.0 * r + c for c in range(4)] for r in range(4)]
    _, final = _simulate("reduce_scatter", inputs)
    assert final == [[sum(x[r] for x in inputs)] for r in range(4)]


def test_ring_steps_send_one_chunk_to_the_next_rank_each():
    frames, _ = _simulate("all_reduce", [[1.0, 2.0, 3.0, 4.0]] * 4)
    for f in frames[1:]:
        assert sorted(s[0] for s in f["sends"]) == [0, 1, 2, 3]
        assert all(dst == (src + 1) % 4 for src, dst, _ in f["sends"])


def test_split_covers_the_vector_even_when_shorter_than_the_ring():
    assert _split([1.0, 2.0], 4) == [[], [1.0], [], [2.0]]
    assert sum(_split(list(range(10)), 3), []) == list(range(10))


def test_collective_view_checks_every_op_against_the_real_outputs():
    view = CollectiveView(collective_records(4))
    assert [v["op"] for v in view.ops] == ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]
    assert view.ok and view.op == "all_reduce" and view.frame == 0
    assert len(view.current()["frames"]) == 1 + 2 * 3


def test_a_wrong_real_output_is_surfaced_as_a_mismatch():
    records = collective_records(4)
    records[0]["output"] = [999.0, 100.0]  # rank 0's all_reduce came back wrong
    ar = _collective_view(records)[0]
    assert not ar["ok"] and "ranks [0]" in ar["mismatch"] and "999.0" in ar["mismatch"]
    view = CollectiveView(records)
    assert not view.ok and view.op == "all_reduce"
    records[-1]["output"] = [42.0]  # and rank 3's send/recv: the view opens on the first bad op
    assert CollectiveView(records).op == "all_reduce"
    records[0]["output"] = [10.0, 100.0]
    assert CollectiveView(records).op == "send_recv"


def test_collective_records_may_come_one_list_per_rank():
    flat = collective_records(4)
    per_rank = [[r for r in flat if r["rank"] == k] for k in range(4)]
    assert _collective_view(per_rank) == _collective_view(flat)


def test_collective_view_steps_and_clamps():
    view = CollectiveView(collective_records(4))
    view.show("broadcast")
    assert view.step(100) == 3 and view.step(-100) == 0
    with pytest.raises(ValueError, match="no records"):
        view.show("all_to_all")


def test_collective_view_replayed_from_json_equals_the_live_one(tmp_path):
    live = data_state(CollectiveView(collective_records(4)))
    assert data_state(replayed(CollectiveView, collective_records(4), tmp_path)) == live


def test_collective_view_takes_the_frame_the_browser_sets(fake_comm):
    view = CollectiveView(collective_records(4))
    view.comm.from_browser({"op": "reduce_scatter", "frame": 2})
    assert (view.op, view.frame) == ("reduce_scatter", 2)


# --- ShardingView: slice extents ---------------------------------------------------------------------
def test_fsdp_shard_extents_tile_dim0_in_dp_order():
    view = _sharding_view(layout_records("zero3"))
    tok = [row["params"][0] for row in view["rows"]]
    assert tok == [[0, 8, 0, 16], [8, 16, 0, 16], [16, 24, 0, 16], [24, 32, 0, 16]]
    bias = [row["params"][2] for row in view["rows"]]
    assert bias == [[0, 4, 0, 1], [4, 8, 0, 1], [8, 12, 0, 1], [12, 16, 0, 1]]


def test_strided_fsdp_shard_lies_inside_the_tp_shard():
    rows = _sharding_view(layout_records("tp_fsdp"))["rows"]
    # rank = dp*2 + tp; TP holds half tp, FSDP's strided shard takes half of that by dp
    starts = {(r["coords"]["dp"], r["coords"]["tp"]): r["params"][0][:2] for r in rows}
    assert starts == {(0, 0): [0, 8], (1, 0): [8, 16], (0, 1): [16, 24], (1, 1): [24, 32]}
    assert [r["gathered"][0][:2] for r in rows] == [[0, 16], [16, 32], [0, 16], [16, 32]]  # dp all-gather: the TP shard


def test_hsdp_shards_within_a_replica_group():
    view = _sharding_view(layout_records("hsdp"))
    assert view["sizes"]["dp_shard"] == 2 and view["sizes"]["dp_replicate"] == 2
    assert [r["params"][0][:2] for r in view["rows"]] == [[0, 16], [16, 32], [0, 16], [16, 32]]


def test_an_explicit_offset_wins_and_long_placement_names_parse():
    info = _param([10, 4], [3, 4], ["Shard(dim=0)"], ["dp"])
    assert _extent(info, {"dp": 3}, {"dp": 4}) == [9, 10, 0, 4]  # torch.chunk: chunks of 3, last one short
    assert _extent({**info, "offset": [6, 0]}, {"dp": 3}, {"dp": 4}) == [6, 9, 0, 4]
    assert _extent(_param([8, 6], [8, 3], ["Replicate()", "Shard(dim=1)"], ["dp", "tp"]), {"dp": 1, "tp": 1},
                   {"dp": 2, "tp": 2}) == [0, 8, 3, 6]


def test_layout_records_and_their_dicts_draw_the_same_and_another_shape_fails_naming_the_key():
    records = layout_records("pp")
    assert _sharding_view([LayoutRecord.from_dict(r) for r in records]) == _sharding_view(records)
    renamed = [{**{k: v for k, v in r.items() if k != "stage_ids"}, "stages": r["stage_ids"]} for r in records]
    with pytest.raises(RecordShapeError, match="LayoutRecord: unknown key 'stages'"):
        ShardingView(renamed)
    as_list = [{**r, "params": [{"name": n, **info} for n, info in r["params"].items()]} for r in records]
    with pytest.raises(RecordShapeError, match="ParamLayout: unknown key 'name'"):
        _sharding_view(as_list)
    no_shape = [{**r, "params": {n: {k: v for k, v in info.items() if k != "local_shape"}
                                 for n, info in r["params"].items()}} for r in records]
    with pytest.raises(RecordShapeError, match="ParamLayout: missing key 'local_shape'"):
        plot_sharding(no_shape)


def test_zero1_optimizer_layer_holds_only_owned_parameters():
    rows = _sharding_view(layout_records("zero1"))["rows"]
    assert all(r["params"][k] == [0, s[0], 0, s[1] if len(s) > 1 else 1]
               for r in rows for k, s in enumerate([[32, 16], [16, 16], [16], [16, 16], [32, 16]]))
    owners = [[k for k, e in enumerate(r["optim"]) if e] for r in rows]
    assert owners == [[0, 4], [1], [2], [3]]


def test_pipeline_rows_hold_only_their_stage():
    view = _sharding_view(layout_records("pp"))
    assert [r["stages"] for r in view["rows"]] == [[0], [0], [1], [1]]
    assert [r["blocks"] for r in view["rows"]] == [[0], [0], [1], [1]]
    assert [sum(e is not None for e in r["params"]) for r in view["rows"]] == [3, 3, 2, 2]
    assert view["phases"] == []


def test_fsdp_phases_gather_free_and_reduce_scatter_each_block():
    view = ShardingView(layout_records("zero3"))
    ops = [(p["op"], p["unit"]) for p in view.phases]
    assert ops[1:4] == [("all_gather", "root"), ("all_gather", "blocks.0"), ("free", "blocks.0")]
    assert ("reduce_scatter", "blocks.1") in ops and ops[-1] == ("step", "")
    assert ops.index(("reduce_scatter", "blocks.1")) < ops.index(("reduce_scatter", "blocks.0"))
    gather_b0 = ops.index(("all_gather", "blocks.0"))
    assert view.held(1, "params", gather_b0)[1] == [0, 16, 0, 16]  # whole while gathered
    assert view.held(1, "params", gather_b0 + 1)[1] == [4, 8, 0, 16]  # back to the shard once freed
    last = len(view.phases) - 1
    assert view.held(1, "grads", last) == view.held(1, "params")  # gradients end as shards
    assert view.held(1, "grads", 0) == [None] * 5


def test_zero2_keeps_parameters_whole_until_backward():
    records = [{**r, "zero": 2} for r in layout_records("zero3")]
    ops = [p["op"] for p in ShardingView(records).phases]
    assert "free" not in ops and ops.count("all_gather") == 3


def test_sharding_view_accepts_a_run_result_dict_and_replays_from_json(tmp_path):
    records = layout_records("tp_fsdp")
    live = data_state(ShardingView(records))
    assert data_state(ShardingView({"config": {}, "losses": [], "layout": records})) == live
    assert data_state(replayed(ShardingView, records, tmp_path)) == live


def test_set_layout_sends_one_update_and_resets_the_phase(fake_comm):
    view = ShardingView(layout_records("zero3"))
    assert view.comm.opened["data"]["state"]["rows"] == view.rows
    view.step(2)
    view.comm.sent.clear()
    view.set_layout(layout_records("zero1"))
    assert len(view.comm.sent) == 1
    state = view.comm.sent[0]["state"]
    assert state["phase"] == -1 and state["strategy"] == "zero1" and state["phases"] == []


# --- message size ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make, limit", [(lambda: ClusterView(rank_status(8)), 2_000),
                                         (lambda: CollectiveView(collective_records(4)), 10_000),
                                         (lambda: CollectiveView(collective_records(8)), 32_000),  # ring: world² cells
                                         (lambda: ShardingView(layout_records("tp_fsdp")), 6_000)])
def test_state_messages_stay_small(fake_comm, make, limit):
    widget = make()
    state = widget.comm.request_state()["state"]
    data = {k: v for k, v in state.items() if k in DATA_TRAITS[type(widget).__name__]}
    assert len(json.dumps(data)) < limit
    assert widget.get_state()["_esm"].startswith("//")  # the ESM file itself travels, not a path


# --- matplotlib fallbacks --------------------------------------------------------------------------
def test_plot_cluster_draws_one_bar_per_rank():
    fig = plot_cluster(rank_status(6, failed=1))
    assert isinstance(fig, Figure)
    bars = [p for p in fig.axes[0].patches if (p.get_gid() or "").startswith("rank")]
    assert len(bars) == 6
    assert bars[1].get_facecolor()[:3] == pytest.approx(matplotlib.colors.to_rgb("#c62828"))


def test_plot_collective_draws_one_lane_per_rank_and_a_cell_per_chunk_and_step():
    fig = plot_collective(collective_records(4), "all_reduce")
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == 4 and len(ax.get_xticks()) == 7
    assert len([p for p in ax.patches if p.get_gid() == "cell"]) == 7 * 4 * 4


def test_plot_sharding_draws_one_lane_per_rank_and_the_held_slices():
    records = layout_records("pp")
    fig = plot_sharding(records)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(ax.get_yticks()) == 4
    assert len([p for p in ax.patches if p.get_gid() == "tensor"]) == 4 * 5
    assert len([p for p in ax.patches if p.get_gid() == "held"]) == 3 + 3 + 2 + 2
    optim = plot_sharding(layout_records("zero1"), layer="optim")
    assert len([p for p in optim.axes[0].patches if p.get_gid() == "held"]) == 5


def test_plot_sharding_rejects_an_unknown_layer():
    with pytest.raises(ValueError, match="layer must be one of"):
        plot_sharding(layout_records("zero3"), layer="activations")


@pytest.mark.parametrize("view, rows, record", [
    (ClusterView, rank_status, "RankStatus"), (plot_cluster, rank_status, "RankStatus"),
    (CollectiveView, collective_records, "CollectiveRecord"), (_collective_view, collective_records, "CollectiveRecord")])
def test_status_and_collective_records_of_another_shape_fail_naming_the_key(view, rows, record):
    good = rows()
    with pytest.raises(RecordShapeError, match=f"{record}: unknown key 'world'"):
        view([{**good[0], "world": 4}] + good[1:])
    with pytest.raises(RecordShapeError, match=f"{record}: missing key 'rank'"):
        view([{k: v for k, v in r.items() if k != "rank"} for r in good])


@pytest.mark.parametrize("kind, title", [
    ("zero3", "fsdp · ZeRO-3 · pp=1 dp=4 tp=1 · dp_shard=4 dp_replicate=1 · placements [dp: S(0)]"),
    ("hsdp", "fsdp · ZeRO-3 · pp=1 dp=4 tp=1 · dp_shard=2 dp_replicate=2 · placements [dp_replicate: R, dp_shard: S(0)]"),
    ("tp_fsdp", "fsdp · ZeRO-3 · pp=1 dp=2 tp=2 · dp_shard=2 dp_replicate=1 · placements [dp: _S(0, 2), tp: S(0)]"),
    ("zero1", "zero1 · ZeRO-1 · pp=1 dp=4 tp=1 · dp_shard=1 dp_replicate=4 · plain tensors · optimizer state split"),
])
def test_sharding_title_says_what_the_placements_built(kind, title):
    view = ShardingView(layout_records(kind))
    assert view.title.startswith(title)


def test_tp_by_dp_at_zero_0_is_shown_as_replication_without_fsdp_collectives():
    # The user chose ZeRO 0; FSDP2 runs it over shards of one rank, which gather and scatter nothing.
    view = _sharding_view(layout_records("tp_replicate"))
    assert view["title"].startswith("TP2×DP2, ZeRO-0 (DP through FSDP2 replicate: whole parameters, all-reduced "
                                    "gradients, as DDP; DDP cannot take TP's DTensors) · pp=1 dp=2 tp=2 · "
                                    "dp_shard=1 dp_replicate=2")
    assert view["zero"] == 0 and view["phases"] == [] and all(row["gathered"] == [] for row in view["rows"])
