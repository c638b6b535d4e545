"""An engine that dies while its rank is idle (killed, or taken down with its whole mpiexec) fails
the next call with DeadRankError naming the rank, and the call after that runs on a whole world."""
from __future__ import annotations

import os
import signal
import time

import pytest

import lab
from lab.pool import launch
from tests.launcher_checks import rank_sum


def test_an_engine_dead_between_calls_fails_the_next_call_by_name_then_the_world_is_whole(cluster):
    victim = cluster.rank_map.ranks[2].pid
    os.kill(victim, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while launch.is_alive(victim) and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(lab.DeadRankError) as caught:
        cluster.run(rank_sum)
    assert caught.value.rank == 2 and f"pid {victim}" in str(caught.value)
    assert cluster.run(rank_sum) == [6.0] * 4
    assert cluster.rank_map.ranks[2].pid != victim
