"""A model the user brings, trained like the lab's own: a Hugging Face causal LM or any ``nn.Module``.

``RunConfig.model`` names it (``kernels.contract.model_rules``): an HF config, rebuilt on every rank
with ``AutoModelForCausalLM.from_config``, or a pickled factory. ``OwnModel`` gives either the
three things the lab's layouts need from a model, without renaming a parameter:

- ``blocks``: the repeated blocks, where FSDP units, activation checkpointing and the per-block
  tensor-parallel plan go;
- ``tp_plan``/``tp_sizes``: the plan in DTensor styles (``kernels.model.own_tp``) and the sizes it splits;
- ``cut_stage``: one pipeline stage. The stage keeps its blocks under their names; the modules
  before the blocks stay on the first stage, those after on the last. A later stage swaps the hidden
  state it receives in as its first block's input, so everything the model computes *beside* its
  blocks (rotary tables, causal masks, position ids) is computed again on every stage, as the model
  itself would: that is why rotary embeddings and masks survive the cut.

``OwnModel`` registers the wrapped model's children as its own, so ``named_parameters`` are the
model's names (``model.layers.0.self_attn.q_proj.weight``), and its forward returns the logits.

Weights are fixed by the seed: the model is built on the CPU under ``torch.manual_seed(seed)``, the
same on every rank and in the one-process reference. Dropout is set to zero: a layout must match
one process, and masks drawn per rank cannot.

Run alone (builds a tiny HF Llama, cuts stage 1 of 2 and runs it on a hidden state)::

    python -m kernels.model.own_model
"""
from __future__ import annotations

import base64
import pickle
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from kernels.contract import layout_rules
from kernels.contract.model_rules import HF
from kernels.model.own_sequence_parallel import (on_hidden_states, sequence_parallel_plans, shard_sequence,
                                                 whole_sequence)
from kernels.model.own_tp import parallel_style


class _Absent(nn.Module):
    """Stands in, on a later pipeline stage, for a module the first stage holds: no parameters.

    Its output is thrown away (the stage's first block takes the received hidden state instead), so
    it only has to have a shape the model's forward accepts: an embedding's (tokens -> zeros of its
    width), anything else's input.
    """

    def __init__(self, width: int | None) -> None:
        super().__init__()
        self.width = width

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if self.width and isinstance(x, torch.Tensor) and not x.is_floating_point():
            return torch.zeros(*x.shape, self.width, device=x.device)
        return x


