"""Alerts from a run: ``on_event=`` on ``lab.Experiment`` and ``lab.Training`` hears of hangs, deaths, spikes,
resumes and finishes.

One hung rank stops a whole job, so whoever runs it has to hear of it at once, not find it in a log
the next morning: large training runs watch each job's last update and post to a chat channel. The
pool already names a dead or hung rank within seconds (``lab.pool.supervise``, ``lab.pool.hang_report``);
this module passes that on, with the rank to blame and the step:

- ``on_event=callable``: called with a ``RunEvent``, on the driver's thread that noticed it;
- ``on_event="https://..."`` (http or https): the event is POSTed as JSON with the standard library
  (``urllib``): ``RunEvent.to_dict()`` plus a one-line ``"text"``, the field a Slack or Mattermost
  incoming webhook shows.

The kinds (``KINDS``):

- "hang": a call timed out or stalled (``lab.RankTimeoutError``, ``lab.HangError``); the rank that kept the
  others waiting, and its step when the run was watched;
- "death": a rank's engine died (``lab.DeadRankError``); the dead rank and the step it was in;
- "error": a rank raised (any other ``lab.RankError``);
- "spike": a loss spike or NaN the spike guard acted on, one per record of ``RunResult.spikes``;
- "resume": ``Training(auto_resume=True)`` reloaded its last complete checkpoint (``lab.run.auto_resume``);
  the step it went back to;
- "finish": a ``run()`` or ``step()`` returned; the steps done and the last loss.

A hook that fails (it raises, the URL does not answer or answers an error) never stops training: the
first failure warns (``EventHookWarning``), later ones are dropped without a word.
"""
from __future__ import annotations

import dataclasses
import json
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kernels.contract.config_rules import Problem
from lab.errors import DeadRankError, RankError, RankTimeoutError

KINDS = ("hang", "death", "error", "spike", "resume", "finish")
POST_TIMEOUT_S = 5.0  # a webhook that does not answer holds the driver this long, once per event


class EventHookWarning(UserWarning):
    """``on_event`` failed; training goes on (said once per run)."""


@dataclass(frozen=True)
class RunEvent:
    """One thing that happened to a run, as the driver noticed it (plain JSON through ``to_dict``)."""

    kind: str  # one of KINDS
    step: int | None  # the global step it concerns (None: not known, e.g. a death outside any watched step)
    rank: int | None  # the rank to blame (None: the whole run, e.g. a spike of the global loss or a finish)
    time: float  # time.time() when the driver noticed it
    message: str
    run: str = ""  # which run: its layout, e.g. "DP2 x TP2"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        where = "" if self.step is None else f" at step {self.step}"
        who = "" if self.rank is None else f", rank {self.rank}"
        return f"[lab{' ' + self.run if self.run else ''}] {self.kind}{where}{who}: {self.message}"


def on_event_problems(on_event: Any) -> list[Problem]:
    """[on-event]: None, a callable, or an http(s) URL to post to."""
    if on_event is None or callable(on_event):
        return []
    if isinstance(on_event, str):
        url = urllib.parse.urlsplit(on_event)
        if url.scheme in ("http", "https") and url.netloc:
            return []
    return [("on-event", "on_event must be None, a callable taking a lab.RunEvent, or an http(s) URL to post "
             f"each event to as JSON, got {on_event!r}")]


def post_json(url: str, body: dict[str, Any], timeout: float = POST_TIMEOUT_S) -> int:
    """POST ``body`` as JSON to ``url``; returns the HTTP status (an error status raises ``urllib.error.HTTPError``)."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.status


class EventSink:
    """Where a run's events go: ``on_event`` (a callable, a URL, or None: nowhere)."""

    def __init__(self, on_event: Callable[[RunEvent], Any] | str | None, run: str = "") -> None:
        self.on_event, self.run = on_event, run
        self._warned = False

    def emit(self, kind: str, message: str, *, step: int | None = None, rank: int | None = None) -> RunEvent:
        """Make the event and hand it to ``on_event``; never raises for the hook's sake."""
        event = RunEvent(kind, step, rank, time.time(), message, self.run)
        if self.on_event is None:
            return event
        try:
            if callable(self.on_event):
                self.on_event(event)
            else:
                post_json(self.on_event, {**event.to_dict(), "text": str(event)})
        except Exception as error:  # a broken alert must never break the training it reports on
            if not self._warned:
                self._warned = True
                warnings.warn(f"on_event failed ({error!r}) for {event}; training goes on, and later failures of "
                              "this hook are not reported", EventHookWarning, stacklevel=3)
        return event

    def failure(self, error: BaseException) -> RunEvent | None:
        """The "hang", "death" or "error" event of an error from the ranks (None for anything else)."""
        if not isinstance(error, RankError):
            return None
        kind = "hang" if isinstance(error, RankTimeoutError) else "death" if isinstance(error, DeadRankError) \
            else "error"
        rank = blamed_rank(error)
        return self.emit(kind, str(error).splitlines()[0], step=_step_of(error, rank), rank=rank)

    def finished(self, result: Any) -> None:
        """After a run or step call: one "spike" event per spike guard record, then "finish"."""
        for spike in getattr(result, "spikes", None) or []:
            self.emit("spike", _spike_message(spike), step=spike.get("step"))
        done = result.first_step + len(result.losses)
        last = f", last loss {result.losses[-1]:.4f}" if result.losses else ""
        self.emit("finish", f"{len(result.losses)} steps trained, {done} in all{last}", step=done)


def blamed_rank(error: RankError) -> int:
    """The rank a failure is blamed on: after a timeout, the first that kept the others waiting; else the cause."""
    late = getattr(error, "late", None)
    return late[0] if late else error.rank


def _step_of(error: RankError, rank: int) -> int | None:
    """The step ``rank`` was in, from the error's hang report (taken when the run was watched)."""
    report = getattr(error, "report", None)
    if report is None or not 0 <= rank < len(report.ranks):
        return None
    step = report.rank(rank).step
    return step if step >= 0 else None


def _spike_message(spike: dict[str, Any]) -> str:
    loss, median = spike.get("loss"), spike.get("median")
    size = f"loss {loss:.4g} against a running median of {median:.4g}" if isinstance(loss, float) and \
        isinstance(median, float) else f"loss {loss}"
    return f"{size} ({spike.get('reason', 'spike')}): {spike.get('action', 'recorded')}"
