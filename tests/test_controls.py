"""Controls explain broken rules inline, keep Run disabled for them, and re-run valid layouts on the warm pool."""
from __future__ import annotations

import lab
from lab.controls import Controls

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)


def test_broken_rules_are_named_inline_and_block_run(cluster):
    controls = Controls(lab.Experiment(cluster, TINY, lab.Parallel(dp=4), global_batch=8, steps=2))
    assert not controls.button.disabled
    controls.fields["tp"].value = 2  # dp 4 × tp 2 = 8 ranks on a world of 4
    assert controls.button.disabled and "[world-size]" in controls.explanation.value
    controls.fields["dp"].value = 2
    assert not controls.button.disabled and "cl-invalid" not in controls.explanation.value


def test_run_trains_the_new_layout_on_the_warm_pool_and_updates_views(cluster):
    pids = [r.pid for r in cluster.rank_map.ranks]
    controls = Controls(lab.Experiment(cluster, TINY, lab.Parallel(dp=4), global_batch=8, steps=2))
    controls.fields["dp"].value, controls.fields["tp"].value, controls.fields["zero"].value = 2, 2, 3
    result = controls.run()
    assert result.config["tp"] == 2 and result.config["zero"] == 3
    assert "equal to one process" in controls.losses.value
    assert len(controls.sharding.rows) == 4  # the sharding view now shows the new layout's ranks
    assert [r.pid for r in cluster.rank_map.ranks] == pids  # same engines: nothing was relaunched
