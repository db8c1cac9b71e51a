"""The expert-parallel layouts made so far, one per expert-parallel size: the MoE layer makes one when
asked (`set_deepspeed_parallelism`), the engine when it trains a model with experts, DeepSpeed scripts
through `deepspeed.utils.groups._create_expert_and_data_parallel`; all three are the same groups
(Topology caches them). `deepspeed.utils.groups` answers its expert accessors from here."""

from __future__ import annotations

import torch.distributed as dist

from ..topology import Topology

_made: dict[int, Topology] = {}


def make(ep_size: int) -> Topology:
    """The groups for `ep_size` over the whole world (data parallelism only), made once."""
    if ep_size not in _made:
        record(Topology(dist.get_world_size(), ep=ep_size).build_groups())
    return _made[ep_size]


def record(topology: Topology) -> None:
    """A layout whose expert groups exist (the engine's own, built already)."""
    if topology.ep > 1:
        _made[topology.ep] = topology


def made() -> dict[int, Topology]:
    """Expert-parallel size -> its layout, for the sizes whose groups exist."""
    return dict(_made)
