"""``DataSpec``: which tokens a run trains on, as the ranks receive it (``RunConfig.data``).

Five kinds, each a pure function of (seed, step) on every rank and in the one-process
reference, so a step's global batch is the same wherever it is built and a resumed run
goes on with the batch after its checkpoint's step:

- ``synthetic``: the seeded Markov chain of ``kernels.train.data`` (the default);
- ``tokens``: a 1-D array of token ids in a ``.npy`` or ``.pt`` file;
- ``text``: text files, tokenised by bytes (ids 0-255) or by a ``tokenizers`` JSON file;
- ``task``: a generated task with a right answer (``modular_addition``: "a b = c" with
  c = (a + b) mod p), whose loss counts only the answers, so its accuracy can be measured;
- ``batches``: the user's own batches in order, one per step (inputs and targets), in a ``.npy``
  file of shape (steps, 2, B, T).

Files are read by each rank where it runs: on several hosts, each host must see the path.
The driver (``lab.run.data_sources``) checks what needs the files and the model (the file
exists, the ids fit the vocabulary, one sequence fits) before anything launches; this module
checks the fields alone. Standard library only.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from kernels.contract.config_rules import Problem, is_int
from kernels.contract.records import Record

TOKEN_SUFFIXES = (".npy", ".pt")
TASKS = ("modular_addition",)


class DataKind(enum.StrEnum):
    """Where a run's tokens come from."""

    SYNTHETIC = "synthetic"
    TOKENS = "tokens"
    TEXT = "text"
    TASK = "task"
    BATCHES = "batches"


@dataclass(frozen=True)
class DataSpec(Record):
    """A run's data: its kind and what that kind needs."""

    kind: DataKind = DataKind.SYNTHETIC
    paths: tuple[str, ...] = ()  # tokens, batches: one file; text: one or more, read in order as one stream
    tokenizer: str | None = None  # text: None tokenises by bytes, else a tokenizers JSON file
    task: str | None = None  # task: one of TASKS
    modulus: int | None = None  # modular_addition: p

    def __post_init__(self) -> None:
        self._enum_field("kind", DataKind)
        object.__setattr__(self, "paths", tuple(self.paths))

    def describe(self) -> str:
        """One line: "synthetic chain", "text: a.txt (bytes)", "modular addition mod 11"."""
        if self.kind is DataKind.TEXT:
            return f"text: {', '.join(self.paths)} ({self.tokenizer or 'bytes'})"
        if self.kind is DataKind.TOKENS:
            return f"tokens: {self.paths[0] if self.paths else '?'}"
        if self.kind is DataKind.TASK:
            return f"{(self.task or '?').replace('_', ' ')} mod {self.modulus}"
        if self.kind is DataKind.BATCHES:
            return f"batches: {self.paths[0] if self.paths else '?'}"
        return "synthetic chain"


def data_spec_problems(spec: Any) -> list[Problem]:
    """[data]: the fields a data kind needs, each sane (what needs the files is the driver's check)."""
    if not isinstance(spec, DataSpec):
        return [("data", f"data must be a DataSpec, got {type(spec).__name__}")]
    paths_ok = all(isinstance(p, str) and p for p in spec.paths)
    if spec.kind is DataKind.SYNTHETIC and (spec.paths or spec.tokenizer or spec.task):
        return [("data", "synthetic data takes no paths, tokenizer or task")]
    if spec.kind is DataKind.TOKENS and not (len(spec.paths) == 1 and paths_ok
                                              and spec.paths[0].endswith(TOKEN_SUFFIXES)):
        return [("data", f"token data is one {' or '.join(TOKEN_SUFFIXES)} file of 1-D ids, got {spec.paths!r}")]
    if spec.kind is DataKind.BATCHES and not (len(spec.paths) == 1 and paths_ok and spec.paths[0].endswith(".npy")):
        return [("data", f"batch data is one .npy file of (steps, 2, B, T) ids, got {spec.paths!r}")]
    if spec.kind is DataKind.TEXT and not (spec.paths and paths_ok):
        return [("data", f"text data needs one or more file paths, got {spec.paths!r}")]
    if spec.kind is DataKind.TASK and not (spec.task in TASKS and is_int(spec.modulus) and spec.modulus >= 2):
        return [("data", f"a task is one of {', '.join(TASKS)} with an int modulus >= 2, got task={spec.task!r}, "
                 f"modulus={spec.modulus!r}")]
    return []
