"""Rank map rules (docs/design.md#rank-map): host order, local ranks, GPU binding, backend choice."""
from __future__ import annotations

import json

import pytest

from lab.pool.rank_map import RankMapError, build_rank_map, local_world_sizes
from kernels.contract.pool_records import EngineInfo, RankMap


def engine(engine_id: int, host: str = "a", gpus: tuple[str, ...] = (),
           ip: str | None = None) -> EngineInfo:
    """A fake engine report; the ip defaults to one per host so master_addr is checkable."""
    return EngineInfo(engine_id=engine_id, host=host, ip=ip or f"10.0.0.{ord(host[0])}",
                      pid=1000 + engine_id, gpus=gpus)


def test_single_host_without_gpus_gives_four_gloo_cpu_ranks_with_a_note():
    m = build_rank_map([engine(i) for i in range(4)])
    assert m.backend == "gloo"
    assert [r.rank for r in m.ranks] == [0, 1, 2, 3]
    assert [r.local_rank for r in m.ranks] == [0, 1, 2, 3]
    assert {r.device for r in m.ranks} == {"cpu"}
    assert {r.gpu for r in m.ranks} == {None}
    assert {r.backend for r in m.ranks} == {"gloo"}
    assert m.note == "no GPUs visible: CPU ranks with gloo"


def test_single_host_with_four_shared_gpus_gives_nccl_one_cuda_device_per_rank():
    gpus = ("0", "1", "2", "3")
    m = build_rank_map([engine(i, gpus=gpus) for i in range(4)])
    assert m.backend == "nccl"
    assert [r.device for r in m.ranks] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert [r.gpu for r in m.ranks] == ["0", "1", "2", "3"]
    assert {r.backend for r in m.ranks} == {"nccl"}
    assert "nccl" in m.note and "4 ranks" in m.note


def test_hosts_are_ordered_by_their_lowest_engine_id_and_ranks_numbered_host_by_host():
    engines = [engine(2, "a"), engine(3, "b"), engine(1, "a"), engine(0, "b"), engine(4, "c")]
    m = build_rank_map(engines)
    assert [(r.rank, r.host, r.local_rank, r.engine_id) for r in m.ranks] == [
        (0, "b", 0, 0), (1, "b", 1, 3),
        (2, "a", 0, 1), (3, "a", 1, 2),
        (4, "c", 0, 4),
    ]
    assert m.hosts() == {"b": [0, 1], "a": [2, 3], "c": [4]}
    assert local_world_sizes(m) == {"b": 2, "a": 2, "c": 1}


def test_rank_fields_come_from_the_engine_that_becomes_the_rank():
    m = build_rank_map([engine(5, "x", ip="10.1.1.1"), engine(2, "y", ip="10.2.2.2")])
    by_engine = m.by_engine()
    assert (by_engine[2].rank, by_engine[2].pid, by_engine[2].ip) == (0, 1002, "10.2.2.2")
    assert (by_engine[5].rank, by_engine[5].pid, by_engine[5].ip) == (1, 1005, "10.1.1.1")


def test_master_addr_is_the_ip_of_rank_zero():
    m = build_rank_map([engine(1, "a", ip="10.0.0.1"), engine(0, "b", ip="10.0.0.2")])
    assert m.ranks[0].host == "b"
    assert m.master_addr == "10.0.0.2"


def test_cuda_visible_devices_subset_maps_local_rank_to_logical_index_and_physical_id():
    m = build_rank_map([engine(0, gpus=("2", "3")), engine(1, gpus=("2", "3"))])
    assert m.backend == "nccl"
    assert [(r.device, r.gpu) for r in m.ranks] == [("cuda:0", "2"), ("cuda:1", "3")]


def test_uuid_gpu_ids_are_kept_as_the_physical_id():
    uuids = ("GPU-aaaa-1111", "GPU-bbbb-2222")
    m = build_rank_map([engine(0, gpus=uuids), engine(1, gpus=uuids)])
    assert [r.gpu for r in m.ranks] == list(uuids)


def test_per_engine_gpu_binding_gives_every_rank_cuda_0_on_its_own_gpu_with_nccl():
    m = build_rank_map([engine(i, gpus=(str(i),)) for i in range(4)])
    assert m.backend == "nccl"
    assert [r.device for r in m.ranks] == ["cuda:0"] * 4
    assert [r.gpu for r in m.ranks] == ["0", "1", "2", "3"]


def test_same_physical_gpu_on_two_hosts_is_not_a_conflict():
    m = build_rank_map([engine(0, "a", gpus=("0",)), engine(1, "b", gpus=("0",))])
    assert m.backend == "nccl"
    assert [(r.host, r.device, r.gpu) for r in m.ranks] == [
        ("a", "cuda:0", "0"), ("b", "cuda:0", "0")]


def test_duplicate_per_engine_gpu_falls_back_to_gloo_with_a_note_naming_the_conflict():
    engines = [engine(0, gpus=("0",)), engine(1, gpus=("0",)), engine(2, gpus=("1", "2"))]
    m = build_rank_map(engines)
    assert m.backend == "gloo"
    assert {r.device for r in m.ranks} == {"cpu"}
    assert {r.gpu for r in m.ranks} == {None}
    assert "host 'a'" in m.note
    assert "engines 0 and 1 share GPU '0'" in m.note
    assert "2 GPUs for 3 ranks" in m.note
    assert "NCCL needs one GPU per rank" in m.note


