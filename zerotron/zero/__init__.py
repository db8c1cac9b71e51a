"""ZeRO: the model states of each stage: replicated with all-reduced gradients (stage 0,
replicated.py), sharded over the data-parallel ranks (stages 1-2, sharded.py; stage 3, stage3.py)."""

from __future__ import annotations

import functools
import weakref

import torch

from ..config import Config
from ..log import warn
from ..precision import DTYPES
from .partition_api import GatheredParameters, Init, consolidated_state_dict, unwrap_model_for_generation
from .shard_group import ShardGroup, ShardGroups
from .strategy import ModelStates


def make_model_states(
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    config: Config,
    groups: ShardGroups,
    isolate: list[list[torch.nn.Parameter]] = (),
) -> ModelStates:
    """The object that reduces gradients, owns master weights and publishes updated parameters,
    each parameter over its ShardGroup in `groups` (shard_group.py), for the configured ZeRO stage;
    it takes over the optimizer's param groups. Each list in `isolate` gets
    buckets of its own, laid out alike on every rank holding it (weights tied across pipeline
    stages, whose reduced gradients are then summed between those stages)."""
    zero = config.zero_optimization
    offload = (
        zero.offload_optimizer
        if zero.offload_optimizer is not None and zero.offload_optimizer.device == "cpu"
        else None
    )
    reduce_dtype = DTYPES[config.communication_data_type] if config.communication_data_type else None
    group_of = optimizer_groups(module, optimizer)
    # Module order, reversed below: roughly the order backward produces the gradients.
    params = [p for p in module.parameters() if id(p) in group_of]
    from .flat import bucket_numel

    bucket = bucket_numel(zero.reduce_bucket_size, sum(p.numel() for p in params))
    if zero.stage == 0:
        from .replicated import ReplicatedStates

        states = ReplicatedStates(_bucketed(params, bucket, groups, isolate), groups, reduce_dtype)
    elif zero.stage == 3:
        from .stage3 import Stage3States

        states = Stage3States(module, params, group_of, groups, zero, reduce_dtype, offload=offload)
    else:
        from .sharded import ShardedStates
        from .sharded_bucket import ShardedBucket

        buckets = [ShardedBucket(ps, groups.of(ps[0])) for ps in _bucketed(params, bucket, groups, isolate)]
        states = ShardedStates(
            buckets,
            set(),
            group_of,
            groups,
            zero.stage,
            zero.allgather_bucket_size,
            reduce_dtype,
            offload=offload,
            reshard=zero.reshard_after_backward,
            overlap_gather=zero.overlap_param_gather,
        )
        if zero.overlap_param_gather:
            states.params.watch(module, states.bucket_of)
    states.adopt(optimizer, allow_untested=config.zero_allow_untested_optimizer)
    return states


def optimizer_groups(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> index of the optimizer group holding it. Every group may hold only the
    module's parameters (else an update would go to a tensor the model does not use); a parameter that
    requires a gradient but is in no group stays as it is, as in DeepSpeed, with a warning when a
    gradient reaches it."""
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
    group_of = {}
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer group {gi} holds a tensor of shape {tuple(p.shape)} that is not a "
                    "parameter of the model: build the optimizer (or model_parameters) from this "
                    "model's parameters"
                )
            if p.requires_grad:
                group_of[id(p)] = gi
    missing = [(n, p) for n, p in module.named_parameters() if p.requires_grad and id(p) not in group_of]
    # DeepSpeed takes parameters left out of every group and never updates them (BingBertSquad leaves out
    # BERT's pooler, which its loss never uses; bing_bert's pre-training too, whose next-sentence loss
    # does). One that never receives a gradient trains exactly as if it were in a group; one that does
    # stays as it is, which a warning says once (while this optimizer lives: the model may be handed on).
    alive, warned = weakref.ref(optimizer), []
    for name, p in missing:
        p.register_post_accumulate_grad_hook(
            functools.partial(_ungrouped_gradient, alive, name, [n for n, _ in missing], warned)
        )
    return group_of


def _ungrouped_gradient(alive, name: str, ungrouped: list[str], warned: list, param: torch.Tensor) -> None:
    if alive() is None or warned:
        return
    warned.append(name)
    shown = ", ".join(ungrouped[:5]) + (f" and {len(ungrouped) - 5} more" if len(ungrouped) > 5 else "")
    warn(
        f"parameter {name} received a gradient but is in no optimizer group: it stays as it is, as in DeepSpeed "
        f"(parameters that require gradients but are in no optimizer group: {shown}). To train them, pass them "
        "(model_parameters=model.parameters()); to say they are frozen, set requires_grad=False"
    )


def _bucketed(params, max_numel, groups: ShardGroups | None = None, isolate=()):
    """Parameters in reverse module order (roughly when backward produces their gradients) cut
    into buckets, each of one shard group; each isolated list forms buckets of its own, after the others."""
    from .flat import split_into_buckets

    present = {id(p) for p in params}
    isolated = [[p for p in group if id(p) in present] for group in isolate]
    apart = {id(p) for group in isolated for p in group}
    group_of = groups.of if groups is not None else lambda p: None
    buckets = split_into_buckets([p for p in reversed(params) if id(p) not in apart], max_numel, group_of)
    for group in isolated:
        buckets += split_into_buckets(group, max_numel, group_of) if group else []
    return buckets
