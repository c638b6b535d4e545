"""Several hosts on one machine (``lab.testing.hosts``): rank map, training, inter-host bytes, clean-up.

Needs root (network namespaces, veths, a bridge, tc): skipped otherwise. One 2-host × 2-rank
pool serves the module; every test that builds its own checks that nothing of it is left.
"""
from __future__ import annotations

import itertools
import os
import subprocess

import pytest

from kernels.parallel.mesh import ParallelDims, rank_grid
from kernels.train.reference import train_reference
from kernels.contract.run_config import RunConfig
from kernels.train.entry import train_rank
from kernels.contract.layout_rules import MESH_AXES, coords
from lab.measure.host_traffic import inter_host_total
from lab.measure.memory_and_comm import measure_layout
from lab.planning.plan_mesh import axis_groups
from lab.planning.planner import plan

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="simulated hosts need root (network namespaces, veth, tc)")
TINY = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64, "vocab": 64, "seq_len": 16}
BASE = {"model": TINY, "global_batch": 8, "steps": 2, "lr": 1e-2, "seed": 0, "return_params": False}
TP_ACROSS = ("pp", "tp", "dp")  # ranks of one tp group on two hosts
LAYOUTS = {"pp2-dp2": {"pp": 2, "dp": 2}, "dp2-tp2-tp-across-hosts": {"dp": 2, "tp": 2, "mesh_order": TP_ACROSS}}


