"""Synthetic, learnable token data and the ways a global batch is split over ranks.

The data is a fixed random first-order Markov chain over the vocabulary (a
"bigram language"): every token has a few successors with fixed, skewed
probabilities. Its entropy rate is far below ln(vocab), so a GPT's loss falls
quickly from ln(vocab) towards ``SyntheticTokens.loss_floor``. Everything is
seeded: the chain by ``seed``, each batch by ``(seed, step)``, so every rank can
build the same global batch without any communication and the one-process
reference sees exactly the same tokens.

Splitting, as PyTorch does it:

- ``shard_batch`` splits a global batch over data-parallel ranks the way
  ``torch.utils.data.DistributedSampler(shuffle=False, drop_last=True)`` does: rank
  r takes samples r, r+dp_world, r+2*dp_world, ... (strided, not contiguous). We
  require the batch to divide evenly, so no sample is dropped or padded and the
  mean loss over ranks equals the global-batch loss.
- ``microbatches`` splits a rank's batch into n contiguous chunks, as
  ``torch.distributed.pipelining`` splits its inputs (``TensorChunkSpec(0)``).

Run alone (prints a sample and the entropy floor)::

    python -m kernels.train.data
"""
from __future__ import annotations

import functools
import math
from typing import Protocol

import torch

from kernels.contract.config_rules import ConfigError
from kernels.contract.data_spec import DataKind
from kernels.contract.run_config import RunConfig
from kernels.model.family import model_config
from kernels.train.task_data import ModularAddition
from kernels.train.token_data import StepBatches, TokenWindows, stream

_BRANCH_WEIGHTS = (8.0, 4.0, 2.0, 1.0)  # successor probabilities ∝ these: entropy ≈ 1.14 nats
# Up to this vocabulary the successors come from sorting a V×V random matrix, as they always have (the data of
# every small model stays the same); above, that sort takes minutes and V²·12 bytes (13 GB at 32768).
SORTED_SUCCESSORS_MAX_VOCAB = 2048


def _mix(seed: int, step: int) -> int:
    """A seed for one step's batch, apart from the chain's own seed (splitmix64 style)."""
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) % (2**64)
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) % (2**64)
    return z % (2**63)


class SyntheticTokens:
    """A seeded Markov-chain token stream; ``global_batch(step, B)`` is deterministic."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0) -> None:
        branches = len(_BRANCH_WEIGHTS)
        if vocab < branches:
            raise ValueError(f"vocab={vocab} must be at least {branches}")
        if seq_len < 1:
            raise ValueError(f"seq_len={seq_len} must be positive")
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        self.successors = successor_table(vocab, branches, seed)  # (V, branches): the distinct tokens after t
        w = torch.tensor(_BRANCH_WEIGHTS)
        self.branch_probs = w / w.sum()  # (branches,)

    @property
    def loss_floor(self) -> float:
        """Entropy rate of the chain in nats: the best mean loss a model can reach.

        The first target of each sequence is predictable too (it follows the first
        input), so every target costs this much at best.
        """
        p = self.branch_probs
        return float(-(p * p.log()).sum())

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (B, T) int64, the same on every call."""
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        T = self.seq_len
        seq = torch.empty(batch_size, T + 1, dtype=torch.long)  # (B, T+1)
        seq[:, 0] = torch.randint(0, self.vocab, (batch_size,), generator=g)
        branch = torch.multinomial(self.branch_probs, batch_size * T, replacement=True, generator=g)
        branch = branch.view(batch_size, T)  # (B, T): which successor each step takes
        for t in range(T):
            seq[:, t + 1] = self.successors[seq[:, t], branch[:, t]]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # (B, T), (B, T)


