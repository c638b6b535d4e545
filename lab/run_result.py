"""What one training run measured, as plain data that can be saved and replayed without ranks."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RunResult:
    """Per-step losses, per-rank step times and the layout each rank actually built.

    ``layout[r]`` is rank r's own description: its mesh coordinates, the strategy,
    and for every parameter it holds the global and local shapes and placements.
    ``params`` (only when asked for) maps rank -> {name: nested lists}.
    """

    config: dict[str, Any]  # the run config the ranks received (model, layout, training)
    losses: list[float]  # global-batch mean loss per optimizer step
    step_times: list[list[float]]  # [rank][step] seconds
    layout: list[dict[str, Any]]  # [rank] layout record
    grad_norms: list[float] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    params: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        """Ranks that took part (1 for the one-process reference)."""
        return len(self.step_times)

    def matches(self, other: "RunResult", rtol: float = 1e-4) -> bool:
        """True when every step's loss equals ``other``'s within ``rtol``."""
        return len(self.losses) == len(other.losses) and all(
            math.isclose(a, b, rel_tol=rtol) for a, b in zip(self.losses, other.losses))

    def loss_table(self, other: "RunResult | None" = None) -> str:
        """Step, loss (and the other run's loss beside it) as aligned text."""
        head = "step  loss" + ("        reference   rel. diff" if other else "")
        rows = [head]
        for step, loss in enumerate(self.losses):
            row = f"{step:>4}  {loss:.6f}"
            if other:
                ref = other.losses[step]
                row += f"    {ref:.6f}    {abs(loss - ref) / abs(ref):.1e}"
            rows.append(row)
        return "\n".join(rows)

    def to_json(self, path: str | Path | None = None) -> str:
        """Serialise to JSON (and write it to ``path`` if given)."""
        text = json.dumps(asdict(self))
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "RunResult":
        """Read back what ``to_json`` wrote (a JSON string or a file path)."""
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        data = json.loads(text)
        data["params"] = {int(k): v for k, v in data.get("params", {}).items()}
        return cls(**data)
