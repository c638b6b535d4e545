"""This rank's batches, step by step, ready on its device when the step wants them.

Every batch is a pure function of (seed, step) (``kernels.train.data.GlobalBatches``), so it
can be built at any time, in any thread, and still be the batch the reference sees. On a
GPU the Markov chain's token-by-token loop runs on the CPU for tens of milliseconds per
batch at real sequence lengths; built in the step it would leave the GPU idle that long.
So on CUDA a background thread builds the next batches while the current step runs (the
loop spends most of a GPU step waiting on the device, with the interpreter lock released)
into pinned memory, and the copy to the GPU is asynchronous. On the CPU there is nothing
to overlap with (the step's compute needs the core), so batches are built in the step.

Run alone (the same batches built ahead and in place)::

    python -m kernels.train.batches
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kernels.parallel.ring_attention import zigzag_positions
from kernels.train.data import GlobalBatches, SyntheticTokens, shard_batch


class BatchStream:
    """(inputs, targets) of this dp rank's share for steps first_step..steps-1, each (B/dp, T) on ``device``.

    With context parallelism (``cp`` > 1) each is (B/dp, T/cp): the columns ``zigzag_positions(T, cp, cp_rank)``
    of the replica's share, the positions the rank's ring attention holds (``kernels.parallel.context_parallel``).
    ``ahead`` batches are built in a background thread (default: 2 on CUDA, 0 on the CPU).
    ``first_step`` > 0 resumes the data where a checkpoint left it.
    """

    def __init__(self, data: GlobalBatches, *, steps: int, global_batch: int, dp_rank: int, dp: int,
                 device: torch.device, ahead: int | None = None, first_step: int = 0, cp: int = 1,
                 cp_rank: int = 0) -> None:
        self.data, self.steps, self.global_batch, self.first_step = data, steps, global_batch, first_step
        self.dp_rank, self.dp, self.device, self.cp, self.cp_rank = dp_rank, dp, device, cp, cp_rank
        self.ahead = (2 if device.type == "cuda" else 0) if ahead is None else ahead
        self._pin = device.type == "cuda" and torch.cuda.is_available()

    def _build(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = shard_batch(*self.data.global_batch(step, self.global_batch), self.dp_rank, self.dp)
        if self.cp > 1:  # targets too: each rank's loss is over the tokens it holds
            columns = zigzag_positions(inputs.size(1), self.cp, self.cp_rank)
            inputs, targets = inputs[:, columns], targets[:, columns]
        if self._pin:  # a pinned source lets the copy to the GPU run asynchronously
            inputs, targets = inputs.pin_memory(), targets.pin_memory()
        return inputs, targets

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.ahead == 0:
            for step in range(self.first_step, self.steps):
                yield tuple(t.to(self.device) for t in self._build(step))
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="batches") as pool:
            queued: list[Future] = [pool.submit(self._build, s)
                                    for s in range(self.first_step, min(self.first_step + self.ahead, self.steps))]
            for step in range(self.first_step, self.steps):
                inputs, targets = queued.pop(0).result()
                if step + self.ahead < self.steps:
                    queued.append(pool.submit(self._build, step + self.ahead))
                yield inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)


if __name__ == "__main__":
    data = SyntheticTokens(vocab=64, seq_len=16)
    kwargs = dict(steps=4, global_batch=8, dp_rank=1, dp=2, device=torch.device("cpu"))
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(BatchStream(data, **kwargs), BatchStream(data, ahead=2, **kwargs)))
    print("built ahead == built in place:", same)
