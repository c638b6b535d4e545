"""What a checkpoint directory holds, read without ranks: its meta record, its tensors' shapes, its completeness.

A checkpoint is one directory per saved step, ``<checkpoint_dir>/step_000003``, written by
``torch.distributed.checkpoint`` (DCP: one ``.distcp`` file per writing rank plus the
global ``.metadata``) and a ``meta.json`` (step, data position, run config, layout, last
loss, when). Ranks write under ``step_000003.partial``; rank 0 writes ``meta.json`` and
renames the directory last (``kernels.checkpoint.save_load``), so a directory with the final name
is complete by construction and a save killed half-way leaves only a ``.partial`` one,
which nothing here lists or loads.

Keys are the flattened DCP keys: ``model.<GPT parameter name>`` (the names of
``kernels.model.gpt.GPT.state_dict()``, under every layout), ``optim.state.<name>.<exp_avg|
exp_avg_sq|step>`` (one entry per parameter, so any partition of the parameters over
ranks can load them), the optimizer's settings ``optim_settings.<lr|betas|...>`` (once,
when every parameter shares them; else ``optim.param_groups.<name>.<lr|...>``),
``rng.<rank>``.

A relayout's passage (``save_checkpoint(passage=True)``, removed once read) holds each
writing rank's shards as a safetensors file instead, written and read by torch's Hugging Face
storage for DCP; ``storage_reader`` tells the two apart.

Run alone (lists the complete checkpoints under a directory)::

    python -m kernels.checkpoint.files /tmp/ckpts
"""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

META_NAME = "meta.json"
PARTIAL_SUFFIX = ".partial"
_STEP_DIR = re.compile(r"^step_(\d+)$")
WEIGHTS_SUFFIX = ".safetensors"


class CheckpointError(ValueError):
    """A checkpoint cannot be used as asked; the message names the path and the cause."""


class CheckpointMissingError(CheckpointError):
    """The path holds no complete checkpoint, or the checkpoint lacks what the run needs."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint is of another model: the message names the first mismatched keys and shapes."""


def step_dir(checkpoint_dir: str | os.PathLike, step: int) -> Path:
    """The directory of the checkpoint saved after ``step`` steps."""
    return Path(checkpoint_dir) / f"step_{step:06d}"


def is_complete(path: str | os.PathLike) -> bool:
    """True for a step directory whose save finished on every rank (it carries its final name and meta)."""
    p = Path(path)
    return _STEP_DIR.match(p.name) is not None and (p / META_NAME).is_file() and (p / ".metadata").is_file()


def complete_checkpoints(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The complete step directories under ``checkpoint_dir``, oldest step first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def resolve(path: str | os.PathLike) -> Path:
    """A step directory, or the latest complete one under a checkpoint directory; else CheckpointMissingError."""
    p = Path(path)
    if is_complete(p):
        return p
    if not p.exists():
        raise CheckpointMissingError(f"no checkpoint at {p}: the path does not exist")
    if _STEP_DIR.match(p.name) or p.name.endswith(PARTIAL_SUFFIX):
        missing = [n for n in (".metadata", META_NAME) if not (p / n).is_file()]
        raise CheckpointMissingError(f"checkpoint {p} is partial (a save that did not finish): "
                                     f"missing {', '.join(missing) or 'its final name'}")
    found = complete_checkpoints(p)
    if not found:
        partial = sorted(q.name for q in p.iterdir() if q.name.endswith(PARTIAL_SUFFIX)) if p.is_dir() else []
        extra = f" (only partial saves: {', '.join(partial)})" if partial else ""
        raise CheckpointMissingError(f"no complete checkpoint under {p}: no step_NNNNNN directory "
                                     f"with .metadata and {META_NAME}{extra}")
    return found[-1]


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The meta record of a complete step directory (``resolve`` it first)."""
    return json.loads((Path(path) / META_NAME).read_text())


def storage_reader(path: str | os.PathLike) -> Any:
    """torch's DCP storage reader for the step directory ``path``: DCP's own files, or a passage's safetensors."""
    import torch.distributed.checkpoint as dcp  # torch only where tensors are read

    if any(Path(path).glob("*.safetensors")):
        return dcp.HuggingFaceStorageReader(str(path))
    return dcp.FileSystemReader(str(path))


def tensor_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...] | None]:
    """Every flattened key DCP stored, with its global shape (None for a non-tensor value)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = storage_reader(path).read_metadata()
    return {key: tuple(m.size) if isinstance(m, TensorStorageMetadata) else None
            for key, m in metadata.state_dict_metadata.items()}


def check_against(path: str | os.PathLike, expected: dict[str, tuple[int, ...]], *, what: str = "model",
                  stored: dict[str, tuple[int, ...] | None] | None = None) -> None:
    """Raise when the checkpoint lacks a key of ``expected`` (``{flattened key: shape}``) or stores another shape.

    Shapes are checked first, so a checkpoint of another model names its mismatched
    tensors rather than whichever key happens to be missing. ``stored``: the checkpoint's
    ``tensor_shapes``, when the caller has read them already.
    """
    stored = tensor_shapes(path) if stored is None else stored
    wrong = [f"{key}: checkpoint {list(stored[key])}, {what} {list(shape)}"
             for key, shape in expected.items() if key in stored and stored[key] is not None
             and tuple(stored[key]) != tuple(shape)]
    if wrong:
        raise CheckpointMismatchError(f"checkpoint {path} is of another model shape; first mismatched: "
                                      + "; ".join(wrong[:3]) + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3
                                                                else ""))
    missing = [key for key in expected if key not in stored]
    if missing:
        raise CheckpointMissingError(f"checkpoint {path} lacks {len(missing)} of the {what}'s {len(expected)} "
                                     f"tensors, first: {', '.join(missing[:3])}")


def directory_bytes(path: str | os.PathLike) -> int:
    """Bytes of every file in a checkpoint directory."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


if __name__ == "__main__":
    for found in complete_checkpoints(sys.argv[1] if len(sys.argv) > 1 else "."):
        meta = read_meta(found)
        print(found, "step", meta["step"], "loss", meta.get("loss"), directory_bytes(found), "bytes")
