"""What the driver sent: the code of notebook functions, so that a rank's frames name their cell again.

cloudpickle sends a function the ranks cannot import (one defined in a notebook cell, a
lambda, a ``%%px``-pushed helper, a function of a module registered to go by value) as its
code object. Since cloudpickle 3.1.3 that code arrives with its file name replaced by
``"<dynamic-code>"``, which makes the pickle deterministic but leaves the rank's traceback
without its cell: the driver's ``linecache``, which holds each cell's source under the
file name the code carries, then has nothing to show.

The driver knows what it sent. Before each call (``Cluster.run``, ``Cluster.push``) it
records the code objects the call carries: the function's own, those nested in it
(lambdas, inner functions), and those of the notebook functions and classes it reads as
globals, holds in a closure or passes as arguments. A rank's frame under a rewritten or
unknown file name is then mapped back by code identity: its function name and line, and
its qualified name and first line where the rank reports them (the frames of an
exception do; a stack dumped from C during a hang has only name and line). Among equal
candidates the most recently sent wins: that is the definition the rank ran.
"""
from __future__ import annotations

import dataclasses
import functools
import linecache
import re
import sys
import types
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import cloudpickle

from kernels.watch.stack_report import CodeId, Frame
from lab.pool import frames

REWRITTEN = "<dynamic-code>"  # cloudpickle >= 3.1.3's file name for every code object it sends by value
_MAX_CODES = 4096  # the book forgets the oldest beyond this: a notebook session redefines a function many times
_MAX_ITEMS = 64  # items looked at per container argument: functions sit near the top, not in a tensor list
_MAX_DEPTH = 4  # containers inside containers
# A frame's line in a printed traceback: Python's 'File "<f>", line 5, in g' or IPython's "File <f>:5, in g(...)".
_TRACEBACK_LINE = re.compile(r'File "?(<[^">]+>)"?(?:, line |:)(\d+), in ([\w<>.]+)')


@dataclasses.dataclass(frozen=True)
class SentCode:
    """One code object as the driver compiled it: where it came from and which lines it spans."""

    filename: str
    name: str
    qualname: str
    firstlineno: int
    lines: frozenset[int]


class SentCodeBook:
    """The code objects sent to the ranks, newest last, and the way back from a rank's frame to them."""

    def __init__(self) -> None:
        self._codes: OrderedDict[SentCode, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._codes)

    def remember(self, *objects: object) -> None:
        """Record every code object ``objects`` carry to the ranks (functions, classes, arguments)."""
        seen: set[int] = set()
        for obj in objects:
            for code in _codes_of(obj, seen, 0):
                sent = _sent(code)
                self._codes.pop(sent, None)
                self._codes[sent] = None
        while len(self._codes) > _MAX_CODES:
            self._codes.popitem(last=False)

    def restore(self, frames: Sequence[Frame], codes: Sequence[CodeId | None] | None = None) -> list[Frame]:
        """``frames`` with every rewritten or unknown file name replaced by the one the driver compiled it under.

        ``codes`` (one ``(qualname, firstlineno)`` or None per frame) narrows the match
        where the rank reported it. A frame nothing matches is left as it is.
        """
        out = []
        for i, (filename, lineno, function) in enumerate(frames):
            code_id = codes[i] if codes is not None and i < len(codes) else None
            found = self.find(filename, lineno, function, code_id)
            out.append((found.filename if found else filename, lineno, function))
        return out

    def find(self, filename: str, lineno: int, function: str, code_id: CodeId | None = None) -> SentCode | None:
        """The most recently sent code a rank's frame ``(filename, lineno, function)`` ran, if it was rewritten."""
        if not _rewritten(filename):
            return None
        for sent in reversed(self._codes):
            if sent.name == function and lineno in sent.lines and (
                    code_id is None or (sent.qualname, sent.firstlineno) == tuple(code_id)):
                return sent
        return None

    def restore_text(self, text: str) -> str:
        """A rank's printed traceback with each notebook frame named as the driver names it ("Cell In[3], line 5")."""
        def named(match: re.Match[str]) -> str:
            found = self.find(match[1], int(match[2]), match[3])
            place = frames.label(found.filename if found else match[1], int(match[2]))
            if found is None and place.startswith("File "):  # neither sent by value nor one of this kernel's cells
                return match[0]
            return f"{place}, in {match[3]}"
        return _TRACEBACK_LINE.sub(named, text)


def _rewritten(filename: str) -> bool:
    # A pseudo file name the driver has no source for: cloudpickle's "<dynamic-code>", or any other
    # "<...>" name a serializer might use. Real paths and the driver's own cells are left alone.
    return filename == REWRITTEN or (filename.startswith("<") and filename not in linecache.cache)


def _sent(code: types.CodeType) -> SentCode:
    lines = frozenset(line for _, _, line in code.co_lines() if line is not None)
    return SentCode(code.co_filename, code.co_name, getattr(code, "co_qualname", code.co_name),
                    code.co_firstlineno, lines | {code.co_firstlineno})


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _codes_of(obj: object, seen: set[int], depth: int) -> Iterator[types.CodeType]:
    """The code objects cloudpickle sends by value with ``obj``, following what it reads."""
    if id(obj) in seen or depth > _MAX_DEPTH:
        return
    seen.add(id(obj))
    if isinstance(obj, types.FunctionType):
        if _by_value(obj.__module__, obj.__code__):
            yield from _function_codes(obj, seen, depth)
    elif isinstance(obj, (types.MethodType, staticmethod, classmethod)):
        yield from _codes_of(obj.__func__, seen, depth)
    elif isinstance(obj, functools.partial):
        for part in (obj.func, *obj.args, *obj.keywords.values()):
            yield from _codes_of(part, seen, depth + 1)
    elif isinstance(obj, property):
        for part in (obj.fget, obj.fset, obj.fdel):
            yield from _codes_of(part, seen, depth)
    elif isinstance(obj, type):
        if _by_value(obj.__module__, None):
            for member in list(vars(obj).values()):
                yield from _codes_of(member, seen, depth)
    elif isinstance(obj, dict):
        for value in list(obj.values())[:_MAX_ITEMS]:
            yield from _codes_of(value, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in list(obj)[:_MAX_ITEMS]:
            yield from _codes_of(value, seen, depth + 1)
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _codes_of(getattr(obj, f.name, None), seen, depth + 1)
    elif callable(obj) and not isinstance(obj, types.BuiltinFunctionType):
        yield from _codes_of(type(obj), seen, depth)  # an instance of a notebook class carries its methods


def _function_codes(fn: types.FunctionType, seen: set[int], depth: int) -> Iterator[types.CodeType]:
    codes = list(_nested(fn.__code__))
    yield from codes
    names = {name for code in codes for name in code.co_names}
    # cloudpickle sends the globals the function reads, its closure and its defaults with it.
    carried = [fn.__globals__[name] for name in sorted(names) if name in fn.__globals__]
    carried += [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
    carried += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    for value in carried:
        if not isinstance(value, types.ModuleType):
            yield from _codes_of(value, seen, depth + 1)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a cell not bound yet (a recursive inner function before its definition ran)
        return False
    return True


def _by_value(module: str | None, code: types.CodeType | None) -> bool:
    """Whether cloudpickle sends this function or class itself rather than a reference the rank imports."""
    if module is None or module == "__main__" or module not in sys.modules:
        return True
    if code is not None and code.co_filename.startswith("<"):
        return True
    registered = cloudpickle.list_registry_pickle_by_value()
    return any(module == name or module.startswith(name + ".") for name in registered)
