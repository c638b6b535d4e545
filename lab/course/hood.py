"""Open the hood: show the lab's own implementation of a technique in a notebook, next to the exercise."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from IPython.display import Code, Markdown, display


def open_the_hood(*objects: Any) -> None:
    """Display the source of each function, class or module, headed by where it lives in the repository.

    An exercise asks the student to write a technique by hand; this shows the code that the lab itself
    runs for it, so the two can be compared line by line.
    """
    for obj in objects:
        path = Path(inspect.getsourcefile(obj) or "?")
        lines, first = inspect.getsourcelines(obj)
        where = "/".join(path.parts[-3:]) if len(path.parts) >= 3 else path.name
        display(Markdown(f"`{getattr(obj, '__qualname__', getattr(obj, '__name__', where))}`, "
                         f"from `{where}`, line {max(first, 1)}:"))
        display(Code("".join(lines), language="python"))
