"""A view's static figure: what a notebook saved without widget state shows, and what the course book prints.

A live view is an anywidget: JupyterLab draws it from the ``application/vnd.jupyter.widget-view+json`` entry of
its display bundle, which ranks above every other entry there. A notebook read without a kernel (an executed
copy, nbconvert, the course book of ``lab.course.book``) has no widget state, so each view also puts into its
bundle an ``image/png`` drawn by its matplotlib twin from its current state, and a ``text/plain`` that says what
it shows, never an object repr. The bundle's metadata names the view (``VIEW_KEY``), so a book can tell a view
whose figure is missing from any other output.

The PNG is drawn at every display, live too, so it is drawn small (``DPI``): a readable page figure, not a print.
"""
from __future__ import annotations

import io
import textwrap
from typing import Any

DPI = 72  # a 10-inch figure is 720 px wide: a book column, at a fraction of the cost of matplotlib's 100
VIEW_KEY = "cluster_lab_view"  # output metadata: this output is a view named so, its PNG is its figure


def figure_png(fig: Any, dpi: int = DPI) -> bytes:
    """A matplotlib Figure as PNG bytes (the Agg canvas; no pyplot, so no global figure is left open)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def note_png(text: str) -> bytes:
    """A small figure that only says ``text`` (wrapped): a view with nothing to draw yet still shows as a figure."""
    from matplotlib.figure import Figure

    lines = textwrap.wrap(text, 110)
    fig = Figure(figsize=(8, 0.3 + 0.2 * len(lines)))
    fig.text(0.01, 0.5, "\n".join(lines), ha="left", va="center", fontsize=9, color="#444444")
    return figure_png(fig)


def stack_pngs(pngs: list[bytes]) -> bytes:
    """Several PNGs as one, top to bottom, left-aligned on white (one display holds one ``image/png``)."""
    from PIL import Image

    images = [Image.open(io.BytesIO(png)).convert("RGB") for png in pngs]
    out = Image.new("RGB", (max(i.width for i in images), sum(i.height for i in images)), "white")
    top = 0
    for image in images:
        out.paste(image, (0, top))
        top += image.height
    buffer = io.BytesIO()
    out.save(buffer, format="PNG")
    return buffer.getvalue()


def with_static(bundle: Any, name: str, text: str, png: bytes | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``bundle`` (a live widget's ``_repr_mimebundle_``: a dict or ``(data, metadata)``) with ``text`` as its
    ``text/plain``, ``png`` as its ``image/png`` (left out when None) and the view's name in its metadata."""
    data, metadata = bundle if isinstance(bundle, tuple) else (bundle or {}, {})
    data = {**data, "text/plain": text}
    if png is not None:
        data["image/png"] = png
    return data, {**(metadata or {}), VIEW_KEY: name}


class StaticFigure:
    """Mixin for a view (put it before ``anywidget.AnyWidget``): its display bundle holds its twin's PNG.

    A view implements ``static_figure`` (its matplotlib twin on its current state; None where there is nothing
    to draw yet) and ``static_text`` (what it shows, in one or two lines); ``repr`` says the same.
    """

    def static_figure(self) -> Any:
        """The matplotlib Figure of what the view shows now, or None where it holds nothing yet."""
        raise NotImplementedError(f"{type(self).__name__} names no static figure")

    def static_text(self) -> str:
        """What the view shows, in words."""
        raise NotImplementedError(f"{type(self).__name__} says nothing about what it shows")

    def static_png(self) -> bytes:
        """The static figure as PNG bytes; a short note where the view holds nothing yet."""
        fig = self.static_figure()
        return note_png(f"{type(self).__name__}: nothing to show yet") if fig is None else figure_png(fig)

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        live = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        try:
            png: bytes | None = self.static_png()
        except Exception as error:  # the live view must still show; a book flags the view without its figure
            return with_static(live, type(self).__name__, f"{self!r}\n(no static figure: {error!r})", None)
        return with_static(live, type(self).__name__, repr(self), png)

    def __repr__(self) -> str:
        return f"{type(self).__name__}: {self.static_text()}"
