"""Save and load training state under any layout with ``torch.distributed.checkpoint`` (DCP).

Algorithm: DCP's sharded save and resharding load. ``get_state_dict`` turns the model and
optimizer of any layout into one logical state dict keyed by the parameters' names
(``kernels.model.gpt.GPT``'s own ``state_dict`` keys): DDP's wrapper is looked through, FSDP2
(ZeRO-2/3, HSDP, bf16, CPU offload) and TP/SP leave DTensors whose shards DCP writes once
each, replicated plain tensors are written by one rank (DCP's de-duplication). The
optimizer state is flattened per parameter (``optim.state.<name>.exp_avg``), so any other
partition of the parameters, another layout or world size, reads its own pieces: DCP's
load plans each rank's reads from the saved chunks' offsets. The optimizer's settings (lr,
betas, ...) are the same for every parameter of the lab's one AdamW group, so they are
saved once (``optim_settings.<field>``) rather than per parameter and field, which would
be three in four of a small GPT's entries, each pickled, listed in the metadata that every
save gathers and broadcasts, and read back by every rank; an optimizer whose parameters
differ keeps the per-parameter form (``optim.param_groups.<name>.<field>``), and a load
reads either.

- Pipeline stages: the model passed is the ``nn.ModuleList`` of this rank's stages; its
  index prefix ("0.", "1.") is dropped from every key, which leaves the GPT's names (each
  stage keeps the names of the blocks it holds).
- ZeRO-1: a ``ZeroRedundancyOptimizer`` holds the AdamW state of the parameters its rank
  owns in its local optimizer (``.optim``); that one goes through ``get_state_dict``, so
  each dp rank writes the state of its own partition, and on load each rank reads the
  state of the partition it owns now (another dp size partitions differently). ZeRO-1 with TP or PP
  (``kernels.parallel.zero1_slices``) gives torch's per-parameter state dict itself, each slice's
  state gathered whole over dp, so it is saved and loaded as any plain optimizer's.
- Completeness: every rank writes under ``<path>.partial``; once DCP's collective finish
  has written the global metadata, rank 0 writes ``meta.json`` and renames the directory
  to ``path``. A save killed before that leaves ``path`` absent (``kernels.checkpoint.files``).
- Asynchronous save: ``kernels.checkpoint.async_save``.

Run alone through the rank entry point (saves under DP 2, resumes under TP 2)::

    torchrun --nproc-per-node 2 -m kernels.train.entry --dp 2 --steps 2 --checkpoint-dir /tmp/ckpt
    torchrun --nproc-per-node 2 -m kernels.train.entry --tp 2 --steps 4 --resume-from /tmp/ckpt
"""
from __future__ import annotations

import inspect
import json
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer

from kernels.checkpoint import fresh_optimizer
from kernels.checkpoint.files import (META_NAME, PARTIAL_SUFFIX, CheckpointMissingError, check_against, storage_reader,
                                     tensor_shapes)
from kernels.checkpoint.strided_shards import described, placed_like
from kernels.parallel.ddp import unwrap

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_SETTINGS_HEAD = "param_groups."
# A torch without the Hugging Face storage's distributed saves writes a passage in DCP's own format.
_HF_WRITER = getattr(dcp, "HuggingFaceStorageWriter", None)
PASSAGE_IN_SAFETENSORS = _HF_WRITER is not None and "save_distributed" in inspect.signature(_HF_WRITER).parameters
SHARED_SETTINGS = "optim_settings"  # the settings every parameter shares, saved once: optim_settings.<field>


def local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """ZeRO-1's per-rank AdamW (the state of this rank's partition), else the optimizer itself."""
    return optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer


def _is_stages(model: nn.Module) -> bool:
    return isinstance(model, nn.ModuleList)


def _strip(key: str, stages: bool) -> str:
    """A stage list's key without its index: "0.blocks.1.attn.q.weight" -> "blocks.1.attn.q.weight"."""
    if not stages:
        return key
    for head in ("state.", "param_groups."):  # flattened optimizer keys: <head><fqn>.<field>
        if key.startswith(head):
            return head + key[len(head):].split(".", 1)[1]
    return key.split(".", 1)[1]


def logical_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict, dict]:
    """(model, optimizer, key map) state dicts keyed by the GPT's names; the map leads back to the module's own keys."""
    model = unwrap(model)
    stages = _is_stages(model)
    if optimizer is None:
        model_sd, optim_sd = get_state_dict(model, [], options=_OPTIONS)
    else:
        fresh = fresh_optimizer.is_fresh(local_optimizer(optimizer))
        model_sd, optim_sd = get_state_dict(model, local_optimizer(optimizer), options=_OPTIONS)
        if fresh:  # torch stepped it at lr 0 to make its state: the count goes back to 0
            fresh_optimizer.restart_step_counts(local_optimizer(optimizer), optim_sd)
    back = {_strip(k, stages): k for k in [*model_sd, *optim_sd]}
    return ({_strip(k, stages): v for k, v in model_sd.items()}, {_strip(k, stages): v for k, v in optim_sd.items()},
            back)


