"""What a machine with 0, 1, 2 or 8 visible GPUs gives for the ranks a notebook asks for."""
from __future__ import annotations

import pytest

from kernels.contract.pool_records import EngineInfo
from lab.pool.rank_map import RankMapError, build_rank_map


def engines(n: int, gpus: int) -> list[EngineInfo]:
    """n engines on one host that all see the same ``gpus`` GPUs (as lab.start launches them)."""
    return [EngineInfo(engine_id=i, host="box", ip="127.0.0.1", pid=100 + i, gpus=tuple(map(str, range(gpus))),
                       cpu_count=16) for i in range(n)]


@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
def test_nccl_with_one_gpu_per_rank_when_there_are_enough_gpus_else_cpu_ranks(gpus, ranks):
    rank_map = build_rank_map(engines(ranks, gpus))
    if gpus >= ranks:
        assert rank_map.backend == "nccl"
        assert [r.device for r in rank_map.ranks] == [f"cuda:{i}" for i in range(ranks)]
        assert len({r.gpu for r in rank_map.ranks}) == ranks  # never two ranks on one GPU
    else:
        assert rank_map.backend == "gloo" and {r.device for r in rank_map.ranks} == {"cpu"}
        expected = "no GPUs visible" if gpus == 0 else f"for {ranks} ranks"
        assert expected in rank_map.note
        if gpus:
            assert "share_gpu=True" in rank_map.note  # the table tells the user the other choice


@pytest.mark.parametrize("gpus", [1, 2, 8])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_shared_gpus_put_gloo_ranks_round_robin_on_the_gpus_and_say_so(gpus, ranks):
    rank_map = build_rank_map(engines(ranks, gpus), share_gpu=True)
    if gpus >= ranks:  # enough GPUs: sharing is not needed, NCCL wins
        assert rank_map.backend == "nccl"
        return
    assert rank_map.backend == "gloo"
    assert [r.device for r in rank_map.ranks] == [f"cuda:{i % gpus}" for i in range(ranks)]
    assert f"{ranks} ranks on {gpus} GPU" in rank_map.note and "contention" in rank_map.note


def test_share_gpu_without_a_gpu_keeps_cpu_ranks_and_says_why():
    rank_map = build_rank_map(engines(4, 0), share_gpu=True)
    assert {r.device for r in rank_map.ranks} == {"cpu"}
    assert "no GPU to share" in rank_map.note


def test_share_gpu_with_nccl_is_refused_naming_the_rule():
    with pytest.raises(RankMapError, match="NCCL refuses two ranks on one GPU"):
        build_rank_map(engines(4, 1), backend="nccl", share_gpu=True)


def test_per_engine_binding_shares_each_engines_own_gpu():
    # Slurm-style binding: each engine sees its own list; two engines bound to the same GPU share it.
    bound = [EngineInfo(engine_id=i, host="node", ip="10.0.0.1", pid=i, gpus=(str(i % 2), "x" * i), cpu_count=8)
             for i in range(4)]
    rank_map = build_rank_map(bound, share_gpu=True)
    assert rank_map.backend == "gloo" and [r.gpu for r in rank_map.ranks] == ["0", "1", "0", "1"]


@pytest.mark.parametrize("share_gpu", [False, True])
@pytest.mark.parametrize("gpus", [0, 1, 2, 8])
def test_only_an_nccl_world_is_bound_to_its_gpu(gpus, share_gpu):
    # A bound gloo world makes DeviceMesh split groups from it, which torch 2.11 cannot do for gloo.
    from kernels.engine.runtime import bound_device

    rank_map = build_rank_map(engines(4, gpus), share_gpu=share_gpu)
    bound = [bound_device(rank_map.backend, r.device) for r in rank_map.ranks]
    if rank_map.backend == "nccl":
        assert [str(b) for b in bound] == [r.device for r in rank_map.ranks]
    else:
        assert bound == [None] * 4
