"""Tokens to their experts and back: the kept routes' rows sorted by expert, sent to the ranks holding
those experts (an all-to-all of uneven blocks over the expert-parallel group), each local expert run
on the rows it received from every rank, the outputs sent back and weighted onto their tokens.

Only routed rows travel and are computed: no capacity buffers padded with zeros (DeepSpeed pads each
expert to the capacity, or without dropping to the largest count any expert got on any rank). The
arithmetic per token is DeepSpeed's: expert(hidden) times the route's weight in fp32, summed over the
token's routes. Splits are host integers (one small all-to-all of the counts per layer and pass);
with one expert-parallel rank nothing is exchanged.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from .gating import Routes


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
    and summed. `experts(rows, counts)` runs this rank's experts on rows grouped by local expert;
    `comm`: the expert-parallel group (None or one rank: every expert is here)."""
    ep = 1 if comm is None else comm.size
    num_experts = routes.counts.numel()
    local = num_experts // ep
    kept = (routes.experts >= 0).reshape(-1)
    expert = routes.experts.reshape(-1)[kept]
    route = torch.arange(kept.numel(), device=x.device)[kept]  # index into [k * tokens]
    order = torch.argsort(expert * (routes.capacity + 1) + routes.slots.reshape(-1)[kept], stable=True)
    route, expert = route[order], expert[order]
    rows = x[route % x.shape[0]]  # grouped by expert, in slot order within one
    counts = torch.bincount(expert, minlength=num_experts)
    if ep == 1:
        out = experts(rows, counts.tolist())
    else:
        table = counts.view(ep, local)  # rows for each rank's local experts
        received = torch.empty_like(table)
        comm.all_to_all_single(received, table)
        send, arrived = table.sum(1).tolist(), received.reshape(-1).tolist()  # (the host sync)
        receive = received.sum(1).tolist()
        got = _Exchange.apply(rows, comm, send, receive)  # by source rank, then local expert
        # regroup by local expert (every source's rows for expert 0, then expert 1, ...) and back
        starts = torch.tensor([0] + arrived[:-1], device=x.device).cumsum(0).view(ep, local)
        segments = [(int(starts[s, j]), arrived[s * local + j]) for j in range(local) for s in range(ep)]
        perm = torch.cat([torch.arange(a, a + n, device=x.device) for a, n in segments]) if got.shape[0] else None
        per_expert = received.sum(0).tolist()
        if perm is None:
            out = experts(got, per_expert)
        else:
            ran = experts(got[perm], per_expert)
            out = torch.empty_like(ran).index_copy(0, perm, ran)
        out = _Exchange.apply(out, comm, receive, send)
    per_route = out.new_zeros(kept.numel(), x.shape[1]).index_copy(0, route, out)
    weighted = per_route.view(*routes.experts.shape, x.shape[1]) * routes.weights.unsqueeze(-1)
    return weighted.sum(0).to(x.dtype)