def _settings_of(optim_sd: dict[str, Any]) -> dict[str, Any]:
    """The flattened optimizer settings, ``param_groups.<name>.<field>`` (lr, betas, ...), of a logical state."""
    return {k: v for k, v in optim_sd.items() if k.startswith(_SETTINGS_HEAD)}


def _field(settings_key: str) -> str:
    return settings_key.rsplit(".", 1)[1]  # a name may hold dots, a field never does


def shared_settings(settings: dict[str, Any]) -> dict[str, Any] | None:
    """``{field: value}`` when every parameter has the same settings (the lab's one AdamW group), else None."""
    shared: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, torch.Tensor):  # a tensor lr (capturable AdamW): kept per parameter
            return None
        if shared.setdefault(_field(key), value) != value:
            return None
    return shared or None


def checkpoint_payload(model: nn.Module, optimizer, rank: int, optimizer_settings: bool = True) -> dict[str, Any]:
    """What DCP writes for this rank: the logical model and optimizer state, the shared settings once, its RNG."""
    model_sd, optim_sd, _ = logical_state(model, optimizer)
    settings = _settings_of(optim_sd)
    optim_state = {k: v for k, v in optim_sd.items() if k not in settings}
    payload = {"model": described(model_sd), "optim": described(optim_state), "rng": {str(rank): torch.get_rng_state()}}
    if not optimizer_settings:  # see load_checkpoint
        return payload
    shared = shared_settings(settings)
    if shared is None:
        payload["optim"].update(settings)
    else:
        payload[SHARED_SETTINGS] = shared
    return payload


def finalize_save(partial: Path, final: Path, meta: dict[str, Any], began: float) -> None:
    """Rank 0, after every rank's write: meta last, then the final name (replacing an older save of that step)."""
    meta = {**meta, "saved_at": time.time(), "save_seconds": time.perf_counter() - began}
    (partial / META_NAME).write_text(json.dumps(meta, indent=1, sort_keys=True))
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=final.name + ".old-", dir=final.parent))
        final.rename(old / final.name)
        shutil.rmtree(old)
    partial.rename(final)


def save_checkpoint(path: str, model: nn.Module, optimizer, meta: dict[str, Any],
                    process_group: dist.ProcessGroup | None = None, *, passage: bool = False) -> None:
    """Save ``model`` and ``optimizer`` (any layout) and ``meta`` to the step directory ``path``; every rank calls it.

    ``meta`` is plain JSON: the step, the data position, the run config, the last loss.
    Each rank's CPU RNG state is saved beside the tensors. ``path`` exists only once the
    save is complete (module docstring). ``passage=True`` writes a relayout's passage: the
    optimizer's settings (lr, betas, ...) left out, so only a load with
    ``optimizer_settings=False`` reads it, and each rank's shards in one safetensors file
    (torch's Hugging Face storage writer), which a load reads by offset where DCP's own
    format unpickles every tensor: 13 ms instead of 200 ms for a small GPT's 130 tensors.
    """
    final = Path(path)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    rank, began = dist.get_rank(process_group), time.perf_counter()
    writer = _HF_WRITER(str(partial), save_distributed=True) if passage and PASSAGE_IN_SAFETENSORS \
        else dcp.FileSystemWriter(str(partial))
    dcp.save(checkpoint_payload(model, optimizer, dist.get_rank(), optimizer_settings=not passage),
             storage_writer=writer, process_group=process_group)
    if rank == 0:  # dcp.save returned: its collective finish came after every rank's files
        finalize_save(partial, final, meta, began)
    dist.barrier(group=process_group)  # nobody goes on (or loads) before the checkpoint carries its name