def _left_behind(token: str, pids: set[int]) -> list[str]:
    """The namespaces and links of the network with ``token``, and the listed processes, still there."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    left = [n for n in names if n.startswith(f"clab-{token}")]
    left += [w.rstrip(":").split("@")[0] for w in links.split() if w.startswith((f"clb{token}", f"clv{token}"))]
    return left + [f"pid {p}" for p in pids if os.path.exists(f"/proc/{p}") and _not_zombie(p)]


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def two_hosts():
    from lab.testing import hosts
    with hosts(2, 2) as cluster:
        pids, token = cluster.pids, cluster.network.token
        yield cluster
    assert _left_behind(token, pids) == []


def test_flipped_mesh_order_matches_the_planners_coordinates():
    dims = {"dp": 2, "tp": 3, "pp": 2}
    for order in itertools.permutations(MESH_AXES):
        parallel = ParallelDims(world_size=12, order=order, **dims)
        grid = rank_grid(parallel)
        for r in range(12):
            assert parallel.coords(r) == coords(r, dims, order)
            c = parallel.coords(r)
            assert grid[c["pp"], c["dp"], c["tp"]].item() == r
        for i, axis in enumerate(MESH_AXES):  # the mesh's groups along an axis: the grid's rows along it
            rows = grid.movedim(i, -1).reshape(-1, dims[axis]).tolist()
            assert sorted(rows) == sorted(axis_groups(dims["dp"], dims["tp"], dims["pp"], axis, order)), (order, axis)
    with pytest.raises(ValueError, match="mesh_order must name pp, dp and tp"):
        RunConfig.from_options({"dp": 2, "tp": 2, "mesh_order": ("pp", "dp", "dp")})


def test_hosts_says_it_needs_root(monkeypatch):
    from lab.testing import hosts
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="need root"):
        with hosts(2, 1):
            pass


@needs_root
@pytest.mark.slow
def test_ranks_are_numbered_host_by_host_on_reachable_addresses(two_hosts):
    rm = two_hosts.rank_map
    net = two_hosts.network
    assert [r.host for r in rm.ranks] == ["host0", "host0", "host1", "host1"]
    assert [r.local_rank for r in rm.ranks] == [0, 1, 0, 1]
    assert [r.ip for r in rm.ranks] == [net.addresses[0]] * 2 + [net.addresses[1]] * 2
    assert rm.master_addr == net.addresses[0]

    def where(master):
        import os
        import socket
        with socket.socket() as s:
            s.settimeout(2)
            reach = s.connect_ex((master, 9))  # refused (111): routed to the master's host, which answered
        return socket.gethostname(), os.environ["GLOO_SOCKET_IFNAME"], reach

    got = two_hosts.run(where, rm.master_addr)
    assert [g[:2] for g in got] == [("host0", "eth0"), ("host0", "eth0"), ("host1", "eth0"), ("host1", "eth0")]
    assert all(g[2] == 111 for g in got), got  # ECONNREFUSED: the master's host answered
    shown = repr(two_hosts)
    assert "host0" in shown and "host1" in shown


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_hosts_train_like_one_process(two_hosts, layout):
    cfg = {**BASE, **LAYOUTS[layout]}
    ref = train_reference(RunConfig.from_options(cfg))
    results = two_hosts.run(train_rank, cfg)
    for rank, res in enumerate(results):
        assert res["losses"] == pytest.approx(ref["losses"], rel=1e-4), f"rank {rank} losses"
        assert res["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4), f"rank {rank} grad norms"


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_inter_host_bytes_equal_the_planners(two_hosts, layout):
    before = two_hosts.network.inter_host_bytes()
    records = measure_layout(two_hosts, {**BASE, **LAYOUTS[layout]})["comm"]
    after = two_hosts.network.inter_host_bytes()
    metered, planned = inter_host_total(records), inter_host_total(records, "predicted_inter_bytes")
    assert metered > 0 and metered == planned, [(r.rank, r.op, r.inter_bytes, r.predicted_inter_bytes) for r in records]
    assert all(r.predicted_inter_bytes is not None for r in records if r.op != "recv")
    # The kernel counted at least that many bytes between the hosts (it also counts headers,
    # the steps before the metered one and the groups' set-up).
    assert sum(after) - sum(before) >= metered


@needs_root
@pytest.mark.slow
def test_hsdp_sends_between_hosts_what_the_planner_says_and_less_than_full_shard(two_hosts):
    # HYBRID_SHARD with dp_replicate=2 shards inside each host and all-reduces each shard across them; FULL_SHARD's
    # rings of 4 cross the link twice for every all-gather and reduce-scatter.
    hsdp = {"dp": 4, "fsdp_strategy": "hybrid", "dp_replicate": 2}
    between = {}
    for name, layout in {"hybrid": hsdp, "full": {"dp": 4, "fsdp_strategy": "full"}}.items():
        records = measure_layout(two_hosts, {**BASE, **layout})["comm"]
        between[name] = inter_host_total(records)
        assert between[name] == inter_host_total(records, "predicted_inter_bytes"), name
    assert {r.op for r in records} == {"all_gather", "reduce_scatter"}
    planned = plan(TINY, gpus=4, gpus_per_node=2, parallel=hsdp, global_batch=BASE["global_batch"], dtype="fp32")
    assert between["hybrid"] == planned.link("inter").wire_bytes * 4  # every rank all-reduces its shard across
    assert 0 < between["hybrid"] < between["full"]


@needs_root
@pytest.mark.slow
def test_nothing_is_left_behind_after_an_error_and_the_cap_holds():
    from lab.testing import hosts
    pids: set[int] = set()
    token = "not built"
    with pytest.raises(RuntimeError, match="on purpose"):
        with hosts(2, 1, link_gbit=0.2) as cluster:
            pids = cluster.pids
            net = cluster.network
            token = net.token
            assert net.shaping in ("htb", "tbf") and net.measured_gbit <= 0.2 * 1.2, net
            raise RuntimeError("on purpose")
    assert pids and _left_behind(token, pids) == []


@needs_root
@pytest.mark.slow
def test_bench_collectives_sweeps_inside_and_across_hosts(two_hosts):
    from lab import bench_collectives
    from lab.measure.bench import link_groups
    assert link_groups([r.host for r in two_hosts.rank_map.ranks]) == {"intra": [[0, 1], [2, 3]],
                                                                       "inter": [[0, 2], [1, 3]]}
    records = bench_collectives(two_hosts, sizes=(1 << 16,), ops=("all_reduce", "send_recv"), iters=2)
    assert sorted((r.op, r.link, r.world) for r in records) == [
        ("all_reduce", "", 4), ("all_reduce", "inter", 2), ("all_reduce", "intra", 2),
        ("send_recv", "", 4), ("send_recv", "inter", 2), ("send_recv", "intra", 2)]
    assert all(r.busbw > 0 for r in records)


@needs_root
@pytest.mark.slow
def test_a_hang_on_other_hosts_is_diagnosed_from_their_beacons():
    """The driver cannot read these ranks' state files (they are on host0/host1): their beacons tell."""
    import lab
    from lab.testing import hosts
    with hosts(2, 2) as cluster:
        pids, token = cluster.pids, cluster.network.token
        assert not cluster._local_pids  # no rank counts as on the driver's host
        exp = lab.Experiment(cluster, lab.GPT(**{k: v for k, v in TINY.items() if k != "d_ff"}), lab.Parallel(dp=4),
                             steps=3, faults=[lab.Hang(2, at_step=1)], hang_after=3.0)
        with pytest.raises(lab.HangError) as info:
            exp.run(progress=False)
    report = info.value.report
    assert [r.state for r in report.ranks] == ["in collective", "in collective", "in compute", "in collective"]
    assert report.never_arrived == (2,) and report.flight_never_arrived == (2,), report
    assert _left_behind(token, pids) == []
