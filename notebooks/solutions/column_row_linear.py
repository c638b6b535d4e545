%%px
# Exercise column_row_linear (runs on every rank): Megatron's f and g, then the two split Linears.
import torch.nn as nn
import torch.nn.functional as F


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's f: identity in forward; in backward, all-reduce (sum) the input's gradient over the ranks."""

    @staticmethod
    def forward(ctx, x):
        ### BEGIN SOLUTION
        return x
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        grad = grad.clone()  # sum a copy: autograd may hand this buffer to other consumers too
        dist.all_reduce(grad)  # each rank's columns of A gave part of dL/dX; the whole is their sum
        return grad
        ### END SOLUTION


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce (sum) in forward; identity in backward."""

    @staticmethod
    def forward(ctx, partial):
        ### BEGIN SOLUTION
        total = partial.clone()
        dist.all_reduce(total)  # each rank's rows of B gave a partial Y; Y is their sum
        return total
        ### END SOLUTION

    @staticmethod
    def backward(ctx, grad):
        ### BEGIN SOLUTION
        return grad  # Y = sum of the parts, so dL/d(part) = dL/dY on every rank
        ### END SOLUTION


class ColumnParallelLinear(nn.Module):
    """``full`` split by its outputs: the columns of A in Y = XA, the rows of nn.Linear's (out, in) weight.

    This rank keeps out/world of them: weight (out/world, in) and bias (out/world,), DTensor's Shard(0).
    Forward: the whole input X on every rank -> this rank's out/world outputs.
    """

    def __init__(self, full: nn.Linear):
        super().__init__()
        ### BEGIN SOLUTION
        part = slice(rank * full.out_features // world, (rank + 1) * full.out_features // world)
        self.weight = nn.Parameter(full.weight.detach()[part].clone())
        self.bias = nn.Parameter(full.bias.detach()[part].clone())
        ### END SOLUTION

    def forward(self, x):  # (N, in), whole on every rank -> (N, out/world)
        ### BEGIN SOLUTION
        return F.linear(CopyToTensorParallel.apply(x), self.weight, self.bias)
        ### END SOLUTION


class RowParallelLinear(nn.Module):
    """``full`` split by its inputs: the rows of B in Y = HB, the columns of nn.Linear's weight (Shard(1)).

    This rank keeps weight (out, in/world); the bias stays whole and is added once, after the sum.
    Forward: this rank's in/world slice of H -> the whole output Y on every rank.
    """

    def __init__(self, full: nn.Linear):
        super().__init__()
        ### BEGIN SOLUTION
        part = slice(rank * full.in_features // world, (rank + 1) * full.in_features // world)
        self.weight = nn.Parameter(full.weight.detach()[:, part].clone())
        self.bias = nn.Parameter(full.bias.detach().clone())
        ### END SOLUTION

    def forward(self, h):  # (N, in/world), this rank's slice -> (N, out), whole on every rank
        ### BEGIN SOLUTION
        return ReduceFromTensorParallel.apply(F.linear(h, self.weight)) + self.bias
        ### END SOLUTION
