"""The console script's main job runs every collective and checks each result."""
from __future__ import annotations

import subprocess

import pytest

from lab.demo import expected_output


def test_expected_values_are_computed_by_hand_not_by_torch():
    assert expected_output("all_reduce", 0, 4) == [10.0, 20.0, 30.0, 40.0]
    assert expected_output("reduce_scatter", 1, 2) == [1.0 + 101.0]
    assert expected_output("send_recv", 0, 4) == [3.0]
    assert expected_output("broadcast", 3, 4) == [7.0]


@pytest.mark.slow  # a 2-rank pool and a training run in a subprocess
def test_demo_prints_every_collective_for_every_rank_and_all_match():
    done = subprocess.run(["cluster-lab", "--ranks", "2", "--train-ranks", "2", "demo"], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv"):
        assert sum(line.startswith(op) for line in done.stdout.splitlines()) == 2
    assert "10 of 10 collective results match" in done.stdout
    assert "PP1×DP1×TP2" in done.stdout and "losses equal the one-process reference" in done.stdout


@pytest.mark.slow
def test_default_demo_trains_the_gpt_in_3d_beside_one_process():
    done = subprocess.run(["cluster-lab", "demo"], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PP2×DP2×TP2" in done.stdout and "on 8 ranks" in done.stdout
    table = done.stdout[done.stdout.index("step  loss"):].splitlines()[1:6]
    assert len(table) == 5 and all(float(row.split()[-1]) < 1e-4 for row in table)
    assert "losses equal the one-process reference" in done.stdout


@pytest.mark.slow  # starts a 2-rank pool in a subprocess
def test_info_prints_the_rank_table():
    done = subprocess.run(["cluster-lab", "--ranks", "2", "info"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "rank  host" in done.stdout and "gloo" in done.stdout
