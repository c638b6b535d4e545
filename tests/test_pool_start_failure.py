"""Engines that die while a pool starts: the lab says what they printed, and tries once more.

The engines here run a command that prints a line and exits 1, for the first start (the lab then
starts the pool again and it works) or for every start (the error carries that line).
"""
from __future__ import annotations

import sys
import warnings

import pytest

import lab
from lab.pool import launch, lifetime
from tests.launcher_checks import rank_sum

CRASH = [sys.executable, "-c", "import sys; print('engine could not start: out of widgets', flush=True); sys.exit(1)"]


def engines_crash_in_the_first(starts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the engines of this process's next ``starts`` pool starts print a line and exit 1."""
    plain_watch, calls = lifetime.watch_driver, []

    def crashing_engines(config):
        plain_watch(config)
        calls.append(1)
        if len(calls) <= starts:
            config.LocalEngineSetLauncher.engine_cmd = CRASH
        return config

    monkeypatch.setattr(lifetime, "watch_driver", crashing_engines)


def stopped_sources(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The PIDs of every start the lab cleans up from now on, as it cleans it up."""
    plain_stop, stopped = launch.stop_source, []

    def recording_stop(source, *args, **kwargs):
        killed = plain_stop(source, *args, **kwargs)
        stopped.append(set(source.pids))
        return killed

    monkeypatch.setattr(launch, "stop_source", recording_stop)
    return stopped


def start(n: int = 2) -> lab.Cluster:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", lab.OversubscribedWarning)
        return lab.start(n=n, backend="gloo", timeout=60, activate=False, spare_engines=0)


@pytest.mark.slow  # a failed start, then a whole pool
def test_engines_that_die_while_starting_are_started_once_more_with_a_warning_saying_what_they_printed(monkeypatch):
    engines_crash_in_the_first(1, monkeypatch)
    with pytest.warns(lab.PoolStartWarning, match="(?s)engines exited while the pool started.*"
                      "engine 0 .*out of widgets.*Starting the pool once more"):
        pool = start()
    try:
        assert pool.run(rank_sum) == [1.0, 1.0]  # ranks 0 and 1
    finally:
        pool.stop()


def test_engines_that_die_at_every_start_raise_with_their_output_and_leave_no_process(monkeypatch):
    engines_crash_in_the_first(2, monkeypatch)
    stopped = stopped_sources(monkeypatch)
    with pytest.warns(lab.PoolStartWarning, match="out of widgets"), \
            pytest.raises(lab.PoolStartError, match="(?s)exit_code.*engine 1 printed:\nengine could not start") as info:
        start()
    assert info.value.engines_exited
    assert len(stopped) == 2 and all(stopped)  # both starts, each with its controller at least
    assert not [pid for pids in stopped for pid in pids if launch.is_alive(pid)]
