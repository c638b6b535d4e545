"""Each view's front-end module: the shared DOM helper (static/dom.js) followed by the view's own file.

anywidget loads every ``_esm`` as one self-contained module (from a blob URL), so modules cannot import
a shared file; the helper is prepended here instead of being copied into each file.
"""
from __future__ import annotations

import pathlib

STATIC = pathlib.Path(__file__).parent / "static"


def view_module(*names: str) -> str:
    """The ES module text of the view whose scripts are ``static/<name>`` (helpers first, the view's own last)."""
    return "\n".join((STATIC / name).read_text() for name in ("dom.js", *names))
