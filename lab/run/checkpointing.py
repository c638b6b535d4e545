"""Checkpoints on the driver: list them, check a resume before launch, export the weights to safetensors.

The ranks write and read checkpoints (``kernels.checkpoint.save_load``, ``kernels.train.run_checkpoints``);
the driver only reads directories (``kernels.checkpoint.files``): ``checkpoints(PATH)``
lists the complete ones as ``Checkpoint`` records, ``resume_path`` turns whatever
``resume_from`` was given (a record, a step directory, a checkpoint directory, a
``.safetensors`` file, a Hugging Face ``save_pretrained`` directory) into the one path the ranks load, after checking that it exists,
is complete and holds tensors of the model's shapes, so a bad resume fails here, named,
before anything launches. ``export`` consolidates a checkpoint's weights in this process
(DCP reads every rank's shards) into one safetensors file keyed by the model's (GPT or Llama)
own parameter names.
"""
from __future__ import annotations

import datetime as _dt
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernels.checkpoint.files import (WEIGHTS_SUFFIX, CheckpointMismatchError, CheckpointMissingError, check_against,
                                      complete_checkpoints, directory_bytes, read_meta, resolve)
from kernels.contract.config_rules import Problem
from kernels.contract.run_config import RunConfig
from kernels.model.family import ModelConfig, meta_model, model_config
from lab.run.hf_export import hf_weights_file, is_hf_directory, write_hf_directory


@dataclass(frozen=True)
class Checkpoint:
    """One complete checkpoint: the step it was saved after, where, under which layout, its size and time."""

    step: int
    path: str
    layout: dict[str, Any]  # pp, dp, tp, zero, schedule and the strategy in words
    world_size: int
    bytes: int
    saved_at: _dt.datetime
    loss: float | None = None  # the loss of the step it was saved after
    save_seconds: float | None = None  # from the save's start to its completion, on rank 0

    def __fspath__(self) -> str:
        return self.path

    def __str__(self) -> str:
        return (f"step {self.step}: {self.path} ({self.layout.get('describe', '?')}, {self.world_size} ranks, "
                f"{self.bytes / 1e6:.2f} MB, saved {self.saved_at:%Y-%m-%d %H:%M:%S})")


def record(path: str | os.PathLike) -> Checkpoint:
    """The record of one complete step directory."""
    meta = read_meta(path)
    return Checkpoint(step=int(meta["step"]), path=str(Path(path).resolve()), layout=dict(meta.get("layout", {})),
                      world_size=int(meta.get("world_size", 0)), bytes=directory_bytes(path),
                      saved_at=_dt.datetime.fromtimestamp(meta["saved_at"]), loss=meta.get("loss"),
                      save_seconds=meta.get("save_seconds"))


def checkpoints(path: str | os.PathLike) -> list[Checkpoint]:
    """The complete checkpoints under a directory, oldest step first; a save that did not finish is not listed."""
    return [record(p) for p in complete_checkpoints(path)]


def resume_path(resume_from: Any) -> str:
    """The absolute path the ranks load for ``resume_from``: a step directory, a checkpoint directory's latest
    complete one, or a ``.safetensors`` file; CheckpointMissingError names what is missing."""
    if isinstance(resume_from, Checkpoint):
        resume_from = resume_from.path
    path = Path(os.fspath(resume_from)).resolve()
    if is_hf_directory(path):  # save_pretrained's directory: its weights file, keyed by the model's names
        return hf_weights_file(path)
    if path.name.endswith(WEIGHTS_SUFFIX):
        if not path.is_file():
            raise CheckpointMissingError(f"no weights file at {path}")
        return str(path)
    return str(resolve(path))


