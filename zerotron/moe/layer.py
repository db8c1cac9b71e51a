"""DeepSpeed's MoE layer (`deepspeed.moe.layer.MoE`): a router (`TopKGate`), num_experts copies of an
expert module, and the exchange between them (exchange.py) -- each token's hidden state sent to its
kept routes' experts, each expert run on the rows it got, the outputs weighted back onto the tokens.
Returns DeepSpeed's `(output, l_aux, exp_counts)`; `use_residual` mixes in a dense MLP by a learned
coefficient (Residual MoE).

With `ep_size` > 1 each rank holds num_experts / ep_size of the experts, and the tokens travel to
them and back over the expert-parallel group (exchange.py), which the engine makes (topology.py) and
hands to every MoE layer; their parameters, marked as DeepSpeed marks them, are reduced and sharded
over the expert-data-parallel group (zero/shard_group.py). Experts run one after another on the rows
routed to them (a per-expert loop; every local expert runs, on no rows too, so ZeRO-3's gathers
happen on every rank whatever the routing).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..comm import comm_for
from ..zero.partitioned_init import copy_partitioned
from . import ep_groups
from .exchange import run_experts
from .gating import Routes, agree_over, route
from .grouped import Groups

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
            dropless_bound=True,  # (the layer's route table needs no exact capacity: no host read for it)
        )


class Experts(nn.Module):
    """num_local_experts copies of `expert`, each run on its own rows (DeepSpeed's `Experts`: its
    parameters are marked `allreduce = False` with the expert group's name, as DeepSpeed's tools read)."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: Optional[str] = None):
        super().__init__()
        # (under zero.Init the template is partitioned: each copy gets pieces of its own)
        self.deepspeed_experts = nn.ModuleList(copy_partitioned(expert) for _ in range(num_local_experts))
        self.num_local_experts = num_local_experts
        for e in self.deepspeed_experts:
            for p in e.parameters():
                p.allreduce, p.group_name = False, expert_group_name

    def forward(self, rows: torch.Tensor, groups: Groups) -> torch.Tensor:
        """[rows, hidden] grouped by local expert (`groups.counts[j]` rows for expert j) -> the same."""
        outs = []
        for part, expert in zip(rows.split(groups.counts), self.deepspeed_experts):
            out = expert(part)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs)


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
        if enable_expert_tensor_parallelism:
            raise NotImplementedError(
                "enable_expert_tensor_parallelism: zerotron's experts are not split by tensor parallelism (expert "
                "parallelism composes with data parallelism and ZeRO); leave it False"
            )
        self.ep_size, self.num_experts, self.num_local_experts = ep_size, num_experts, num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.use_residual, self.use_tutel = use_residual, use_tutel  # tutel: a CUDA kernel library; not used
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        gate = TopKGate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                        noisy_gate_policy, drop_tokens, use_rts, None, top2_2nd_expert_sampling)  # fmt: skip
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = _MOELayer(gate, experts, ep_size)
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Make the expert-parallel groups (as the engine does at initialize) and take this layer's."""
        if use_data_before_expert_parallel_:
            raise NotImplementedError(
                "use_data_before_expert_parallel_: zerotron lays expert-parallel groups out as consecutive "
                "data-parallel ranks (DeepSpeed's default); leave it False"
            )
        if self.ep_size > 1:
            self.deepspeed_moe._set_ep_group(ep_groups.make(self.ep_size).group("ep"))

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

    def __init__(self, gate: TopKGate, experts: Experts, ep_size: int = 1):
        super().__init__()
        self.gate, self.experts, self.ep_size = gate, experts, ep_size
        self.ep_group = None
        self.l_aux = self.exp_counts = None

    def _set_ep_group(self, ep_group) -> None:
        """The expert-parallel group (DeepSpeed's name): tokens are exchanged over it, and the gate
        agrees on the dropless capacity over it."""
        self.ep_group = self.gate.ep_group = ep_group

    def forward(self, x: torch.Tensor, used_token: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.ep_size > 1 and self.ep_group is None:
            raise RuntimeError(
                f"this MoE layer has ep_size {self.ep_size} but no expert-parallel group: pass the model to "
                "zerotron.initialize (it makes the groups), or call its set_deepspeed_parallelism() first"
            )
        tokens = x.reshape(-1, x.shape[-1])
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.counts
        comm = comm_for(self.ep_group, "ep") if self.ep_group is not None else None
        return run_experts(tokens, routes, self.experts, comm).reshape(x.shape)
