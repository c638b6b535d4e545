"""The course as a static book: Jupyter Book 1 built from notebooks executed elsewhere, then checked for figures.

``python -m lab.course.book EXECUTED_DIR OUT_DIR`` stages ``book/`` (config, table of contents, intro),
``docs/design.md`` (the notebooks link to its sections) and every notebook of ``notebooks/`` as executed in
EXECUTED_DIR (CI's notebook runs write them to ``build/executed/``, tests/notebook_runs.py), then runs
``jupyter-book build``, which never executes a cell (``execute_notebooks: "off"``). The HTML lands in
``OUT_DIR/_build/html``. Staged, each notebook loses what only a kernel can show:

- widget state and every ``application/vnd.jupyter.widget-view+json`` output entry: no state is saved, so a
  view shows its ``image/png`` (``widgets.static_figure``); any other widget (a progress bar) is left out, as
  its text is only what it said when first displayed;
- an exercise's solution input (``lab.role == "blank"``, ``lab.course.exercises``) is folded away
  (``hide-input``): a reader clicks to see it.

Then every page is checked (``check_book``), and the command fails naming the notebook and the cell when a
notebook is missing, an output shows an object repr (``object at 0x``), a view shows as text instead of
its figure, a figure is missing from its cell, or an image file is missing.
"""
from __future__ import annotations

import argparse
import copy
import html
import importlib.util
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

import nbformat

from widgets.static_figure import VIEW_KEY

ROOT = Path(__file__).resolve().parents[2]
BOOK, NOTEBOOKS, DESIGN = ROOT / "book", ROOT / "notebooks", ROOT / "docs" / "design.md"
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
FIGURE_TYPES = ("image/png", "image/jpeg", "image/svg+xml")
OBJECT_REPR = re.compile(r"<?[\w.]+ object at 0x[0-9a-fA-F]+>?")


@dataclass(frozen=True)
class Problem:
    """One thing a reader of the built book would see broken."""

    notebook: str
    where: str  # "cell 12" (the notebook's cell index), or "page"
    what: str

    def __str__(self) -> str:
        return f"{self.notebook}, {self.where}: {self.what}"


