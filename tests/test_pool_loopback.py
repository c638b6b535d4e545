"""On one host, nothing the lab started listens beyond loopback: controller, engines, the ranks'
rendezvous store and their gloo sockets, mesh sub-groups included. On several hosts each rank
listens on its own address only."""
from __future__ import annotations

import psutil
import pytest

import lab
from kernels.engine import runtime
from kernels.contract.pool_records import EngineInfo
from lab.pool.cluster_world import listen_addresses
from lab.pool.rank_map import build_rank_map

LOOPBACK = {"127.0.0.1", "::1"}


def listening(pids: set[int]) -> set[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of these processes and their children."""
    found = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in family:
            try:
                found |= {(p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                          if c.status == psutil.CONN_LISTEN}
            except psutil.NoSuchProcess:
                pass
    return found


def listening_while_in_a_sub_group() -> list[str]:
    """This rank's listening addresses while a fresh gloo sub-group of two ranks is alive."""
    import psutil
    import torch
    import torch.distributed as dist

    group = dist.new_group([0, 1])  # collective over the world: every rank creates it
    if dist.get_rank() in (0, 1):
        dist.all_reduce(torch.ones(1), group=group)
    me = psutil.Process()
    addresses = sorted({c.laddr.ip for c in me.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})
    dist.barrier()
    dist.destroy_process_group(group)
    return addresses


def test_nothing_the_lab_started_listens_beyond_loopback(cluster):
    ranks = cluster.rank_map.ranks
    up = listening(cluster.pids)
    assert any(pid == ranks[0].pid for pid, _, _ in up), "rank 0's store should be listening"
    assert {ip for _, ip, _ in up} <= LOOPBACK, sorted(s for s in up if s[1] not in LOOPBACK)

    in_group = cluster.run(listening_while_in_a_sub_group)
    assert all(addresses and set(addresses) <= LOOPBACK for addresses in in_group), in_group

    tiny = lab.GPT(layers=2, d_model=16, heads=2, vocab=32, seq_len=8)
    lab.Experiment(cluster, tiny, lab.Parallel(dp=2, tp=2), global_batch=4, steps=1).run()
    after = listening(cluster.pids)
    assert {ip for _, ip, _ in after} <= LOOPBACK, sorted(s for s in after if s[1] not in LOOPBACK)


def engine(engine_id: int, host: str, ip: str) -> EngineInfo:
    return EngineInfo(engine_id=engine_id, host=host, ip=ip, pid=100 + engine_id, gpus=(), cpu_count=4)


def test_one_host_listens_on_loopback_even_with_a_public_controller_address():
    one_host = build_rank_map([engine(i, "a", "192.0.2.7") for i in range(2)])
    assert listen_addresses(one_host) == ["127.0.0.1", "127.0.0.1"]


def test_several_hosts_listen_each_on_the_address_that_reaches_the_controller():
    two_hosts = build_rank_map([engine(0, "a", "192.0.2.7"), engine(1, "b", "192.0.2.8"),
                                engine(2, "a", "192.0.2.7")])
    assert listen_addresses(two_hosts) == ["192.0.2.7", "192.0.2.7", "192.0.2.8"]


def test_the_interface_of_an_address_is_found_and_a_foreign_address_is_refused():
    assert runtime.interface_of("127.0.0.1") in psutil.net_if_addrs()
    with pytest.raises(RuntimeError, match="198.51.100.99"):
        runtime.interface_of("198.51.100.99")
