"""Where the sharded stages keep gradients between backward and the step: stage 1 accumulates
in full buckets and reduce-scatters once at the boundary (AccumulatedGrads); stages 2-3 reduce
each backward's gradients at once into a buffer of shards (StreamedGrads). ShardedStates
(sharded.py) drives either through the same methods."""
from __future__ import annotations

import torch

from .flat import FlatBucket


class AccumulatedGrads:
    """Stage 1's gradient holder: every micro-batch accumulates into full buckets (each parameter's
    .grad a view of its bucket, as in data parallelism); at the boundary backward each bucket is
    reduce-scattered once and its own slice becomes the reduced shard."""
    accumulates = True  # nothing is reduced before the boundary (pipelines: reduce_accumulated)
    flat = None         # no separate shard buffer

    def __init__(self):
        self._reduced = False

    def attach(self, b: FlatBucket, total_offset: int) -> None:
        b.grad_full = torch.zeros(b.padded_numel, dtype=b.dtype, device=b.device)
        b.grad_views = b.views(b.grad_full)
        for p, view in zip(b.params, b.grad_views):
            p.grad = view

    def allocate(self, total: int, dtype, device) -> None:
        pass

    def take(self, b: FlatBucket, i: int, param, sync: bool) -> bool:
        """A parameter's gradient is in; True when it now counts toward launching the reduction."""
        view = b.grad_views[i]
        if param.grad is not view:
            if param.grad is not None:
                view.add_(param.grad)
            param.grad = view
        return sync

    def to_reduce(self, b: FlatBucket):
        return b.grad_full

    def reduced(self, b: FlatBucket, received: torch.Tensor) -> None:
        b.own_slice(b.grad_full).copy_(received)

    def shard(self, b: FlatBucket) -> torch.Tensor:
        return b.own_slice(b.grad_full)

    def begin_reduction(self, sync: bool) -> bool:
        if not sync:
            return False
        if self._reduced:  # the full buckets now hold reduced and unreduced parts side by side
            raise RuntimeError("ZeRO stage 1 reduces the accumulated gradients once, at the boundary "
                               "backward; call engine.step() after it before another backward")
        self._reduced = True
        return True

    def zero(self, buckets) -> None:
        self._reduced = False
        for b in buckets:
            b.grad_full.zero_()
            for p, view in zip(b.params, b.grad_views):
                p.grad = view

    def nbytes(self, buckets) -> int:
        return sum(b.grad_full.numel() * b.grad_full.element_size() for b in buckets)


class StreamedGrads:
    """Stages 2-3's gradient holder: each backward's gradients are added into a short-lived
    bucket buffer (staging) as they arrive and reduce-scattered at once; the reduced shard is
    added into one buffer of gradient shards (grad_shard: a view per bucket)."""
    accumulates = False

    def __init__(self):
        self.flat: torch.Tensor | None = None

    def allocate(self, total: int, dtype, device) -> None:
        self.flat = torch.zeros(total, dtype=dtype, device=device)

    def attach(self, b: FlatBucket, total_offset: int) -> None:
        b.grad_shard = self.flat[total_offset:total_offset + b.shard_numel]

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
        b.grad_shard.add_(received)

    def shard(self, b: FlatBucket) -> torch.Tensor:
        return b.grad_shard

    def begin_reduction(self, sync: bool) -> bool:
        return True

    def zero(self, buckets) -> None:
        self.flat.zero_()

    def nbytes(self, buckets) -> int:
        return self.flat.numel() * self.flat.element_size()
