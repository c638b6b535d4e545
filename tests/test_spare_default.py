"""A shared server sets the default number of spare engines once, for every student's ``lab.start``."""
from __future__ import annotations

import pytest

from lab.pool.start_or_connect import SPARES_VARIABLE, default_spare_engines


def test_without_the_variable_one_spare(monkeypatch):
    monkeypatch.delenv(SPARES_VARIABLE, raising=False)
    assert default_spare_engines() == 1


def test_the_variable_sets_the_default(monkeypatch):
    monkeypatch.setenv(SPARES_VARIABLE, "0")
    assert default_spare_engines() == 0


def test_a_variable_that_is_not_a_number_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(SPARES_VARIABLE, "none")
    with pytest.raises(ValueError, match="CLUSTER_LAB_SPARE_ENGINES must be a whole number"):
        default_spare_engines()
