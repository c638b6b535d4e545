"""Whatever a rank does, the driver gets a clear error in bounded time and the pool stays usable.

The failure drills run on the session's shared pool right after a training run on it: a
run used to leave its world's gloo connections open, so that a failing rank no longer
made its peers fail fast. The bounds asserted here are the ones the issue asks for
(error within 5 s of an engine's death, within timeout + 2 s of a timeout).
"""
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
from kernels.engine import runtime
from lab.pool import launch
from tests.conftest import start_pool

DEATH_TO_ERROR_S = 5.0  # the bound, from SIGKILL to the DeadRankError, world rebuilt
TIMEOUT_SLACK_S = 2.0  # the bound on how late after its timeout a RankTimeoutError may come


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


def engine_pids(cluster) -> list[int]:
    return [r.pid for r in cluster.rank_map.ranks]


@pytest.fixture
def trained(cluster):
    """The shared pool right after a training run with mesh sub-groups, FSDP and DTensor (their caches kept groups alive)."""
    lab.Experiment(cluster, lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16),
                   lab.Parallel(dp=2, tp=2, zero=3), global_batch=8, steps=1).run()
    return cluster


@pytest.fixture
def spare_ready(cluster):
    """The shared pool once a spare engine is warmed (after a replacement the next one needs a few seconds)."""
    deadline = time.monotonic() + 120
    while cluster.spares() < 1:
        assert time.monotonic() < deadline, "no spare engine became ready in 120 s"
        time.sleep(0.2)
    return cluster


def test_rank_raising_after_a_training_run_makes_peers_fail_fast_or_says_who_was_replaced(trained):
    cluster, before = trained, engine_pids(trained)
    start = time.monotonic()
    with pytest.raises(lab.RankError) as info:
        cluster.run(raise_on_rank_two, timeout=30)
    assert time.monotonic() - start < DEATH_TO_ERROR_S
    error = info.value
    assert error.rank == 2 and error.host == cluster.rank_map.ranks[2].host
    assert str(error).startswith("rank 2 on host") and "rank two refuses" in str(error)
    # Peers fail at once ("closed by peer" / "reset by peer"). A peer that stays blocked anyway (its
    # connections still held open) must be named as killed and replaced, never hidden.
    killed = set(error.recovery.killed)
    assert all(f.collateral and ("by peer" in f.evalue or f.rank in killed) for f in error.failures[1:]), error.failures
    # A killed rank gets a spare engine, or waits for a new one that the next call picks up.
    assert set(error.recovery.replaced) | set(error.recovery.waiting_for_engines) == killed
    assert [p for r, p in enumerate(engine_pids(cluster)) if r not in killed] == \
        [p for r, p in enumerate(before) if r not in killed]
    assert cluster.run(runtime.lingering_groups) == [0] * 4  # the failing rank's groups were really freed
    assert cluster.run(rank_sum) == [6.0] * 4


def test_timeout_names_the_rank_that_never_reached_the_collective_within_timeout_plus_two_seconds(trained):
    cluster, before = trained, engine_pids(trained)
    start = time.monotonic()
    with pytest.raises(lab.RankTimeoutError) as info:
        cluster.run(sleep_on_rank_one, timeout=3)
    assert time.monotonic() - start < 3 + TIMEOUT_SLACK_S
    error = info.value
    assert error.late == [1] and error.rank == 1
    assert error.waiting == {0: "all_reduce", 2: "all_reduce", 3: "all_reduce"}
    head = str(error).splitlines()
    assert head[0].startswith("rank 1 (host") and "did not reach the all_reduce" in head[0]
    assert "ranks 0, 2, 3" in head[0] and "waited there" in head[0]
    assert "sleep_on_rank_one" in head[1] and "--> " in str(error) and "time.sleep(120)" in str(error)
    assert error.recovery.rebuilt and engine_pids(cluster) == before
    assert cluster.run(rank_sum) == [6.0] * 4


def test_timeout_names_a_rank_that_returned_without_joining_the_collective(cluster):
    def skip_on_rank_three() -> float:
        import torch.distributed as dist
        return -1.0 if dist.get_rank() == 3 else rank_sum()

    with pytest.raises(lab.RankTimeoutError) as info:
        cluster.run(skip_on_rank_three, timeout=2)
    assert info.value.late == [3] and info.value.rank == 3 and sorted(info.value.waiting) == [0, 1, 2]
    assert "had returned without joining" in str(info.value).splitlines()[0]
    assert cluster.run(rank_sum) == [6.0] * 4


def test_interrupt_signals_every_engine_and_pool_is_usable_after(trained):
    cluster, before = trained, engine_pids(trained)
    threading.Timer(1.0, _thread.interrupt_main).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cluster.run(sleep_on_rank_one)
    assert time.monotonic() - start < 10
    assert cluster.run(rank_sum) == [6.0] * 4
    assert engine_pids(cluster) == before  # recovered without killing or replacing an engine


