"""DeepSpeed's MoE layer (`deepspeed.moe.layer.MoE`): a router (`TopKGate`), num_experts copies of an
expert module, and the dispatch between them -- each token's hidden state copied into its experts'
capacity buffers, each expert run on its buffer, the outputs weighted back onto the tokens. Returns
DeepSpeed's `(output, l_aux, exp_counts)`; `use_residual` mixes in a dense MLP by a learned
coefficient (Residual MoE).

Experts run on their own buffers one after another (a per-expert loop); all experts live on every
rank (`ep_size` 1: they train under data parallelism and ZeRO like any other parameters). Expert
parallelism (`ep_size` > 1) is refused by name until the engine's expert groups exist.
"""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .gating import Routes, agree_over, route

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")


class TopKGate(nn.Module):
    """DeepSpeed's `TopKGate(model_dim, num_experts, k, capacity_factor, eval_capacity_factor,
    min_capacity, noisy_gate_policy, drop_tokens, use_rts, ep_group, top2_2nd_expert_sampling)`:
    a bias-free linear router in fp32; `route(x)` gives the route table (gating.py)."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group=None,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"noisy_gate_policy {noisy_gate_policy!r}: use None, 'Jitter' or 'RSample'")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.capacity_factor, self.eval_capacity_factor = k, capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.ep_group = drop_tokens, use_rts, ep_group
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def route(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> Routes:
        x = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:  # multiplicative noise in [1 - 1e-2, 1 + 1e-2]
            low, high = torch.tensor(1.0 - 1e-2, device=x.device), torch.tensor(1.0 + 1e-2, device=x.device)
            x = x * torch.distributions.Uniform(low, high).rsample(x.shape)
        logits = F.linear(x, self.wg.weight.float())
        return route(
            logits,
            self.k,
            self.capacity_factor if self.training else self.eval_capacity_factor,
            self.min_capacity,
            self.drop_tokens,
            self.use_rts,
            self.noisy_gate_policy if self.training and self.k == 1 else None,
            self.top2_2nd_expert_sampling,
            used_token=used_token,
            agree_capacity=agree_over(self.ep_group),
        )


class Experts(nn.Module):
    """num_local_experts copies of `expert`, each run on its own rows (DeepSpeed's `Experts`: its
    parameters are marked `allreduce = False` with the expert group's name, as DeepSpeed's tools read)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce, p.group_name = False, expert_group_name

    def forward(self, buffers: torch.Tensor) -> torch.Tensor:
        """[experts, capacity, hidden] -> the same, each expert on its slice."""
        outs = []
        for rows, expert in zip(buffers, self.deepspeed_experts):
            out = expert(rows)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.stack(outs)


def dispatch(x: torch.Tensor, routes: Routes, experts: int) -> torch.Tensor:
    """[tokens, hidden] -> [experts, capacity, hidden]: each kept route's token in its slot, zeros
    in the slots nothing was routed to."""
    flat = torch.zeros(experts * routes.capacity + 1, x.shape[1], dtype=x.dtype, device=x.device)
    kept = routes.experts >= 0
    where = torch.where(kept, routes.experts * routes.capacity + routes.slots, experts * routes.capacity)
    tokens = torch.arange(x.shape[0], device=x.device).expand_as(where)
    flat = flat.index_put((where[kept],), x[tokens[kept]])
    return flat[:-1].view(experts, routes.capacity, x.shape[1])


def combine(out: torch.Tensor, routes: Routes) -> torch.Tensor:
    """[experts, capacity, hidden] -> [tokens, hidden]: each token's routes' outputs, weighted (fp32)."""
    experts, capacity, hidden = out.shape
    padded = torch.cat([out.reshape(-1, hidden), out.new_zeros(1, hidden)])
    where = torch.where(routes.experts >= 0, routes.experts * capacity + routes.slots, experts * capacity)
    routed = padded[where]  # [k, tokens, hidden]
    return (routed * routes.weights.unsqueeze(-1)).sum(0).to(out.dtype)


class MoE(nn.Module):
    """DeepSpeed's `MoE(hidden_size, expert, num_experts=1, ep_size=1, k=1, capacity_factor=1.0,
    eval_capacity_factor=1.0, min_capacity=4, use_residual=False, noisy_gate_policy=None,
    drop_tokens=True, use_rts=True, use_tutel=False, enable_expert_tensor_parallelism=False,
    top2_2nd_expert_sampling=True)`; `forward(hidden_states, used_token=None)` returns
    `(output, l_aux, exp_counts)`."""

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: Optional[str] = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"num_experts {num_experts} is not a multiple of ep_size {ep_size}")
        if ep_size > 1 or enable_expert_tensor_parallelism:
            raise NotImplementedError(
                f"ep_size {ep_size}{' with expert tensor parallelism' if enable_expert_tensor_parallelism else ''}: "
                "zerotron's MoE layer keeps every expert on every rank for now (expert parallelism is being "
                "built); use ep_size=1, where the experts train under data parallelism and ZeRO"
            )
        self.ep_size, self.num_experts, self.num_local_experts = ep_size, num_experts, num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual, self.use_tutel = use_residual, use_tutel  # tutel: a CUDA kernel library; not used
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)  # fmt: skip
        self.deepspeed_moe = _MOELayer(gate, Experts(expert, self.num_local_experts, self.expert_group_name))
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """DeepSpeed makes the expert groups here; with every expert on every rank there are none."""

    def forward(self, hidden_states: torch.Tensor, used_token: Optional[torch.Tensor] = None):
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts


class _MOELayer(nn.Module):
    """The gate and the experts under DeepSpeed's attribute names (`deepspeed_moe.gate.wg`,
    `deepspeed_moe.experts.deepspeed_experts.N`), so checkpoints keep DeepSpeed's keys."""

    def __init__(self, gate: TopKGate, experts: Experts):
        super().__init__()
        self.gate, self.experts = gate, experts
        self.l_aux = self.exp_counts = None

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.counts
        out = self.experts(dispatch(tokens, routes, self.gate.wg.out_features))
        return combine(out, routes).reshape(x.shape)