def _expected_shapes(state: dict[str, Any], prefix: str) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.{k}": tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def load_checkpoint(path: str, model: nn.Module, optimizer, process_group: dist.ProcessGroup | None = None,
                    *, optimizer_settings: bool = True) -> dict[str, Any]:
    """Load a complete step directory into ``model`` and ``optimizer`` of any layout; returns its meta.

    Every rank calls it (without an initialized process group, one process loads the whole
    model: the reference). Raises ``CheckpointMismatchError`` naming the first mismatched
    keys and shapes, ``CheckpointMissingError`` naming what is missing. This rank's RNG
    state is restored when the checkpoint holds one for its rank. ``optimizer_settings=False``
    keeps the optimizer's own settings (lr, betas, ...) instead of reading them, as a
    relayout does: its optimizer is made from the same run config as the saved one.
    """
    model_sd, optim_sd, back = logical_state(model, optimizer)
    settings = _settings_of(optim_sd)
    optim_sd = {k: v for k, v in optim_sd.items() if k not in settings}
    stored = tensor_shapes(path)  # the storage's metadata, read once per load
    check_against(path, _expected_shapes(model_sd, "model"), stored=stored)
    # Only an optimizer with state to restore needs it: plain SGD keeps none (its state dict is settings alone).
    if optim_sd and not any(k.startswith("optim.") for k in stored):
        raise CheckpointMissingError(f"checkpoint {path} holds no optimizer state (weights only)")
    rank = dist.get_rank() if dist.is_initialized() else 0
    payload: dict[str, Any] = {"model": described(model_sd), "optim": described(optim_sd)}
    kept, read_shared = settings, []  # optimizer_settings=False keeps the optimizer's own
    if optimizer_settings:  # each setting as saved: per parameter (flattened), or once for all
        payload["optim"].update({k: v for k, v in settings.items() if f"optim.{k}" in stored})
        read_shared = [k for k in settings if k not in payload["optim"]]
        payload.update(_shared_settings_to_read(path, stored, read_shared, settings))
    if f"rng.{rank}" in stored:
        payload["rng"] = {str(rank): torch.get_rng_state()}
    with warnings.catch_warnings():  # one process (the reference) loading the whole model is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(payload, storage_reader=storage_reader(path), process_group=process_group)
    if optimizer_settings:  # the per-parameter ones were read into payload["optim"]
        kept = {k: payload[SHARED_SETTINGS][_field(k)] for k in read_shared}
    loaded = placed_like(payload["model"], model_sd), placed_like(payload["optim"], optim_sd)
    set_state_dict(unwrap(model), [] if optimizer is None else local_optimizer(optimizer),
                   model_state_dict={back[k]: v for k, v in loaded[0].items()},
                   optim_state_dict={back[k]: v for k, v in {**kept, **loaded[1]}.items()},
                   options=_OPTIONS)
    if "rng" in payload:
        torch.set_rng_state(payload["rng"][str(rank)])
    return json.loads((Path(path) / META_NAME).read_text())


def _shared_settings_to_read(path: str, stored: dict[str, Any], keys: list[str],
                             settings: dict[str, Any]) -> dict[str, Any]:
    """The part of a load's payload that reads the shared settings ``keys`` need (raising when they are not there)."""
    fields = {_field(k): settings[k] for k in keys}
    missing = [f for f in fields if f"{SHARED_SETTINGS}.{f}" not in stored]
    if missing:
        raise CheckpointMissingError(f"checkpoint {path} lacks the optimizer setting(s) {', '.join(missing)} "
                                     f"of {keys[0].removeprefix(_SETTINGS_HEAD).rsplit('.', 1)[0]}")
    return {SHARED_SETTINGS: fields} if fields else {}


def load_weights(path: str, model: nn.Module) -> None:
    """Load a safetensors file of whole weights (GPT names) into ``model`` of any layout; the optimizer stays fresh.

    Each rank reads the file and keeps its own pieces: ``set_model_state_dict`` with full
    tensors distributes each onto the parameter's DTensor placements; a pipeline stage
    takes only the names it holds.
    """
    from safetensors.torch import load_file

    inner = unwrap(model)
    own, _, back = logical_state(inner, None)
    full = load_file(path)
    for name, alias in tied_aliases(inner).items():  # a tied head stored once (save_pretrained)
        if name not in full and alias in full:
            full[name] = full[alias]
    expected = {f"model.{k}": tuple(v.shape) for k, v in own.items()}
    _check_weights(path, full, expected)
    options = StateDictOptions(full_state_dict=True, strict=not _is_stages(inner))
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    set_model_state_dict(inner, {back[k]: full[k] for k in own}, options=options)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{name: name it shares its tensor with}`` for every parameter registered twice (a head tied to the
    embedding): the second name, which a weights file may leave out, to the first."""
    first: dict[int, str] = {}
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def _check_weights(path: str, full: dict[str, torch.Tensor], expected: dict[str, tuple[int, ...]]) -> None:
    """The safetensors file's names and shapes against the model's (``check_against``'s errors)."""
    from kernels.checkpoint.files import CheckpointMismatchError

    wrong = [f"{k[6:]}: file {list(full[k[6:]].shape)}, model {list(s)}"
             for k, s in expected.items() if k[6:] in full and tuple(full[k[6:]].shape) != s]
    if wrong:
        raise CheckpointMismatchError(f"weights {path} are of another model shape; first mismatched: "
                                      + "; ".join(wrong[:3]))
    missing = [k[6:] for k in expected if k[6:] not in full]
    if missing:
        raise CheckpointMissingError(f"weights {path} lack {', '.join(missing[:3])}")

