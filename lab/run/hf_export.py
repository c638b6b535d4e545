"""Weights to and from a Hugging Face directory: what ``transformers`` saves and loads with ``save_pretrained``.

The lab trains an HF model under the model's own parameter names, so a checkpoint of any layout,
consolidated (``lab.export``), is already keyed as ``transformers`` keys it. ``write_hf_directory``
loads those weights into the model built from its config on the CPU and calls its own
``save_pretrained``: ``config.json`` (the user's config, dropout as given) and ``model.safetensors``
(a tied head stored once, as transformers stores it). ``hf_weights_file`` goes the other way: a
``save_pretrained`` directory as a weights file that ``resume_from`` loads into any layout, the
tensors resharded onto the ranks' placements (the seeds' Megatron <-> HF conversion, by resharding).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from kernels.contract.model_rules import HF
from kernels.checkpoint.files import CheckpointMissingError
from kernels.model.own_model import hf_config

HF_CONFIG, HF_WEIGHTS = "config.json", "model.safetensors"


def is_hf_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory ``save_pretrained`` wrote (a config and its weights), not a lab checkpoint."""
    path = Path(path)
    return path.is_dir() and (path / HF_CONFIG).is_file() and (path / HF_WEIGHTS).is_file()


def write_hf_directory(model_spec: Mapping[str, Any], weights: Mapping[str, torch.Tensor],
                       out_dir: str | os.PathLike) -> Path:
    """Write ``weights`` (full tensors, the model's names) of the HF model ``model_spec`` names as a
    ``save_pretrained`` directory that ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads."""
    from transformers import AutoModelForCausalLM

    if model_spec.get("family") != HF:
        raise ValueError("format='hf' exports a model built from a Hugging Face config; this run trained "
                         f"a {model_spec.get('family') or 'lab.GPT'} model: export it to a .safetensors file")
    config = hf_config(model_spec, for_training=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(dict(weights), strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise CheckpointMissingError(f"the weights lack {len(missing)} of the model's tensors, first: "
                                     f"{', '.join(missing[:3])}")
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def hf_weights_file(path: str | os.PathLike) -> str:
    """The weights file of a ``save_pretrained`` directory, for ``resume_from``."""
    weights = Path(path) / HF_WEIGHTS
    if not weights.is_file():
        raise CheckpointMissingError(f"{path} holds no {HF_WEIGHTS} (a sharded save is not read yet)")
    return str(weights.resolve())
