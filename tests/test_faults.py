"""Faults on purpose give their named outcome, and a hang is diagnosed from the ranks' collective logs.

The pool tests run on the shared 4-rank pool with the tiny GPT under DP 4. The bounds are
the issue's: a HangReport within hang_after + 5 s of the hang, naming the hung rank and the
collective the others wait in; the Slow wait figure within 25%.
"""
from __future__ import annotations

import _thread
import json
import statistics
import threading
import time

import pytest

import lab
from kernels.watch.collective_log import MAX_OPEN, CollectiveLog
from kernels.watch.state_file import HEADER, log_path, read_state
from lab.run.faults import fault_problems
import lab.pool.hang_report
from kernels.contract.watch_records import FlightGroup, RankActivity
from lab.pool.hang_report import RankDoing, build_report, flight_findings
from widgets.training_dashboard import rank_rows

MODEL = dict(layers=2, d_model=32, heads=4, vocab=64, seq_len=16)
HANG_AFTER_S = 3.0
REPORT_SLACK_S = 5.0  # the bound: the report within hang_after + 5 s of the hang


# ------------------------------------------------------------------ torch-free parts
def test_a_ranks_log_is_read_back_while_it_is_open_with_per_group_sequence_numbers(tmp_path):
    path = str(tmp_path / "log.bin")
    log = CollectiveLog(rank=1, path=path)
    log.begin_step(0)
    log.act("backward, step 0, micro-batch 0")
    first = log.enter("all_reduce", "dp", (0, 1), 4096)
    log.leave(first)
    log.enter("all_reduce", "dp", (0, 1), 8)
    log.enter("broadcast", "tp", (1, 3), 16)
    state = read_state(path)
    assert state.rank == 1 and state.step == 0 and state.action == "backward, step 0, micro-batch 0"
    assert [(c.op, c.group, c.ranks, c.seq, c.nbytes, c.phase) for c in state.open] == [
        ("all_reduce", "dp", (0, 1), 2, 8, "backward"), ("broadcast", "tp", (1, 3), 1, 16, "backward")]
    waits = log.finish()
    assert read_state(path).action == "done"
    assert len(waits) == 1 and waits[0].collectives == 3
    assert 0 < waits[0].grad_sync_s == waits[0].wait_s <= waits[0].step_s  # still-open ones count to the step's end
    log.close()


def test_the_published_snapshot_is_exactly_the_records_dict(tmp_path):
    # The log builds the snapshot's dict directly (it runs twice per collective): the record's own
    # conversion of what it parses back must give the very same dict, so the two cannot drift apart.
    path = tmp_path / "log.bin"
    log = CollectiveLog(rank=2, path=str(path))
    log.begin_step(3)
    log.note_fault("slow by 0.1 s")
    for i in range(MAX_OPEN + 2):
        log.enter("all_gather", "tp", (2, 3), 64 * i)
    raw = path.read_bytes()
    length = HEADER.unpack_from(raw, 0)[1]
    body = json.loads(raw[HEADER.size:HEADER.size + length])
    assert body == RankActivity.from_dict(body).to_dict()
    assert len(body["open"]) == MAX_OPEN and body["more_open"] == 2 and body["faults"] == ["slow by 0.1 s"]
    log.close()


def test_a_collective_open_across_a_step_boundary_counts_in_both_steps_and_no_more(tmp_path):
    log = CollectiveLog(rank=0, path=str(tmp_path / "log.bin"))
    log.begin_step(0)
    token = log.enter("all_reduce", "world", (0, 1), 4)  # async, still in flight when the next step begins
    log.begin_step(1)
    log.completed(token)
    waits = log.finish()
    assert all(0 <= w.wait_s <= w.step_s and w.compute_s >= 0 for w in waits), waits
    log.close()


