"""Where the sharded stages keep gradients between backward and the step: stage 1 accumulates
in full buckets and reduce-scatters once at the boundary (AccumulatedGrads); stages 2-3 reduce
each backward's gradients at once into shards (StreamedGrads). Either keeps the reduced shard
of a bucket in its grad_shard until the step, and holds nothing between a step and the next
backward. ShardedStates (sharded.py) drives either through the same methods."""
from __future__ import annotations

import torch

from .flat import FlatBucket


class AccumulatedGrads:
    """Stage 1's gradient holder: every micro-batch accumulates into full buckets (each parameter's
    .grad a view of its bucket, as in data parallelism); at the boundary backward each bucket is
    reduce-scattered once, its own slice becomes the reduced shard and the full bucket is freed.
    The buckets are made again by the first gradient after the step, so between a step and the
    next backward no gradient memory is held."""
    accumulates = True  # nothing is reduced before the boundary (pipelines: reduce_accumulated)

    def __init__(self):
        self._reduced = False

    def attach(self, b: FlatBucket, total_offset: int) -> None:
        b.grad_full, b.grad_shard = None, None

    def take(self, b: FlatBucket, i: int, param, sync: bool) -> bool:
        """A parameter's gradient is in; True when it now counts toward launching the reduction."""
        if b.grad_full is None:
            b.grad_full = torch.zeros(b.padded_numel, dtype=b.dtype, device=b.device)
            b.grad_views = b.views(b.grad_full)
        view = b.grad_views[i]
        if param.grad is not view:
            if param.grad is not None:
                view.add_(param.grad)
            param.grad = view
        return sync

    def to_reduce(self, b: FlatBucket):
        full = b.grad_full
        b.grad_full, b.grad_views = None, []
        for p in b.params:  # the views would keep the full bucket alive
            p.grad = None
        return full

    def reduced(self, b: FlatBucket, received: torch.Tensor) -> None:
        # `received` is the own slice of the full bucket: copied out, so the bucket is freed now
        b.grad_shard = received.to(b.dtype, copy=True)

    def shard(self, b: FlatBucket) -> torch.Tensor:
        if b.grad_shard is None:  # no gradient reached this bucket
            b.grad_shard = torch.zeros(b.shard_numel, dtype=b.dtype, device=b.device)
        return b.grad_shard

    def begin_reduction(self, sync: bool) -> bool:
        if not sync:
            return False
        if self._reduced:  # the bucket of an earlier micro-batch is reduced already
            raise RuntimeError("ZeRO stage 1 reduces the accumulated gradients once, at the boundary "
                               "backward; call engine.step() after it before another backward")
        self._reduced = True
        return True

    def zero(self, buckets) -> None:
        self._reduced = False
        for b in buckets:
            b.grad_full, b.grad_views, b.grad_shard = None, [], None
            for p in b.params:
                p.grad = None

    def release(self, b: FlatBucket) -> None:
        b.grad_shard = None

    def nbytes(self, buckets) -> int:
        return sum(t.numel() * t.element_size() for b in buckets for t in (b.grad_full, b.grad_shard)
                   if t is not None)


class StreamedGrads:
    """Stages 2-3's gradient holder: each backward's gradients are added into a short-lived
    bucket buffer (staging) as they arrive and reduce-scattered at once; the reduced shard is
    kept in the bucket's grad_shard (added into it under accumulation). A bucket's shard exists
    from its first reduction to the step, as DeepSpeed's and FSDP2's gradients do: between a
    step and the next backward no gradient memory is held."""
    accumulates = False

    def attach(self, b: FlatBucket, total_offset: int) -> None:
        b.grad_shard = None

    def take(self, b: FlatBucket, i: int, param, sync: bool) -> bool:
        if b.staging is None:
            b.staging = torch.zeros(b.padded_numel, dtype=b.dtype, device=b.device)
        off = b.offsets[i]
        b.staging[off:off + b.numels[i]].add_(param.grad.reshape(-1))
        param.grad = None
        return True

    def to_reduce(self, b: FlatBucket):
        full, b.staging = b.staging, None
        return full

    def reduced(self, b: FlatBucket, received: torch.Tensor) -> None:
        # `received` is a slice of the bucket-sized buffer just reduced: copied out, so that
        # buffer is freed now
        if b.grad_shard is None:
            b.grad_shard = received.to(b.dtype, copy=True)
        else:
            b.grad_shard.add_(received)

    def shard(self, b: FlatBucket) -> torch.Tensor:
        if b.grad_shard is None:  # no backward since the last step
            b.grad_shard = torch.zeros(b.shard_numel, dtype=b.dtype, device=b.device)
        return b.grad_shard

    def begin_reduction(self, sync: bool) -> bool:
        return True

    def zero(self, buckets) -> None:
        for b in buckets:
            b.grad_shard = None

    def release(self, b: FlatBucket) -> None:
        b.grad_shard = None

    def nbytes(self, buckets) -> int:
        return sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in buckets if b.grad_shard is not None)