def test_forced_nccl_with_a_duplicate_per_engine_gpu_raises():
    engines = [engine(0, gpus=("0",)), engine(1, gpus=("0",)), engine(2, gpus=("1",))]
    with pytest.raises(RankMapError) as err:
        build_rank_map(engines, backend="nccl")
    assert "host 'a' has 2 GPUs for 3 ranks (engines 0 and 1 share GPU '0')" in str(err.value)


def test_identical_single_gpu_lists_count_as_one_shared_gpu():
    # Two engines that both see only ("0",) cannot be told apart from one GPU shared by the host.
    m = build_rank_map([engine(0, gpus=("0",)), engine(1, gpus=("0",))])
    assert m.backend == "gloo"
    assert "host 'a' has 1 GPU ('0') for 2 ranks" in m.note


def test_per_engine_binding_with_an_engine_that_sees_no_gpu_falls_back_to_gloo():
    m = build_rank_map([engine(0, gpus=("0",)), engine(1, gpus=())])
    assert m.backend == "gloo"
    assert "engine 1 sees no GPU" in m.note and "1 GPU for 2 ranks" in m.note


def test_too_few_shared_gpus_falls_back_to_gloo_with_a_note_naming_host_gpus_and_ranks():
    m = build_rank_map([engine(i, gpus=("0",)) for i in range(4)])
    assert m.backend == "gloo"
    assert {r.device for r in m.ranks} == {"cpu"}
    assert m.note.startswith("host 'a' has 1 GPU ('0') for 4 ranks")
    assert "using gloo on CPU; NCCL needs one GPU per rank (share_gpu=True" in m.note


def test_one_host_short_of_gpus_makes_the_whole_world_gloo():
    engines = [engine(0, "a", gpus=("0", "1")), engine(1, "a", gpus=("0", "1")),
               engine(2, "b"), engine(3, "b")]
    m = build_rank_map(engines)
    assert m.backend == "gloo"
    assert {r.device for r in m.ranks} == {"cpu"}
    assert "host 'b' has 0 GPUs (none) for 2 ranks" in m.note
    assert "host 'a'" not in m.note


def test_forced_nccl_with_too_few_gpus_names_the_host_its_ranks_and_gpus():
    engines = [engine(0, "a", gpus=("0", "1")), engine(1, "a", gpus=("0", "1")),
               *(engine(i, "b", gpus=("0",)) for i in (2, 3, 4))]
    with pytest.raises(RankMapError) as err:
        build_rank_map(engines, backend="nccl")
    msg = str(err.value)
    assert "nccl" in msg and "one GPU per rank" in msg
    assert "host 'b' has 1 GPU ('0') for 3 ranks (engines 2, 3, 4)" in msg
    assert "host 'a'" not in msg


def test_forced_nccl_with_enough_gpus_matches_auto():
    engines = [engine(i, gpus=("0", "1")) for i in range(2)]
    assert build_rank_map(engines, backend="nccl") == build_rank_map(engines)


def test_forced_gloo_puts_every_rank_on_cpu_even_with_gpus_and_says_it_was_requested():
    m = build_rank_map([engine(i, gpus=("0", "1")) for i in range(2)], backend="gloo")
    assert m.backend == "gloo"
    assert [(r.device, r.gpu, r.backend) for r in m.ranks] == [("cpu", None, "gloo")] * 2
    assert "requested" in m.note


def test_unequal_hosts_are_allowed_unless_equal_hosts_are_required():
    engines = [engine(0, "a"), engine(1, "a"), engine(2, "b")]
    assert build_rank_map(engines).world_size == 3
    with pytest.raises(RankMapError) as err:
        build_rank_map(engines, require_equal_hosts=True)
    msg = str(err.value)
    assert "same number of ranks on every host" in msg
    assert "'a': 2" in msg and "'b': 1" in msg


def test_equal_hosts_pass_when_required():
    engines = [engine(0, "a"), engine(1, "b"), engine(2, "a"), engine(3, "b")]
    m = build_rank_map(engines, require_equal_hosts=True)
    assert local_world_sizes(m) == {"a": 2, "b": 2}


def test_rank_map_round_trips_through_a_dict_and_json():
    m = build_rank_map([engine(1, "a", gpus=("2", "3")), engine(0, "b", gpus=("5",)),
                        engine(2, "a", gpus=("2", "3"))])
    assert m.backend == "nccl"
    assert RankMap.from_dict(m.to_dict()) == m
    assert RankMap.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_empty_engine_list_raises():
    with pytest.raises(RankMapError, match="at least 1 engine"):
        build_rank_map([])


def test_unknown_backend_raises_and_lists_the_allowed_ones():
    with pytest.raises(RankMapError, match=r"unknown backend 'mpi'.*auto, nccl, gloo"):
        build_rank_map([engine(0)], backend="mpi")


def test_duplicate_engine_ids_raise_naming_the_id():
    with pytest.raises(RankMapError, match=r"engine ids must be unique: \[3\]"):
        build_rank_map([engine(3, "a"), engine(3, "b"), engine(1, "a")])


def test_rank_map_error_is_a_value_error():
    assert issubclass(RankMapError, ValueError)
