"""Pipeline placement and the schedule rules kernels.parallel.pipeline enforces, in words.

The pipelines' numerics (every schedule on PP 2 and PP 4 against one process, with one
and with two blocks per stage) are in tests/test_layout_parity.py, through the real loop.
"""
from __future__ import annotations

import pytest

from kernels.contract.layout_rules import stage_ids
from kernels.parallel.pipeline import check_schedule


def test_stage_placement_is_looped_or_v():
    assert [stage_ids("1f1b", r, 4, 1) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert stage_ids("interleaved_1f1b", 1, 4, 3) == (1, 5, 9)
    assert stage_ids("looped_bfs", 3, 4, 2) == (3, 7)
    assert [stage_ids("zbv", r, 4, 2) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert stage_ids("dualpipev", 0, 2, 2) == (0, 3)  # rank 0 has first and last


@pytest.mark.parametrize("schedule, pp, spr, m, words", [
    ("gpipe", 2, 2, 4, "one stage per rank"),
    ("zbv", 2, 3, 4, "exactly 2 stages"),
    ("1f1b", 4, 1, 3, ">= number of stages"),
    ("dualpipev", 2, 2, 3, ">= number of stages"),
    ("interleaved_1f1b", 4, 2, 9, "multiple of"),
    ("pipedream", 2, 1, 4, "unknown schedule"),
])
def test_schedule_rules_are_checked_in_words(schedule, pp, spr, m, words):
    with pytest.raises(ValueError, match=words):
        check_schedule(schedule, pp, spr, m)
