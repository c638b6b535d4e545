"""How a pool shows itself: a text table for ``repr`` and an HTML table for Jupyter, one row per rank."""
from __future__ import annotations

import html as _html
from typing import Any

COLUMNS = ("rank", "host", "pid", "device", "backend", "threads", "state")


def ranks(n: int) -> str:
    """ "1 rank", "4 ranks"."""
    return f"{n} rank" if n == 1 else f"{n} ranks"


def text(cluster: Any) -> str:
    """The pool's size, backend and threads, then a row per rank, then the rank map's note."""
    head = f"Cluster: {ranks(cluster.world_size)}, backend {cluster.backend}, {cluster.threads} thread(s) per rank"
    rows = [tuple(str(getattr(s, c)) for c in COLUMNS) for s in cluster.status()]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(COLUMNS)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    note = [f"note: {cluster.rank_map.note}"] if cluster.rank_map.note else []
    return "\n".join([head, line(COLUMNS), *(line(r) for r in rows), *note])


def html(cluster: Any) -> str:
    """The same as an HTML table, failed, dead and busy ranks shaded."""
    colour = {"failed": "#f8d7da", "dead": "#f5c2c7", "busy": "#fff3cd"}
    body = "".join(
        f"<tr style='background:{colour.get(s.state, 'transparent')}'>"
        + "".join(f"<td>{_html.escape(str(getattr(s, c)))}</td>" for c in COLUMNS) + "</tr>"
        for s in cluster.status())
    note = cluster.rank_map.note
    note_html = f"<p><i>{_html.escape(note)}</i></p>" if note else ""
    return (f"<div class='cluster-lab-ranks'><b>Cluster</b>: {ranks(cluster.world_size)}, "
            f"backend <code>{cluster.backend}</code><table><thead><tr>"
            + "".join(f"<th>{c}</th>" for c in COLUMNS)
            + f"</tr></thead><tbody>{body}</tbody></table>{note_html}</div>")
