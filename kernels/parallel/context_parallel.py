"""Context parallelism: ``apply_cp`` makes every attention of the lab's models a ring over the cp ranks of a replica.

Algorithm: ring attention (Liu et al., 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"), with the zig-zag (head-tail) load balance of torch's ``context_parallel``
(its ``_HeadTailLoadBalancer``) and of Megatron-LM's context parallelism.

What is split: the sequences of each data-parallel replica, over the ``cp`` ranks of its ring. Cut
each sequence of T tokens into 2·cp equal chunks; cp rank r keeps chunks r and 2·cp-1-r
(``kernels.parallel.ring_attention.zigzag_positions``) of the inputs and of the targets
(``kernels.train.batches.BatchStream``), so every rank holds an early and a late chunk and does the
same causal work. Embeddings, norms, MLPs, the head and the loss see T/cp tokens and need nobody
else; only attention reads earlier tokens, so ``apply_cp``:

- swaps each attention module's ``attend`` (causal SDPA in one process) for ring attention over the
  cp group (``kernels.parallel.ring_attention.ring_attention``): q stays, k/v blocks travel the ring,
  partial results merge by log-sum-exp; grouped-query k/v travel with their own, fewer heads;
- sets the global positions the rank holds on the model and on each attention: the GPT's learned
  position table indexes them, Llama's RoPE rotates by them.

How gradients and the loss meet: every cp rank holds the same weights and sits on the mesh's data
axis beside dp (``kernels.parallel.mesh``), so DDP / FSDP / ZeRO-1 average gradients over dp·cp
ranks and the loop averages the reported loss over them. Each rank's loss is the mean over its own
B/dp · T/cp tokens, the same count on every rank, so the mean of the dp·cp rank losses is the
global mean. Its gradient is the average of the rank gradients: ring backward sends each k/v block's
gradient back to the rank that owns it, so a rank's parameter gradient holds every rank's loss
through the keys and values it computed.

Tensor parallelism composes: TP splits the heads and the ring runs on the rank's own heads (the
attention function is swapped, the Linears TP shards are untouched, so the order does not matter).
Pipelines compose: every stage's attention is a ring over the same cp ranks, and a stage's input is
already the rank's s/cp positions. Refused before launch: sequence parallel ([cp-combination]: both
split the sequence), and models the user brought ([cp-model]): the lab swaps the attention of its own
models only.

On CUDA ranks the same ring runs (p2p over NCCL, or host-staged over gloo); torch's own
``torch.distributed.tensor.experimental.context_parallel``, which intercepts the CUDA SDPA kernels,
is not used.

Ring records: given a ``RingLog``, each attention call made while it records appends one
``kernels.contract.expert_context_records.RingStep`` dict per ring step (the train loop records the
last step's last micro-batch forward: ``kernels.train.step_hooks.StepHooks``).

Run alone (CP 2 on two CPU ranks: the GPT's logits against one process's at the rank's positions)::

    python -m kernels.parallel.context_parallel
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from kernels.contract.config_rules import ConfigError
from kernels.contract.expert_context_records import RingStep
from kernels.contract.layout_combinations import cp_chunk_problems
from kernels.parallel.ring_attention import ring_attention, zigzag_positions


class RingLog:
    """This rank's ring steps, as ``RingStep`` dicts in ``rows``, of the attention calls made inside ``recording``."""

    def __init__(self, rank: int, cp_rank: int, cp: int) -> None:
        self.rank, self.cp_rank, self.cp = rank, cp_rank, cp
        self.rows: list[dict[str, Any]] = []
        self._step: int | None = None  # the training step being recorded; None while not recording

    @contextlib.contextmanager
    def recording(self, step: int) -> Iterator[None]:
        """Record the ring steps of the attention calls made inside, as training step ``step``'s."""
        self._step = step
        try:
            yield
        finally:
            self._step = None

    @property
    def on(self) -> bool:
        return self._step is not None

    def add(self, layer: str, steps: list[dict[str, Any]]) -> None:
        """One attention call's ring steps (``ring_attention``'s ``steps`` dicts), under its module name."""
        self.rows += [RingStep(rank=self.rank, step=self._step, layer=layer, ring_step=s["step"], kv_rank=s["kv_rank"],
                               start_s=s["start_s"], compute_s=s["compute_s"], wait_s=s["wait_s"],
                               sent_bytes=s["sent_bytes"], chunk_pairs=s["chunk_pairs"], cp_rank=self.cp_rank,
                               cp=self.cp).to_dict() for s in steps]