def test_killed_engine_is_named_within_five_seconds_with_the_world_already_rebuilt(spare_ready):
    cluster = spare_ready
    victim = cluster.rank_map.ranks[2]
    survivors = {r.rank: r.pid for r in cluster.rank_map.ranks if r.rank != 2}
    killed_at = []
    experiment = lab.Experiment(cluster, lab.GPT(layers=4, d_model=32, heads=4, vocab=64, seq_len=16),
                                lab.Parallel(dp=4), global_batch=16, steps=400)
    threading.Timer(3.0, lambda: (killed_at.append(time.monotonic()), os.kill(victim.pid, signal.SIGKILL))).start()
    with pytest.raises(lab.DeadRankError) as info:
        experiment.run()
    assert killed_at and time.monotonic() - killed_at[0] < DEATH_TO_ERROR_S
    error, text = info.value, str(info.value)
    assert error.rank == 2 and text.startswith(f"rank 2 (host {victim.host}) died") and str(victim.pid) in text
    new_pid = cluster.rank_map.ranks[2].pid
    assert error.recovery.replaced == {2: (victim.pid, new_pid)} and error.recovery.rebuilt
    assert f"rank 2 now runs in pid {new_pid}" in text and "world is rebuilt" in text and "restart()" not in text
    assert cluster.run(rank_sum) == [6.0] * 4  # no restart
    assert {r: cluster.rank_map.ranks[r].pid for r in survivors} == survivors and not alive([victim.pid])


def test_errors_show_the_users_own_frame_from_a_notebook_cell_and_from_a_lambda(cluster):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()  # a real IPython: cells are compiled and cached as in a notebook
    try:
        shell.user_ns["cluster"] = cluster
        shell.run_cell("import torch.distributed as dist\n\ndef step(x):\n"
                       "    if dist.get_rank() == 1:\n        return x / 0\n    return x\n")
        cell = shell.run_cell("cluster.run(step, 1)").error_in_exec
        sent = shell.run_cell("cluster.run(lambda: 1 // (dist.get_rank() - 1))").error_in_exec
    finally:
        InteractiveShell.clear_instance()
    assert isinstance(cell, lab.RankError) and isinstance(sent, lab.RankError)
    lines = str(cell).splitlines()
    assert lines[0] == f"rank 1 on host {cell.host} raised ZeroDivisionError: division by zero"
    assert lines[1].startswith("  Cell In[") and lines[1].endswith("line 5, in step")
    assert lines[2].endswith("| def step(x):") and lines[3].endswith("|     if dist.get_rank() == 1:")
    assert lines[4].startswith("  --> 5 |") and lines[4].endswith("return x / 0")
    lines = str(sent).splitlines()
    assert lines[0] == f"rank 1 on host {sent.host} raised ZeroDivisionError: integer division or modulo by zero"
    assert lines[1].startswith("  Cell In[") and lines[1].endswith("in <lambda>")
    assert lines[2].endswith("cluster.run(lambda: 1 // (dist.get_rank() - 1))")
    for error in (cell, sent):
        shown = "\n".join(error._render_traceback_())  # what IPython prints
        assert "Could not get source" not in shown and "ipyparallel" not in shown and "call_guarded" not in shown
        assert len(shown.splitlines()) <= 8
        assert "call_guarded" in error.remote_traceback  # everything, one attribute away
    assert cluster.run(rank_sum) == [6.0] * 4


def wedge_ranks_zero_and_one() -> None:
    import time

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    if rank in (0, 1):  # each waits for a message the other never sends: SIGINT cannot reach them
        dist.recv(torch.zeros(1), src=1 - rank)
    time.sleep(120)  # rank 2 sleeps in Python; rank 3 is killed meanwhile


@pytest.mark.slow  # two of the three lost ranks need fresh engines (5-8 s each on two cores)
def test_dead_engine_is_reported_within_five_seconds_even_with_survivors_wedged_in_a_collective(spare_ready):
    cluster = spare_ready
    old = engine_pids(cluster)
    killed_at = []
    threading.Timer(1.0, lambda: (killed_at.append(time.monotonic()), os.kill(old[3], signal.SIGKILL))).start()
    with pytest.raises(lab.DeadRankError) as info:
        cluster.run(wedge_ranks_zero_and_one)
    assert killed_at and time.monotonic() - killed_at[0] < DEATH_TO_ERROR_S
    recovery, text = info.value.recovery, str(info.value)
    assert info.value.rank == 3 and text.startswith("rank 3 (host")
    assert recovery.killed == (0, 1) and "ranks 0, 1 stayed blocked even after SIGINT" in text
    assert sorted([*recovery.replaced, *recovery.waiting_for_engines]) == [0, 1, 3]
    assert all(f"rank {r} now runs in pid {new}" in text for r, (_, new) in recovery.replaced.items())
    assert "the next call waits for" in text and "restart()" not in text
    assert cluster.run(rank_sum) == [6.0] * 4  # waits for the new engines, then runs: no restart
    now = engine_pids(cluster)
    assert now[2] == old[2] and not alive([old[0], old[1], old[3]]) and len(set(now) - set(old)) == 3


@pytest.mark.slow  # starts and stops a pool of its own
def test_stop_leaves_no_process_the_lab_started():
    pool = start_pool(2)
    pids = pool.pids
    engine_pids = {r.pid for r in pool.rank_map.ranks}
    assert engine_pids <= pids and len(pids) > len(engine_pids)  # controller, nannies, the spare too
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


@pytest.mark.slow  # replaces all four engines, three of them with freshly started ones
def test_ranks_deadlocked_in_a_collective_are_named_replaced_and_the_pool_never_hangs(cluster):
    old = engine_pids(cluster)
    start = time.monotonic()
    with pytest.raises(lab.RankTimeoutError, match="all waiting in collectives") as info:
        cluster.run(wait_for_a_message_nobody_sends, timeout=2)
    assert time.monotonic() - start < 2 + DEATH_TO_ERROR_S
    assert info.value.waiting == {r: "recv" for r in range(4)} and info.value.recovery.killed == (0, 1, 2, 3)
    assert cluster.run(rank_sum) == [6.0] * 4
    assert not alive(old)  # the wedged engines were killed and replaced
