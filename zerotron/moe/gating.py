"""Which experts each token goes to (DeepSpeed-MoE's gating, GShard's): the router's softmax, the top-k
experts per token, a capacity per expert past which tokens are dropped (or none: dropless), each
kept token's slot in its expert's buffer, its combine weight, the load-balancing loss `l_aux` and the
tokens each expert was chosen by (`exp_counts`).

The decision is kept as a route table, `Routes`: for each of the k routes of each token, the expert
(-1 when the capacity dropped it), the slot and the weight -- k x tokens numbers, where DeepSpeed's
functions return dense [tokens, experts, capacity] combine and dispatch tensors. `dense()` builds
those from a table, and `top1gating` / `top2gating` / `topkgating` return them with DeepSpeed's
signatures; which tokens are kept, in which slots, with which weights, is DeepSpeed 0.19.8's:

- k 1: the argmax of the softmax (of the logits plus Gumbel noise under noisy_gate_policy "RSample");
  capacity ceil(tokens / experts x capacity_factor), at least min_capacity; past it, the tokens kept
  are the top `capacity` of the routing mask, scaled by uniform noise under use_rts (random token
  selection); the weight is the softmax probability, unnormalized; l_aux = E x sum(mean prob x
  fraction routed).
- k 2: the second expert is the argmax of the logits without the first (plus Gumbel noise when
  top2_2nd_expert_sampling); capacity from 2 x capacity_factor; second choices take slots after
  every first choice; kept tokens by position; weights normalized over the two kept;
  l_aux = E^2 x mean(mean prob x fraction first-routed).
- k > 2: top-k of the softmax; capacity from k x capacity_factor; kept by probability ("probs") or
  position; weights normalized over the kept; l_aux = E^2 / k x mean(mean prob x fraction routed).
- Without dropping, the capacity is the most tokens any expert got, agreed (maximum) over the
  expert-parallel ranks through `agree_capacity`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F


@dataclass
class Routes:
    experts: torch.Tensor  # [k, tokens] int64: the expert of each route, -1 where the capacity dropped it
    slots: torch.Tensor  # [k, tokens] int64: the route's place in its expert's buffer
    weights: torch.Tensor  # [k, tokens] fp32: what the expert's output is multiplied by
    capacity: int  # slots per expert
    l_aux: torch.Tensor  # the load-balancing loss
    counts: torch.Tensor  # [experts]: routes each expert was chosen by, before dropping


def gumbel(shape, device) -> torch.Tensor:
    """Standard Gumbel noise (torch's distribution, as DeepSpeed draws it: the same seed, the same noise)."""
    zero, one = torch.tensor(0.0, device=device), torch.tensor(1.0, device=device)
    return torch.distributions.Gumbel(zero, one).rsample(shape)


def _capacity(tokens: int, experts: int, factor: float, min_capacity: int) -> int:
    return max(int(torch.ceil(torch.tensor(tokens / experts * factor))), int(min_capacity))


def agree_over(group) -> Optional[Callable[[int], int]]:
    """The largest capacity over `group`'s ranks (DeepSpeed's all-reduce with MAX over the expert-
    parallel group), through Comm; None without a group."""
    if group is None:
        return None
    import torch.distributed as dist

    from ..comm import comm_for
    from ..comm.core import local_device

    comm = comm_for(group, "ep")

    def agree(capacity: int) -> int:
        most = torch.tensor([capacity], dtype=torch.int64, device=local_device())
        comm.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most.item())

    return agree


def _dropless(counts: torch.Tensor, agree: Optional[Callable[[int], int]], bound: bool, tokens: int) -> int:
    """The capacity without dropping: the most routes any expert got, agreed over the expert-parallel ranks
    (a host read and an all-reduce: the size of DeepSpeed's dense tensors); with `bound`, the token count,
    which every expert's routes are within (all a route table needs, at no cost: the MoE layer's case)."""
    if bound:
        return tokens
    most = int(counts.max())
    return agree(most) if agree is not None else most


