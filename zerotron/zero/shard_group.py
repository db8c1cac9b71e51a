"""Which ranks hold the same copy of a parameter: the group its gradient is reduced over and its
states are sharded over.

Dense parameters: every data-parallel replica ("dp"). With expert parallelism, an expert lives on
one rank of each expert-parallel group, so its copies are the replicas with the same expert-parallel
index (DeepSpeed's expert-data-parallel group, `ep` times smaller). Its gradient still averages the
losses of every replica: each rank's expert gradient already sums the tokens its expert-parallel
group sent it, so the sum over the expert-data group covers every replica's batch once, and is
divided by the whole data-parallel size (dividing by the expert-data size is DeepSpeed's #5618:
expert gradients `ep` times too large).

Every bucket holds parameters of one group; the stages reduce, gather and shard each bucket over
its own group. Squared gradient norms are summed over the dense group: its ranks together hold
every expert shard exactly once, as they hold every dense shard once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Comm


@dataclass(frozen=True, eq=False)
class ShardGroup:
    reduce: Comm  # gradient reductions
    gather: Comm  # parameter gathers and broadcasts: the same ranks, a second process group
    replicas: int  # the ranks whose losses a gradient averages: reductions divide by it

    @property
    def size(self) -> int:
        return self.reduce.size

    @property
    def rank(self) -> int:
        return self.reduce.rank

    @property
    def dense(self) -> bool:
        """Every replica holds the parameters (not an expert group)."""
        return self.size == self.replicas


class ShardGroups:
    """The dense group and, under expert parallelism, the experts' group; `of(param)` picks one."""

    def __init__(self, dense: ShardGroup, expert: ShardGroup | None = None):
        self.dense, self.expert = dense, expert

    def of(self, param: torch.nn.Parameter) -> ShardGroup:
        return self.expert if self.expert is not None and is_expert_param(param) else self.dense

    @property
    def norm_group(self):
        """The group summing squared gradient norms when ranks hold different pieces."""
        return self.dense.gather.group if self.dense.size > 1 else None


def is_expert_param(param: torch.Tensor) -> bool:
    """An expert's parameter, by DeepSpeed's mark (`allreduce = False`, set by the MoE layer's experts)."""
    return getattr(param, "allreduce", True) is False
