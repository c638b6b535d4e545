"""A warm pool keeps the meshes of recent layouts: reused by the next run of a shape, evicted beyond the capacity
with their groups destroyed, dropped with the world they lived in (kernels.parallel.warm_meshes)."""
from __future__ import annotations

import pytest

import lab
from kernels.parallel import warm_meshes

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)


def _set_capacity(n: int) -> None:
    from kernels.parallel import warm_meshes as kept  # on the rank
    kept.CPU_CAPACITY = n


def _ids() -> list[int]:
    from kernels.parallel import warm_meshes as kept
    return [id(mesh) for mesh in kept._meshes.values()]


def _fail() -> None:
    raise RuntimeError("on purpose")


def _run(cluster: lab.Cluster, parallel: lab.Parallel) -> list[float]:
    return lab.Experiment(cluster, TINY, parallel, global_batch=8, steps=2).run(progress=False).losses


@pytest.mark.slow
def test_a_shape_run_again_reuses_its_mesh_and_the_capacity_evicts_the_oldest_without_leaking(cluster):
    cluster.run(warm_meshes.release_all)
    try:
        first = _run(cluster, lab.Parallel(tp=2, dp=2, zero=3))
        ids = cluster.run(_ids)
        assert all(len(i) == 1 for i in ids)
        assert _run(cluster, lab.Parallel(tp=2, dp=2, zero=3)) == first  # the same numbers on the same mesh
        assert cluster.run(_ids) == ids, "the second run of the shape built a new mesh"
        cluster.run(_set_capacity, 2)
        _run(cluster, lab.Parallel(dp=4))
        _run(cluster, lab.Parallel(pp=2, dp=2, microbatches=2))
        kept = cluster.run(warm_meshes.kept_meshes)
        assert all(len(k) == 2 and "tp=2" not in k[0] + k[1] for k in kept), kept  # the oldest (TP2×DP2) went
        assert cluster.run(warm_meshes.unkept_group_count) == [1] * 4, "an evicted mesh's groups stayed alive"
    finally:
        cluster.run(_set_capacity, warm_meshes.CPU_CAPACITY)
        cluster.run(warm_meshes.release_all)
    assert cluster.run(warm_meshes.kept_meshes) == [[]] * 4


@pytest.mark.slow
def test_a_failed_call_drops_the_kept_meshes_with_the_world(cluster):
    _run(cluster, lab.Parallel(tp=2, dp=2))
    assert all(cluster.run(warm_meshes.kept_meshes))
    with pytest.raises(lab.RankError):
        cluster.run(_fail)
    assert cluster.run(warm_meshes.kept_meshes) == [[]] * 4  # the rebuilt world starts cold
    assert len(_run(cluster, lab.Parallel(tp=2, dp=2))) == 2


@pytest.mark.slow
def test_a_held_trainings_mesh_is_never_evicted_under_it(cluster):
    cluster.run(warm_meshes.release_all)
    cluster.run(_set_capacity, 1)
    try:
        with lab.Training(cluster, TINY, lab.Parallel(tp=2, dp=2), global_batch=8) as training:
            training.step(1)
            _run(cluster, lab.Parallel(dp=4))  # over the capacity: the held mesh stays, the run's may go later
            assert all(any("tp=2" in key for key in kept) for kept in cluster.run(warm_meshes.kept_meshes))
            training.step(1)  # its groups are alive
            held_losses = training.losses
        reference = _run(cluster, lab.Parallel(tp=2, dp=2))
        assert held_losses == pytest.approx(reference, rel=1e-6)
    finally:
        cluster.run(_set_capacity, warm_meshes.CPU_CAPACITY)
        cluster.run(warm_meshes.release_all)


@pytest.mark.slow
def test_a_held_training_outlives_the_eviction_of_a_mesh_equal_to_its_own(cluster):
    # DTensor's cache hands PP2×TP2's tensors the "tp" mesh TP2×DP2 ran on (equal by value); evicting TP2×DP2
    # must not destroy the group those tensors name (kernels.parallel.shared_mesh_groups).
    cluster.run(warm_meshes.release_all)
    cluster.run(_set_capacity, 2)
    pipeline = lab.Parallel(pp=2, tp=2, microbatches=2)
    try:
        _run(cluster, lab.Parallel(tp=2, dp=2, zero=3))
        with lab.Training(cluster, TINY, pipeline, global_batch=8) as training:
            training.step(1)
            _run(cluster, lab.Parallel(dp=4))  # over the capacity: TP2×DP2's mesh is evicted
            assert not any("dp=2, tp=2, pp=1" in key for kept in cluster.run(warm_meshes.kept_meshes) for key in kept)
            training.step(1)
            held_losses = training.losses
        assert cluster.run(warm_meshes.unkept_group_count) == [1] * 4, "a shared group outlived every mesh using it"
        reference = _run(cluster, pipeline)
        assert held_losses == pytest.approx(reference, rel=1e-6)
    finally:
        cluster.run(_set_capacity, warm_meshes.CPU_CAPACITY)
        cluster.run(warm_meshes.release_all)