def test_a_training_ranks_log_writes_from_its_thread_a_fault_at_once_and_the_rest_by_close(tmp_path):
    # A change costs the step no write: 2,000 changes make a few writes from the publisher's thread.
    path = str(tmp_path / "log.bin")
    log = CollectiveLog(rank=0, path=path, publish_every_s=0.05)
    first = read_state(path).counter  # the first snapshot is written at once
    log.begin_step(0)
    for _ in range(1000):
        log.leave(log.enter("all_reduce", "dp", (0, 1), 8))
    log.act("optimizer, step 0")
    deadline = time.monotonic() + 30
    while read_state(path).action != "optimizer, step 0" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert read_state(path).action == "optimizer, step 0"  # published without any call from the rank
    assert (read_state(path).counter - first) // 2 < 50
    log.note_fault("Hang(rank=0) struck at step 0")  # a fault may end the process next: written before returning
    assert read_state(path).faults == ("Hang(rank=0) struck at step 0",)
    log.act("forward, step 1, micro-batch 0")
    log.close()  # what was pending is written
    assert read_state(path).action == "forward, step 1, micro-batch 0"


def test_log_path_is_per_process_in_the_given_directory(tmp_path):
    assert log_path(123, str(tmp_path)) == str(tmp_path / "cluster-lab-collectives-123.bin")
    assert read_state(str(tmp_path / "missing.bin")) is None


def test_report_names_who_waits_where_and_who_never_arrived():
    group = (0, 1, 2, 3)
    rows = [RankDoing(r, "in collective", "backward, step 1, micro-batch 0", "all_reduce", "dp", group, 57, 1024, 6.0)
            for r in (0, 1)]
    rows.insert(2, RankDoing(2, "in compute", "forward, step 1, micro-batch 3, stage 1", silent_s=6.1))
    rows.append(RankDoing(3, "in collective", "backward, step 1, micro-batch 0", "all_reduce", "dp", group, 57, 1024,
                          5.0))
    report = build_report(rows, "a test")
    assert report.findings == ("ranks 0, 1, 3 wait in all_reduce #57 of group dp=[0,1,2,3] (for 6.0 s); rank 2 never "
                               "entered it (last seen in forward, step 1, micro-batch 3, stage 1)",)
    assert report.never_arrived == (2,)
    assert "rank 2: in compute, last seen in forward" in str(report)


def test_report_tells_a_mismatch_from_a_missing_rank():
    rows = [RankDoing(0, "in collective", "optimizer, step 0", "all_reduce", "world", (0, 1), 4, 8, 2.0),
            RankDoing(1, "in collective", "optimizer, step 0", "broadcast", "world", (0, 1), 4, 8, 2.0)]
    report = build_report(rows, "a test")
    assert report.never_arrived == ()
    assert "rank 1 waits in broadcast #4 of group world=[0,1] instead" in report.findings[0]


def test_flight_recorder_summaries_name_who_is_in_the_open_collective_and_who_never_entered_it():
    def group(last, done):
        return (FlightGroup("0", "dp", (0, 1, 2, 3), last, "gloo:all_reduce", done),)

    lines, never = flight_findings({0: group(12, 11), 1: group(12, 11), 2: group(11, 11), 3: group(12, 11)})
    assert lines == ("gloo:all_reduce #12 of group dp=[0,1,2,3]: ranks 0, 1, 3 entered it and have not finished; "
                     "rank 2 never entered it (its last was #11, finished)",)
    assert never == (2,)
    lines, never = flight_findings({0: group(12, 12), 1: group(12, 12)})  # nothing open: nothing to say
    assert lines == () and never == ()
    lines, _ = flight_findings({0: group(5, 4)})
    assert "rank 1 sent no flight record" in lines[0]


def test_bad_faults_are_refused_naming_the_constraint():
    problems = fault_problems([lab.Slow(4, 2.0), lab.Slow(1, 0.5), lab.Hang(0, 3), lab.Crash(-1, 0), "kill 2"],
                              world_size=4, steps=3)
    text = [message for _, message in problems]
    assert len(problems) == 5 and {rule for rule, _ in problems} == {"faults"}
    assert "rank must be one of the pool's ranks 0..3" in text[0]
    assert "factor must be a finite number >= 1" in text[1]
    assert "at_step must be a step the run takes, 0..2 (steps=3)" in text[2]
    assert "rank must be one of the pool's ranks" in text[3]
    assert "must be lab.Slow, lab.Hang, lab.Crash or lab.Kill" in text[4]
    assert fault_problems([lab.Slow(3, 1.0), lab.Kill(0, 2)], world_size=4, steps=3) == []


