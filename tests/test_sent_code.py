"""A rank's frames name the notebook cell they came from, whatever file name the serializer gave the code.

cloudpickle >= 3.1.3 renames the file of every code object it sends by value to "<dynamic-code>".
These tests do what it does (``code.replace(co_filename=...)`` on every nested code object), run the
renamed copy, and check that the driver's ``SentCodeBook`` names each frame's cell again. The slow
test in ``test_frames_under_cloudpickle.py`` does the same through real ranks under 3.1.2 and 3.1.3.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import linecache
import types

import pytest

from kernels.watch import stack_report
from lab.pool.frames import render, user_frame
from lab.pool.sent_code import REWRITTEN, SentCodeBook

_cells = 0


def cell(source: str, namespace: dict) -> str:
    """Compile ``source`` as IPython compiles a cell: a made-up file name whose lines live in linecache."""
    global _cells
    _cells += 1
    name = f"<ipython-input-{_cells}-test>"
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    exec(compile(source, name, "exec"), namespace)
    return name


def as_sent(code: types.CodeType) -> types.CodeType:
    """The code object as cloudpickle 3.1.3 rebuilds it on a rank: every file name "<dynamic-code>"."""
    consts = tuple(as_sent(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=REWRITTEN, co_consts=consts)


def on_rank(fn: types.FunctionType, namespace: dict) -> types.FunctionType:
    """``fn`` rebuilt from renamed code, reading renamed copies of the namespace's functions."""
    sent_ns = dict(namespace)
    for key, value in namespace.items():
        if isinstance(value, types.FunctionType):
            sent_ns[key] = types.FunctionType(as_sent(value.__code__), sent_ns, value.__name__)
    return sent_ns[fn.__name__]


def failure_of(fn, *args) -> dict:
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001 - the test wants the failure's record, whatever it is
        stack_report.record_failure(error, skip=1)
        return stack_report.last_failure()
    raise AssertionError("expected a failure")


@pytest.fixture
def nb() -> dict:
    return {"__name__": "__main__"}


def test_a_nested_function_and_a_lambda_inside_a_notebook_function_name_their_cell(nb):
    first = cell("def outer(x):\n    def inner(y):\n        return y / 0\n    return inner(x)\n", nb)
    second = cell("def apply(v):\n    f = lambda w: 1 // w\n    return f(v)\n", nb)
    book = SentCodeBook()
    book.remember(nb["outer"], nb["apply"])
    nested = failure_of(on_rank(nb["outer"], nb), 1)
    assert [f[0] for f in nested["frames"]] == [REWRITTEN, REWRITTEN]
    assert book.restore(nested["frames"], nested["codes"]) == [(first, 4, "outer"), (first, 3, "inner")]
    lam = failure_of(on_rank(nb["apply"], nb), 0)
    assert book.restore(lam["frames"], lam["codes"]) == [(second, 3, "apply"), (second, 2, "<lambda>")]
    shown = render(user_frame(book.restore(lam["frames"])))
    assert "line 2, in <lambda>" in shown and shown.splitlines()[-1].endswith("f = lambda w: 1 // w")


def test_a_notebook_function_called_from_another_cell_is_found_through_the_globals_it_reads(nb):
    helper_cell = cell("def helper(v):\n    return [1][v]\n", nb)
    cell("def uses(v):\n    return helper(v)\n", nb)
    book = SentCodeBook()
    book.remember(nb["uses"])  # only the called function is passed: helper comes with its globals
    failure = failure_of(on_rank(nb["uses"], nb), 3)
    assert book.restore(failure["frames"], failure["codes"])[-1] == (helper_cell, 2, "helper")


def test_two_cells_defining_one_name_are_told_apart_by_first_line_and_the_newest_wins_without_it(nb):
    old = cell("x = 1\ndef step(v):\n    return v / 0\n", nb)
    old_step = nb["step"]
    new = cell("def step(v):\n    w = v\n    return w / 0\n", nb)  # line 3 of both cells is in step
    book = SentCodeBook()
    book.remember(old_step)
    book.remember(nb["step"])
    old_failure = failure_of(types.FunctionType(as_sent(old_step.__code__), nb), 1)
    assert book.restore(old_failure["frames"], old_failure["codes"]) == [(old, 3, "step")]
    assert book.restore(old_failure["frames"]) == [(new, 3, "step")]  # a dumped stack has no first line


def test_closures_partials_methods_classes_and_dataclass_arguments_are_followed(nb):
    name = cell("class Model:\n    def forward(self):\n        return 1 / 0\n"
                "def make():\n    m = Model()\n    return lambda: m.forward()\n", nb)

    @dataclasses.dataclass
    class Config:
        hook: object

    book = SentCodeBook()
    book.remember(functools.partial(nb["make"]), (Config(hook=nb["Model"]().forward),))
    names = {(sent.filename, sent.qualname) for sent in book._codes}
    assert {(name, "Model.forward"), (name, "make"), (name, "make.<locals>.<lambda>")} <= names


def test_library_functions_go_by_reference_and_are_not_recorded():
    book = SentCodeBook()
    book.remember(json.dumps, [json.loads], {"f": functools.partial(json.dumps, indent=2)})
    assert len(book) == 0


def test_frames_with_a_real_file_or_that_match_nothing_are_left_as_they_are(nb):
    cell("def step(v):\n    return v / 0\n", nb)
    book = SentCodeBook()
    book.remember(nb["step"])
    frames = [("/usr/lib/python3/x.py", 2, "step"), (REWRITTEN, 2, "other"), (REWRITTEN, 40, "step")]
    assert book.restore(frames) == frames


def test_a_printed_traceback_names_the_cell_in_python_and_ipython_form(nb):
    name = cell("def step(v):\n    return v / 0\n", nb)
    book = SentCodeBook()
    book.remember(nb["step"])
    text = ('File "<dynamic-code>", line 2, in step\n'
            "File <dynamic-code>:2, in step(***failed resolving arguments***)\n"
            "File <string>:1\n")
    assert book.restore_text(text) == (f'File "{name}", line 2, in step\n'
                                       f"File \"{name}\", line 2, in step(***failed resolving arguments***)\n"
                                       "File <string>:1\n")
