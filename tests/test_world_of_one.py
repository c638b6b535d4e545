"""A world of one rank works everywhere: what a one-GPU machine gives, guarded on CPU."""
from __future__ import annotations

import subprocess

import pytest
from ipyparallel.error import RemoteError

import lab
from lab.run.controls import Controls
from kernels.contract.pool_records import RankInfo, RankMap
from lab.pool.supervise import Outcome, describe_failures
from tests.conftest import start_pool

TINY = lab.GPT(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
# Every layout a world of one rank admits (dp = tp = pp = 1).
WORLD_ONE_LAYOUTS = [dict(), dict(mixed_precision="bf16"), dict(zero=1), dict(zero=2), dict(zero=3), dict(zero=3, mixed_precision="bf16"),
                     dict(zero=3, cpu_offload=True), dict(activation_checkpointing=True), dict(microbatches=2)]


@pytest.fixture(scope="module")
def solo():
    with start_pool(1) as pool:  # stopped on leaving, failed tests too
        yield pool


def test_run_returns_one_plain_result_per_rank(solo):
    assert solo.world_size == 1
    assert solo.run(lambda: 5) == [5]
    assert solo.run(lambda x: x + 1, 1, ranks=[0]) == {0: 2}
    assert solo.run(lambda: [1, 2]) == [[1, 2]]  # a list result stays one rank's list


def test_push_pull_and_px_work_on_one_rank(solo):
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()  # the magics register on the shell that exists when activating
    solo.push({"greeting": "hi"})
    assert solo.pull("greeting") == ["hi"] and solo.pull("rank", ranks=[0]) == {0: 0}
    solo.activate()
    shell.run_cell_magic("px", "", "t = torch.ones(2); dist.all_reduce(t)\nseen = t.tolist()")
    assert solo.pull("seen") == [[1.0, 1.0]]


@pytest.mark.parametrize("options", WORLD_ONE_LAYOUTS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
def test_every_world_one_layout_trains_like_one_process_and_is_measured(solo, options):
    exp = lab.Experiment(solo, TINY, lab.Parallel(**options), global_batch=8, steps=2, measure=True)
    result = exp.run()
    assert result.matches(exp.reference()), result.loss_table(exp.reference())
    assert {row["rank"] for row in result.memory_records} == {0}
    assert all(row["op"] != "all_reduce" or row["bytes"] == 0 for row in result.comm())


def test_view_and_controls_follow_a_world_of_one(solo):
    view = solo.view()
    solo.run(lambda: None)
    assert [r["state"] for r in view.ranks] == ["idle"]
    controls = Controls(lab.Experiment(solo, TINY, lab.Parallel(), global_batch=8, steps=2))
    controls.fields["zero"].value = 3
    assert not controls.button.disabled
    assert controls.run().config["strategy"]["requested_zero"] == 3 and "equal to one process" in controls.losses.value


def test_a_remote_error_without_type_or_message_still_says_what_is_known():
    error = RemoteError(None, None, traceback="")
    out = Outcome(errors={0: error}, finished_at={0: 0.0})
    rank_map = RankMap((RankInfo(rank=0, engine_id=0, host="h", ip="127.0.0.1", pid=1, local_rank=0,
                                 device="cpu", gpu=None, backend="gloo"),), "gloo", "127.0.0.1")
    failure = describe_failures(out, rank_map)[0]
    assert "None" not in f"{failure.ename}: {failure.evalue}"
    assert failure.ename == "RemoteError" and "no exception type or message" in failure.evalue


@pytest.mark.slow  # two subprocesses, each starting its own pool
def test_cli_on_one_rank_matches_every_collective_and_says_1_rank():
    done = subprocess.run(["cluster-lab", "--ranks", "1", "--train-ranks", "1", "demo"], capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "5 of 5 collective results match" in done.stdout
    assert "on 1 rank," in done.stdout and "losses equal the one-process reference" in done.stdout
    info = subprocess.run(["cluster-lab", "--ranks", "1", "info"], capture_output=True, text=True, timeout=120)
    assert info.returncode == 0 and "Cluster: 1 ranks" not in info.stdout and "Cluster: 1 rank," in info.stdout
