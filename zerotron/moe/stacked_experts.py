"""Expert parallelism for models whose experts are stacked (DeepSpeed's AutoEP config, "expert_parallel"):
Hugging Face MoE families and zerotron's reference MoE model, which follows their interface.

Transformers 5 gives every MoE family one experts interface: a module (its class decorated with
`use_experts_implementation`) holding each projection of all its experts stacked in one parameter,
expert first, and called as `experts(hidden [tokens, h], top_k_index [tokens, k], top_k_weights)`
by the family's own MoE block after the family's own router. zerotron keeps both: it cuts each
stacked parameter to this rank's experts (a split along dim 0 over the expert-parallel group, made
and described as tensor parallelism's are, so checkpoints, consolidation and the Hugging Face save
join it back) and makes the module's call send each token's routes to the ranks holding their
experts (moe/exchange.py), run there by the family's own expert code on its local experts. The
model keeps its names: a saved model loads as the Hugging Face model it was (DeepSpeed's AutoEP
replaces the block and renames the router's weight).
"""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from ..comm import Comm
from ..errors import ConfigError
from ..tensor_parallel.layers import shard_parameter
from ..zero.partitioned_init import take_whole
from .exchange import run_experts
from .gating import Routes
from .grouped import Groups, on_device


def is_stacked_experts(module: nn.Module) -> bool:
    """An experts module on Transformers' interface (a family's, or the reference MoE model's): the
    decorator's marks and parameters stacked by expert."""
    return (
        hasattr(module, "is_transposed")
        and hasattr(module, "has_gate")
        and isinstance(getattr(module, "num_experts", None), int)
        and any(len(s) >= 2 and s[0] == module.num_experts for s in map(_shape, module.parameters(recurse=False)))
    )


def _shape(p: torch.Tensor) -> tuple:
    return tuple(p.shape if p.numel() else getattr(p, "ds_shape", p.shape))  # (released by ZeRO-3: empty)


def stacked_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if is_stacked_experts(m)]


@torch.no_grad()
def split_stacked_experts(model: nn.Module, comm: Comm) -> int:
    """Keep this rank's experts of every experts module (`comm`: the expert-parallel group, experts
    numbered in rank order); returns how many modules were split."""
    found = stacked_experts(model)
    for name, m in found:
        total = m.num_experts
        if total % comm.size:
            raise ConfigError(
                "expert_parallel.autoep_size",
                comm.size,
                f"{name} has {total} experts, not a multiple of it; use a divisor of {total}",
            )
        local = total // comm.size
        params = dict(m.named_parameters(recurse=False))
        take_whole(params.values())  # (built under zero.Init: whole first)
        for pname, p in params.items():
            if p.dim() == 0 or p.shape[0] != total:
                raise ConfigError(
                    "expert_parallel.enabled",
                    True,
                    f"{name}.{pname} (shape {tuple(p.shape)}) is not stacked by expert, so it cannot be split "
                    "over expert-parallel ranks; disable expert_parallel for this model",
                )
            shard_parameter(p, 0, comm)  # in place: optimizer groups built before initialize still hold it
            p.allreduce, p.group_name = False, f"ep_size_{comm.size}"  # DeepSpeed's expert marks
        m.num_experts, m.zt_total_experts, m.zt_ep_comm = local, total, comm
        m.forward = types.MethodType(_expert_parallel_forward, m)
        m.register_state_dict_post_hook(_every_expert)
    return len(found)


def _every_expert(module, state: dict, prefix: str, local_metadata) -> None:
    """`model.state_dict()` holds every expert, as the model had them (accelerate's get_state_dict and so
    the Trainer's save_model below ZeRO-3 read it): collective over the expert-parallel group, like the
    calls that gather ZeRO-3's parameters. With keep_vars (zerotron's own consolidation, which joins the
    split itself) and for parameters ZeRO-3 released, the state is left as it is."""
    for name in dict(module.named_parameters(recurse=False)):
        value = state.get(prefix + name)
        if value is None or isinstance(value, nn.Parameter) or value.numel() == 0:
            continue
        state[prefix + name] = torch.cat(module.zt_ep_comm.all_gather_list(value.contiguous()))


def _expert_parallel_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts module's call under expert parallelism: the same arguments and result."""
    tokens, k = top_k_index.shape
    index = top_k_index.t().long()
    routes = Routes(
        experts=torch.where((index >= 0) & (index < self.zt_total_experts), index, -1),  # (a family's no-op slot)
        slots=torch.arange(tokens, device=index.device).expand(k, tokens),
        weights=top_k_weights.t(),
        capacity=tokens,
        l_aux=None,
        counts=torch.zeros(self.zt_total_experts, dtype=torch.long, device=index.device),
    )
    return run_experts(hidden_states, routes, lambda rows, groups: _local_experts(self, rows, groups), self.zt_ep_comm)


def _local_experts(module, rows: torch.Tensor, groups: Groups) -> torch.Tensor:
    """Rows grouped by local expert through the experts' own code: zerotron's reference experts take them
    grouped (`grouped`, with their counts: no host read), a family's through its interface, each row
    routed to its expert with weight 1. (No rows: no gradient, which ZeRO handles.)"""
    if hasattr(module, "grouped"):
        return module.grouped(rows, groups)
    counts = on_device(torch.tensor(groups.counts, dtype=torch.int64), rows.device)
    experts = torch.arange(len(groups.counts), device=rows.device)
    index = torch.repeat_interleave(experts, counts, output_size=rows.shape[0]).unsqueeze(1)  # (sizes known)
    weights = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    return type(module).forward(module, rows, index, weights)
