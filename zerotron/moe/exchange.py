"""Tokens to their experts and back: the kept routes' rows sorted by expert, sent to the ranks holding
those experts (an all-to-all of uneven blocks over the expert-parallel group), each local expert run
on the rows it received from every rank, the outputs sent back and weighted onto their tokens.

Only routed rows travel and are computed: no capacity buffers padded with zeros (DeepSpeed pads each
expert to the capacity, or without dropping to the largest count any expert got on any rank). The
arithmetic per token is DeepSpeed's: expert(hidden) times the route's weight in fp32, summed over the
token's routes. Splits are host integers: one small all-to-all of the counts per layer and pass, then
one host read of them (the layer's only host sync); with one expert-parallel rank nothing is exchanged.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from .gating import Routes
from .grouped import Groups, on_device


class _Exchange(torch.autograd.Function):
    """All-to-all of row blocks (`send[i]` rows to group rank i, `receive[j]` rows from rank j);
    its backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, comm: Comm, send: list[int], receive: list[int]):
        ctx.comm, ctx.send, ctx.receive = comm, send, receive
        return _exchange(rows, comm, send, receive)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.comm, ctx.receive, ctx.send), None, None, None


def _exchange(rows: torch.Tensor, comm: Comm, send: list[int], receive: list[int]) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    comm.all_to_all_single(out, rows.contiguous(), output_splits=receive, input_splits=send)
    return out


def run_experts(x: torch.Tensor, routes: Routes, experts, comm: Comm | None) -> torch.Tensor:
    """[tokens, hidden] -> [tokens, hidden]: each token's kept routes through their experts, weighted
    and summed. `experts(rows, groups)` runs this rank's experts on rows grouped by local expert
    (`groups`: grouped.Groups, each expert's row count and the grouped matrix multiply's offsets);
    `comm`: the expert-parallel group (None or one rank: every expert is here).

    One host read per call: the routes' counts per expert (with the counts the other ranks send here),
    which split the all-to-all; everything else the device computes from them."""
    ep = 1 if comm is None else comm.size
    num_experts = routes.counts.numel()
    local = num_experts // ep
    expert = routes.experts.reshape(-1)
    expert = torch.where(expert >= 0, expert, num_experts)  # a dropped route sorts after every expert's
    order = torch.argsort(expert * (routes.capacity + 1) + routes.slots.reshape(-1), stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=x.device)
    counts.index_add_(0, expert, torch.ones_like(expert))  # (bincount's size would depend on the values)
    if ep == 1:
        host = counts.tolist()  # the host read
        route = order[: sum(host[:num_experts])]  # kept routes (index into k x tokens), grouped by expert
        groups = Groups(host[:num_experts], counts[:num_experts].cumsum(0).to(torch.int32))
        out = experts(x[route % x.shape[0]], groups)
    else:
        table = counts[:num_experts].view(ep, local)  # rows for each rank's local experts
        received = torch.empty_like(table)
        comm.all_to_all_single(received, table)
        host = torch.cat([table.reshape(-1), received.reshape(-1)]).tolist()  # the host read
        mine, arrived = host[:num_experts], host[num_experts:]  # arrived[s * local + j]: from rank s for expert j
        send = [sum(mine[r * local : (r + 1) * local]) for r in range(ep)]
        receive = [sum(arrived[s * local : (s + 1) * local]) for s in range(ep)]
        route = order[: sum(send)]
        got = _Exchange.apply(x[route % x.shape[0]], comm, send, receive)  # by source rank, then local expert
        groups = Groups([sum(arrived[j::local]) for j in range(local)], received.sum(0).cumsum(0).to(torch.int32))
        perm = on_device(_by_expert(arrived, ep, local), x.device)  # regrouped by local expert, and back
        ran = experts(got[perm], groups)
        out = _Exchange.apply(torch.empty_like(ran).index_copy(0, perm, ran), comm, receive, send)
    per_route = out.new_zeros(expert.numel(), x.shape[1]).index_copy(0, route, out)
    weighted = per_route.view(*routes.experts.shape, x.shape[1]) * routes.weights.unsqueeze(-1)
    return weighted.sum(0).to(x.dtype)


def _by_expert(arrived: list[int], ep: int, local: int) -> torch.Tensor:
    """The order that takes rows received by source rank then local expert (`arrived[s * local + j]` rows
    from rank s for expert j) to local expert then source rank: computed on the host from host counts."""
    lengths = torch.tensor(arrived, dtype=torch.int64)
    starts = lengths.cumsum(0) - lengths  # where each (source, expert) block starts as received
    by_expert = torch.arange(ep * local).view(ep, local).t().reshape(-1)  # the blocks in the new order
    lengths, starts = lengths[by_expert], starts[by_expert]
    placed = lengths.cumsum(0) - lengths  # where each block starts in the new order
    return torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - placed, lengths)
