"""Every view drawn from records that real ranks wrote, live and after a JSON round trip of the RunResult.

The widget unit tests feed hand-written records; here one 4-rank gloo pool runs PP2×DP2
1F1B with ZeRO-1 inside (``trace=True, measure=True``), FSDP (ZeRO-3) over dp=4
(``measure=True``) and ``kernels.engine.collectives.run_collectives``. Every record they return
must have exactly the shape ``kernels.contract.records`` defines (``from_dict`` is strict, and
``to_dict`` gives the same dict back), and every view and its matplotlib fallback must
draw from them, the same before and after the JSON round trip. A change of shape on the
ranks fails here, naming the record and the key.
"""
from __future__ import annotations

import json

import anywidget
import matplotlib
import pytest
from matplotlib.figure import Figure

import lab
from kernels.engine.collectives import run_collectives
from kernels.contract.measure_records import (BubbleReport, ClockSync, CollectiveRecord, CommRecord, LayoutRecord, MemoryRecord, TraceEvent)
from kernels.contract.pool_records import RankStatus
from lab.run.run_result import RunResult
from widgets import (ClusterView, CollectiveView, MemoryView, PipelineTimeline, ShardingView, plot_cluster,
                     plot_collective, plot_memory, plot_sharding, plot_timeline)

matplotlib.use("Agg")
TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
RUNS = {"pp2_dp2_zero1": dict(parallel=lab.Parallel(pp=2, dp=2, zero=1, schedule="1f1b", microbatches=4),
                              trace=True, measure=True),
        "fsdp_dp4": dict(parallel=lab.Parallel(dp=4, zero=3), measure=True)}


@pytest.fixture(scope="module")
def pool(cluster):
    """The session's shared 4-rank pool."""
    return cluster


@pytest.fixture(scope="module")
def results(pool) -> dict[str, RunResult]:
    return {name: lab.Experiment(pool, TINY, run["parallel"], global_batch=8, steps=2,
                                 **{k: v for k, v in run.items() if k != "parallel"}).run()
            for name, run in RUNS.items()}


@pytest.fixture(scope="module")
def collectives(pool) -> list:
    return pool.run(run_collectives)


def replayed(res: RunResult) -> RunResult:
    return RunResult.from_json(res.to_json())


def synced(view) -> dict:
    """The view's own synced traits, checked to be JSON-only."""
    own = set(view.trait_names(sync=True)) - set(anywidget.AnyWidget.class_trait_names(sync=True))
    state = {name: getattr(view, name) for name in sorted(own)}
    assert json.loads(json.dumps(state)) == state, type(view).__name__
    return state


def kept(written, back) -> bool:
    """Every value the ranks wrote is in ``back`` unchanged (``back`` may add the defaults they left out)."""
    if isinstance(written, dict):
        return isinstance(back, dict) and all(k in back and kept(v, back[k]) for k, v in written.items())
    return written == back


def exact(record_type, rows: list[dict]) -> None:
    """Each dict has ``record_type``'s shape: strict ``from_dict`` accepts it, ``to_dict`` keeps every value."""
    assert rows, f"the ranks wrote no {record_type.__name__}"
    for row in rows:
        assert kept(row, record_type.from_dict(row).to_dict()), (record_type.__name__, row)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_record_the_ranks_wrote_has_its_record_shape(results, name):
    res = results[name]
    exact(LayoutRecord, res.layout)
    exact(MemoryRecord, res.memory_records)
    exact(CommRecord, res.comm_records)
    if RUNS[name].get("trace"):
        exact(TraceEvent, res.events)
        exact(ClockSync, res.clock)
        exact(BubbleReport, [res.bubble])


def test_collective_and_status_records_have_their_record_shape(pool, collectives):
    exact(CollectiveRecord, [r for per_rank in collectives for r in per_rank])
    exact(RankStatus, [s.to_dict() for s in pool.status()])


