"""The rank side of %%px: a cell's source runs in a namespace like an IPython cell, its output captured."""
from __future__ import annotations

import traceback

import pytest

from kernels.engine import cell


def test_cell_defines_names_in_the_namespace_and_returns_its_last_expression():
    ns = {"rank": 2}
    out = cell.run_cell("x = [rank] * 3\nprint('x is', x)\nsum(x)", "<cell a>", ns)
    assert ns["x"] == [2, 2, 2]
    assert out.stdout == "x is [2, 2, 2]\n"
    assert out.value == {"text/plain": "6"}
    assert cell.run_cell("x + [1]", "<cell b>", ns).value == {"text/plain": "[2, 2, 2, 1]"}


def test_trailing_semicolon_or_a_statement_last_gives_no_value():
    ns: dict = {}
    assert cell.run_cell("1 + 1;  # hidden, as in IPython", "<cell>", ns).value is None
    assert cell.run_cell("y = 3", "<cell>", ns).value is None
    assert cell.run_cell("None", "<cell>", ns).value is None
    assert cell.run_cell("", "<cell>", ns).value is None


def test_stderr_is_captured_apart_from_stdout():
    out = cell.run_cell("import sys\nprint('out')\nprint('err', file=sys.stderr)", "<cell>", {})
    assert (out.stdout, out.stderr) == ("out\n", "err\n")


def test_a_raising_cell_keeps_what_it_wrote_and_its_traceback_shows_the_cell_line():
    with pytest.raises(ZeroDivisionError) as caught:
        cell.run_cell("print('before')\nz = 1 / 0", "<px cell 7>", {})
    text = "".join(traceback.format_exception(caught.value))
    assert '"<px cell 7>", line 2' in text and "z = 1 / 0" in text
    partial = cell.take_last_output()
    assert partial.stdout == "before\n" and partial.value is None
    assert cell.take_last_output() is None  # taken once