def route(
    logits: torch.Tensor,
    k: int = 1,
    capacity_factor: float = 1.0,
    min_capacity: int = 8,
    drop_tokens: bool = True,
    use_rts: bool = True,
    noisy_gate_policy: Optional[str] = None,
    second_expert_sampling: bool = True,
    drop_policy: str = "probs",
    used_token: Optional[torch.Tensor] = None,
    agree_capacity: Optional[Callable[[int], int]] = None,
    dropless_bound: bool = False,
) -> Routes:
    """The route table for router `logits` [tokens, experts] (fp32). `agree_capacity(c)`: the largest
    c over the expert-parallel ranks (dropless only); `dropless_bound`: without dropping, the capacity is
    the token count instead (see _dropless)."""
    if k < 1 or k > logits.shape[1]:
        raise ValueError(f"k {k}: each token goes to between 1 and the {logits.shape[1]} experts")
    if k == 1:
        return _top1(logits, capacity_factor, min_capacity, drop_tokens, use_rts, noisy_gate_policy, used_token,
                     (agree_capacity, dropless_bound))  # fmt: skip
    if used_token is not None:
        raise ValueError("used_token masks tokens for top-1 gating only (as in DeepSpeed)")
    dropless = (agree_capacity, dropless_bound)
    if k == 2:
        return _top2(logits, capacity_factor, min_capacity, drop_tokens, second_expert_sampling, dropless)
    return _topk(logits, k, capacity_factor, min_capacity, drop_tokens, drop_policy, dropless)


def _top1(logits, factor, min_capacity, drop_tokens, use_rts, noisy, used_token, dropless) -> Routes:
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    choice = torch.argmax(logits + gumbel(logits.shape, logits.device) if noisy == "RSample" else gates, dim=1)
    mask = F.one_hot(choice, experts)
    if used_token is not None:
        mask = mask * used_token.unsqueeze(1).to(mask.dtype)
    counts = mask.sum(0).detach()
    capacity = _capacity(tokens, experts, factor, min_capacity)
    if not drop_tokens:
        capacity = min(_dropless(counts, *dropless, tokens=tokens), tokens)
    l_aux = torch.sum(gates.mean(0) * mask.float().mean(0)) * experts
    if tokens < min_capacity:
        raise ValueError(
            f"{tokens} tokens and min_capacity {min_capacity}: the tokens must be at least min_capacity; "
            "lower min_capacity (0 is allowed) or give more tokens per batch"
        )
    ranked = mask * torch.rand(mask.shape, device=mask.device) if use_rts else mask
    kept = torch.topk(ranked, k=min(capacity, tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, kept, 1)
    slot = ((torch.cumsum(mask, dim=0) - 1) * mask).sum(1)
    routed = mask.sum(1) > 0
    return Routes(
        experts=torch.where(routed, choice, -1).unsqueeze(0),
        slots=slot.unsqueeze(0),
        weights=(gates * mask).sum(1).unsqueeze(0),
        capacity=capacity,
        l_aux=l_aux,
        counts=counts,
    )


def _top2(logits, factor, min_capacity, drop_tokens, sampling, dropless) -> Routes:
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, experts)
    noisy = logits + gumbel(logits.shape, logits.device) if sampling else logits
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, experts)
    loc1 = torch.cumsum(mask1, dim=0) - 1
    loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(0, keepdim=True)  # second choices after every first
    l_aux = torch.mean(gates.mean(0) * mask1.float().mean(0)) * experts * experts
    counts = (mask1 + mask2).sum(0).detach()
    if drop_tokens:
        capacity = _capacity(tokens, experts, factor * 2, min_capacity)
        mask1, mask2 = mask1 * (loc1 < capacity), mask2 * (loc2 < capacity)
    else:
        capacity = _dropless(counts, *dropless, tokens=tokens)
    g1, g2 = (gates * mask1).sum(1), (gates * mask2).sum(1)
    denom = torch.clamp(g1 + g2, min=torch.finfo(gates.dtype).eps)
    kept1, kept2 = mask1.sum(1) > 0, mask2.sum(1) > 0
    return Routes(
        experts=torch.stack([torch.where(kept1, first, -1), torch.where(kept2, second, -1)]),
        slots=torch.stack([(loc1 * mask1).sum(1), (loc2 * mask2).sum(1)]),
        weights=torch.stack([g1 / denom, g2 / denom]),
        capacity=capacity,
        l_aux=l_aux,
        counts=counts,
    )


