"""The reference model's mixture-of-experts MLP (GPTConfig.n_experts > 0), plain single-device PyTorch:
a router picks each token's top-k experts (softmax over the chosen logits, as Mixtral), SwiGLU experts
whose weights are stacked expert first, and Switch Transformer's load-balancing loss.

The experts module follows Transformers' experts interface (stacked parameters, `has_gate`,
`is_transposed`, `experts(hidden, top_k_index, top_k_weights)`), so the expert parallelism zerotron
gives Transformers' MoE families splits it too (zerotron/moe/stacked_experts.py, the config's
"expert_parallel" section); nothing in here knows about ranks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..moe.grouped import Groups, grouped_linear


class Experts(nn.Module):
    has_gate, is_transposed = True, False  # Transformers' experts interface: [gate; up] stacked, [out, in]

    def __init__(self, num_experts: int, d_model: int, ffn: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * ffn, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, ffn))
        self.down_proj.residual_projection = True

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [tokens, d], the experts and weights of each token's routes [tokens, k] -> [tokens, d]."""
        tokens, k = top_k_index.shape
        expert = top_k_index.reshape(-1)
        order = torch.argsort(expert, stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=expert.device)
        counts.index_add_(0, expert, torch.ones_like(expert))
        groups = Groups(counts.tolist(), counts.cumsum(0).to(torch.int32))  # (the layer's one host read)
        out = self.grouped(hidden[order // k], groups)  # the routes' tokens, grouped by expert
        out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
        return hidden.new_zeros(hidden.shape).index_add(0, order // k, out.to(hidden.dtype))

    def grouped(self, rows: torch.Tensor, groups: Groups) -> torch.Tensor:
        """Rows already grouped by expert (`groups`: how many each) through their experts' SwiGLU."""
        gate, up = grouped_linear(rows, self.gate_up_proj, groups).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, self.down_proj, groups)


class MoEMLP(nn.Module):
    def __init__(self, d_model: int, num_experts: int, top_k: int, ffn: int):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = Experts(num_experts, d_model, ffn)
        self.aux_loss = None  # the last forward's load-balancing loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        top, index = probs.topk(self.top_k, dim=-1)
        weights = top / top.sum(dim=-1, keepdim=True)
        # Switch Transformer: experts x sum over experts of (share of routes) x (mean router probability)
        share = probs.new_zeros(probs.shape[1]).index_add_(0, index.reshape(-1), probs.new_ones(index.numel()))
        share = share / index.numel()  # (a sum, not bincount, whose size would depend on the values: a host sync)
        self.aux_loss = probs.shape[1] * (share * probs.mean(0)).sum()
        return self.experts(tokens, index, weights).reshape(x.shape)
