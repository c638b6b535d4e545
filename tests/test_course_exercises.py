"""Exercises: every blank is its solution with the student's part cut out, and each grader fails on the blank.

The notebooks run with their solutions filled in (tests/notebook_runs.py), so each grader passing on its
solution is checked there; here each exercise runs alone with the blank left in, and must fail in its grader.
"""
from __future__ import annotations

import nbformat
import pytest
from nbclient.exceptions import CellExecutionError

from lab.course.exercises import BEGIN, END, ExerciseError, blank_of, exercises, graded_alone, solved
from tests.notebook_runs import NOTEBOOKS, ROOT, client

EXERCISES = [e for path in NOTEBOOKS for e in exercises(path)]
SOLUTIONS = ROOT / "notebooks" / "solutions"


def test_the_course_has_at_least_six_exercises_in_distinct_notebooks():
    assert len(EXERCISES) >= 6, [e.name for e in EXERCISES]
    assert len({e.notebook for e in EXERCISES}) >= 6
    assert len({e.name for e in EXERCISES}) == len(EXERCISES), "exercise names must be unique"


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.name)
def test_the_shipped_blank_is_the_solution_with_the_student_part_cut_out(exercise):
    nb = nbformat.read(exercise.notebook, as_version=4)
    shipped = nb.cells[exercise.blank].source.rstrip("\n")
    assert shipped == blank_of(exercise.solution(), exercise.name), (
        f"{exercise.notebook.name}: the blank of {exercise.name!r} is not the blank of {exercise.solution_path.name}; "
        "edit the solution and regenerate the blank with lab.course.exercises.blank_of")
    assert "NotImplementedError" in shipped and BEGIN not in shipped


def test_every_solution_file_belongs_to_an_exercise():
    assert sorted(p.stem for p in SOLUTIONS.glob("*.py")) == sorted(e.name for e in EXERCISES)


def test_solved_notebooks_differ_from_the_shipped_ones_only_at_their_blanks():
    for path in NOTEBOOKS:
        shipped, answers = nbformat.read(path, as_version=4), solved(path)
        blanks = {e.blank for e in exercises(path)}
        changed = {i for i, (a, b) in enumerate(zip(shipped.cells, answers.cells)) if a.source != b.source}
        assert changed == blanks, (path.name, changed, blanks)


def test_blank_of_cuts_every_marked_part_at_its_indent_and_keeps_the_rest():
    solution = f"def f(x):\n    y = 1\n    {BEGIN}\n    y = x\n    {END}\n    for i in range(2):\n        {BEGIN}\n        y += i\n        {END}\n    return y"
    assert blank_of(solution, "f") == (
        'def f(x):\n    y = 1\n    # YOUR CODE HERE\n    raise NotImplementedError("exercise f")\n'
        '    for i in range(2):\n        # YOUR CODE HERE\n        raise NotImplementedError("exercise f")\n    return y')


@pytest.mark.parametrize("solution", ["def f():\n    return 1", f"def f():\n    {BEGIN}\n    return 1"])
def test_a_solution_without_a_closed_marked_part_is_refused_by_name(solution):
    with pytest.raises(ExerciseError, match="'f'"):
        blank_of(solution, "f")


def test_an_exercise_without_its_grader_is_refused(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"lab": {"exercise": "lonely", "role": "blank"}})]
    nbformat.write(nb, tmp_path / "n.ipynb")
    with pytest.raises(ExerciseError, match="lonely.*one grader"):
        exercises(tmp_path / "n.ipynb")


@pytest.mark.slow  # each starts a kernel and, for most, a pool of 4 ranks
@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.name)
def test_with_the_blank_left_in_the_grader_fails(exercise):
    nb = graded_alone(exercise)
    kernel = client(nb, exercise.notebook)
    with kernel.setup_kernel():
        for i, cell in enumerate(nb.cells[:-1]):  # the context and the blank itself run
            kernel.execute_cell(cell, i)
        with pytest.raises(CellExecutionError) as failed:
            kernel.execute_cell(nb.cells[-1], len(nb.cells) - 1)
    assert "NotImplementedError" in str(failed.value) or "AssertionError" in str(failed.value), str(failed.value)[-2000:]
