"""Every notebook is a lesson: goals and prerequisites before its first cell runs, a theory section that cites
a primary source, and discussion questions after its last (asserting) cell."""
from __future__ import annotations

import re

import nbformat
import pytest

from tests.notebook_runs import NOTEBOOKS

# A citation as the notebooks write one: authors, then a year, e.g. "Rajbhandari et al. 2020" or
# "Huang et al., 2019", or an arXiv identifier.
CITATION = re.compile(r"(et al\.?,?\s*\(?(19|20)\d\d|arXiv:\d{4}\.\d{4,5}|\b[A-Z][a-z]+ (and|&) [A-Z][a-z]+,? \(?(19|20)\d\d)")


def _markdown_before_and_after_code(path):
    nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    md = [(i, c.source) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]
    return md, code[0], code[-1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_goals_and_prerequisites_come_before_the_first_code_cell(path):
    md, first, _ = _markdown_before_and_after_code(path)
    opening = "\n".join(s for i, s in md if i < first)
    assert "**Goals" in opening, f"{path.name}: no **Goals** before the first code cell"
    assert "**Prerequisites" in opening, f"{path.name}: no **Prerequisites** before the first code cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_theory_section_cites_a_primary_source(path):
    md, _, _ = _markdown_before_and_after_code(path)
    theory = [s for _, s in md if s.lstrip().startswith("## Theory")]
    assert theory, f"{path.name}: no '## Theory' section"
    assert CITATION.search("\n".join(theory)), f"{path.name}: its theory section cites no source (authors and year)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_discussion_questions_follow_the_last_code_cell(path):
    md, _, last = _markdown_before_and_after_code(path)
    questions = [s for i, s in md if i > last and s.lstrip().startswith("## Questions")]
    assert questions, f"{path.name}: no '## Questions' after the last code cell"
    assert questions[0].count("?") >= 3, f"{path.name}: fewer than three questions"
