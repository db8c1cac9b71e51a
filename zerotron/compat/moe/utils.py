"""`deepspeed.moe.utils`: telling expert parameters from shared ones, and the optimizer groups
DeepSpeed's MoE wants. As in DeepSpeed, an expert parameter is one with `allreduce = False`
(and a `group_name`), as the MoE layer's experts are; a model without them gets every group back
unchanged (as a list, DeepSpeed's output type)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn as nn

from ...moe.layer import MoE
from ...zero.shard_group import is_expert_param as is_moe_param


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def split_params_into_shared_and_expert_params(params):
    shared = [p for p in params if not is_moe_param(p)]
    experts = [p for p in params if is_moe_param(p)]
    return shared, experts


def split_params_grads_into_shared_and_expert_params(group):
    """(gradients of shared parameters, gradients of expert parameters), each in its parameter's dtype."""
    shared, experts = [], []
    for p in group:
        if p.grad is not None:
            (experts if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, experts


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971) -> list[dict]:
    """Move expert parameters out of each group into groups of their own, one per (group, expert
    group name), with `moe: True` and the group's other settings, cut to at most `max_group_size`
    elements each (None: uncut). Accepts a dict, a list or a tuple of dicts; returns a list.
    Groups that hold expert parameters need a 'name'."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"param groups must be a dict, a list or a tuple of dicts, not {type(param_groups).__name__}")
    for group in param_groups:  # a generator would be used up by the first look
        params = group["params"]
        if not isinstance(params, list):
            group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
    expert_names = sorted({p.group_name for g in param_groups for p in g["params"] if is_moe_param(p)})
    if not expert_names:
        return param_groups
    moe_groups: dict = defaultdict(dict)
    for group in param_groups:
        for name in expert_names:
            moe_groups[group["name"]][name] = {**group, "name": name, "moe": True, "params": []}
    for group in param_groups:
        kept = []
        for p in group["params"]:
            if is_moe_param(p):
                moe_groups[group["name"]][p.group_name]["params"].append(p)
            else:
                kept.append(p)
        group["params"] = kept
    for by_name in moe_groups.values():
        for moe_group in by_name.values():
            if max_group_size is None:
                param_groups.append(moe_group)
                continue
            chunk, size = [], 0
            for p in moe_group["params"]:
                if chunk and size + p.numel() > max_group_size:
                    param_groups.append({**moe_group, "params": chunk})
                    chunk, size = [], 0
                chunk.append(p)
                size += p.numel()
            if chunk:
                param_groups.append({**moe_group, "params": chunk})
    return param_groups


def is_moe_param_group(param_group) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list):
    """DeepSpeed's helper: parameters or groups -> groups with the MoE split applied (once)."""
    if not isinstance(model_parameters, list):
        raise TypeError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError(f"optimizer parameters must be tensors or dicts, not {type(p).__name__}")
    first = model_parameters[0]
    if isinstance(first, torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"}
        )
    if isinstance(first, dict) and not any("moe" in g for g in model_parameters):
        return split_params_into_different_moe_groups_for_optimizer(model_parameters)
    return model_parameters