def prepare(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of an executed notebook as the book shows it: no widget state or widget-view entries, and each
    exercise's solved cell tagged ``hide-input``."""
    out = copy.deepcopy(nb)
    out.metadata.pop("widgets", None)
    for cell in out.cells:
        if cell.metadata.get("lab", {}).get("role") == "blank":
            tags = cell.metadata.setdefault("tags", [])
            if "hide-input" not in tags:
                tags.append("hide-input")
        if "outputs" in cell:
            cell.outputs = [o for o in cell.outputs if not _stateless_widget(o)]
        for output in cell.get("outputs", []):
            output.get("data", {}).pop(WIDGET_VIEW, None)
    return out


def _stateless_widget(output: dict) -> bool:
    """A widget that is no lab view and has no figure (a progress bar, a slider): with no state saved, its text
    is what it said when first displayed (a bar at 0%), so the book leaves it out."""
    data = output.get("data", {})
    return WIDGET_VIEW in data and not expected_figures(output)


def expected_figures(output: dict) -> int:
    """1 where a reader must see ``output`` as a figure: it holds an image, or it is a lab view."""
    return int(any(k in output.get("data", {}) for k in FIGURE_TYPES) or VIEW_KEY in output.get("metadata", {}))


class _Page(HTMLParser):
    """The code cells of a built page in order (myst-nb's ``div.cell``), each with the images and the text of its
    outputs (``div.cell_output``), and the count of live-widget scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: list[dict] = []
        self._divs: list[set[str]] = []  # the classes of each open div
        self.widget_views = 0

    def _in_output(self) -> bool:
        return bool(self.cells) and any("cell_output" in classes for classes in self._divs)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "div":
            self._divs.append(set((a.get("class") or "").split()))
            if "cell" in self._divs[-1]:
                self.cells.append({"images": [], "text": []})
        elif tag == "img" and self._in_output():
            self.cells[-1]["images"].append(a.get("src") or "")
        elif tag == "script" and a.get("type") == WIDGET_VIEW:
            self.widget_views += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "div" and self._divs:
            self._divs.pop()

    def handle_data(self, data: str) -> None:
        if self._in_output():
            self.cells[-1]["text"].append(data)


def check_page(name: str, page: Path, nb: nbformat.NotebookNode) -> list[Problem]:
    """What is broken on the built ``page`` of notebook ``name`` (``nb`` as staged, see ``prepare``)."""
    if not page.exists():
        return [Problem(name, "page", f"no page {page.name}: the notebook is not in the book")]
    parsed = _Page()
    parsed.feed(page.read_text(encoding="utf-8"))
    problems = []
    if parsed.widget_views:
        problems.append(Problem(name, "page", f"{parsed.widget_views} live widget(s) without state show nothing"))
    code = [i for i, cell in enumerate(nb.cells)  # a cell tagged remove-cell is not on the page
            if cell.cell_type == "code" and "remove-cell" not in cell.metadata.get("tags", [])]
    if len(code) != len(parsed.cells):
        problems.append(Problem(name, "page", f"{len(parsed.cells)} code cells on the page, {len(code)} in the file"))
    for index, shown in zip(code, parsed.cells):
        problems += _check_cell(name, f"cell {index}", nb.cells[index], shown, page.parent)
    return problems


def _check_cell(name: str, where: str, cell: nbformat.NotebookNode, shown: dict, folder: Path) -> list[Problem]:
    """One code cell: its object reprs, its figures against its outputs, and its image files."""
    problems = [Problem(name, where, f"an object repr shows in place of what it stands for: {m}")
                for m in OBJECT_REPR.findall(html.unescape("".join(shown["text"])))]
    outputs = [] if "remove-output" in cell.metadata.get("tags", []) else cell.get("outputs", [])
    wanted = sum(expected_figures(o) for o in outputs)
    if len(shown["images"]) < wanted:
        views = [o["data"].get("text/plain", "") for o in outputs
                 if VIEW_KEY in o.get("metadata", {}) and not any(k in o.get("data", {}) for k in FIGURE_TYPES)]
        said = "; ".join(f"a view shows as text: {str(v).splitlines()[0][:120]}" for v in views)
        problems.append(Problem(name, where, f"{wanted} figure(s) expected, {len(shown['images'])} shown" +
                                (f" ({said})" if said else "")))
    for src in shown["images"]:
        if not src.startswith("data:") and not ((folder / src).is_file() and (folder / src).stat().st_size):
            problems.append(Problem(name, where, f"image {src} is missing"))
    return problems


def check_book(html_dir: Path, notebooks: dict[str, nbformat.NotebookNode]) -> list[Problem]:
    """Every notebook's page in the built book, checked (``notebooks``: name -> notebook as staged)."""
    return [p for name, nb in notebooks.items() for p in check_page(name, html_dir / "notebooks" / f"{name}.html", nb)]


def stage(executed: Path, src: Path, names: list[str]) -> tuple[dict[str, nbformat.NotebookNode], list[Problem]]:
    """Lay out the book's sources in ``src``: book/, docs/design.md and each executed notebook, prepared.
    Returns the staged notebooks and a problem per notebook not found in ``executed``."""
    if not (BOOK / "_config.yml").exists():
        raise FileNotFoundError(f"no book config at {BOOK}: build the book from a clone of the repository")
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(BOOK, src)
    (src / "docs").mkdir()
    shutil.copy(DESIGN, src / "docs" / "design.md")
    (src / "notebooks").mkdir()
    staged, missing = {}, []
    for name in names:
        path = executed / f"{name}.ipynb"
        if not path.exists():
            missing.append(Problem(name, "page", f"not executed: no {path}"))
            continue
        staged[name] = prepare(nbformat.read(path, as_version=4))
        nbformat.write(staged[name], src / "notebooks" / path.name)
    return staged, missing


def build(src: Path, out: Path) -> Path:
    """``jupyter-book build`` of ``src`` into ``out`` (from scratch); returns the HTML folder."""
    if importlib.util.find_spec("jupyter_book") is None:
        raise ModuleNotFoundError("the book needs Jupyter Book 1: pip install -e \".[book]\" (jupyter-book>=1,<2)")
    shutil.rmtree(out / "_build", ignore_errors=True)
    command = [sys.executable, "-c", "from jupyter_book.cli.main import main; main()", "build", str(src),
               "--path-output", str(out), "--builder", "html"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"jupyter-book build failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return out / "_build" / "html"


def build_book(executed: Path, out: Path, names: list[str] | None = None) -> tuple[Path, list[Problem]]:
    """Stage, build and check the book of ``names`` (default: every notebook in notebooks/); returns the HTML
    folder and the problems found (an empty list: every page and figure is there)."""
    names = names or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    staged, missing = stage(executed, out / "src", names)
    html_dir = build(out / "src", out)
    return html_dir, missing + check_book(html_dir, staged)


def main(argv: list[str] | None = None) -> int:
    """The command line: build, print the problems, exit 1 if there are any."""
    parser = argparse.ArgumentParser(prog="python -m lab.course.book", description=__doc__.split("\n")[0])
    parser.add_argument("executed", type=Path, help="folder of executed notebooks (CI's: build/executed)")
    parser.add_argument("out", type=Path, help="output folder; the HTML lands in OUT/_build/html")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these notebooks (stems) instead of all of them")
    args = parser.parse_args(argv)
    html_dir, problems = build_book(args.executed, args.out, args.only)
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{'FAILED' if problems else 'built'}: {html_dir / 'index.html'} ({len(problems)} problem(s))")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
