"""The course as a static book: built from the executed notebooks, every view a figure, no object repr anywhere.

The slow test builds the whole book from ``build/executed/`` (what tests/test_notebooks.py and the browser run of
notebook 05 leave there; tests/conftest.py runs this module last); a notebook not there is executed here first.
The fast tests check the staging and the page checks on hand-made notebooks and pages shaped as myst-nb writes them.
"""
from __future__ import annotations

import base64
import os
import time

import nbformat
import pytest

from lab.course.book import ROOT, WIDGET_VIEW, build_book, check_page, prepare, stage
from tests.notebook_runs import EXECUTED, NOTEBOOKS, execute, runnable_here
from widgets.static_figure import VIEW_KEY, note_png

BOOK_OUT = ROOT / "build" / "book"  # kept after the run: the HTML is in build/book/_build/html
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
REPR = "<widgets.pipeline_timeline.PipelineTimeline object at 0x7f3a2c1d5e90>"


def view_output(png: bool = True) -> dict:
    """A lab view's display output as an executed notebook holds it."""
    data = {WIDGET_VIEW: {"model_id": "ab12", "version_major": 2, "version_minor": 1},
            "text/plain": "PipelineTimeline: 4 ranks, one traced step"}
    if png:
        data["image/png"] = base64.b64encode(note_png("a timeline")).decode()
    return nbformat.v4.new_output("display_data", data=data, metadata={VIEW_KEY: "PipelineTimeline"})


def notebook(*outputs: dict, blank: bool = False) -> nbformat.NotebookNode:
    """A markdown title, then one code cell holding ``outputs``."""
    cell = nbformat.v4.new_code_cell("view", outputs=list(outputs))
    if blank:
        cell.metadata["lab"] = {"exercise": "ring", "role": "blank"}
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A chapter"), cell])


def page(tmp_path, *outputs_html: str) -> "os.PathLike":
    """A built page as myst-nb writes it: one ``div.cell`` per code cell, its outputs in ``div.cell_output``."""
    cells = "".join(f'<div class="cell docutils container"><div class="cell_input docutils container"><pre>view</pre>'
                    f'</div><div class="cell_output docutils container">{out}</div></div>' for out in outputs_html)
    (tmp_path / "_images").mkdir(exist_ok=True)
    (tmp_path / "_images" / "fig.png").write_bytes(note_png("a timeline"))
    (tmp_path / "notebooks").mkdir(exist_ok=True)
    path = tmp_path / "notebooks" / "05_pipe.html"
    path.write_text(f"<html><body><h1>A chapter</h1>{cells}</body></html>")
    return path


IMG = '<img alt="fig" src="../_images/fig.png" />'


def text(s: str) -> str:
    return f'<div class="output text_plain highlight-myst-ansi notranslate"><pre>{s}</pre></div>'


def test_staging_drops_widget_entries_and_stale_bars_and_folds_solutions():
    bar = nbformat.v4.new_output("display_data", data={WIDGET_VIEW: {"model_id": "cd34"},
                                                       "text/plain": "training:   0%|   | 0/5"})
    nb = notebook(view_output(), bar, blank=True)
    nb.metadata["widgets"] = {WIDGET_STATE: {"state": {}}}
    staged = prepare(nb)
    outputs = staged.cells[1].outputs
    assert len(outputs) == 1 and set(outputs[0].data) == {"text/plain", "image/png"}  # the bar said 0% forever
    assert staged.cells[1].metadata.tags == ["hide-input"] and "widgets" not in staged.metadata
    assert WIDGET_VIEW in nb.cells[1].outputs[0].data  # the executed notebook itself is left as it was


def test_a_view_drawn_as_its_figure_passes(tmp_path):
    assert check_page("05_pipe", page(tmp_path, IMG), prepare(notebook(view_output()))) == []


def test_an_object_repr_fails_naming_the_notebook_and_cell(tmp_path):
    nb = prepare(notebook(nbformat.v4.new_output("execute_result", data={"text/plain": REPR}, execution_count=1)))
    problems = check_page("05_pipe", page(tmp_path, text(REPR.replace("<", "&lt;").replace(">", "&gt;"))), nb)
    assert [(p.notebook, p.where) for p in problems] == [("05_pipe", "cell 1")]
    assert "object repr" in problems[0].what and "object at 0x7f3a2c1d5e90" in problems[0].what


def test_a_view_without_its_figure_fails_as_text(tmp_path):
    problems = check_page("05_pipe", page(tmp_path, text("PipelineTimeline: 4 ranks")),
                          prepare(notebook(view_output(png=False))))
    assert len(problems) == 1 and "a view shows as text: PipelineTimeline" in problems[0].what


def test_a_missing_image_page_or_notebook_fails(tmp_path):
    html = page(tmp_path, IMG)
    (tmp_path / "_images" / "fig.png").unlink()
    assert "image ../_images/fig.png is missing" in str(check_page("05_pipe", html, prepare(notebook(view_output()))))
    assert "not in the book" in str(check_page("06_x", tmp_path / "06_x.html", notebook()))
    executed = tmp_path / "executed"
    executed.mkdir()
    nbformat.write(notebook(view_output()), executed / "05_pipe.ipynb")
    staged, missing = stage(executed, tmp_path / "src", ["05_pipe", "06_x"])
    assert list(staged) == ["05_pipe"] and [(p.notebook, "not executed" in p.what) for p in missing] == [("06_x", True)]
    assert (tmp_path / "src" / "_toc.yml").exists() and (tmp_path / "src" / "docs" / "design.md").exists()


@pytest.mark.slow
@pytest.mark.timeout(1800)  # run alone, it first executes every notebook (about 10 minutes here); in CI they are done
def test_the_book_builds_from_the_executed_notebooks_with_every_view_a_figure():
    names = [p.stem for p in NOTEBOOKS if runnable_here(nbformat.read(p, as_version=4))]
    for path in NOTEBOOKS:  # run alone, or after a notebook test that skipped: execute what is not there
        if path.stem in names and not (EXECUTED / path.name).exists():
            execute(path)
    began = time.perf_counter()
    html_dir, problems = build_book(EXECUTED, BOOK_OUT, names)
    print(f"book of {len(names)} notebooks built and checked in {time.perf_counter() - began:.0f} s: {html_dir}")
    assert not problems, "\n".join(map(str, problems))
    staged = [nbformat.read(BOOK_OUT / "src" / "notebooks" / f"{n}.ipynb", as_version=4) for n in names]
    views = sum(VIEW_KEY in o.get("metadata", {}) for nb in staged for c in nb.cells for o in c.get("outputs", []))
    assert views, "no view in any notebook: the figure checks would pass vacuously"
