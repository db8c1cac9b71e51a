"""ZeRO: model states sharded over the data-parallel ranks (stages 1-3)."""
from __future__ import annotations

from .partition_api import GatheredParameters, Init, consolidated_state_dict

import torch

from ..comm import Comm
from ..config import Config
from ..precision import DTYPES


def make_model_states(module: torch.nn.Module, optimizer: torch.optim.Optimizer, config: Config, comm: Comm,
                      gather_comm: Comm):
    """The object that reduces gradients (over `comm`), owns master weights and publishes updated
    parameters (gathering over `gather_comm`, the same ranks in a second process group), for the
    configured ZeRO stage; it takes over the optimizer's param groups."""
    zero = config.zero_optimization
    reduce_dtype = DTYPES[config.communication_data_type] if config.communication_data_type else None
    group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"] if p.requires_grad}
    # Module order, reversed below: roughly the order backward produces the gradients.
    params = [p for p in module.parameters() if id(p) in group_of]
    if zero.stage == 0:
        from ..data_parallel import ReplicatedStates
        states = ReplicatedStates(params, comm, zero.reduce_bucket_size, reduce_dtype)
    elif zero.stage == 3:
        from .stage3 import Stage3States
        states = Stage3States(module, params, group_of, comm, gather_comm, zero, reduce_dtype)
    else:
        from .flat import FlatBucket, split_into_buckets
        from .sharded import ShardedStates
        buckets = []
        for ps in split_into_buckets(list(reversed(params)), zero.reduce_bucket_size):
            b = FlatBucket(ps, comm.size, comm.rank)
            b.full = b.flatten_params()
            b.point_params_at(b.full)
            b.shard = b.own_slice(b.full)
            buckets.append(b)
        states = ShardedStates(buckets, set(), group_of, comm, gather_comm, zero.stage, zero.allgather_bucket_size,
                               reduce_dtype)
    states.adopt(optimizer)
    return states
