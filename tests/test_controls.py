"""Controls explain broken rules inline, keep Run disabled for them, and re-run valid layouts on the warm pool."""
from __future__ import annotations

import pytest

import lab
from lab.run.controls import Controls
from tests.conftest import start_pool
from tests.test_static_figures import png_size

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)


def test_broken_rules_are_named_inline_and_block_run(cluster):
    controls = Controls(lab.Experiment(cluster, TINY, lab.Parallel(dp=4), global_batch=8, steps=2))
    assert not controls.button.disabled
    controls.fields["tp"].value = 2  # dp 4 × tp 2 = 8 ranks on a world of 4
    assert controls.button.disabled and "[world-size]" in controls.explanation.value
    controls.fields["dp"].value = 2
    assert not controls.button.disabled and "cl-invalid" not in controls.explanation.value


def test_the_layout_fields_without_a_control_are_kept(cluster):
    order = ("pp", "tp", "dp")
    exp = lab.Experiment(cluster, TINY, lab.Parallel(dp=2, tp=2, loss_parallel=True, mesh_order=order),
                         global_batch=8, steps=2)
    controls = Controls(exp)
    controls.fields["zero"].value = 3
    shown = controls.parallel()
    assert (shown.zero, shown.loss_parallel, shown.mesh_order) == (3, True, order)


def test_run_trains_the_new_layout_on_the_warm_pool_and_updates_views(cluster):
    pids = [r.pid for r in cluster.rank_map.ranks]
    controls = Controls(lab.Experiment(cluster, TINY, lab.Parallel(dp=4), global_batch=8, steps=2))
    controls.fields["dp"].value, controls.fields["tp"].value, controls.fields["zero"].value = 2, 2, 3
    result = controls.run()
    assert result.config["strategy"]["tp"] == 2 and result.config["strategy"]["requested_zero"] == 3
    assert "equal to one process" in controls.losses.value
    assert len(controls.sharding.rows) == 4  # the sharding view now shows the new layout's ranks
    assert [r.pid for r in cluster.rank_map.ranks] == pids  # same engines: nothing was relaunched


def test_run_keeps_trace_and_measure_so_the_timeline_and_memory_views_follow(cluster):
    exp = lab.Experiment(cluster, TINY, lab.Parallel(pp=2, dp=2, microbatches=2), global_batch=8, steps=1,
                         trace=True, synthetic_forward_s=0.002, measure=True)
    controls = Controls(exp)
    assert controls.timeline.layout.display == "none"  # nothing recorded yet: hidden, not empty
    before = png_size(controls._repr_mimebundle_()[0])
    result = controls.run()
    assert result.events and result.memory_records
    assert controls.timeline.layout.display is None and controls.memory.layout.display is None
    data, _ = controls._repr_mimebundle_()  # read without a kernel: the form, then the three views, as one figure
    assert png_size(data)[1] > before[1] + 300 and "not run yet" not in data["text/plain"]
    assert "object at 0x" not in data["text/plain"] and "application/vnd.jupyter.widget-view+json" in data
    assert sorted(controls.timeline.ranks) == [0, 1, 2, 3] and controls.timeline.bubble["pp"] == 2
    assert controls.memory.ranks == [0, 1, 2, 3]
    assert controls.memory.strip["ranks"] == [0, 1, 2, 3]  # memory over the traced step
    controls.fields["pp"].value, controls.fields["dp"].value = 1, 4  # no pipeline: nothing to trace
    controls.run()
    assert controls.timeline.layout.display == "none" and controls.memory.layout.display is None
    assert controls.memory.strip["rows"] == []  # this run traced no step: no stale strip


@pytest.mark.slow  # starts and stops a pool of its own (about 12 s quiet)
def test_run_goes_away_with_a_note_once_the_pool_stops():
    pool = start_pool(1)
    try:
        controls = Controls(lab.Experiment(pool, TINY, lab.Parallel(), global_batch=2, steps=1))
        assert not controls.button.disabled and not pool.stopped
    finally:
        pool.stop()
    assert pool.stopped and controls.button.disabled and controls.button.layout.display == "none"
    assert "pool is stopped" in controls.status.value
    controls.fields["zero"].value = 1  # a valid change does not bring Run back
    assert controls.button.disabled


def test_keep_weights_trains_on_across_layouts(cluster):
    """Ticked, each Run moves the live weights to the shown layout and trains on; the table shows every step."""
    pids = [r.pid for r in cluster.rank_map.ranks]
    controls = Controls(lab.Experiment(cluster, TINY, lab.Parallel(dp=4), global_batch=8, steps=2))
    controls.keep_weights.value = True
    controls.run()
    controls.fields["dp"].value, controls.fields["tp"].value, controls.fields["zero"].value = 2, 2, 3
    result = controls.run()
    assert result.config["strategy"]["tp"] == 2 and controls.training.steps_done == 4 and len(result.losses) == 2
    assert controls.losses.value.count("<tr>") == 1 + 4 and "equal to one process" in controls.losses.value
    assert [r.pid for r in cluster.rank_map.ranks] == pids
    controls.keep_weights.value = False  # unticked: the kept weights are freed on the ranks
    assert controls.training is None


@pytest.mark.slow  # 21 s; the fast tier keeps the layout and kept-weights cases above
def test_a_new_layout_trains_on_the_experiments_own_data(cluster, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Controls keep the data the experiment was given. " * 20)
    model = lab.GPT(layers=2, d_model=32, heads=4, vocab=128, seq_len=16)
    controls = Controls(lab.Experiment(cluster, model, lab.Parallel(dp=4), global_batch=8, steps=2, data=str(corpus)))
    controls.fields["dp"].value, controls.fields["tp"].value = 2, 2
    result = controls.run()
    assert result.config["data"]["kind"] == "text" and "equal to one process" in controls.losses.value
    controls.keep_weights.value = True
    assert controls.run().config["data"]["kind"] == "text" and "equal to one process" in controls.losses.value


@pytest.mark.slow
def test_a_new_layout_trains_with_the_experiments_own_optimizer(cluster):
    """An SGD experiment stays SGD in every Run of the controls, kept weights or not, and so does its reference."""
    controls = Controls(lab.Experiment(cluster, TINY, lab.Parallel(dp=4), global_batch=8, steps=2, optimizer="sgd"))
    controls.fields["dp"].value, controls.fields["tp"].value = 2, 2
    assert controls.run().config["optimizer"] == "sgd" and "equal to one process" in controls.losses.value
    controls.keep_weights.value = True
    assert controls.run().config["optimizer"] == "sgd" and "equal to one process" in controls.losses.value
