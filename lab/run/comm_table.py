"""``CommTable``: a run's collectives as a table, each beside its analytic volume (``RunResult.comm()``)."""
from __future__ import annotations

import html

_COLUMNS = (("rank", "rank", "{}"), ("op", "op", "{}"), ("source", "source", "{}"), ("n", "group_size", "{}"),
            ("count", "count", "{}"), ("bytes", "payload_bytes", "{:,}"),
            ("predicted", "predicted_payload_bytes", "{:,.0f}"), ("ms", "seconds", "{:.3f}"),
            ("busbw GB/s", "busbw", "{:.3f}"), ("inter-host", "inter_bytes", "{:,.0f}"),
            ("planned inter", "predicted_inter_bytes", "{:,.0f}"))


class CommTable(list):
    """CommRecord dicts (a plain list) that print as a table: payload bytes beside the analytic volume,
    and the wire bytes that crossed to another host beside the planner's (docs/design.md#traffic-inside-and-across-hosts).

    ``ms`` is the summed time of the calls; busbw = payload / time × the nccl-tests factor (docs/design.md#bus-bandwidth).
    """

    def _cells(self) -> list[list[str]]:
        scale = {"seconds": 1e3, "busbw": 1e-9}
        return [[("-" if row.get(key) is None else fmt.format(row[key] * scale.get(key, 1)))
                 for _, key, fmt in _COLUMNS] for row in self]

    def __str__(self) -> str:
        cells = [[name for name, _, _ in _COLUMNS]] + self._cells()
        widths = [max(len(r[i]) for r in cells) for i in range(len(_COLUMNS))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells)

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(name)}</th>" for name, _, _ in _COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in self._cells())
        return f"<table class='cl-comm-table'><tr>{head}</tr>{body}</table>"
