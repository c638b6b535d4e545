"""Exercises: a blank cell a student fills in, a hidden solution, and a grader cell that checks it.

A notebook marks the cells of an exercise in their metadata, ``{"lab": {"exercise": name, "role": r}}``:

- ``context``: cells the exercise needs besides itself (the imports, the pool); graded alone, the exercise
  runs only these, its blank and its grader, so a blank is checked without running the whole notebook;
- ``blank``: the cell the student writes, shipped with its answer cut out;
- ``grader``: an asserting cell that fails until the blank is filled in correctly.

The solution is ``notebooks/solutions/<name>.py``: the whole cell, with the part a student writes between
nbgrader's markers (``### BEGIN SOLUTION`` / ``### END SOLUTION``). The blank shipped in the notebook is
that file with each marked part replaced as nbgrader's ``ClearSolutions`` does (a ``# YOUR CODE HERE``
line and a ``raise NotImplementedError``), so the solution is the single source of truth, a test checks
that every shipped blank is the blank of its solution, and a teacher who uses nbgrader can feed it the
solved notebooks (``python -m lab.course.exercises solved notebooks/ OUT``) directly.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
ROLES = ("context", "blank", "grader")
_MARKED = re.compile(rf"^([ \t]*){re.escape(BEGIN)}[^\n]*\n.*?^[ \t]*{re.escape(END)}[^\n]*$", re.M | re.S)


class ExerciseError(ValueError):
    """An exercise whose cells or solution file do not fit the rules above."""


@dataclass(frozen=True)
class Exercise:
    """One exercise of a notebook: the indices of its cells and its solution file."""

    name: str
    notebook: Path
    context: tuple[int, ...]
    blank: int
    grader: int

    @property
    def solution_path(self) -> Path:
        """``solutions/<name>.py`` beside the notebook."""
        return self.notebook.parent / "solutions" / f"{self.name}.py"

    def solution(self) -> str:
        """The solved cell's source, markers included."""
        if not self.solution_path.exists():
            raise ExerciseError(f"exercise {self.name!r} of {self.notebook.name}: no solution at {self.solution_path}")
        return self.solution_path.read_text().rstrip("\n")


def blank_of(solution: str, name: str) -> str:
    """The student's cell: every marked part of ``solution`` cut out, as nbgrader's ClearSolutions does."""
    if BEGIN not in solution:
        raise ExerciseError(f"exercise {name!r}: the solution marks no part with {BEGIN!r} ... {END!r}")
    cut = _MARKED.sub(lambda m: f"{m[1]}# YOUR CODE HERE\n{m[1]}raise NotImplementedError(\"exercise {name}\")",
                      solution)
    if BEGIN in cut or END in cut:
        raise ExerciseError(f"exercise {name!r}: a {BEGIN!r} without its {END!r}, or the other way round")
    return cut


def exercises(notebook: Path) -> list[Exercise]:
    """The exercises of ``notebook``, in the order of their blanks; each has one blank and one grader after it."""
    return _exercises_in(nbformat.read(notebook, as_version=4), notebook)


def _exercises_in(nb: nbformat.NotebookNode, notebook: Path) -> list[Exercise]:
    cells: dict[str, dict[str, list[int]]] = {}
    for i, cell in enumerate(nb.cells):
        mark = cell.metadata.get("lab", {})
        if "exercise" not in mark:
            continue
        if mark.get("role") not in ROLES:
            raise ExerciseError(f"{notebook.name} cell {i}: exercise role {mark.get('role')!r} is not one of {ROLES}")
        cells.setdefault(mark["exercise"], {r: [] for r in ROLES})[mark["role"]].append(i)
    found = []
    for name, by_role in cells.items():
        if len(by_role["blank"]) != 1 or len(by_role["grader"]) != 1 or by_role["grader"][0] < by_role["blank"][0]:
            raise ExerciseError(f"{notebook.name}: exercise {name!r} needs one blank cell and one grader cell after it")
        found.append(Exercise(name, notebook, tuple(by_role["context"]), by_role["blank"][0], by_role["grader"][0]))
    return sorted(found, key=lambda e: e.blank)


def solved(notebook: Path) -> nbformat.NotebookNode:
    """``notebook`` with every blank replaced by its solution (the teacher's copy, and what CI runs)."""
    nb = nbformat.read(notebook, as_version=4)
    for exercise in _exercises_in(nb, notebook):
        nb.cells[exercise.blank].source = exercise.solution()
    return nb


def graded_alone(exercise: Exercise) -> nbformat.NotebookNode:
    """A notebook of the exercise's context cells, its blank as shipped and its grader, in that order."""
    nb = nbformat.read(exercise.notebook, as_version=4)
    nb.cells = [nb.cells[i] for i in (*exercise.context, exercise.blank, exercise.grader)]
    return nb


def _write_solved(source: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.glob("*.ipynb")):
        nbformat.write(solved(path), out / path.name)
        print(f"{out / path.name}: {len(exercises(path))} exercise(s) solved")


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "solved":
        sys.exit("usage: python -m lab.course.exercises solved NOTEBOOKS_DIR OUT_DIR")
    _write_solved(Path(sys.argv[2]), Path(sys.argv[3]))
