"""Ulysses sequence parallelism (Jacobs et al. 2023, DeepSpeed-Ulysses): each rank holds 1/sp of every
sequence. Attention needs the whole sequence, so its q, k and v go through an all-to-all that trades
the sequence split for a head split ([.., s/sp, h, d] -> [.., s, h/sp, d]); each rank attends over
the full sequence for its heads, and a second all-to-all trades back. Everything outside attention
(embeddings, MLPs, norms, the loss) is per token and runs on the rank's slice unchanged.

Per layer and rank, the all-to-alls move 4 tensors of (sp-1)/sp x s/sp x b x h x d elements (q, k,
v and the output; GQA's k and v are smaller), and as much again in backward.

`DistributedAttention` takes DeepSpeed's arguments and layouts: tensors are [b, s, h, d]
(batch_dim_idx 0) or [s, b, h, d] (batch_dim_idx 1), heads in dim 2; `scatter_idx` >= 2 with
`gather_idx` < 2 (DeepSpeed's defaults 2 and 0) trades the sequence split for the head split before
attention, and back after it. Heads are dealt out in contiguous blocks, so with grouped-query
attention every query head lands beside its key/value head when the KV heads divide by sp.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm, comm_for


def _split_dims(batch_dim_idx: int) -> tuple[int, int]:
    if batch_dim_idx not in (0, 1):
        raise ValueError(f"batch_dim_idx is {batch_dim_idx}: use 0 for [b, s, h, d] tensors or 1 for [s, b, h, d]")
    return (1 if batch_dim_idx == 0 else 0), 2  # (sequence dim, head dim)


def _exchange(x: torch.Tensor, comm: Comm, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut `x` into comm.size blocks along `scatter_dim`, send block i to group rank i, and join the
    blocks that arrive (in rank order) along `gather_dim`."""
    blocks = torch.stack(x.chunk(comm.size, dim=scatter_dim))
    received = torch.empty_like(blocks)
    comm.all_to_all_single(received, blocks)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _SeqAllToAll(torch.autograd.Function):
    """The all-to-all as an autograd function: its backward is the all-to-all the other way."""

    @staticmethod
    def forward(ctx, x, comm: Comm, scatter_dim: int, gather_dim: int):
        ctx.comm, ctx.scatter_dim, ctx.gather_dim = comm, scatter_dim, gather_dim
        return _exchange(x, comm, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.comm, ctx.gather_dim, ctx.scatter_dim), None, None, None


def seq_all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over `group`: `x` split along `scatter_dim`, gathered along
    `gather_dim` (counted in engine.comm_stats() as "all_to_all")."""
    comm = comm_for(group, "sp")
    if comm.size == 1:
        return x
    if x.shape[scatter_dim] % comm.size:
        raise ValueError(
            f"cannot split dimension {scatter_dim} of size {x.shape[scatter_dim]} over the {comm.size} sequence-"
            "parallel ranks: it must be a multiple of sequence_parallel_size (heads: use a sequence_parallel_size "
            "that divides the number of heads and of key/value heads; sequence: pad the sequence to a multiple)"
        )
    return _SeqAllToAll.apply(x, comm, scatter_dim, gather_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's (Megatron's) rotary embedding over the first cos.shape[-1] channels."""
    rot = cos.shape[-1]
    head, rest = t[..., :rot], t[..., rot:]
    return torch.cat((head * cos + _rotate_half(head) * sin, rest), dim=-1)


class DistributedAttention(nn.Module):
    """DeepSpeed's `DistributedAttention(local_attention, sequence_process_group, scatter_idx=2,
    gather_idx=0)`: `local_attention(q, k, v, *args, **kwargs)` runs on the full sequence and
    1/sp of the heads. `sp_stream` (DeepSpeed's overlap of the q/k/v all-to-alls on a side stream)
    is accepted and not used: the exchanges run in order on the current stream."""

    def __init__(
        self,
        local_attention: nn.Module,
        sequence_process_group,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream=None,
        num_kv_heads: int | None = None,
    ):
        super().__init__()
        if not (scatter_idx >= 2 and gather_idx < 2):
            raise ValueError(
                f"scatter_idx {scatter_idx}, gather_idx {gather_idx}: attention's inputs trade the sequence split "
                "for the head split (scatter the heads, dim 2; gather the sequence, dim 0 or 1): use DeepSpeed's "
                "defaults scatter_idx=2, gather_idx=0"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.num_kv_heads = num_kv_heads
        self.sp_stream = sp_stream

    def forward(self, query, key, value, batch_dim_idx: int = 0, rotary_pos_emb=None, *args, **kwargs):
        seq, heads = _split_dims(batch_dim_idx)
        self._check_heads(query, key)
        q, k, v = (seq_all_to_all(t, self.spg, heads, seq) for t in (query, key, value))
        if rotary_pos_emb is not None:  # Megatron-DeepSpeed hands [b, s, 1, d] tables: sequence first
            cos, sin = (t.permute(1, 0, 2, 3) for t in rotary_pos_emb)
            q, k = _apply_rotary(q, cos, sin), _apply_rotary(k, cos, sin)
        context = self.local_attn(q, k, v, *args, **kwargs)
        return seq_all_to_all(context, self.spg, seq, heads)

    def _check_heads(self, query: torch.Tensor, key: torch.Tensor):
        sp = comm_for(self.spg, "sp").size
        kv = self.num_kv_heads or key.shape[2]
        if sp > 1 and (query.shape[2] % sp or kv % sp):
            raise ValueError(
                f"{query.shape[2]} query heads and {kv} key/value heads cannot be dealt out to {sp} sequence-parallel "
                "ranks: Ulysses gives each rank whole heads, so both counts must be multiples of "
                "sequence_parallel_size; use a sequence_parallel_size that divides them"
            )
