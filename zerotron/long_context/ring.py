"""Ring attention (context parallelism): each of cp ranks holds 1/cp of the sequence's queries, keys
and values; the key/value blocks travel around the ring, and each rank attends its queries to every
block as it passes, merging the blocks' partial results by their log-sum-exp (an exact softmax over
the whole sequence: Liu et al. 2023, Megatron-Core's and torchtitan's context parallelism). Unlike
Ulysses it does not split heads, so it works with more ranks than key/value heads.

Causal load balancing: the sequence is cut into 2*cp chunks and rank r holds chunks r and
2*cp-1-r (a head and a tail), so every rank has the same share of the causal triangle.
`ring_shard` / `ring_positions` lay a batch out that way. For a pair of chunks (my queries, a
passing block's keys), a later query chunk sees the whole key chunk, the same chunk is the causal
diagonal, and an earlier one nothing: only the first two are computed.

Each block is torch's fused attention with its log-sum-exp (the CPU flash kernel; on CUDA the flash
kernel in fp16/bf16, the memory-efficient one in fp32, whose log-sum-exp comes padded to 32 rows and
is cut to the queries' count); backward recomputes each block's gradients from the global output and
log-sum-exp, the key/value gradients travelling with their block back to its owner. The next
block's exchange is posted before the current block is computed, so the transfer overlaps compute.
Per layer each rank sends its k and v slices cp-1 times in forward, and in backward k and v cp-1
times and their gradients (fp32 accumulators) cp times: engine.comm_stats()["p2p"].
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Comm, comm_for

# ---- one block: torch's fused kernels --------------------------------------------------------
_LSE_ROWS = 32  # CUDA's memory-efficient kernel pads its log-sum-exp to a multiple of this many queries


def _flash_fits(q) -> bool:
    """CUDA's flash kernel takes fp16/bf16 with a head size a multiple of 8 up to 256: its log-sum-exp
    comes unpadded. Otherwise (fp32) the memory-efficient kernel."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256


def _block_forward(q, k, v, causal: bool, scale: float):
    """Attention of q to one key/value block: (output, log-sum-exp [b, h, s] in fp32, what the kernel's
    backward takes of its forward)."""
    if q.device.type == "cuda" and _flash_fits(q):
        out, lse, *_, seed, offset, _ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, scale=scale
        )
        return out, lse.float(), (seed, offset)
    if q.device.type == "cuda":
        out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, causal, scale=scale
        )
        return out, lse[..., : q.shape[2]].float(), (seed, offset)  # (padded: see _LSE_ROWS)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.float(), ()


def _block_backward(grad, q, k, v, out, lse, causal: bool, scale: float, rng: tuple):
    """This block's share of dq, dk, dv, given the output and log-sum-exp over every block (`rng`: what
    the kernel's forward returned for its backward; no dropout, so any block's)."""
    if q.device.type == "cuda" and _flash_fits(q):
        m, n = q.shape[2], k.shape[2]
        return torch.ops.aten._scaled_dot_product_flash_attention_backward(
            grad, q, k, v, out, lse, None, None, m, n, 0.0, causal, *rng, scale=scale
        )
    if q.device.type == "cuda":
        padded = torch.nn.functional.pad(lse, (0, -q.shape[2] % _LSE_ROWS))  # the kernel's own layout
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad, q, k, v, None, out, padded, *rng, 0.0, [True, True, True, False], causal, scale=scale
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale
    )


# ---- the schedule ------------------------------------------------------------------------------
def _pairs(rank: int, source: int, cp: int, causal: bool):
    """(my chunk slot, its chunk slot, causal?) for the pairs of chunks that attend: slot 0 is a
    rank's head chunk (index rank), slot 1 its tail (2*cp-1-rank)."""
    if not causal:
        return [(None, None, False)]
    mine, theirs = (rank, 2 * cp - 1 - rank), (source, 2 * cp - 1 - source)
    return [(a, b, mine[a] == theirs[b]) for a in (0, 1) for b in (0, 1) if mine[a] >= theirs[b]]


def _slot(t, slot):
    return t if slot is None else t.chunk(2, dim=2)[slot]


def _piece(t, slot):
    return _slot(t, slot).contiguous()


def _exchange(comm: Comm, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object]:
    """Send `tensors` to the next ring rank, receive the previous rank's into new buffers."""
    nxt, prv = ((comm.rank + step) % comm.size for step in (1, -1))
    if comm.group is not None:
        nxt, prv = dist.get_global_rank(comm.group, nxt), dist.get_global_rank(comm.group, prv)
    tensors = [t.contiguous() for t in tensors]
    incoming = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, comm.group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, t, prv, comm.group) for t in incoming]
    return incoming, comm.batch_p2p(ops)


