"""Tensor-parallel layers: Megatron's column- and row-split linear layers, the vocabulary-parallel
cross-entropy, and the one way a parameter is cut in place (`shard_parameter`).

One column/row pair costs one all-reduce in forward and one in backward. With sequence
parallelism the activations between the pairs (norms, residuals) are split along the sequence,
and every all-reduce becomes an all-gather before a column layer plus a reduce-scatter after a
row layer: the same bytes, with 1/tp of the activation memory in those regions.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm
from ..errors import ConfigError
from .collectives import (
    COPY_IN,
    GATHER_SEQUENCE,
    REDUCE_OUT,
    SCATTER_SEQUENCE,
    Conjugates,
    all_reduce_max,
    conjugate,
    gather_last_dim,
    split_sequence,
)
from .split import local_part


def shard_parameter(param: nn.Parameter, dim: int, comm: Comm, stride: int = 1) -> nn.Parameter:
    """Keep this rank's slice of `param` in place. The Parameter object stays the same, so the
    optimizer groups and `model_parameters` a script built before `initialize` still name it; a
    weight two modules share (a tied embedding and head) is cut once."""
    dim = dim % param.dim()
    if hasattr(param, "tp_split_dim"):
        if (param.tp_split_dim, param.tp_stride) != (dim, stride):
            raise ConfigError(
                "tensor-parallel plan",
                f"a weight of shape {tuple(param.shape)} shared by two modules",
                f"one splits it along dim {param.tp_split_dim}, the other along dim {dim}; untie it "
                "or give both modules styles that split it alike",
            )
        return param
    check_divisible(param.shape[dim], comm.size * stride, f"dimension {dim} of a {tuple(param.shape)} weight")
    param.data = local_part(param.detach(), dim, comm.rank, comm.size, stride).clone()
    param.tp_split_dim = dim  # how to reassemble the full tensor (checkpoints, consolidation)
    param.tp_comm = comm
    param.tp_stride = stride
    return param


def check_divisible(n: int, tp: int, what: str):
    if n % tp:
        raise ConfigError(
            "tensor_parallel.autotp_size", tp, f"it must divide the {what} ({n}); choose a size that does"
        )


class Region:
    """State the tensor-parallel modules of one model share.

    `split`: whether this forward runs sequence-parallel. The embedding decides it per forward:
    sequence parallelism needs the length to divide the tensor-parallel size, so other lengths
    (generation, say) take the plain tensor-parallel path with the same weights.

    The entry into a column-parallel region is shared by the column layers reading one input
    (q, k and v; gate and up): the input is copied in (or sequence-gathered) once, so backward sums
    their gradients first and pays one all-reduce (or reduce-scatter), as a fused QKV would.

    `entering` / `exiting`: what the column layers' input and the row layer's output go through:
    the collective pairs of `pairs()`, except while a "region" module runs one half of its batch
    (tensor_parallel.tp_overlap_comm, parallel/overlap.py), which runs them itself around the half
    (`collectives_outside`): then the column layers read their input as it comes.
    """

    def __init__(self, comm: Comm, sequence_parallel: bool):
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.split = False
        self.last_in, self.last_out = None, None
        self.entering, self.exiting = self._enter, self._exit

    def start(self, seq_len: int):
        self.split = self.sequence_parallel and seq_len % self.comm.size == 0

    def pairs(self) -> tuple[Conjugates, Conjugates]:
        """The entry's and the exit's collective pairs in this forward."""
        return (GATHER_SEQUENCE, SCATTER_SEQUENCE) if self.split else (COPY_IN, REDUCE_OUT)

    def enter(self, x):
        return self.entering(x)

    def exit(self, y):
        return self.exiting(y)

    def _enter(self, x):
        if x is not self.last_in:
            self.last_in, self.last_out = x, conjugate(x, self.pairs()[0], self.comm)
        return self.last_out

    def _exit(self, y):
        return conjugate(y, self.pairs()[1], self.comm)

    @property
    def collectives_inside(self) -> bool:
        return self.exiting == self._exit

    @contextlib.contextmanager
    def collectives_outside(self, exiting):
        """The modules run without the region's collectives: the column layers read their input as
        it comes, the row layer's output goes to `exiting`."""
        self.entering, self.exiting = _as_is, exiting
        try:
            yield
        finally:
            self.entering, self.exiting = self._enter, self._exit


def _as_is(x):
    return x