def model_shapes(model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``{"model.<name>": shape}`` of the model, built on the meta device (no memory, no init)."""
    return {f"model.{k}": tuple(v.shape) for k, v in meta_model(model).state_dict().items()}


def check_resume(path: str, model: ModelConfig, steps: int, optimizer: str = "adamw") -> int:
    """Check a resolved ``resume_path`` against the model, the run's total steps and its optimizer
    (a weights file carries no optimizer state, so any will do); returns the step it resumes at."""
    expected = model_shapes(model)
    if path.endswith(WEIGHTS_SUFFIX):
        from kernels.checkpoint.save_load import tied_aliases
        for name in tied_aliases(meta_model(model)):  # a tied head may be stored once (save_pretrained)
            expected.pop(f"model.{name}", None)
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            stored = {f"model.{k}": tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        wrong = [f"{k[6:]}: file {list(stored[k])}, model {list(s)}" for k, s in expected.items()
                 if k in stored and stored[k] != s]
        if wrong:
            raise CheckpointMismatchError(f"weights {path} are of another model shape; first mismatched: "
                                          + "; ".join(wrong[:3]))
        missing = [k[6:] for k in expected if k not in stored]
        if missing:
            raise CheckpointMissingError(f"weights {path} lack {len(missing)} tensors, first: {', '.join(missing[:3])}")
        return 0
    check_against(path, expected)
    meta = read_meta(path)
    step, saved_with = int(meta["step"]), meta.get("config", {}).get("optimizer", "adamw")
    problems = []
    if step >= steps:
        problems.append(("checkpoint", f"the checkpoint {path} is at step {step} and steps={steps} counts "
                                       f"the total: nothing is left to run; pass steps > {step}"))
    if saved_with != optimizer:
        problems.append(("checkpoint", f"the checkpoint {path} holds {saved_with}'s state and this run's optimizer is "
                                       f"{optimizer}: it cannot go on from it; resume with optimizer={saved_with!r}, "
                                       "or start from its weights alone (lab.export to a .safetensors file)"))
    if problems:
        from lab.run.parallel import ParallelConfigError

        raise ParallelConfigError(problems)
    return step


def directory_problems(checkpoint_dir: Any) -> list[Problem]:
    """[checkpoint-dir]: the directory exists or can be made, and this process can write into it."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        return []  # the type is kernels.contract.config_rules.checkpoint_problems' to name
    path = Path(checkpoint_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as error:
        return [("checkpoint-dir", f"checkpoint_dir {str(path)!r} is not writable: {error.strerror or error}")]
    return []


def export(source: Any, out_path: str | os.PathLike, format: str = "safetensors") -> Path:
    """Write the consolidated full weights of a checkpoint (or of anything with ``.save(dir)``) to a safetensors file.

    ``source``: a ``Checkpoint``, a step or checkpoint directory, or a live object whose
    ``save(dir)`` writes a checkpoint there (``lab.Training``). Keys are
    the model's parameter names; ``resume_from=<the file>`` loads it into any layout.
    ``format="hf"`` (a model built from a Hugging Face config) writes a ``save_pretrained`` directory
    instead, which ``transformers.AutoModelForCausalLM.from_pretrained(out_path)`` loads and
    ``resume_from=out_path`` reads back into any layout (``lab.run.hf_export``).
    """
    if format not in ("safetensors", "hf"):
        raise ValueError(f"format must be 'safetensors' or 'hf', got {format!r}")
    from safetensors.torch import save_file

    from kernels.checkpoint.save_load import load_checkpoint

    if hasattr(source, "save") and not isinstance(source, (str, os.PathLike)):
        with tempfile.TemporaryDirectory(prefix="lab-export-") as scratch:
            source.save(scratch)
            return export(scratch, out_path, format)
    path = resume_path(source)
    meta = read_meta(path)
    model = meta_model(model_config(RunConfig.from_options(meta["config"]))).to_empty(device="cpu")
    load_checkpoint(path, model, None)
    if format == "hf":
        return write_hf_directory(meta["config"]["model"], model.state_dict(), out_path)
    out = Path(out_path)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, str(out),
              metadata={"step": str(meta["step"]), "source": path})
    return out
