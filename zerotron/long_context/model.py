"""Sequence parallelism applied to a model from outside (the reference GPT's adapter uses these):
the attention core wrapped in Ulysses' all-to-alls or run as ring attention, and the loss every
sequence rank computes as the full sequence's mean (ALST's convention, docs/long-context.md)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import comm_for
from .ring import ring_attention
from .ulysses import seq_all_to_all


class UlyssesCore:
    """An attention core on (batch, heads, seq, head_dim) tensors run over the full sequence for
    heads / sp heads: q, k, v trade their sequence split for a head split, the output trades back."""

    def __init__(self, core, group):
        self.core, self.group = core, group

    def __call__(self, q, k, v):
        q, k, v = (seq_all_to_all(t, self.group, 1, 2) for t in (q, k, v))
        return seq_all_to_all(self.core(q, k, v), self.group, 2, 1)


class RingCore:
    """Causal attention on (batch, heads, seq, head_dim) tensors whose sequence is split over the
    ring `group` in load-balanced halves (layout.py), key/value blocks passed around the ring."""

    def __init__(self, group):
        self.group = group

    def __call__(self, q, k, v):
        return ring_attention(q, k, v, self.group, causal=True)


class _SumOverGroup(torch.autograd.Function):
    """Sum over the sequence ranks; its gradient is the sum of theirs (each rank's loss depends on
    every rank's share)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        out = x.clone()
        comm.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        ctx.comm.all_reduce(grad)
        return grad, None


class SequenceMeanLoss:
    """Cross-entropy over the whole sequence on every sequence rank: the sums and valid-token counts
    of the ranks' slices added up (targets of -100 are skipped)."""

    def __init__(self, group):
        self.comm = comm_for(group, "sp")

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        count = (targets != -100).sum().to(total.dtype)
        return _SumOverGroup.apply(total, self.comm) / _SumOverGroup.apply(count, self.comm)
