"""Tiled compute along the sequence (ALST's TiledMLP, tiled loss and `sequence_tiled_compute`, with
DeepSpeed's signatures): a per-token function run on `shards` slices of the sequence one after
another, so what it keeps for backward is one slice's worth, never the whole sequence's (an MLP's
4x-wide activations, a loss's vocabulary-wide logits).

Each slice runs under torch's non-reentrant checkpoint: forward keeps only the slice's input, and
backward recomputes the slice's intermediates when it reaches them, one slice at a time. Everything
stays in one autograd graph, so each parameter's gradient is accumulated once per backward, scaled
by whatever multiplies the result (loss scale, gradient accumulation, a weighted loss), and ZeRO
sees one gradient per parameter at every stage. DeepSpeed's versions instead run their own
backward passes (the loss inside forward), which needs `compute_params` flags for ZeRO and leaves
parameter gradients unscaled by anything applied after the loss; here `compute_params` is accepted
and not needed. Cost: the function runs twice per step (forward and recompute).
"""

from __future__ import annotations

import math

import torch
from torch.utils.checkpoint import checkpoint


def _slices(n: int, shards: int) -> list[tuple[int, int]]:
    step = math.ceil(n / max(1, shards))
    return [(i, min(i + step, n)) for i in range(0, n, step)] if n else [(0, 0)]


def _checkpointed(fn, *args):
    if torch.is_grad_enabled() and any(torch.is_tensor(a) and a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)  # nothing to differentiate through (or parameters only): checkpoint would only cost


def _reduce(out: torch.Tensor, reduction):
    if reduction is None:
        return out
    if reduction == "mean":
        return out.mean()
    if reduction == "sum":
        return out.sum()
    raise ValueError(f"output_reduction is {reduction!r}: use None, 'mean' or 'sum'")


def sequence_tiled_compute(
    fn,
    seqlen,
    shards,
    kwargs_to_shard,
    kwargs_to_pass,
    grad_requiring_tensor_key,
    compute_params=None,
    output_unshard_dimension=1,
    output_reduction="mean",
):
    """`fn(**slices, **kwargs_to_pass)` on `shards` slices of dim 1 of every `kwargs_to_shard` tensor
    ([batch, seq, ...], `seqlen` long); the outputs joined along `output_unshard_dimension` (0: each
    slice's output stacked as a new first dimension) and reduced by `output_reduction` (None,
    "mean" over every element, or "sum"). Gradients reach every tensor and parameter fn uses."""
    if grad_requiring_tensor_key not in kwargs_to_shard and grad_requiring_tensor_key not in kwargs_to_pass:
        raise ValueError(f"grad_requiring_tensor_key {grad_requiring_tensor_key!r} names none of the keyword arguments")
    keys = list(kwargs_to_shard)

    def run(*sliced):
        return fn(**dict(zip(keys, sliced)), **kwargs_to_pass)

    outs = [
        _checkpointed(run, *(v[:, a:b] for v in kwargs_to_shard.values()))
        for a, b in _slices(seqlen, shards)
        if b > a or seqlen == 0
    ]
    if output_unshard_dimension == 0:
        joined = torch.stack(outs)
    else:
        joined = torch.cat(outs, dim=output_unshard_dimension)
    return _reduce(joined, output_reduction)


class SequenceTiledCompute:
    """DeepSpeed's autograd function behind `sequence_tiled_compute`, with its positional `apply`."""

    @staticmethod
    def apply(
        fn,
        seqlen,
        shards,
        keys_to_shard,
        keys_to_pass,
        grad_requiring_tensor_key,
        compute_params,
        output_unshard_dimension,
        output_reduction,
        *args,
    ):
        values = list(args)
        to_shard = dict(zip(keys_to_shard, values[: len(keys_to_shard)]))
        to_pass = dict(zip(keys_to_pass, values[len(keys_to_shard) :]))
        return sequence_tiled_compute(
            fn,
            seqlen,
            shards,
            to_shard,
            to_pass,
            grad_requiring_tensor_key,
            compute_params,
            output_unshard_dimension,
            output_reduction,
        )


class TiledMLP:
    """DeepSpeed's `TiledMLP.apply(fn, self, x, shards, compute_params)`: `fn(self, x)` (an MLP's
    forward) on `shards` slices of the second-to-last dimension of `x`, joined back."""

    @staticmethod
    def apply(fn, self, x, shards, compute_params=None):
        n = x.shape[-2]
        outs = [_checkpointed(fn, self, x[..., a:b, :]) for a, b in _slices(n, shards)]
        return torch.cat(outs, dim=-2)


class TiledFusedLogitsLoss:
    """DeepSpeed's `TiledFusedLogitsLoss.apply(fn, self, x, y, mask, shards, compute_params,
    output_reduction)`: `fn(self, x, y[, mask])` returns one slice's loss from its hidden states
    (e.g. lm_head then cross-entropy); x [batch, seq, ...] and y [batch, seq, ...] are flattened to
    rows and cut into `shards` slices, and the slices' losses averaged ("mean") or added ("sum").
    Only one slice's logits exist at a time, in forward and in backward."""

    @staticmethod
    def apply(fn, self, x, y, mask, shards, compute_params, output_reduction):
        if output_reduction not in ("mean", "sum"):
            raise ValueError(f"output_reduction is {output_reduction!r}: use 'mean' or 'sum'")
        if x.dim() < 2 or y.dim() < 2 or x.shape[:2] != y.shape[:2]:
            raise ValueError(
                f"x {tuple(x.shape)} and y {tuple(y.shape)} must both be [batch, seq, ...] with the same batch and seq"
            )
        if mask is not None and tuple(mask.shape) != tuple(x.shape[:2]):
            raise ValueError(f"mask {tuple(mask.shape)} must be [batch, seq], x's first two dims {tuple(x.shape[:2])}")
        rows = x.reshape(-1, *x.shape[2:])
        targets = y.reshape(-1, *y.shape[2:])
        flat_mask = None if mask is None else mask.reshape(-1)
        losses = []
        for a, b in _slices(rows.shape[0], shards):
            extra = () if flat_mask is None else (flat_mask[a:b],)
            losses.append(_checkpointed(fn, self, rows[a:b], targets[a:b], *extra))
        return _reduce(torch.stack(losses), output_reduction)
