"""Where a rank was, for a person: the user's own frame with its source lines, library frames hidden.

The ranks report frames as (file, line, function) (``kernels.watch.stack_report``); source lines
are read here, on the driver, through ``linecache``. A function defined in a notebook cell,
or a lambda, was compiled by the driver's IPython, which keeps every cell in ``linecache``
under the file name the code carries; the engine never had that source, which is why its
own traceback says "Could not get source".
"""
from __future__ import annotations

import linecache
import os
import sysconfig
from collections.abc import Sequence

from kernels.watch.stack_report import Frame

_LAB = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_KERNELS = os.path.join(os.path.dirname(_LAB), "kernels")
# Library, lab and guard frames: not where a user looks for their mistake.
_INTERNAL_DIRS = tuple({os.path.realpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "purelib", "platlib")}
                       | {_LAB + os.sep})
_INTERNAL_FILES = tuple(os.path.join(_KERNELS, name)
                        for name in ("engine/runtime.py", "watch/stack_report.py", "engine/cell.py"))
# Code a user typed, compiled under a made-up name; "<dynamic-code>" is what cloudpickle >= 3.1.3 calls
# a notebook function's file when the driver could not name it again (lab.pool.sent_code).
_USER_PSEUDO_FILES = ("<ipython-input", "<%%px cell", "<dynamic-code>")


def is_internal(filename: str) -> bool:
    """True for frames of Python itself, installed packages (torch, ipyparallel), the lab and the rank guard."""
    if filename.startswith("<") and not filename.startswith(_USER_PSEUDO_FILES):
        return True  # "<string>" (ipyparallel's exec), "<frozen ...>"
    path = os.path.realpath(filename) if os.path.isabs(filename) else filename
    return path.startswith(_INTERNAL_DIRS) or path in _INTERNAL_FILES


def user_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame outside Python, the libraries and the lab; else the innermost frame."""
    mine = [f for f in frames if not is_internal(f[0])]
    return (mine or list(frames) or [None])[-1]


def collective_of(frames: Sequence[Frame]) -> str | None:
    """The torch.distributed call a stack is inside (e.g. "all_reduce"), or None if it is in none.

    The outermost frame in ``distributed_c10d`` names the collective the user (or a
    library such as FSDP) called; without one, the outermost torch.distributed frame.
    """
    dist = [f for f in frames if f"{os.sep}torch{os.sep}distributed{os.sep}" in f[0]]
    c10d = [f for f in dist if f[0].endswith("distributed_c10d.py")]
    return (c10d or dist)[0][2] if dist else None


def label(filename: str, lineno: int) -> str:
    """ "Cell In[3], line 7" for a notebook cell of this kernel, else 'File "path", line 7'."""
    try:
        from IPython import get_ipython
        shell = get_ipython()
    except ImportError:
        shell = None
    named = shell.compile.format_code_name(filename) if shell is not None else None
    if named:
        return f"{named[0]} {named[1]}, line {lineno}"
    return f'File "{filename}", line {lineno}'


def render(frame: Frame | None, context: int = 2) -> str:
    """The frame's place and its last ``context`` + 1 source lines, the failing one marked ``-->``."""
    if frame is None:
        return ""
    filename, lineno, function = frame
    lines = [f"  {label(filename, lineno)}, in {function}"]
    shown = [(n, linecache.getline(filename, n).rstrip()) for n in range(max(1, lineno - context), lineno + 1)]
    shown = [(n, text) for n, text in shown if text or n == lineno]
    if not any(text for _, text in shown):
        return lines[0] + "\n      (its source is not available on the driver either)"
    width = len(str(lineno))
    lines += [f"  {'-->' if n == lineno else '   '} {n:>{width}} | {text}" for n, text in shown]
    return "\n".join(lines)


def plain_traceback(frames: Sequence[Frame]) -> str:
    """Frames as a plain Python-style stack, outermost first, with source lines the driver can read."""
    out = []
    for filename, lineno, function in frames:
        out.append(f'  File "{filename}", line {lineno}, in {function}')
        text = linecache.getline(filename, lineno).strip()
        if text:
            out.append(f"    {text}")
    return "\n".join(out)