# ------------------------------------------------------------------------ on the pool
def experiment(cluster, **kwargs) -> lab.Experiment:
    return lab.Experiment(cluster, lab.GPT(**MODEL), lab.Parallel(dp=4), **kwargs)


def test_bad_fault_is_refused_before_launch(cluster):
    with pytest.raises(lab.ParallelConfigError, match=r"at_step must be a step the run takes, 0\.\.2"):
        experiment(cluster, steps=3, faults=[lab.Kill(1, at_step=3)])
    with pytest.raises(lab.ParallelConfigError, match="faults.0. must be lab.Slow, lab.Hang, lab.Crash or lab.Kill"):
        experiment(cluster, steps=3, faults=["kill rank 2"])
    with pytest.raises(lab.ParallelConfigError, match="hang_after must be None or a number of seconds > 0"):
        experiment(cluster, steps=3, hang_after=0)


def _interrupt_once_hung(cluster, rank: int) -> None:
    """Interrupt this process (as Ctrl-C would) a second after ``rank`` logged that its Hang struck."""
    path = log_path(cluster.rank_map.ranks[rank].pid, cluster._dump_dir())

    def watch() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = read_state(path)
            if state is not None and any(f.startswith("Hang") for f in state.faults):
                time.sleep(1.0)  # the others reach the gradient all-reduce
                break
            time.sleep(0.1)
        _thread.interrupt_main()

    threading.Thread(target=watch, daemon=True).start()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["hang_after", "timeout", "interrupt"])
def test_hang_gives_a_report_naming_the_hung_rank_and_the_collective_the_others_wait_in(cluster, how):
    exp = experiment(cluster, steps=3, faults=[lab.Hang(2, at_step=1)],
                     hang_after=HANG_AFTER_S if how == "hang_after" else None)
    expected = {"hang_after": lab.HangError, "timeout": lab.RankTimeoutError, "interrupt": KeyboardInterrupt}[how]
    if how == "interrupt":
        _interrupt_once_hung(cluster, 2)
    with pytest.raises(expected) as info:
        exp.run(timeout=15.0 if how == "timeout" else None)  # setup takes seconds on loaded cores
    report = info.value.report
    assert report.never_arrived == (2,)
    finding = report.findings[0]
    assert finding.startswith("ranks 0, 1, 3 wait in all_reduce #") and "of group dp=[0,1,2,3]" in finding
    assert "rank 2 never entered it (last seen in forward, step 1, micro-batch 0)" in finding
    assert report.rank(2).faults == ("Hang(rank=2, at_step=1) struck at step 1",)
    if how != "interrupt":  # a rank sends its flight summary once quiet for a second; the interrupt may come sooner
        assert report.flight_never_arrived == (2,), report.flight  # torch's own flight recorder agrees
        assert report.flight[0].startswith("gloo:all_reduce #") and "ranks 0, 1, 3 entered it" in report.flight[0]
    if how == "hang_after":
        assert report.rank(2).silent_s <= HANG_AFTER_S + REPORT_SLACK_S  # taken this soon after rank 2 went quiet
        assert info.value.rank == 2 and info.value.late == [2]
        assert str(info.value).startswith(f"no rank made progress for {HANG_AFTER_S:g} s (hang_after): " + finding)
    assert len(experiment(cluster, steps=1).run().losses) == 1  # the pool trains again


@pytest.mark.slow
def test_a_hang_is_diagnosed_from_the_ranks_beacons_alone_as_for_ranks_on_other_hosts(cluster, monkeypatch):
    monkeypatch.setattr(lab.pool.hang_report, "read_state", lambda path: None)  # no state file readable from here
    with pytest.raises(lab.HangError) as info:
        experiment(cluster, steps=3, faults=[lab.Hang(2, at_step=1)], hang_after=HANG_AFTER_S).run()
    report = info.value.report
    assert report.never_arrived == (2,) and report.flight_never_arrived == (2,)
    assert "rank 2 never entered it (last seen in forward, step 1, micro-batch 0)" in report.findings[0]


