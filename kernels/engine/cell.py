"""One notebook cell run on a rank, the way IPython runs a cell: the rank side of ``%%px``.

The cell runs in the engine's user namespace, the one ``cluster.push`` binds names in
and where ``rank``, ``world``, ``device``, ``torch`` and ``dist`` already live, so a
name one cell defines is seen by the next. As in IPython, a final expression is the
cell's value (a trailing ``;`` hides it). Unlike an ipyparallel ``execute``, whose output
streams out of the engine on its own channel, everything the cell prints or displays is
captured and returned in the call's reply as a ``CellOutput``: the driver shows it when
the cell ends, labelled by rank, and a failing or late rank is supervised like any call.

When the cell raises (or is interrupted), what it wrote up to then is kept, and
``take_last_output`` hands it to the driver, which shows it before the rank's error.

Run alone (one process, no ranks)::

    python -m kernels.engine.cell
"""
from __future__ import annotations

import ast
import base64
import io
import linecache
import tokenize
from types import CodeType
from typing import Any

from IPython import get_ipython
from IPython.utils.capture import capture_output

from kernels.contract.pool_records import CellOutput

_last_output: CellOutput | None = None  # this rank's last cell, kept for the driver after a failure
_SILENT_TOKENS = {tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT,
                  tokenize.ENDMARKER}


def run_cell(source: str, cell_name: str, namespace: dict[str, Any] | None = None) -> CellOutput:
    """Run the Python ``source`` in ``namespace`` (the engine's user namespace by default).

    ``cell_name`` names the cell in tracebacks, which show its lines. Returns what the
    cell printed to stdout and stderr, what it displayed, and its final value as a mime
    bundle formatted on the rank (so no rank tensor travels to the driver).
    """
    global _last_output
    _last_output = None
    namespace = _user_namespace() if namespace is None else namespace
    body, last = _compile(source, cell_name)
    value = None
    with capture_output() as captured:
        try:
            exec(body, namespace)
            if last is not None:
                value = _mime_bundle(eval(last, namespace))
        finally:  # on failure too: the driver shows what the cell wrote before it raised
            _last_output = CellOutput(captured.stdout, captured.stderr,
                                      tuple(_plain(o.data) for o in captured.outputs), value)
    return _last_output


def take_last_output() -> CellOutput | None:
    """What this rank's last cell wrote (up to its error, if it raised); None once taken."""
    global _last_output
    output, _last_output = _last_output, None
    return output


def _user_namespace() -> dict[str, Any]:
    shell = get_ipython()
    if shell is None:
        raise RuntimeError("run_cell without a namespace needs an IPython shell (an ipyparallel engine has one)")
    return shell.user_ns


def _compile(source: str, cell_name: str) -> tuple[CodeType, CodeType | None]:
    """The cell's statements, and its final expression (None when the cell has no value to show)."""
    # Registered like IPython's own cells, so the rank's traceback prints the failing line.
    linecache.cache[cell_name] = (len(source), None, source.splitlines(keepends=True), cell_name)
    tree = ast.parse(source, cell_name)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not _ends_with_semicolon(source):
        last = compile(ast.Expression(tree.body.pop().value), cell_name, "eval")
    return compile(tree, cell_name, "exec"), last


def _ends_with_semicolon(source: str) -> bool:
    """IPython's rule: a cell whose last token is ``;`` shows no value."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in _SILENT_TOKENS]
    return bool(tokens) and tokens[-1].string == ";"


def _mime_bundle(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    shell = get_ipython()
    if shell is None:
        return {"text/plain": repr(value)}
    data, _ = shell.display_formatter.format(value)
    return _plain(data)


def _plain(data: dict[str, Any]) -> dict[str, Any]:
    # Images come out of IPython's formatters as bytes; a notebook carries them as base64 text.
    return {mime: base64.b64encode(v).decode("ascii") if isinstance(v, bytes) else v for mime, v in data.items()}


if __name__ == "__main__":
    ns: dict[str, Any] = {"rank": 0}
    out = run_cell("x = [rank] * 3\nprint('x is', x)\nsum(x) + 1", "<demo cell>", ns)
    print(f"stdout: {out.stdout!r}  value: {out.value}  x in namespace: {ns['x']}")
