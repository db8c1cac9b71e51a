"""What expert parallelism asks of the engine: the expert-parallel size the model's MoE layers were
built for, the groups each layer exchanges tokens over, the shard groups that reduce and shard expert
parameters (zero/shard_group.py), and the names experts have in topology-free checkpoints (their
global expert number, not their place on this rank: DeepSpeed's checkpoints number them so too)."""

from __future__ import annotations

import re

import torch
import torch.nn as nn

from ..comm import Comm, comm_for
from ..errors import ConfigError
from ..zero.shard_group import ShardGroup, ShardGroups
from . import ep_groups
from .layer import MoE
from .stacked_experts import split_stacked_experts, stacked_experts


def expert_parallel_size(module: nn.Module, autoep_size: int = 1) -> int:
    """The `ep_size` of the model's MoE layers, or the config's `expert_parallel.autoep_size` for a
    Hugging Face MoE model (1 without either)."""
    sizes = sorted({m.ep_size for m in module.modules() if isinstance(m, MoE)})
    if len(sizes) > 1:
        raise ValueError(
            f"the model's MoE layers have ep_size {sizes}: zerotron needs one expert-parallel size for the whole "
            "model (its groups are one layout); build every MoE layer with the same ep_size"
        )
    if sizes and autoep_size > 1:
        raise ConfigError(
            "expert_parallel.enabled",
            True,
            f"the model's DeepSpeed MoE layers split their experts themselves (ep_size {sizes[0]}); remove the "
            "expert_parallel section (it is for Hugging Face MoE models)",
        )
    if autoep_size > 1 and not stacked_experts(module):
        raise ConfigError(
            "expert_parallel.enabled",
            True,
            "the model has no stacked experts module (a Transformers MoE family's experts, or the reference "
            "MoE model's) to split; "
            "disable expert_parallel, or build the MoE layers with deepspeed.moe.layer.MoE(ep_size=...)",
        )
    return sizes[0] if sizes else autoep_size


def shard_groups(module: nn.Module, topology, grad_comm: Comm, dp_comm: Comm) -> ShardGroups:
    """The dense shard group and, with expert parallelism, the experts' (its groups handed to every
    MoE layer)."""
    dense = ShardGroup(grad_comm, dp_comm, topology.replicas)
    if topology.ep == 1:
        return ShardGroups(dense)
    ep_groups.record(topology)
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for m in layers:
        m.deepspeed_moe._set_ep_group(topology.group("ep"))
    if not layers:  # a Hugging Face MoE model (the config's expert_parallel section)
        split_stacked_experts(module, comm_for(topology.group("ep"), "ep"))
    experts = ShardGroup(
        Comm(topology.group("edp_grad"), "edp_grad"), Comm(topology.group("edp"), "edp"), dense.replicas
    )
    return ShardGroups(dense, experts)


_LOCAL_EXPERT = re.compile(r"(^|\.)deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.")


def global_expert_names(module: nn.Module, ep_rank: int) -> dict[str, str]:
    """state-dict name -> its name with the local expert number made global, for the experts of MoE
    layers split over expert-parallel ranks (others keep their names)."""
    local = {name: m.num_local_experts for name, m in module.named_modules() if isinstance(m, MoE) and m.ep_size > 1}
    names = {}
    for name in module.state_dict(keep_vars=True):
        match = _LOCAL_EXPERT.search(name)
        owner = name[: match.start()] if match else None
        if match and owner in local:
            number = ep_rank * local[owner] + int(match.group(2))
            names[name] = f"{name[: match.start(2)]}{number}{name[match.end(2) :]}"
    return names


def gather_experts(state: dict[str, torch.Tensor], module: nn.Module, topology) -> dict[str, torch.Tensor]:
    """`state` (the module's, experts under local numbers) with every expert-parallel rank's experts,
    under their global numbers: what one process holding every expert would have (every rank of an
    expert-parallel group must call it, with the same keys)."""
    if topology.ep == 1:
        return state
    comm = comm_for(topology.group("ep"), "ep")
    names = [global_expert_names(module, r) for r in range(topology.ep)]
    whole = {}
    for name, tensor in state.items():
        if name not in names[0]:
            whole[name] = tensor
            continue
        for rank, part in enumerate(comm.all_gather_list(tensor.contiguous())):
            whole[names[rank][name]] = part
    return whole
