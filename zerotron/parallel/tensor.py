"""Megatron-style tensor parallelism, applied to a plain model afterwards by a plan.

A plan maps module-name patterns (fnmatch, e.g. "layers.*.attn.wq") to a style:

    "column"  nn.Linear whose output features are split: input copied in (all-reduced in backward)
    "column_qkv"  a fused q|k|v projection as "column", each of the three blocks split separately
    "row"     nn.Linear whose input features are split: outputs all-reduced in forward
              (Transformers' Conv1D, which stores its weight transposed, works for all linear styles)
    "vocab"   nn.Embedding whose vocabulary is split: each rank looks up its rows, outputs summed
    "head"    the output projection as "column", its logits left split, and the model's loss
              replaced by a vocabulary-parallel cross-entropy that never gathers the logits
    "head_gathered"  the output projection as "column" with its logits gathered whole (for models
              that compute their loss themselves, such as Hugging Face's)
    "norm"    a norm in the sequence-parallel region (only matters with sequence parallelism)

One column/row pair costs one all-reduce in forward and one in backward. With sequence
parallelism the activations between the pairs (norms, residuals) are split along the sequence,
and every all-reduce becomes an all-gather before a column layer plus a reduce-scatter after a
row layer: the same bytes, with 1/tp of the activation memory in those regions.
"""
from __future__ import annotations

import fnmatch

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import Comm
from ..errors import ConfigError
from .split import local_part
from .collectives import (all_reduce_max, copy_to_region, gather_last_dim, gather_sequence,
                          reduce_from_region, scatter_sequence)

STYLES = ("column", "column_qkv", "row", "vocab", "head", "head_gathered", "norm")


def _shard(param: nn.Parameter, dim: int, comm: Comm, stride: int = 1) -> nn.Parameter:
    """Keep this rank's slice of `param` in place: the Parameter object stays the same, so the
    optimizer groups and `model_parameters` a script built before `initialize` still name it.
    A weight shared by two modules (tied embedding and head) is cut once."""
    if hasattr(param, "tp_split_dim"):
        if (param.tp_split_dim, param.tp_stride) != (dim, stride):
            raise ConfigError("tensor-parallel plan", f"shared weight of shape {tuple(param.shape)}",
                              f"it is split along dim {param.tp_split_dim} by one module and dim {dim} by another; "
                              "untie it or give both modules the same style")
        return param
    param.data = local_part(param.detach(), dim, comm.rank, comm.size, stride).clone()
    param.tp_split_dim = dim  # how to reassemble the full tensor (checkpoints, parity checks)
    param.tp_comm = comm
    param.tp_stride = stride
    return param


class _Region:
    """State the tensor-parallel modules of one model share.

    `split`: whether this forward runs sequence-parallel. The embedding decides it per forward:
    sequence parallelism needs the length to divide the tensor-parallel size, so other lengths
    (generation, say) take the plain tensor-parallel path with the same weights.

    The entry into a column-parallel region is shared by the column layers reading one input
    (q, k and v; gate and up): the input is copied in (or sequence-gathered) once, so backward sums
    their gradients first and pays one all-reduce (or reduce-scatter), as a fused QKV would.
    """

    def __init__(self, comm: Comm, sequence_parallel: bool):
        self.comm, self.sequence_parallel = comm, sequence_parallel
        self.split = False
        self.last_in, self.last_out = None, None

    def start(self, seq_len: int):
        self.split = self.sequence_parallel and seq_len % self.comm.size == 0

    def enter(self, x):
        if x is not self.last_in:
            enter = gather_sequence if self.split else copy_to_region
            self.last_in, self.last_out = x, enter(x, self.comm)
        return self.last_out

    def exit(self, y):
        return scatter_sequence(y, self.comm) if self.split else reduce_from_region(y, self.comm)


def _transposed(module) -> bool:
    """Transformers' Conv1D (GPT-2) is a linear layer whose weight is stored (in, out)."""
    return not isinstance(module, nn.Linear) and hasattr(module, "nf")


