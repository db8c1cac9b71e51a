"""The state stages 1-3 keep for each flat bucket: where its full buffer is (a Residency), this
rank's shard of the parameters, its fp32 master, and its place in the reductions."""

from __future__ import annotations

import torch

from .flat import FlatBucket
from .residency import Residency
from .shard_group import ShardGroup


class ShardedBucket(FlatBucket):
    def __init__(self, params: list[torch.nn.Parameter], group: ShardGroup, keep=None):
        """The parameters become views into one new full buffer (their current values copied in),
        sharded over `group`; `shard` is this rank's slice of it, or what `keep(slice)` returns
        (stage 3: a copy that outlives the full buffer, in host memory with offload_param)."""
        super().__init__(params, group.size, group.rank)
        self.group = group
        full = self.flatten_params()
        self.point_params_at(full)
        self.residency = Residency(self, full)
        own = self.own_slice(full)
        self.shard: torch.Tensor | None = own if keep is None else keep(own)
        self.master: torch.Tensor | None = None  # fp32 view into the stage's master buffer
        self.index = 0  # place among the stage's buckets: reductions and gathers go in this order
        self.offset = 0  # where its shard starts in the stage's flat master (and host) buffers
        self.ready: set[int] = set()  # parameters whose gradient arrived in this backward
        self.expected = sum(p.requires_grad for p in params)
        self.launched_in_backward = False

    @property
    def full(self) -> torch.Tensor:
        return self.residency.full

    def own_values(self) -> torch.Tensor:
        """This rank's part of the parameters in the model dtype: the shard, or where none is kept
        (stage 3 in bf16/fp16 without offload) the fp32 master cast, as FSDP2 casts at each gather."""
        return self.shard if self.shard is not None else self.master.to(self.dtype)