class RingAttention:
    """An attention module's ``attend`` under context parallelism: causal attention by a ring over ``group``.

    A plain callable, not a module: the model's parameters, state dict and module names stay what they were.
    """

    def __init__(self, group: dist.ProcessGroup, layer: str, log: RingLog | None = None) -> None:
        self.group, self.layer, self.log = group, layer, log

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, h, T/cp, hd) q and (B, kv_h, T/cp, hd) k, v at the rank's zig-zag positions -> (B, h, T/cp, hd)."""
        steps: list[dict[str, Any]] | None = [] if self.log is not None and self.log.on else None
        out = ring_attention(q, k, v, self.group, steps=steps)
        if steps:
            self.log.add(self.layer, steps)
        return out


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The attention modules whose ``attend`` context parallelism swaps (the GPT's and Llama's), by name."""
    return [(name, m) for name, m in model.named_modules() if callable(getattr(m, "attend", None))]


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, log: RingLog | None = None) -> None:
    """Make ``model`` (a lab GPT or Llama, before TP/FSDP/DDP wrap it) train on this rank's zig-zag share of each
    sequence: every attention a ring over ``cp_mesh``'s group, the positions those of ``zigzag_positions``.

    Raises ConfigError [cp-model] for a model without the lab's attention, [cp-chunks] when its ``seq_len``
    does not cut into 2·cp equal chunks.
    """
    attentions = attention_modules(model)
    if not attentions or not hasattr(model, "positions"):
        raise ConfigError([("cp-model", f"context parallelism swaps the attention of the lab's own models (lab.GPT, "
                            f"lab.Llama), and {type(model).__name__} has none the lab knows; use cp=1")])
    cp, seq_len = cp_mesh.size(), model.config.seq_len
    problems = cp_chunk_problems(cp, seq_len)
    if problems:
        raise ConfigError(problems)
    device = next(model.parameters()).device
    positions = zigzag_positions(seq_len, cp, cp_mesh.get_local_rank()).to(device)
    model.positions = positions
    group = cp_mesh.get_group()
    for name, module in attentions:
        module.attend = RingAttention(group, name, log)
        if hasattr(module, "positions"):  # Llama's RoPE rotates by them
            module.positions = positions


def _selftest(rank: int, port: int, world: int) -> None:
    import os

    from kernels.model.gpt import GPTConfig, build_gpt
    from kernels.model.llama import LlamaConfig, build_llama

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", torch.arange(world), mesh_dim_names=("cp",))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    mine = zigzag_positions(16, world, rank)
    for name, make in (("gpt", lambda: build_gpt(GPTConfig(layers=2, d_model=32, heads=4, vocab=64, seq_len=16))),
                       ("llama", lambda: build_llama(LlamaConfig(hidden=32, heads=4, kv_heads=2, ffn=64, vocab=64,
                                                                 seq_len=16), "cpu", torch.float32))):
        whole, model = make(), make()
        log = RingLog(rank, rank, world)
        apply_cp(model, mesh, log)
        with log.recording(0), torch.no_grad():
            logits = model(tokens[:, mine])
            error = float((logits - whole(tokens)[:, mine]).abs().max())
        print(f"rank {rank} {name}: max |logits - one process's| {error:.1e}; {len(log.rows)} ring steps recorded")
    dist.destroy_process_group()


if __name__ == "__main__":
    from kernels.engine.run_alone import spawn_with_port

    spawn_with_port(_selftest, 2, 2)