def _topk(logits, k, factor, min_capacity, drop_tokens, policy, dropless) -> Routes:
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    counts = mask.sum(0).detach()
    l_aux = torch.mean(gates.mean(0) * mask.float().mean(0)) * experts * experts / k
    if drop_tokens:
        capacity = _capacity(tokens, experts, factor * k, min_capacity)
        if policy == "probs":
            by_prob = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            kept = torch.topk(by_prob, k=min(capacity, tokens), dim=0, sorted=False)[1]
            mask &= torch.zeros_like(mask).scatter_(0, kept, True)
            locations = torch.cumsum(mask, dim=0) - 1
        elif policy == "position":
            locations = torch.cumsum(mask, dim=0) - 1
            mask &= locations < capacity
        else:
            raise ValueError(f"drop_policy {policy!r}: use 'probs' or 'position'")
    else:
        capacity = _dropless(counts, *dropless, tokens=tokens)
        locations = torch.cumsum(mask, dim=0) - 1
    masked = gates * mask
    masked = masked / torch.clamp(masked.sum(-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    kept = mask.gather(1, top_idx)
    return Routes(
        experts=torch.where(kept, top_idx, -1).t().contiguous(),
        slots=(locations.gather(1, top_idx) * kept).t().contiguous(),
        weights=masked.gather(1, top_idx).t().contiguous(),
        capacity=capacity,
        l_aux=l_aux,
        counts=counts,
    )


def dense(routes: Routes, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSpeed's (combine_weights [tokens, experts, capacity] fp32, dispatch_mask bool) from a table."""
    tokens = routes.experts.shape[1]
    combine = torch.zeros(tokens, experts, routes.capacity, dtype=routes.weights.dtype, device=routes.weights.device)
    for e, s, w in zip(routes.experts, routes.slots, routes.weights):
        kept = e >= 0
        combine[torch.arange(tokens, device=e.device)[kept], e[kept], s[kept]] += w[kept]
    return combine, combine.bool()


def top1gating(logits, capacity_factor, min_capacity, used_token=None, noisy_gate_policy=None, drop_tokens=True,
               use_rts=True, ep_group=None, agree_capacity=None):  # fmt: skip
    """DeepSpeed's `top1gating`: (l_aux, combine_weights, dispatch_mask, exp_counts)."""
    r = route(logits, 1, capacity_factor, min_capacity, drop_tokens, use_rts, noisy_gate_policy,
              used_token=used_token, agree_capacity=agree_capacity or agree_over(ep_group))  # fmt: skip
    return (r.l_aux, *dense(r, logits.shape[1]), r.counts)


def top2gating(logits, capacity_factor, min_capacity, drop_tokens=True, ep_group=None,
               top2_2nd_expert_sampling=True, agree_capacity=None):  # fmt: skip
    """DeepSpeed's `top2gating`: (l_aux, combine_weights, dispatch_mask, exp_counts)."""
    r = route(logits, 2, capacity_factor, min_capacity, drop_tokens, second_expert_sampling=top2_2nd_expert_sampling,
              agree_capacity=agree_capacity or agree_over(ep_group))  # fmt: skip
    return (r.l_aux, *dense(r, logits.shape[1]), r.counts)


def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs",
               agree_capacity=None):  # fmt: skip
    """DeepSpeed's `topkgating`: (l_aux, combine_weights, dispatch_mask, exp_counts)."""
    r = route(logits, k, capacity_factor, min_capacity, drop_tokens, drop_policy=drop_policy,
              agree_capacity=agree_capacity or agree_over(ep_group))  # fmt: skip
    return (r.l_aux, *dense(r, logits.shape[1]), r.counts)
