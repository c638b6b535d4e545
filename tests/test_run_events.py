"""on_event: a callable or a webhook URL hears of hangs, deaths, spikes, resumes and finishes, and never breaks a run.

The webhook is a real HTTP server on 127.0.0.1 in a thread of this process; the posts go through the
standard library, as they would to a Slack incoming webhook. The torch-free parts run without ranks; one
slow test runs an Experiment on the shared pool and hears its finish through the server.
"""
from __future__ import annotations

import json
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

import lab
from kernels.contract.pool_records import RankFailure
from lab.errors import DeadRankError, HangError, RankError, Recovery
from lab.pool.hang_report import RankDoing, build_report
from lab.run.events import KINDS, EventHookWarning, EventSink, RunEvent, on_event_problems

TINY = dict(layers=2, d_model=32, heads=4, d_ff=64, vocab=64, seq_len=16)


class Webhook:
    """An HTTP server on a free port of 127.0.0.1 that keeps every JSON body posted to it."""

    def __init__(self) -> None:
        self.posts: list[dict] = []
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append({"content_type": self.headers["Content-Type"], **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:  # keep the test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self) -> "Webhook":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook(monkeypatch):
    monkeypatch.setenv("no_proxy", "127.0.0.1")  # urllib would send a loopback post through a proxy otherwise
    with Webhook() as hook:
        yield hook


def _failure(rank: int, ename: str = "EngineDied") -> RankFailure:
    return RankFailure(rank, "vm", ename, "the engine process is gone", "")


def _report(steps: dict[int, int]) -> lab.HangReport:
    return build_report([RankDoing(r, "in compute", f"forward, step {s}, micro-batch 0", step=s)
                         for r, s in sorted(steps.items())], "test")


def test_events_are_posted_as_json_to_a_local_webhook_with_a_text_line(webhook):
    sink = EventSink(webhook.url, run="DP2")
    sink.emit("resume", "went back to step 2", step=2)
    sink.finished(SimpleNamespace(first_step=2, losses=[3.5, 3.25], spikes=[]))
    assert [p["kind"] for p in webhook.posts] == ["resume", "finish"]
    resume, finish = webhook.posts
    assert resume["content_type"] == "application/json"
    assert resume["step"] == 2 and resume["rank"] is None and resume["run"] == "DP2"
    assert resume["text"] == "[lab DP2] resume at step 2: went back to step 2"  # what Slack shows
    assert finish["step"] == 4 and "last loss 3.2500" in finish["message"] and finish["time"] >= resume["time"]


def test_a_death_and_a_hang_name_the_rank_to_blame_and_its_step_from_the_report():
    heard: list[RunEvent] = []
    sink = EventSink(heard.append)
    death = DeadRankError([_failure(1), _failure(0, "RuntimeError")], "rank 1 (host vm) died",
                          Recovery(replaced={1: (100, 200)}), report=_report({0: 3, 1: 3}))
    hang = HangError([RankFailure(r, "vm", "Timeout", "waited", "", collateral=r != 2) for r in (0, 1, 2)],
                     "no rank made progress", Recovery(), late=[2], report=_report({0: 5, 1: 5, 2: 4}))
    crash = RankError([RankFailure(3, "vm", "InjectedCrash", "raised on purpose", "")])
    for error in (death, hang, crash, KeyboardInterrupt()):
        sink.failure(error)
    assert [(e.kind, e.rank, e.step) for e in heard] == [("death", 1, 3), ("hang", 2, 4), ("error", 3, None)]
    assert heard[0].message == "rank 1 (host vm) died"
    assert {e.kind for e in heard} <= set(KINDS)


def test_each_spike_record_is_one_spike_event_before_the_finish():
    heard: list[RunEvent] = []
    spikes = [{"step": 4, "loss": 40.0, "median": 3.5, "reason": "loss above 3x the median", "action": "skipped"},
              {"step": 6, "loss": float("nan"), "median": 3.4, "reason": "nan", "action": "rolled back"}]
    EventSink(heard.append).finished(SimpleNamespace(first_step=0, losses=[3.5] * 8, spikes=spikes))
    assert [(e.kind, e.step) for e in heard] == [("spike", 4), ("spike", 6), ("finish", 8)]
    assert "40" in heard[0].message and "skipped" in heard[0].message and "rolled back" in heard[1].message


def test_a_broken_webhook_or_callable_only_warns_once_and_the_run_goes_on():
    def broken(event):
        raise RuntimeError("chat service down")

    for target in ("http://127.0.0.1:9/nothing-listens-here", broken):
        sink = EventSink(target)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                assert sink.emit("finish", "done", step=step).step == step  # never raises
        assert [type(w.message) for w in caught] == [EventHookWarning], target


def test_on_event_must_be_a_callable_or_an_http_url():
    assert on_event_problems(None) == on_event_problems(print) == on_event_problems("https://hooks.example/x") == []
    for bad in ("ftp://hooks.example/x", "hooks.example", 3):
        assert [rule for rule, _ in on_event_problems(bad)] == ["on-event"]


@pytest.mark.slow
def test_an_experiment_posts_its_finish_to_the_webhook_and_a_callable_hears_it_too(cluster, webhook):
    model, parallel = lab.GPT(**TINY), lab.Parallel(dp=4)
    result = lab.Experiment(cluster, model, parallel, steps=2, on_event=webhook.url).run(progress=False)
    assert [(p["kind"], p["step"]) for p in webhook.posts] == [("finish", 2)]
    assert webhook.posts[0]["run"] == "DP4, ZeRO-0"
    heard: list[RunEvent] = []
    lab.Experiment(cluster, model, parallel, steps=2, on_event=heard.append).run()  # through a RunHandle
    assert [(e.kind, e.step) for e in heard] == [("finish", 2)]
    assert f"{result.losses[-1]:.4f}" in heard[0].message
