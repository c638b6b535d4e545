"""A generated task with a right answer: modular addition, "a b = c" with c = (a + b) mod p.

Each sequence of ``seq_len + 1`` tokens packs ``(seq_len + 1) // 4`` problems of four
tokens ``a, b, =, c`` (``=`` is id p; what is left over is padding, id p + 1). Only the
answers are targets: every other target is -100, which ``torch.nn.functional.cross_entropy``
ignores, so the loss is the answers' alone. Every sequence holds the same number of
answers, so the mean over a data-parallel rank's or a micro-batch's answers, averaged
again, is the global batch's mean, as for plain text.

The pairs (a, b) of a global batch are drawn from a generator seeded by (seed, step), so
the batch is a pure function of (seed, step) like every other data of the lab. There are
p² problems in all: with a small p a model sees them all within a few steps, and
``answer_accuracy`` then tells how many it gets right; the loss alone cannot say that.

Run alone (one sequence and its targets)::

    python -m kernels.train.task_data
"""
from __future__ import annotations

import torch

IGNORE = -100  # cross_entropy's default ignore_index


class ModularAddition:
    """Problems "a b = c" mod ``modulus``; ``global_batch(step, B)`` is deterministic."""

    def __init__(self, modulus: int, seq_len: int, seed: int = 0) -> None:
        if seq_len < 3:
            raise ValueError(f"seq_len={seq_len} must be at least 3: a problem is 4 tokens (inputs a, b, =)")
        self.modulus, self.seq_len, self.seed = modulus, seq_len, seed
        self.equals, self.pad = modulus, modulus + 1
        self.vocab = modulus + 2  # the ids it uses: 0..p-1, "=" and padding
        self.per_sequence = (seq_len + 1) // 4

    def global_batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs (B, T) and targets (B, T): the answers where the input is "=", -100 elsewhere."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        k, p = self.per_sequence, self.modulus
        a, b = torch.randint(0, p, (2, batch_size, k), generator=g)
        problems = torch.stack([a, b, torch.full_like(a, self.equals), (a + b) % p], dim=2)  # (B, k, 4)
        seq = torch.full((batch_size, self.seq_len + 1), self.pad, dtype=torch.long)
        seq[:, :4 * k] = problems.flatten(1)
        inputs, targets = seq[:, :-1].contiguous(), seq[:, 1:].clone()
        answer = torch.zeros(self.seq_len, dtype=torch.bool)
        answer[torch.arange(k) * 4 + 2] = True  # target index 4k+2 is token 4k+3, the answer c
        targets[:, ~answer] = IGNORE
        return inputs, targets


def answer_accuracy(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """The share of answer positions (targets not -100) whose most likely token is the answer."""
    scored = targets != IGNORE
    if not bool(scored.any()):
        raise ValueError("no answer positions among the targets")
    return float((logits.argmax(-1)[scored] == targets[scored]).float().mean())


if __name__ == "__main__":
    task = ModularAddition(modulus=7, seq_len=11)
    x, y = task.global_batch(step=0, batch_size=1)
    print("inputs ", x[0].tolist(), "\ntargets", y[0].tolist())
