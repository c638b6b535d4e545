"""What an Experiment trains on: ``data=`` turned into the ranks' ``DataSpec``, checked before launch.

``lab.Experiment(..., data=...)`` (and ``lab.Training``) takes:

- ``None``: the synthetic Markov chain (``kernels.train.data``), as before;
- ``lab.Text(paths, tokenizer=None)``, or a path or a list of paths: text files, tokenised
  by bytes, or by a ``tokenizers`` JSON file (local only);
- ``lab.Tokens(ids)``: a 1-D tensor or array of token ids (written once to a ``.npy`` file
  named by its content, in the system's temporary directory), or the path of a ``.npy``/``.pt`` file;
- ``lab.ModularAddition(modulus)``: a generated task with a right answer, whose
  ``accuracy`` says how many answers the trained model gets right.

Each is checked here, with the code the ranks run (``kernels.train.data.dataset``), before
anything launches: [data-file] (a file that is missing or not token ids), [data-vocab] (the
ids reach past the model's vocabulary), [data-length] (not one sequence long).
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from kernels.contract.config_rules import ConfigError, Problem
from kernels.contract.data_spec import DataKind, DataSpec
from kernels.contract.run_config import RunConfig
from kernels.model.family import ModelConfig, meta_model, model_fields
from kernels.train.data import dataset
from kernels.train.task_data import answer_accuracy


@dataclass(frozen=True)
class Text:
    """Text files read in order as one stream; ``tokenizer``: None for bytes, else a ``tokenizers`` JSON file."""

    paths: tuple[str, ...] | list[str] | str
    tokenizer: str | None = None

    def spec(self) -> DataSpec:
        """What the ranks receive (absolute paths: their working directory may differ)."""
        paths = (self.paths,) if isinstance(self.paths, (str, os.PathLike)) else tuple(self.paths)
        tokenizer = None if self.tokenizer is None else os.path.abspath(self.tokenizer)
        return DataSpec(DataKind.TEXT, paths=tuple(os.path.abspath(p) for p in paths), tokenizer=tokenizer)


@dataclass(frozen=True)
class Tokens:
    """A 1-D tensor or array of token ids, or the path of a ``.npy`` or ``.pt`` file of them."""

    ids: Any

    def spec(self) -> DataSpec:
        """What the ranks receive: the file, written once per content when the ids are in memory."""
        if isinstance(self.ids, (str, os.PathLike)):
            return DataSpec(DataKind.TOKENS, paths=(os.path.abspath(self.ids),))
        ids = torch.as_tensor(self.ids)
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise ConfigError([("data-file", f"token ids are a 1-D tensor of ints, got {ids.dtype} "
                                f"{tuple(ids.shape)}")])
        return DataSpec(DataKind.TOKENS, paths=(_content_file(ids.long().numpy(), ".npy"),))


def _content_file(array: Any, suffix: str) -> str:
    """``array`` written once to a file named by its content, in the system's temporary directory."""
    import numpy as np

    folder = os.path.join(tempfile.gettempdir(), "cluster-lab-data")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, hashlib.sha1(array.tobytes() + str(array.shape).encode()).hexdigest() + suffix)
    if not os.path.exists(path):  # another run on the same content reads the same file
        partial = f"{path}.{os.getpid()}.partial{suffix}"
        if suffix == ".npy":
            np.save(partial, array)
        else:
            with open(partial, "wb") as f:
                f.write(array.tobytes())
        os.replace(partial, path)
    return path


@dataclass(frozen=True)
class Batches:
    """Your own batches, in order: step ``s`` trains on the ``s``-th. Each is a (B, T+1) tensor of token rows
    (inputs are the first T, targets the last T) or an (inputs, targets) pair of (B, T) tensors (targets
    may hold -100, which the loss ignores). ``batches`` is any iterable: it is read once, here, up to
    ``limit`` batches, and written to one file the ranks read."""

    batches: Any
    limit: int = 10_000

    def spec(self) -> DataSpec:
        """What the ranks receive: one ``.npy`` of (steps, 2, B, T) ids."""
        pairs = []
        for i, item in enumerate(self.batches):
            if i == self.limit:
                break
            if isinstance(item, (tuple, list)) and len(item) == 2:
                pair = torch.stack([torch.as_tensor(item[0]), torch.as_tensor(item[1])])
            else:
                rows = torch.as_tensor(item)
                pair = torch.stack([rows[:, :-1], rows[:, 1:]]) if rows.dim() == 2 else rows
            if pair.dim() != 3 or pair.is_floating_point() or (pairs and pair.shape != pairs[0].shape):
                raise ConfigError([("data", f"batch {i} is {tuple(pair.shape)} {pair.dtype}: each batch is (B, T+1) "
                                    "int token rows or an (inputs, targets) pair of (B, T), all of one shape")])
            pairs.append(pair.long())
        if not pairs:
            raise ConfigError([("data-length", "the iterable of batches yielded none")])
        return DataSpec(DataKind.BATCHES, paths=(_content_file(torch.stack(pairs).numpy(), ".npy"),))


