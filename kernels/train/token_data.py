"""Real tokens: a 1-D id stream from a file or from text, cut into next-token training windows.

``TokenWindows`` cuts the stream into non-overlapping windows of ``seq_len + 1`` tokens
(inputs are the first ``seq_len``, targets the last ``seq_len``) and visits them epoch
by epoch, each epoch in the order of a permutation seeded by ``(seed, epoch)``: sample
``i`` of the run is window ``perm_e[i mod n]`` of epoch ``e = i // n``, as
``DistributedSampler(shuffle=True, seed)`` with ``set_epoch(e)`` orders a dataset (``shuffle=False``:
every epoch in the file's order, as ``DistributedSampler(shuffle=False)``). Step ``s``
takes samples ``s*B .. s*B+B-1``, so a global batch is a pure function of (seed, step):
every rank and the one-process reference build the same one, and a run resumed at step
``k`` feeds batch ``k`` next, the next unseen one.

Text is tokenised by its UTF-8 bytes (ids 0-255, so vocab >= 256) or by a ``tokenizers``
tokenizer saved as JSON (``Tokenizer.from_file``: local files only, nothing downloaded).
A process reads and tokenises a given set of files once (``stream``'s cache), so a warm
pool's later runs on the same text start at once.

Run alone (windows of a short text)::

    python -m kernels.train.token_data
"""
from __future__ import annotations

import functools
import os
import tempfile

import torch

from kernels.contract.data_spec import DataKind, DataSpec


class TokenWindows:
    """Next-token windows of a 1-D id stream; ``global_batch(step, B)`` is deterministic."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int = 0, shuffle: bool = True) -> None:
        self.tokens, self.seq_len, self.seed, self.shuffle = tokens, seq_len, seed, shuffle
        self.windows = (tokens.numel() - 1) // seq_len  # the last target of window w is token (w+1)*T
        if self.windows < 1:
            raise ValueError(f"{tokens.numel()} tokens hold no window of seq_len+1 = {seq_len + 1} tokens")
        self._orders: dict[int, torch.Tensor] = {}

    def order(self, epoch: int) -> torch.Tensor:
        """The windows of ``epoch`` in the order it visits them: DistributedSampler's permutation for
        ``set_epoch(epoch)`` (a generator seeded by seed + epoch), or 0..n-1 without shuffle."""
        if epoch not in self._orders:  # a step spans at most two epochs: keep the last few
            self._orders = {e: o for e, o in self._orders.items() if e >= epoch - 1}
            self._orders[epoch] = torch.randperm(self.windows, generator=torch.Generator().manual_seed(
                self.seed + epoch)) if self.shuffle else torch.arange(self.windows)
        return self._orders[epoch]

    def epoch(self, step: int, batch_size: int) -> int:
        """The epoch of step ``step``'s first sample (a step may end in the next one)."""
        return step * batch_size // self.windows

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets, each (B, T) int64, the same on every call."""
        T = self.seq_len
        rows = []
        for i in range(step * batch_size, (step + 1) * batch_size):
            start = int(self.order(i // self.windows)[i % self.windows]) * T
            rows.append(self.tokens[start:start + T + 1])
        seq = torch.stack(rows).long()  # (B, T+1)
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


class StepBatches:
    """The user's batches in order: step ``s`` is batch ``s`` (inputs and targets as given)."""

    def __init__(self, path: str) -> None:
        self.batches = _load_npy(path).long()  # (steps, 2, B, T)
        if self.batches.dim() != 4 or self.batches.size(1) != 2:
            raise ValueError(f"{path}: batch data is (steps, 2, B, T) ids, got {tuple(self.batches.shape)}")
        self.tokens = self.batches[:, 0]  # the inputs: the ids checked against the vocabulary

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``step``'s inputs and targets, each (B, T) int64."""
        if step >= len(self.batches) or batch_size != self.batches.size(2):
            raise ValueError(f"step {step} with a batch of {batch_size}: the data holds {len(self.batches)} "
                             f"batches of {self.batches.size(2)}")
        return self.batches[step, 0].contiguous(), self.batches[step, 1].contiguous()


@functools.lru_cache(maxsize=8)
def _stream(spec: DataSpec, stamps: tuple[float, ...]) -> torch.Tensor:
    """The spec's ids, read once per set of file versions (``stamps``: their modification times)."""
    del stamps  # part of the cache key only: an edited file is read again
    if spec.kind is DataKind.TOKENS:
        path = spec.paths[0]
        ids = torch.load(path, weights_only=True) if path.endswith(".pt") else _load_npy(path)
        if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex():
            raise ValueError(f"{path}: token data is a 1-D tensor of integer ids, got {ids.dtype} {tuple(ids.shape)}")
        return ids.long()
    text = "".join(open(p, encoding="utf-8").read() for p in spec.paths)
    if spec.tokenizer is None:
        return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()
    from tokenizers import Tokenizer  # optional: only text with a tokenizer needs it

    return torch.tensor(Tokenizer.from_file(spec.tokenizer).encode(text).ids, dtype=torch.long)


def _load_npy(path: str) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.load(path, allow_pickle=False).copy())


def stream(spec: DataSpec) -> torch.Tensor:
    """The 1-D id stream of a ``tokens`` or ``text`` spec (cached while its files are unchanged)."""
    files = spec.paths + ((spec.tokenizer,) if spec.tokenizer else ())
    return _stream(spec, tuple(os.stat(p).st_mtime for p in files))


if __name__ == "__main__":
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("the quick brown fox jumps over the lazy dog. " * 4)
    data = TokenWindows(stream(DataSpec(DataKind.TEXT, paths=(f.name,))), seq_len=12)
    x, y = data.global_batch(step=0, batch_size=2)
    print(f"{data.windows} windows; step 0 sample 0:", bytes(x[0].tolist()).decode(), "->", bytes(y[0].tolist()).decode())
    os.unlink(f.name)