def _merge(acc_out, acc_lse, out, lse):
    """Two partial softmax results over disjoint key sets, as one."""
    if acc_out is None:
        return out.float(), lse
    new = torch.logaddexp(acc_lse, lse)
    return acc_out * torch.exp(acc_lse - new).unsqueeze(-1) + out.float() * torch.exp(lse - new).unsqueeze(-1), new


def _expand(t, groups: int):
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t, groups: int):
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm: Comm, causal: bool, scale: float):
        groups, cp, rank = q.shape[1] // k.shape[1], comm.size, comm.rank
        halves = [[None, None], [None, None]] if causal else [[None, None]]
        block = [k.contiguous(), v.contiguous()]
        for step in range(cp):
            pending = _exchange(comm, block) if step < cp - 1 else None
            source = (rank - step) % cp
            for a, b, diagonal in _pairs(rank, source, cp, causal):
                kb, vb = (_expand(_piece(t, b), groups) for t in block)
                out, lse, ctx.rng = _block_forward(_piece(q, a), kb, vb, diagonal, scale)
                row = halves[a or 0]
                row[0], row[1] = _merge(row[0], row[1], out, lse)
            if pending is not None:
                block, work = pending
                work.wait()
        out = torch.cat([h[0] for h in halves], dim=2)
        lse = torch.cat([h[1] for h in halves], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.causal, ctx.scale = comm, causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, scale = ctx.comm, ctx.causal, ctx.scale
        groups, cp, rank = q.shape[1] // k.shape[1], comm.size, comm.rank
        grad, out = grad.contiguous(), out.to(q.dtype)
        dq = torch.zeros_like(q, dtype=torch.float32)
        block = [k.contiguous(), v.contiguous()]
        dkv = [torch.zeros_like(t, dtype=torch.float32) for t in block]
        for step in range(cp):
            pending = _exchange(comm, block) if step < cp - 1 else None
            source = (rank - step) % cp
            for a, b, diagonal in _pairs(rank, source, cp, causal):
                kb, vb = (_expand(_piece(t, b), groups) for t in block)
                g, qa, oa, la = (_piece(t, a) for t in (grad, q, out, lse))
                dqa, dkb, dvb = _block_backward(g, qa, kb, vb, oa, la, diagonal, scale, ctx.rng)
                _slot(dq, a).add_(dqa)
                _slot(dkv[0], b).add_(_fold(dkb.float(), groups))
                _slot(dkv[1], b).add_(_fold(dvb.float(), groups))
            dkv, work = _exchange(comm, dkv)  # this block's gradients go on with it, home at the end
            work.wait()
            if pending is not None:
                block, work = pending
                work.wait()
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q, k, v, group, causal: bool = True, scale: float | None = None):
    """Attention over the whole sequence for [b, h, s/cp, d] slices held by the ranks of `group`
    (load-balanced halves when causal: `ring_shard`); key/value heads may be fewer than the query
    heads (grouped-query attention), in any number."""
    comm = comm_for(group, "cp")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group evenly over {k.shape[1]} key/value heads")
    if causal and q.shape[2] % 2:
        raise ValueError(
            f"a causal ring needs each rank's slice in two equal chunks (head and tail): {q.shape[2]} tokens "
            "is odd; pad the sequence to a multiple of 2 x context_parallel_size"
        )
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if comm.size == 1:
        return torch.nn.functional.scaled_dot_product_attention(
            q, _expand(k, q.shape[1] // k.shape[1]), _expand(v, q.shape[1] // k.shape[1]), is_causal=causal, scale=scale
        )
    return _RingAttention.apply(q, k, v, comm, causal, scale)


# ---- the layout ------------------------------------------------------------------------------------
def ring_shard(x: torch.Tensor, dim: int, rank: int, cp: int) -> torch.Tensor:
    """Rank `rank`'s load-balanced part of `x` along `dim`: chunks rank and 2*cp-1-rank of 2*cp."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(
            f"a sequence of {x.shape[dim]} tokens cannot be cut into 2 x {cp} equal chunks for the ring: "
            f"pad it to a multiple of {2 * cp}"
        )
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def ring_unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's `ring_shard` part, in rank order."""
    heads = [p.chunk(2, dim=dim)[0] for p in parts]
    tails = [p.chunk(2, dim=dim)[1] for p in reversed(parts)]
    return torch.cat(heads + tails, dim=dim)


def ring_positions(length: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """The positions (0..length-1) of the tokens rank `rank` holds."""
    return ring_shard(torch.arange(length, device=device), 0, rank, cp)
