"""``Record.to_dict``: a flat record skips the JSON round trip and gives what the round trip would have given."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from kernels.contract.records import Record
from kernels.contract.watch_records import StepProgress


def _round_trip(record: Record) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(record)))


def _step(**changes) -> StepProgress:
    fields = dict(rank=1, step=3, steps=10, loss=2.5, step_s=0.04, tokens_per_s=12800.0, collective_s=0.01,
                  compute_s=0.03, memory_bytes=1 << 33, memory_kind="rss", sent_at=1.7e9)
    return StepProgress(**{**fields, **changes})


@pytest.mark.parametrize("record", [_step(), _step(loss=math.inf), _step(memory_kind="cuda", collective_s=0.0)])
def test_a_flat_record_gives_the_round_trips_dict(record):
    out = record.to_dict()
    expected = _round_trip(record)
    assert out == expected and [type(v) for v in out.values()] == [type(v) for v in expected.values()]
    assert StepProgress.from_dict(out) == record


def test_a_value_json_would_change_or_refuse_still_takes_the_round_trip():
    numpy = pytest.importorskip("numpy")
    assert type(_step(loss=numpy.float64(2.5)).to_dict()["loss"]) is float  # a subclass: the round trip made it a float
    with pytest.raises(TypeError):  # json refuses it, as before
        _step(memory_kind=object()).to_dict()