def dataset_spec(data: Any) -> DataSpec:
    """A local ``datasets.Dataset``: its ``input_ids`` column as one token stream, or its ``text`` column
    joined by newlines as text tokenised by bytes."""
    columns = list(data.column_names)
    if "input_ids" in columns:
        return Tokens(torch.cat([torch.as_tensor(ids).reshape(-1) for ids in data["input_ids"]])).spec()
    if "text" in columns:
        text = "\n".join(data["text"]).encode("utf-8")
        import numpy as np

        return Text(_content_file(np.frombuffer(text, dtype=np.uint8), ".txt")).spec()
    raise ConfigError([("data", f"a datasets.Dataset is read by its 'input_ids' or 'text' column; it has {columns}")])


@dataclass(frozen=True)
class ModularAddition:
    """Problems "a b = c" with c = (a + b) mod ``modulus``; the model's vocab must hold modulus + 2 ids."""

    modulus: int = 11

    def spec(self) -> DataSpec:
        """What the ranks receive."""
        return DataSpec(DataKind.TASK, task="modular_addition", modulus=self.modulus)

    def accuracy(self, model: ModelConfig, result: Any, *, batches: int = 4, batch_size: int = 64) -> float:
        """The share of answers the trained weights of ``result`` (``run(return_params=True)``) get right.

        Measured here, on ``batches`` fresh batches of problems (steps the run never trained on).
        """
        params = whole_parameters(result)
        trained = meta_model(model).to_empty(device="cpu")
        trained.load_state_dict(params)
        task, scores = dataset(RunConfig(model=model_fields(model), data=self.spec())), []
        with torch.no_grad():
            for i in range(batches):
                inputs, targets = task.global_batch(10**9 + i, batch_size)
                scores.append(answer_accuracy(trained(inputs), targets))
        return sum(scores) / len(scores)


def whole_parameters(result: Any) -> dict[str, torch.Tensor]:
    """Every parameter of a run's model, whole, from the ranks' ``params`` (pipeline stages joined by name)."""
    if not getattr(result, "params", None):
        raise ValueError("the result holds no parameters: run it with return_params=True")
    out: dict[str, torch.Tensor] = {}
    for rank_params in result.params.values():
        out.update({name: torch.tensor(value) for name, value in rank_params.items()})
    return out


def data_spec(data: Any) -> DataSpec:
    """The ``DataSpec`` of what ``data=`` names (module docstring); ConfigError [data] for anything else."""
    if data is None:
        return DataSpec()
    if isinstance(data, DataSpec):  # a saved run's (Training.load)
        return data
    if isinstance(data, (Text, Tokens, ModularAddition, Batches)):
        return data.spec()
    if hasattr(data, "column_names") and hasattr(data, "features"):  # a datasets.Dataset, built from local files
        return dataset_spec(data)
    if isinstance(data, (str, os.PathLike)):
        return Text(data).spec()
    if isinstance(data, (list, tuple)) and data and all(isinstance(p, (str, os.PathLike)) for p in data):
        return Text(tuple(data)).spec()
    if hasattr(data, "__array__") or isinstance(data, torch.Tensor):
        return Tokens(data).spec()
    if hasattr(data, "__iter__"):
        return Batches(data).spec()
    raise ConfigError([("data", "data is None, lab.Text, lab.Tokens, lab.ModularAddition, lab.Batches, a path or a "
                        "list of paths, a 1-D tensor of token ids, a datasets.Dataset or an iterable of batches; "
                        f"got {type(data).__name__}")])


def data_problems(spec: DataSpec, model: ModelConfig, *, steps: int | None = None,
                  global_batch: int | None = None) -> list[Problem]:
    """[data-file], [data-vocab], [data-length], [data-batch]: what the ranks would find, found here with their
    own code (your own batches: one per step, each of the run's global batch)."""
    for path in spec.paths + ((spec.tokenizer,) if spec.tokenizer else ()):
        if not os.path.isfile(path):
            return [("data-file", f"{path} is not a file this process can read (a pool on several hosts needs it "
                     "at the same path on each)")]
    run = RunConfig(model=model_fields(model), data=spec)
    try:
        data = dataset(run)
    except ConfigError as error:
        return error.problems
    except (OSError, ValueError, RuntimeError, ImportError) as error:  # unreadable, not ids, no tokenizers
        return [("data-file", f"{spec.describe()}: {type(error).__name__}: {error}")]
    if spec.kind is DataKind.BATCHES:
        held, size = data.batches.size(0), data.batches.size(2)
        if steps is not None and held < steps:
            return [("data-length", f"the data holds {held} batches and steps={steps} needs one per step")]
        if global_batch is not None and size != global_batch:
            return [("data-batch", f"each batch holds {size} sequences and global_batch={global_batch}: "
                     f"pass global_batch={size}")]
    return []