@pytest.mark.slow
def test_crash_gives_a_rank_error_naming_the_rank(cluster):
    with pytest.raises(lab.RankError) as info:
        experiment(cluster, steps=3, faults=[lab.Crash(1, at_step=1)]).run()
    error = info.value
    assert error.rank == 1 and error.failures[0].ename == "InjectedCrash"
    assert str(error).startswith("rank 1 on host") and "lab.Crash: rank 1 raised on purpose" in str(error)
    assert all(f.collateral for f in error.failures[1:])


@pytest.mark.slow
def test_kill_gives_a_dead_rank_error(cluster):
    victim = cluster.rank_map.ranks[3].pid
    with pytest.raises(lab.DeadRankError) as info:
        experiment(cluster, steps=3, faults=[lab.Kill(3, at_step=1)]).run()
    assert info.value.rank == 3 and f"pid {victim}" in str(info.value)
    assert len(experiment(cluster, steps=1).run().losses) == 1


def _mean_per_rank(result, field: str) -> dict[int, float]:
    rows: dict[int, list[float]] = {}
    for w in result.step_waits:
        if w["step"] > 0:  # step 0 pays DDP's one-off setup
            rows.setdefault(w["rank"], []).append(w[field])
    return {rank: statistics.mean(v) for rank, v in sorted(rows.items())}


@pytest.mark.slow
def test_slow_rank_makes_the_others_wait_in_the_gradient_all_reduce_for_about_their_compute(cluster):
    # Synthetic time: 4 ranks share 2 loaded cores, so real compute would be mostly waiting for a core.
    t = 0.1  # each forward padded to t, each backward to 2t: compute about 3t per step
    base = experiment(cluster, steps=4, synthetic_forward_s=t).run()
    slow = experiment(cluster, steps=4, synthetic_forward_s=t, faults=[lab.Slow(2, 2.0)]).run()
    assert slow.faults == [{"kind": "slow", "rank": 2, "factor": 2.0, "at_step": None}] and base.faults == []
    others = (0, 1, 3)
    before, after = _mean_per_rank(base, "grad_sync_s"), _mean_per_rank(slow, "grad_sync_s")
    compute = _mean_per_rank(slow, "compute_s")
    growth = statistics.mean(after[r] - before[r] for r in others)
    their_compute = statistics.mean(compute[r] for r in others)
    assert abs(growth - their_compute) <= 0.25 * their_compute, (growth, their_compute, before, after)
    assert slow.stragglers() == [2] and base.stragglers() == []
    marked = [row["rank"] for row in rank_rows(slow.progress, 4, finished=True) if row["straggler"]]
    assert marked == [2]  # the dashboard's own rows, from the live progress records


def test_an_unwatched_run_trains_alike_and_its_ranks_publish_nothing(cluster):
    # watch=False is the torchrun-speed switch: the same losses, no collective log written, no waits recorded.
    parallel = lab.Parallel(pp=2, dp=2, microbatches=2)
    watched = lab.Experiment(cluster, lab.GPT(**MODEL), parallel, global_batch=8, steps=2).run(progress=False)
    paths = [log_path(r.pid, cluster._dump_dir()) for r in cluster.rank_map.ranks]
    before = [read_state(p).counter for p in paths]
    bare = lab.Experiment(cluster, lab.GPT(**MODEL), parallel, global_batch=8, steps=2, watch=False).run(progress=False)
    assert bare.losses == watched.losses and watched.step_waits and not bare.step_waits
    assert [read_state(p).counter for p in paths] == before


def test_an_unwatched_held_training_goes_on_like_a_watched_one(cluster):
    model, parallel = lab.GPT(**MODEL), lab.Parallel(dp=2, tp=2)
    with lab.Training(cluster, model, parallel) as watched, lab.Training(cluster, model, parallel, watch=False) as bare:
        first, first_watched = bare.step(2), watched.step(2)
        assert first.losses == first_watched.losses and first_watched.step_waits and not first.step_waits
        assert bare.step(1).losses == watched.step(1).losses