class ColumnParallelLinear(nn.Module):
    """Output features split. `stride`: a fused projection (q|k|v) is split block by block."""

    def __init__(self, linear: nn.Module, comm: Comm, region: _Region, gather_output: bool = False,
                 stride: int = 1):
        super().__init__()
        self.transposed = _transposed(linear)
        out_dim = 1 if self.transposed else 0
        _check_divisible(linear.weight.shape[out_dim], comm.size * stride, "output features")
        self.region, self.comm, self.gather_output = region, comm, gather_output
        self.weight = _shard(linear.weight, out_dim, comm, stride)
        self.bias = _shard(linear.bias, 0, comm, stride) if linear.bias is not None else None

    def forward(self, x):
        weight = self.weight.t() if self.transposed else self.weight
        y = F.linear(self.region.enter(x), weight, self.bias)
        return gather_last_dim(y, self.comm) if self.gather_output else y


class RowParallelLinear(nn.Module):
    def __init__(self, linear: nn.Module, comm: Comm, region: _Region):
        super().__init__()
        self.transposed = _transposed(linear)
        in_dim = 0 if self.transposed else 1
        _check_divisible(linear.weight.shape[in_dim], comm.size, "input features")
        self.region = region
        self.weight = _shard(linear.weight, in_dim, comm)
        self.bias = linear.bias
        if self.bias is not None:  # added in the sequence-split region: sum its gradient there
            _sum_grad_when_split(self.bias, region)

    def forward(self, x):
        y = self.region.exit(F.linear(x, self.weight.t() if self.transposed else self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    def __init__(self, emb: nn.Embedding, comm: Comm, region: _Region):
        super().__init__()
        _check_divisible(emb.num_embeddings, comm.size, "vocabulary size")
        self.region = region
        self.per_rank = emb.num_embeddings // comm.size
        self.start = comm.rank * self.per_rank
        self.weight = _shard(emb.weight, 0, comm)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.start + self.per_rank)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        self.region.start(ids.shape[1])
        return self.region.exit(out)


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


def _check_divisible(n: int, tp: int, what: str):
    if n % tp:
        raise ConfigError("tensor_parallel.autotp_size", tp, f"it must divide the {what} ({n}); choose a size that does")


def apply_tensor_parallel(model: nn.Module, plan: dict[str, str], comm: Comm, sequence_parallel: bool = False):
    """Replace the modules `plan` names with their tensor-parallel versions, in place.

    Every rank must start from the same full weights (same seed); each keeps only its slice.
    Replicated parameters in sequence-parallel regions (norm weights) see only part of the
    sequence on each rank, so their gradients are summed over the tensor-parallel group.
    """
    for style in plan.values():
        if style not in STYLES:
            raise ConfigError("tensor-parallel plan", style, f"use one of {', '.join(STYLES)}")
    region = _Region(comm, sequence_parallel)
    matched = set()
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None:
            continue
        matched.add(name)
        if style == "norm":
            for p in module.parameters(recurse=False):
                _sum_grad_when_split(p, region)
            continue
        if style in ("column", "column_qkv", "head", "head_gathered"):
            new = ColumnParallelLinear(_expect_linear(module, name, style), comm, region,
                                       gather_output=style == "head_gathered", stride=3 if style == "column_qkv" else 1)
            if style == "head":  # training reads split logits; anything else gets them whole
                model.loss_fn = VocabParallelLoss(comm, new.weight.shape[0])
                model.output_fn = lambda logits, c=comm: gather_last_dim(logits, c)
        elif style == "row":
            new = RowParallelLinear(_expect_linear(module, name, style), comm, region)
        else:
            new = VocabParallelEmbedding(_expect(module, nn.Embedding, name, style), comm, region)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, new)
    if not matched:
        raise ConfigError("tensor-parallel plan", sorted(plan), "no module name matches any pattern of the plan")
    for p in model.parameters():
        if not hasattr(p, "tp_split_dim"):
            p.tp_replicated = True  # counted once, not tp times, in the global gradient norm
    return model


def _sum_grad_when_split(param: nn.Parameter, region: _Region):
    """A replicated parameter used where the sequence is split sees part of it on each rank:
    sum its gradient over the tensor-parallel group (only in forwards that ran split)."""
    if region.sequence_parallel:
        param.register_hook(lambda g: _sum_over(g, region.comm) if region.split else g)


def _sum_over(grad, comm: Comm):
    grad = grad.clone()
    comm.all_reduce(grad)
    return grad


def _expect_linear(module, name, style):
    return module if _transposed(module) else _expect(module, nn.Linear, name, style)


def _expect(module, cls, name, style):
    if not isinstance(module, cls):
        raise ConfigError("tensor-parallel plan", f"{name}: {style}",
                          f"'{style}' applies to {cls.__name__} modules, and {name} is a {type(module).__name__}")
    return module
