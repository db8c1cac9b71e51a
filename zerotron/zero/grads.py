"""Where the sharded stages keep gradients between backward and the step: stage 1 accumulates
in full buckets and reduce-scatters once at the boundary (AccumulatedGrads); stages 2-3 reduce
each backward's gradients at once into shards (StreamedGrads). Either keeps the reduced shard
of a bucket until the step, and holds nothing between a step and the next
backward. ShardedStates (sharded.py) drives either through the same methods."""

from __future__ import annotations

import torch

from .flat import FlatBucket


class OutsideGrads:
    """Gradients a backward that is not this engine's left on its parameters (a GAN's generator loss through the
    discriminator): left accumulated in .grad, unreduced, as DeepSpeed's stages 0-1 leave them, for this engine's
    next backward to take in with its own; a step before that refuses them rather than apply them unreduced."""

    def __init__(self):
        self.left: dict[int, tuple] = {}

    def add(self, b, i: int, param) -> None:
        self.left[id(param)] = (b, i, param)

    def discard(self, param) -> None:
        self.left.pop(id(param), None)

    def take(self) -> list[tuple]:
        """(bucket, index, parameter) of those still there (zero_grad drops them), forgotten from now on."""
        still = [(b, i, p) for b, i, p in self.left.values() if p.grad is not None]
        self.left.clear()
        return still

    def check(self) -> None:
        still = [p for _, _, p in self.left.values() if p.grad is not None]
        if still:
            raise RuntimeError(
                f"{len(still)} parameters (the first of shape {tuple(still[0].shape)}) have gradients from a "
                "backward that was not this engine's, and no backward of this engine took them before step(): "
                "they are not reduced across ranks. Backpropagate through engine.backward(loss) (or the engine's "
                "output), or zero them (model.zero_grad()) if they belong to another model's update"
            )


class _ShardHolder:
    """The reduced gradient shard of each bucket (by bucket index), from its first reduction to
    the step."""

    def __init__(self):
        self.shards: dict[int, torch.Tensor] = {}
        self.outside = OutsideGrads()

    def shard(self, b: FlatBucket) -> torch.Tensor:
        if b.index not in self.shards:  # no gradient reached this bucket since the last step
            self.shards[b.index] = torch.zeros(b.shard_numel, dtype=b.dtype, device=b.device)
        return self.shards[b.index]

    def reduced(self, b: FlatBucket, received: torch.Tensor) -> None:
        """`received`: this rank's slice of a bucket-sized buffer just reduced, copied out so that buffer is
        freed now; added to the shard under accumulation (stages 2-3) or a second boundary backward before the
        step (stage 1: a GAN's real and fake losses)."""
        if b.index not in self.shards:
            self.shards[b.index] = received.to(b.dtype, copy=True)
        else:
            self.shards[b.index].add_(received)

    def release(self, b: FlatBucket) -> None:
        self.shards.pop(b.index, None)

    def _held(self):
        return list(self.shards.values())

    def nbytes(self, buckets) -> int:
        return sum(t.numel() * t.element_size() for t in self._held())


class AccumulatedGrads(_ShardHolder):
    """Stage 1's gradient holder: every micro-batch accumulates into full buckets (each parameter's
    .grad a view of its bucket, as in data parallelism); at the boundary backward each bucket is
    reduce-scattered once, its own slice becomes the reduced shard and the full bucket is freed.
    The buckets are made again by the first gradient after the step, so between a step and the
    next backward no gradient memory is held."""

    accumulates = True  # nothing is reduced before the boundary (pipelines: reduce_accumulated)

    def __init__(self):
        super().__init__()
        self.full: dict[int, torch.Tensor] = {}  # bucket index -> its accumulating full bucket
        self.views: dict[int, list[torch.Tensor]] = {}  # ... and each parameter's .grad, a view of it

    def take(self, b: FlatBucket, i: int, param, sync: bool) -> bool:
        """A parameter's gradient is in; True when it now counts toward launching the reduction."""
        if b.index not in self.full:
            self.full[b.index] = torch.zeros(b.padded_numel, dtype=b.dtype, device=b.device)
            self.views[b.index] = b.views(self.full[b.index])
        view = self.views[b.index][i]
        if param.grad is not view:
            # A fresh bucket, or .grad replaced (zero_grad(set_to_none=True): autograd made a new one,
            # holding the whole gradient since): take it in the view's place
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view
        return sync

    def to_reduce(self, b: FlatBucket):
        full = self.full.pop(b.index, None)
        self.views.pop(b.index, None)
        for p in b.params:  # the views would keep the full bucket alive
            p.grad = None
        return full

    def begin_reduction(self, sync: bool) -> bool:
        return sync

    def zero(self, buckets) -> None:
        self.full.clear()
        self.views.clear()
        self.shards.clear()
        for b in buckets:
            for p in b.params:
                p.grad = None

    def _held(self):
        return list(self.full.values()) + list(self.shards.values())


class StreamedGrads(_ShardHolder):
    """Stages 2-3's gradient holder: each backward's gradients are added into a short-lived
    bucket buffer (staging) as they arrive and reduce-scattered at once; the reduced shard is
    kept (added into under accumulation). A bucket's shard exists from its first reduction to
    the step, as DeepSpeed's and FSDP2's gradients do: between a step and the next backward no
    gradient memory is held."""

    accumulates = False

    def __init__(self):
        super().__init__()
        self.staging: dict[int, torch.Tensor] = {}  # bucket index -> this backward's gradients so far

    def take(self, b: FlatBucket, i: int, param, sync: bool) -> bool:
        if b.index not in self.staging:
            self.staging[b.index] = torch.zeros(b.padded_numel, dtype=b.dtype, device=b.device)
        off = b.offsets[i]
        self.staging[b.index][off : off + b.numels[i]].add_(param.grad.reshape(-1))
        param.grad = None
        return True

    def to_reduce(self, b: FlatBucket):
        return self.staging.pop(b.index, None)

    def begin_reduction(self, sync: bool) -> bool:
        return True

    def zero(self, buckets) -> None:
        self.shards.clear()