def transposed(module) -> bool:
    """Transformers' Conv1D (GPT-2) is a linear layer whose weight is stored (in, out)."""
    return not isinstance(module, nn.Linear) and hasattr(module, "nf")


class ColumnParallelLinear(nn.Module):
    """Output features split (`stride` > 1: a fused q|k|v or gate|up projection, block by block);
    `gather_output`: the outputs are gathered whole (the next layer reads them replicated)."""

    def __init__(self, linear: nn.Module, comm: Comm, region: Region, gather_output: bool = False, stride: int = 1):
        super().__init__()
        self.transposed = transposed(linear)
        self.region, self.comm, self.gather_output = region, comm, gather_output
        self.weight = shard_parameter(linear.weight, 1 if self.transposed else 0, comm, stride)
        self.bias = shard_parameter(linear.bias, 0, comm, stride) if linear.bias is not None else None
        self.in_features = self.weight.shape[0 if self.transposed else 1]
        self.out_features = self.weight.shape[1 if self.transposed else 0] * (comm.size if gather_output else 1)

    def forward(self, x):
        weight = self.weight.t() if self.transposed else self.weight
        y = F.linear(self.region.enter(x), weight, self.bias)
        return gather_last_dim(y, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Input features split; outputs summed over the group, the bias added once after the sum.
    `split_input`: the input arrives whole (replicated) and each rank takes its slice."""

    def __init__(self, linear: nn.Module, comm: Comm, region: Region, split_input: bool = False):
        super().__init__()
        self.transposed = transposed(linear)
        self.region, self.comm, self.split_input = region, comm, split_input
        self.weight = shard_parameter(linear.weight, 0 if self.transposed else 1, comm)
        self.bias = linear.bias
        if self.bias is not None:  # added in the sequence-split region: sum its gradient there
            sum_grad_over(self.bias, region, only_when_split=True)
        self.in_features = self.weight.shape[0 if self.transposed else 1] * (comm.size if split_input else 1)
        self.out_features = self.weight.shape[1 if self.transposed else 0]

    def forward(self, x):
        if self.split_input:
            x = split_sequence(x, self.comm, dim=-1)
        y = self.region.exit(F.linear(x, self.weight.t() if self.transposed else self.weight))
        return y + self.bias if self.bias is not None else y


def sum_grad_over(param: nn.Parameter, region: Region, only_when_split: bool = False):
    """A replicated parameter that sees part of the data on each rank (a norm where the sequence
    is split; a per-head norm over this rank's heads): sum its gradient over the group."""
    if only_when_split and not region.sequence_parallel:
        return
    param.register_hook(lambda g: _summed(g, region.comm) if region.split or not only_when_split else g)


def _summed(grad, comm: Comm):
    grad = grad.clone()
    comm.all_reduce(grad)
    return grad


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary: only (tokens,) -sized statistics
    (max, sum of exponentials, target logit) cross ranks, never the logits."""

    @staticmethod
    def forward(ctx, logits, target, comm, start, ignore_index):
        logits = logits.float()
        peak = all_reduce_max(logits.max(dim=-1).values, comm)
        shifted = logits - peak.unsqueeze(-1)
        local_target = target - start
        inside = (local_target >= 0) & (local_target < logits.shape[-1])
        local_target = local_target.masked_fill(~inside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        exp = shifted.exp()
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        if comm.size > 1:
            comm.all_reduce(sums)
        softmax = exp / sums[0].unsqueeze(-1)
        valid = target != ignore_index
        ctx.save_for_backward(softmax, local_target, inside, valid)
        return (sums[0].log() - sums[1]).masked_fill(~valid, 0.0)

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, inside, valid = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_target] -= inside.to(grad.dtype)
        return grad * (grad_loss * valid).unsqueeze(-1), None, None, None, None


class VocabParallelLoss:
    """Drop-in for the model's `loss_fn(logits, targets)`: mean cross-entropy of split logits over
    the targets that are not `ignore_index` (-100, as F.cross_entropy)."""

    def __init__(self, comm: Comm, vocab_per_rank: int, ignore_index: int = -100):
        self.comm, self.start, self.ignore_index = comm, comm.rank * vocab_per_rank, ignore_index

    def __call__(self, logits, targets):
        flat, targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        losses = _VocabParallelCrossEntropy.apply(flat, targets, self.comm, self.start, self.ignore_index)
        return losses.sum() / (targets != self.ignore_index).sum().clamp(min=1)