@functools.lru_cache(maxsize=4)  # a warm pool's next run of the same vocabulary finds it built
def successor_table(vocab: int, branches: int, seed: int) -> torch.Tensor:
    """(vocab, branches) int64: for each token, ``branches`` distinct tokens that may follow it, seeded."""
    g = torch.Generator().manual_seed(seed)
    if vocab <= SORTED_SUCCESSORS_MAX_VOCAB:
        return torch.rand(vocab, vocab, generator=g).argsort(dim=1)[:, :branches]
    table = []
    for row in torch.randint(0, vocab, (vocab, 2 * branches), generator=g).tolist():
        chosen = list(dict.fromkeys(row))[:branches]  # the first distinct draws, in order
        while len(chosen) < branches:
            extra = int(torch.randint(0, vocab, (1,), generator=g))
            chosen += [] if extra in chosen else [extra]
        table.append(chosen)
    return torch.tensor(table)


class GlobalBatches(Protocol):
    """What every data of the lab is: a step's global batch, a pure function of (seed, step)."""

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets, each (B, T) int64."""


def dataset(run: RunConfig) -> GlobalBatches:
    """The run's data (``RunConfig.data``): every rank and the one-process reference draw the same global batches.

    Raises ``ConfigError`` [data-vocab] when its ids do not fit the model's vocabulary, and
    [data-length] when it holds no sequence: the rules the driver checks before launch.
    """
    mcfg, spec = model_config(run), run.data
    if spec.kind is DataKind.SYNTHETIC:
        return SyntheticTokens(mcfg.vocab, mcfg.seq_len, seed=run.dataset_seed)
    if spec.kind is DataKind.TASK:
        data, top = ModularAddition(spec.modulus, mcfg.seq_len, seed=run.dataset_seed), spec.modulus + 1
    elif spec.kind is DataKind.BATCHES:
        data = StepBatches(spec.paths[0])
        top = int(data.batches.max())
        if data.batches.size(3) != mcfg.seq_len:
            raise ConfigError([("data-length", f"{spec.describe()} holds sequences of {data.batches.size(3)} "
                                f"tokens and the model trains on seq_len={mcfg.seq_len}")])
    else:
        ids = stream(spec)
        if ids.numel() <= mcfg.seq_len:
            raise ConfigError([("data-length", f"{spec.describe()} holds {ids.numel()} tokens: a sequence needs "
                                f"seq_len+1 = {mcfg.seq_len + 1}")])
        # shuffle None is the finite data's default: a new permutation each epoch (DistributedSampler's)
        data, top = TokenWindows(ids, mcfg.seq_len, seed=run.dataset_seed, shuffle=run.shuffle is not False), \
            int(ids.max())
    if top >= mcfg.vocab or (spec.kind is not DataKind.TASK and int(data.tokens.min()) < 0):
        raise ConfigError([("data-vocab", f"{spec.describe()} uses token ids up to {top}, so the model's vocab "
                            f"must be at least {top + 1}, got {mcfg.vocab}")])
    return data


def shard_batch(inputs: torch.Tensor, targets: torch.Tensor, dp_rank: int,
                dp_world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's share: samples dp_rank, dp_rank+dp_world, ... (B/dp_world, T)."""
    B = inputs.size(0)
    if not 0 <= dp_rank < dp_world:
        raise ValueError(f"dp_rank={dp_rank} must be in 0..{dp_world - 1}")
    if B % dp_world:
        raise ValueError(f"global batch {B} must be divisible by dp_world={dp_world}")
    return inputs[dp_rank::dp_world].contiguous(), targets[dp_rank::dp_world].contiguous()


def microbatches(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """``n`` contiguous equal chunks of ``x`` along dim 0, each (B/n, ...)."""
    if n < 1 or x.size(0) % n:
        raise ValueError(f"batch {x.size(0)} must be divisible by n={n} micro-batches")
    return list(x.chunk(n, dim=0))


if __name__ == "__main__":
    data = SyntheticTokens(vocab=64, seq_len=16, seed=0)
    x, y = data.global_batch(step=0, batch_size=4)
    print("inputs[0] ", x[0].tolist())
    print("targets[0]", y[0].tolist())
    print(f"loss floor {data.loss_floor:.3f} nats vs ln V = {math.log(data.vocab):.3f}")
    print("rank 1 of 2 takes samples 1, 3:", shard_batch(x, y, 1, 2)[0].shape)