class OwnModel(nn.Module):
    """The lab's view of a user's model (module docstring). ``spec`` is its ``RunConfig.model`` dict."""

    def __init__(self, inner: nn.Module, spec: Mapping[str, Any]) -> None:
        super().__init__()
        object.__setattr__(self, "inner", inner)  # not a child: its children are ours, under their own names
        object.__setattr__(self, "received", [None])  # a later stage's input, read by its first block's hook
        self.spec = dict(spec)
        for name, child in inner.named_children():
            self.add_module(name, child)
        for name, param in inner.named_parameters(recurse=False):
            self.register_parameter(name, param)
        self.is_hf = spec["family"] == HF
        self.has_first = self.has_last = True
        self.may_leave_parameters_unused = True  # kernels.parallel.ddp: routed experts, optional branches
        self.sequence_shards = 1  # tp under sequence parallelism: a received hidden state holds T/tp positions

    @property
    def blocks(self) -> dict[str, nn.Module]:
        """The model's blocks by name (those this stage kept)."""
        plan = self.spec.get("pp_plan")
        return dict(self.get_submodule(plan["blocks"]).named_children()) if plan else {}

    def tp_sizes(self, sequence_parallel: bool = False) -> dict[str, int]:
        """The sizes the plan splits (``split_sizes``)."""
        return split_sizes(self.spec, sequence_parallel)

    def tp_plan(self, sequence_parallel: bool = False, loss_parallel: bool = False) -> tuple[dict, dict]:
        """(per-block plan, plan for the rest): the spec's styles as DTensor styles, for the modules this
        stage holds (a stage without the embedding or the head leaves their entries out)."""
        plan, blocks = self.spec.get("tp_plan") or {}, (self.spec.get("pp_plan") or {}).get("blocks")
        prefix = f"{blocks}.*." if blocks else None
        block_plan = {k[len(prefix):]: parallel_style(v, loss_parallel) for k, v in plan.items()
                      if prefix and k.startswith(prefix)}
        outer = {k: parallel_style(v, loss_parallel) for k, v in plan.items()
                 if not (prefix and k.startswith(prefix))}
        if sequence_parallel:
            block_plan = sequence_parallel_plans(self.spec, block_plan)
        return block_plan, {k: v for k, v in outer.items() if _holds_parameters(self, k)}

    def after_tp(self, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
        """What sharding by ``parallelize_module`` undoes or leaves to the model: a head tied to the embedding
        gets the embedding's (now sharded) weight again, and an attention that splits one fused q/k/v
        output (GPT-2's ``split_size``) splits its local third. Under sequence parallelism the first stage
        cuts its first block's input to this rank's positions, and the last stage gathers its last block's
        output (``kernels.model.own_sequence_parallel``)."""
        tp = tp_mesh.size()
        if sequence_parallel:
            self.sequence_shards = tp
            if self.has_first:
                first = next(iter(self.blocks.values()))
                first.register_forward_pre_hook(on_hidden_states(lambda x: shard_sequence(x, tp_mesh)),
                                                with_kwargs=True)
            if self.has_last:
                last = list(self.blocks.values())[-1]
                last.register_forward_hook(lambda mod, args, out: whole_sequence(out, tp_mesh) if torch.is_tensor(out)
                                           else (whole_sequence(out[0], tp_mesh), *out[1:]))
        if self.spec.get("tied") and self.has_first and self.has_last:
            self.inner.get_output_embeddings().weight = self.inner.get_input_embeddings().weight
        fused = [k.rpartition(".")[0] for k, v in (self.spec.get("tp_plan") or {}).items() if v == "fused_qkv_colwise"]
        for pattern in fused:
            for name, module in self.named_modules():
                if matches(name, pattern) and isinstance(getattr(module, "split_size", None), int):
                    module.split_size //= tp

    def tied_copies(self, head_only: bool = False) -> list[nn.Parameter]:
        """This stage's copy of a head tied to the embedding: the embedding's weight on the first stage, the
        head's on the last (``kernels.parallel.tied_stages`` keeps them equal); none elsewhere or untied."""
        if not self.spec.get("tied") or self.has_first == self.has_last:
            return []
        if self.has_first:
            return [] if head_only else [self.inner.get_input_embeddings().weight]
        return [self.inner.get_output_embeddings().weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V); a pipeline stage may take or give hidden states (B, T, C)."""
        if x.is_floating_point():  # a later stage: its first block takes x (see cut_stage); x may be a sequence shard
            length = x.shape[1] * self.sequence_shards
            self.received[0], x = x, torch.zeros((x.shape[0], length), dtype=torch.long, device=x.device)
        try:
            if not self.is_hf:
                return self.inner(x)
            if self.has_last:
                return self.inner(input_ids=x, use_cache=False).logits
            # Not the last stage: the base model (its final norm is gone) gives the hidden state, and none of
            # what the LM class does to logits (soft-capping, scaling) applies to it. GPT-2 views its output as
            # (-1, T, C), which makes (B/tp, T, C) of a sequence shard: it is viewed back as (B, T/tp, C). A view
            # is copied: split-backward schedules detach a stage's output in place, which a view refuses.
            hidden = self.inner.get_decoder()(input_ids=x, use_cache=False).last_hidden_state
            if hidden.shape[0] != x.shape[0]:
                hidden = hidden.view(x.shape[0], -1, hidden.shape[-1])
            return hidden.clone() if hidden._is_view() else hidden
        finally:
            self.received[0] = None

    def cut_stage(self, stage: int, num_stages: int, stage_layers: Sequence[int] | None = None) -> "OwnModel":
        """Cut this model in place to pipeline stage ``stage`` of ``num_stages`` (module docstring); ``stage_layers``
        gives each stage's block count (``layout_rules.layer_split``), else the stages are equal."""
        plan = self.spec["pp_plan"]
        container = self.get_submodule(plan["blocks"])
        names = list(container._modules)
        keep = {names[i] for i in layout_rules.layer_split(len(names), num_stages, stage, stage_layers)}
        for name in names:
            if name not in keep:
                del container._modules[name]  # the kept blocks keep their names; iteration skips the gap
        self.has_first, self.has_last = stage == 0, stage == num_stages - 1
        if not self.has_first:
            for path in plan["first"]:
                module = self.get_submodule(path)
                self._replace(path, _Absent(getattr(module, "embedding_dim", None)))
            first_block = next(iter(container._modules.values()))
            first_block.register_forward_pre_hook(self._take_received, with_kwargs=True)
        if not self.has_last:
            for path in plan["last"]:
                self._replace(path, nn.Identity())
        self._slice_layer_types(sorted(keep, key=names.index), names)
        return self

    def _take_received(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # A bound method, not a closure: a deep copy of the cut stage rebinds it to the copy.
        return on_hidden_states(lambda _: self.received[0])(module, args, kwargs)

    def _replace(self, path: str, new: nn.Module) -> None:
        """Set the submodule at ``path`` to ``new`` in the wrapped model (and here, for a top-level one)."""
        parent, _, leaf = path.rpartition(".")
        setattr(self.inner.get_submodule(parent) if parent else self.inner, leaf, new)
        if not parent:
            setattr(self, leaf, new)

    def _slice_layer_types(self, kept: list[str], names: list[str]) -> None:
        """HF models look a block's attention kind up by its position in the loop (``layer_types[i]``):
        a stage's config lists its own blocks' kinds. (Each stage is a deep copy, with its own config.)"""
        config = getattr(self.inner, "config", None)
        types = getattr(config, "layer_types", None)
        if self.is_hf and isinstance(types, list) and len(types) == len(names) and len(set(types)) > 1:
            config.layer_types = [types[names.index(n)] for n in kept]


def split_sizes(spec: Mapping[str, Any], sequence_parallel: bool = False) -> dict[str, int]:
    """What tensor parallelism splits in a model the user brought (heads, kv_heads, module widths), and the
    sequence under sequence parallelism: each must divide by tp."""
    sizes = dict(spec.get("tp_sizes") or {})
    return {**sizes, "seq_len": spec["seq_len"]} if sequence_parallel else sizes


def matches(name: str, pattern: str) -> bool:
    """Whether a module name fits a plan pattern, ``*`` standing for one name part (a block's index)."""
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(w in ("*", p) for p, w in zip(parts, want))


def _holds_parameters(model: nn.Module, path: str) -> bool:
    try:
        return any(True for _ in model.get_submodule(path).parameters())
    except AttributeError:
        return False


def encode_factory(factory: Callable[[], nn.Module], loss: Callable | None = None) -> str:
    """A factory (and a loss) as text for a JSON record: cloudpickle by value, base64."""
    import cloudpickle
    return base64.b64encode(cloudpickle.dumps((factory, loss))).decode("ascii")


def decode_factory(text: str) -> tuple[Callable[[], nn.Module], Callable | None]:
    """The (factory, loss) ``encode_factory`` wrote."""
    return pickle.loads(base64.b64decode(text))


def hf_config(spec: Mapping[str, Any], *, for_training: bool = True):
    """The transformers config ``spec["config"]`` holds (its ``to_dict``); ``for_training``: dropout and jitter
    noise set to zero (an export keeps them as the user gave them)."""
    from transformers import AutoConfig
    fields = {k: v for k, v in spec["config"].items() if k not in ("model_type", "transformers_version")}
    config = AutoConfig.for_model(spec["config"]["model_type"], **fields)
    for name, value in list(vars(config).items()) if for_training else ():
        if any(word in name for word in ("dropout", "pdrop", "jitter")) and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


def build_own(spec: Mapping[str, Any], seed: int, device: torch.device | str = "cpu") -> OwnModel:
    """The model ``spec`` names with the weights ``seed`` fixes, in fp32 on ``device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec["family"] == HF:
            from transformers import AutoModelForCausalLM
            inner = AutoModelForCausalLM.from_config(hf_config(spec), dtype=torch.float32)
        else:
            inner = decode_factory(spec["factory"])[0]()
    for module in inner.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return OwnModel(inner.float().to(device), spec)


def meta_own(spec: Mapping[str, Any]) -> OwnModel:
    """The model on the meta device: names and shapes, nothing allocated."""
    with torch.device("meta"):
        if spec["family"] == HF:
            from transformers import AutoModelForCausalLM
            return OwnModel(AutoModelForCausalLM.from_config(hf_config(spec)), spec)
        return OwnModel(decode_factory(spec["factory"])[0](), spec)


def own_loss(spec: Mapping[str, Any]) -> Callable | None:
    """The loss a ``lab.Model`` brought, or None (the lab's cross-entropy over the logits)."""
    return None if spec["family"] == HF else decode_factory(spec["factory"])[1]


if __name__ == "__main__":
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    spec = {"family": HF, "config": cfg.to_dict(), "pp_plan": {"first": ["model.embed_tokens"],
            "blocks": "model.layers", "last": ["model.norm", "lm_head"]}}
    stage = build_own(spec, seed=0).cut_stage(1, 2)
    print(sorted(n for n, _ in stage.named_parameters()), stage(torch.randn(2, 8, 32)).shape)
