"""`deepspeed.runtime.sequence_parallel.parallel_state_sp`: DeepSpeed's slim sequence-parallel mpu.
`initialize_sequence_parallel(n)` makes the groups the engine will use (zerotron's topology with
sequence_parallel_size n, shared with the engine of the same layout), so the group a script hands
`DistributedAttention` is the engine's, and its all-to-alls count in `engine.comm_stats()`. Passed
as `initialize(mpu=...)`, it sets the sequence-parallel size the config must agree with."""

from __future__ import annotations

import torch.distributed as dist

from ..topology import Topology

_topology: Topology | None = None


def initialize_sequence_parallel(sequence_parallel_size: int) -> None:
    global _topology
    if not dist.is_initialized():
        raise RuntimeError(
            "initialize_sequence_parallel needs the default process group: call "
            "deepspeed.init_distributed() (zerotron.init_distributed()) first"
        )
    if sequence_parallel_size <= 1:
        raise ValueError(f"sequence_parallel_size must be greater than 1, got {sequence_parallel_size}")
    _topology = Topology(dist.get_world_size(), sp=sequence_parallel_size).build_groups()


def _built() -> Topology:
    if _topology is None:
        raise RuntimeError("sequence parallel groups are not initialized: call initialize_sequence_parallel(n) first")
    return _topology


def get_sequence_parallel_group():
    return _built().group("sp")


def get_sequence_data_parallel_group():
    return _built().group("dp")


def get_sequence_parallel_world_size() -> int:
    return _built().sp


def get_sequence_parallel_rank() -> int:
    return _built().coords(dist.get_rank()).sp


def get_sequence_data_parallel_world_size() -> int:
    return _built().replicas


def get_sequence_data_parallel_rank() -> int:
    return dist.get_rank(get_sequence_data_parallel_group())


def _release_sequence_parallel_groups() -> None:
    global _topology
    _topology = None
