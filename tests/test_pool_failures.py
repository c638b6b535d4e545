"""Whatever a rank does, the driver gets a clear error in bounded time and the pool stays usable."""
from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

import lab
from lab import launch
from tests.conftest import start_pool


def rank_sum() -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def raise_on_rank_two() -> float:
    import torch.distributed as dist

    if dist.get_rank() == 2:
        raise ValueError("rank two refuses")
    return rank_sum()


def sleep_on_rank_one() -> float:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(120)
    return rank_sum()


def alive(pids):
    return [p for p in pids if launch.is_alive(p)]


@pytest.mark.usefixtures("fresh_world")
def test_rank_raising_while_peers_wait_in_collective_raises_rank_error_and_world_recovers(cluster):
    start = time.monotonic()
    with pytest.raises(lab.RankError) as info:
        cluster.run(raise_on_rank_two, timeout=10)
    assert time.monotonic() - start < 10
    error = info.value
    assert error.rank == 2 and error.host == cluster.rank_map.ranks[2].host
    assert "rank 2 on host" in str(error) and "rank two refuses" in str(error)
    assert "raise_on_rank_two" in error.failures[0].traceback
    assert all(f.collateral for f in error.failures[1:])
    assert cluster.run(rank_sum) == [6.0] * 4


@pytest.mark.usefixtures("fresh_world")
def test_timeout_names_the_late_ranks_interrupts_them_and_world_recovers(cluster):
    start = time.monotonic()
    with pytest.raises(lab.RankTimeoutError) as info:
        cluster.run(sleep_on_rank_one, timeout=2)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1 and "time.sleep" in info.value.failures[0].traceback
    assert cluster.run(rank_sum) == [6.0] * 4


@pytest.mark.usefixtures("fresh_world")
def test_interrupt_signals_every_engine_and_pool_is_usable_after(cluster):
    pids = [r.pid for r in cluster.rank_map.ranks]
    threading.Timer(1.0, _thread.interrupt_main).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cluster.run(sleep_on_rank_one)
    assert time.monotonic() - start < 10
    assert cluster.run(rank_sum) == [6.0] * 4
    assert [r.pid for r in cluster.rank_map.ranks] == pids  # recovered without restarting engines


@pytest.mark.slow  # restarts all four engines
@pytest.mark.usefixtures("fresh_world")
def test_killed_engine_is_named_within_ten_seconds_and_restart_brings_world_back(cluster):
    victim = cluster.rank_map.ranks[3]
    threading.Timer(1.0, os.kill, (victim.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(lab.DeadRankError) as info:
        cluster.run(sleep_on_rank_one)
    assert time.monotonic() - start < 10
    assert info.value.rank == 3 and "rank 3" in str(info.value) and victim.host in str(info.value)
    assert "dead" in repr(cluster)
    with pytest.raises(lab.LabError, match="restart"):
        cluster.run(rank_sum)
    old = [r.pid for r in cluster.rank_map.ranks]
    cluster.restart()
    assert cluster.run(rank_sum) == [6.0] * 4
    assert not alive(old)


@pytest.mark.slow  # starts and stops a pool of its own
def test_stop_leaves_no_process_the_lab_started():
    pool = start_pool(2)
    pids = pool.pids
    engine_pids = {r.pid for r in pool.rank_map.ranks}
    assert engine_pids <= pids and len(pids) > len(engine_pids)  # controller, nannies too
    pool.stop()
    assert not alive(pids)
    with pytest.raises(lab.PoolStoppedError):
        pool.run(rank_sum)


@pytest.mark.slow  # starts a pool in a subprocess
def test_interpreter_exit_leaves_no_process_the_lab_started():
    script = ("import warnings, lab\nwarnings.simplefilter('ignore')\n"
              "c = lab.start(n=2, backend='gloo', activate=False)\nprint(sorted(c.pids), flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pids = eval(done.stdout.strip().splitlines()[-1])
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and not alive(pids)


def test_lab_refuses_to_signal_a_process_it_did_not_start():
    stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(PermissionError, match="did not start"):
            launch.signal_pids({stranger.pid}, owned={os.getpid() + 10**6}, sig=signal.SIGKILL)
        assert psutil.Process(stranger.pid).is_running()
    finally:
        stranger.kill()
        stranger.wait()


def wait_for_a_message_nobody_sends() -> None:
    import torch
    import torch.distributed as dist

    t = torch.zeros(1)
    dist.recv(t, src=(dist.get_rank() + 1) % dist.get_world_size())


@pytest.mark.slow  # waits out the grace periods, then restarts all four engines
def test_ranks_wedged_in_a_collective_are_replaced_so_the_pool_never_hangs(cluster):
    old = [r.pid for r in cluster.rank_map.ranks]
    start = time.monotonic()
    with pytest.raises(lab.RankTimeoutError, match="did not finish"):
        cluster.run(wait_for_a_message_nobody_sends, timeout=2)
    assert time.monotonic() - start < 40
    assert cluster.run(rank_sum) == [6.0] * 4
    assert not alive(old)  # the wedged engines were killed and replaced
