"""Flat buckets: a list of parameters laid end to end in one buffer, split into equal shards.

The bucket's length is padded to a multiple of the data-parallel size so every rank owns one
contiguous shard of `shard_numel` elements: rank r owns [r * shard_numel, (r + 1) * shard_numel).
Parameters become views into the full buffer while it exists. One bucket is one collective.

Each parameter starts on a 16-byte boundary of the buffer (a few elements of zeros after a parameter
whose size is not a multiple of 16 bytes): CUDA's vectorized kernels read whole 16-byte words, and some
refuse anything else (torch._grouped_mm: "expected data_ptr to be aligned to 16 bytes"). The gaps hold
zeros in every state (weights, gradients, masters, moments) and stay zero through any step.
"""

from __future__ import annotations

import torch

DEEPSPEED_BUCKET_NUMEL = 500_000_000  # DeepSpeed's default reduce_bucket_size
OVERLAP_BUCKETS = 8
ALIGN_BYTES = 16  # where each parameter starts in a bucket (see above)


def bucket_numel(configured: int | None, total: int) -> int:
    """The most elements of one gradient bucket. `reduce_bucket_size` when the config sets it (as
    DeepSpeed reads it); unset, the `total` parameter elements cut into about OVERLAP_BUCKETS
    buckets of at most DeepSpeed's 5e8: buckets are reduced in backward order as each fills, so
    with eight of them all but the last (an eighth of the traffic) can overlap the backward, for a
    model of any size. (DeepSpeed's 5e8 alone makes any model under 5e8 parameters one bucket,
    whose reduction cannot start before the backward ends.)"""
    if configured is not None:
        return configured
    return max(1, min(DEEPSPEED_BUCKET_NUMEL, -(-total // OVERLAP_BUCKETS)))


def cut(items: list, numel, max_numel: int, joins=lambda first, item: True) -> list[list]:
    """Consecutive runs of `items`, each of at most `max_numel` elements (`numel(item)` each; a
    single larger item gets a run of its own), a new run also where `joins(first of the run, item)`
    is false. The one rule for gradient buckets, shared with the planner (planner/overlap.py)."""
    runs, current, size = [], [], 0
    for item in items:
        n = numel(item)
        if current and (size + n > max_numel or not joins(current[0], item)):
            runs.append(current)
            current, size = [], 0
        current.append(item)
        size += n
    if current:
        runs.append(current)
    return runs


def split_into_buckets(params: list[torch.nn.Parameter], max_numel: int, group_of=lambda p: None) -> list[list]:
    """Consecutive runs of parameters of one dtype, device and `group_of(p)` (the ranks sharing
    them: zero/shard_group.py), each run at most `max_numel` elements (a single larger parameter
    gets a bucket of its own)."""
    return cut(
        params,
        lambda p: p.numel(),
        max_numel,
        lambda a, p: p.dtype == a.dtype and p.device == a.device and group_of(p) is group_of(a),
    )


class FlatBucket:
    """The layout of a bucket: its parameters end to end, padded to equal shards. It holds no
    tensors; each stage keeps its own state beside it (sharded.ShardedBucket, grads.py)."""

    def __init__(self, params: list[torch.nn.Parameter], world: int, rank: int):
        self.params = params
        self.world, self.rank = world, rank
        step = max(1, ALIGN_BYTES // params[0].element_size())
        self.offsets, offset = [], 0
        for p in params:
            offset = -(-offset // step) * step
            self.offsets.append(offset)
            offset += p.numel()
        self.numel = offset
        self.shard_numel = -(-offset // world)  # ceil
        self.padded_numel = self.shard_numel * world
        self.dtype, self.device = params[0].dtype, params[0].device
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]  # kept: a released stage-3 parameter has no elements

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel

    def flatten_params(self) -> torch.Tensor:
        """Copy the parameters' current values into a new padded flat buffer."""
        full = torch.zeros(self.padded_numel, dtype=self.dtype, device=self.device)
        for p, off in zip(self.params, self.offsets):
            full[off : off + p.numel()].copy_(p.detach().reshape(-1))
        return full

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[off : off + n].view(shape) for off, n, shape in zip(self.offsets, self.numels, self.shapes)]

    def point_params_at(self, flat: torch.Tensor) -> None:
        """Make every parameter a view into `flat` (same storage, no copy)."""
        for p, view in zip(self.params, self.views(flat)):
            p.data = view

    def own_slice(self, flat: torch.Tensor) -> torch.Tensor:
        start, end = self.shard_range
        return flat[start:end]

    def param_slices_in_shard(self):
        """(param index, start in param, start in shard, length) for each parameter piece this rank owns."""
        start, end = self.shard_range
        for i, (n, off) in enumerate(zip(self.numels, self.offsets)):
            lo, hi = max(off, start), min(off + n, end)
            if lo < hi:
                yield i, lo - off, lo - start, hi - lo