def test_pipeline_timeline_from_a_traced_run(results):
    res = results["pp2_dp2_zero1"]
    states = []
    for run in (res, replayed(res)):
        view = PipelineTimeline(run.events, run.bubble, dict(enumerate(run.planned)))
        states.append(synced(view))
        assert synced(run.timeline()) == states[-1]
        fig = plot_timeline(run.events, BubbleReport.from_dict(run.bubble))
        assert isinstance(fig, Figure) and {p.get_gid() for p in fig.axes[0].patches} >= {"box:F", "box:B", "comm"}
    assert states[0] == states[1]
    state = states[0]
    assert state["ranks"] == [0, 1, 2, 3] and state["bubble"] == res.bubble
    assert {k for k in state["events"]["kind"]} >= {"F", "B", "send", "recv", "optimizer"}
    assert state["plan_match"] == {str(r): True for r in range(4)}, "measured 1F1B order differs from the plan"


@pytest.mark.parametrize("name", list(RUNS))
def test_memory_view_from_measured_runs(results, name):
    res = results[name]
    states = [synced(MemoryView(run.memory_records)) for run in (res, replayed(res))]
    assert states[0] == states[1]
    assert states[0]["ranks"] == [0, 1, 2, 3] and "at_rest" in states[0]["moments"]
    assert all(bar["total"] > 0 and bar["predicted_total"] for bar in states[0]["bars"]["at_rest"])
    for moment in states[0]["moments"]:
        assert isinstance(plot_memory([MemoryRecord.from_dict(m) for m in res.memory_records], moment), Figure)
        assert synced(replayed(res).memory(moment))["moment"] == moment


@pytest.mark.parametrize("name", list(RUNS))
def test_sharding_view_from_the_layouts_the_ranks_built(results, name):
    res = results[name]
    states = [synced(ShardingView(run.layout)) for run in (res, replayed(res))]
    assert states[0] == states[1] == synced(res.sharding())
    rows = states[0]["rows"]
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    if name == "fsdp_dp4":
        assert states[0]["strategy"] == "fsdp" and states[0]["phases"]
        assert all(e is not None and e[1] - e[0] < t["shape"][0] for r in rows
                   for t, e in zip(states[0]["tensors"], r["params"]) if t["shape"][0] >= 4)
    else:
        assert sorted(s for r in rows for s in r["stages"]) == [0, 0, 1, 1]
        def area(extents):
            return sum((e[1] - e[0]) * (e[3] - e[2]) for e in extents if e is not None)
        assert all(area(r["optim"]) < area(r["params"]) for r in rows)  # ZeRO-1: a slice of every tensor's state
    for layer in ("params", "grads", "optim"):
        fig = plot_sharding([LayoutRecord.from_dict(r) for r in res.layout], layer)
        assert isinstance(fig, Figure) and any(p.get_gid() == "held" for p in fig.axes[0].patches)


@pytest.mark.parametrize("name", list(RUNS))
def test_comm_rows_from_measured_runs(results, name):
    res = results[name]
    table = replayed(res).comm()
    assert table == res.comm() and [CommRecord.from_dict(row) for row in table]
    assert str(table).count("\n") == len(res.comm_records)
    sources = {row["source"] for row in res.comm_records}
    assert sources >= ({"pipeline", "dist"} if name == "pp2_dp2_zero1" else {"dist"})


def test_collective_view_from_the_ranks_real_collectives(collectives):
    records = [CollectiveRecord.from_dict(r) for per_rank in collectives for r in per_rank]
    view = CollectiveView(collectives)
    assert view.ok and synced(view) == synced(CollectiveView(records))
    assert [v["op"] for v in view.ops] == ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"]
    for op in [v["op"] for v in view.ops]:
        assert isinstance(plot_collective(records, op), Figure)


def test_cluster_view_from_the_pools_status(pool):
    status = pool.status()
    view = ClusterView(status)
    assert synced(view) == synced(ClusterView([s.to_dict() for s in status]))
    assert [r["rank"] for r in view.ranks] == [0, 1, 2, 3] and view.summary.startswith("4 ranks on 1 host")
    assert isinstance(plot_cluster(status), Figure)
    assert [r["rank"] for r in synced(pool.view())["ranks"]] == [0, 1, 2, 3]
