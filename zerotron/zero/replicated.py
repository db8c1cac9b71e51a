"""Data parallelism (ZeRO stage 0): gradients in flat buckets, all-reduced while backward runs.

Each bucket is one contiguous buffer; every parameter's `.grad` is a view into it, so autograd
accumulates straight into the buffer and one bucket is one collective, with no copies. Buckets
hold parameters in reverse registration order (roughly the order backward produces their
gradients); a post-accumulate-grad hook counts a bucket's parameters, and when the last one is
in, the bucket's all-reduce is launched asynchronously while backward carries on. Buckets are
always launched in index order, so every rank issues the same collectives in the same order
even when hooks fire in a different order.
"""

from __future__ import annotations

import torch

from .grads import OutsideGrads
from .shard_group import ShardGroup, ShardGroups


class Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter], group: ShardGroup):
        self.index, self.group = index, group
        self.params = params
        dtype, device = params[0].dtype, params[0].device
        numel = sum(p.numel() for p in params)
        self.grads = torch.zeros(numel, dtype=dtype, device=device)
        self.views, offset = [], 0
        for p in params:
            self.views.append(self.grads[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.ready: set[int] = set()
        self.expected = len(params)  # gradients to wait for before reducing
        self.work = None
        self.comm_buffer = None  # only when reducing in another dtype
        self.launched_in_backward = False

    def attach(self):
        for p, view in zip(self.params, self.views):
            p.grad = view


class InOrderReduction:
    """Launches bucket reductions in index order on every rank, each as soon as it and every
    bucket before it has all its gradients (`bucket.expected` of them). Subclasses keep
    `buckets`, `_next_launch` and define `_launch(bucket, in_backward)`."""

    def _mark_ready(self, bucket, i: int, param):
        if bucket.index < self._next_launch:
            raise RuntimeError(
                f"gradient of a parameter of shape {tuple(param.shape)} arrived after its bucket was reduced: "
                "the parameter was used again after backward reached it (reentrant checkpointing or a "
                "second backward before engine.step()); use torch.utils.checkpoint(use_reentrant=False)"
            )
        bucket.ready.add(i)
        self._launch_ready(in_backward=True)

    def _launch_ready(self, in_backward: bool):
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if in_backward and len(bucket.ready) < bucket.expected:
                return
            self._launch(bucket, in_backward)
            self._next_launch += 1


class GradBuckets(InOrderReduction):
    """Owns the gradient buffers of `params` and reduces each bucket over its group at accumulation boundaries."""

    def __init__(self, buckets: list[list[torch.nn.Parameter]], groups: ShardGroups, reduce_dtype=None):
        self.groups = groups
        self.reduce_dtype = reduce_dtype
        self.buckets: list[Bucket] = []
        self.sync = True  # reduce in this backward? (False inside gradient accumulation)
        self.open = False  # is a backward of this engine running (engine.backward or loss.backward on its output)?
        self.outside = OutsideGrads()  # (here in the buckets' views already: reduced by the next sync backward)
        self._next_launch = 0
        self._bucket_of: dict[int, tuple[Bucket, int]] = {}
        for params in buckets:
            self._add_bucket(params)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for ps in buckets for p in ps]

    def _add_bucket(self, params):
        bucket = Bucket(len(self.buckets), params, self.groups.of(params[0]))
        bucket.attach()
        for i, p in enumerate(params):
            self._bucket_of[id(p)] = (bucket, i)
        self.buckets.append(bucket)

    # ---- during backward --------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.nn.Parameter):
        bucket, i = self._bucket_of[id(param)]
        view = bucket.views[i]
        if param.grad is not view:
            # Someone replaced .grad (zero_grad(set_to_none=True): autograd made a new one): it holds the whole
            # gradient, and the bucket what was there before the replacement: take it in its place.
            if param.grad is not None:
                view.copy_(param.grad)
            param.grad = view
        # Only this engine's backward reduces: another engine's backward reaching these parameters (a GAN's
        # generator loss through the discriminator) leaves gradients accumulated unreduced, as in DeepSpeed.
        if not self.open:
            self.outside.add(bucket, i, param)
        elif self.sync:
            self._mark_ready(bucket, i, param)

    def _launch(self, bucket: Bucket, in_backward: bool):
        bucket.launched_in_backward = in_backward
        # Divide first: averaging stays exact for power-of-two sizes and fp16 sums cannot overflow.
        buf = bucket.grads
        if self.reduce_dtype is not None and self.reduce_dtype != buf.dtype:
            bucket.comm_buffer = buf.to(self.reduce_dtype)
            buf = bucket.comm_buffer
        group = bucket.group
        if group.replicas > 1:  # (an expert held by one rank still averages every replica's loss)
            buf.div_(group.replicas)
        if group.size > 1:
            bucket.work = group.reduce.all_reduce(buf, async_op=True)

    # ---- after backward ---------------------------------------------------------------------
    def finish(self) -> None:
        """Launch buckets whose parameters got no gradient, then wait for every reduction."""
        self.open = False
        if not self.sync:
            return
        self.outside.take()  # whatever another backward left in the buckets is reduced with them now
        self._launch_ready(in_backward=False)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
                bucket.work = None
            if bucket.comm_buffer is not None:
                bucket.grads.copy_(bucket.comm_buffer)
                bucket.comm_buffer = None
            bucket.ready.clear()
        self._next_launch = 0

    def zero(self) -> None:
        for bucket in self.buckets:
            bucket.grads.zero_()
            bucket.attach()

    def flat_grads(self) -> list[torch.Tensor]:
        return [b.grads for b in self.buckets]

    def remove_hooks(self):
        for h in self._hooks:
            h.remove()


class ReplicatedStates:
    """Stage 0 behind the interface the engine drives (shared with `zero.sharded.ShardedStates`):
    full gradients all-reduced in buckets, full fp32 masters (separate only in bf16/fp16)."""

    host = None  # stage 0 never offloads

    def __init__(self, buckets: list[list[torch.nn.Parameter]], groups: ShardGroups, reduce_dtype=None):
        from ..precision import MasterWeights

        params = [p for ps in buckets for p in ps]
        self.groups = groups
        # gradients are identical on every rank after the all-reduce; with expert parallelism each
        # expert-parallel rank holds other experts: their norms are summed over the data-parallel ranks
        self.norm_group = None if groups.expert is None else groups.norm_group
        self.grad_buckets = GradBuckets(buckets, groups, reduce_dtype)
        self.buckets = self.grad_buckets.buckets
        self.master = MasterWeights(params)
        self._master_of = {id(p): m for p, m in zip(self.master.model_params, self.master.masters)}

    def adopt(self, optimizer, allow_untested: bool = False):
        self.master.adopt(optimizer)  # whole parameters: any optimizer is exact, nothing to check

    def begin_backward(self, sync: bool):
        self.grad_buckets.sync, self.grad_buckets.open = sync, True

    def end_backward(self):
        self.grad_buckets.finish()

    def unscale_and_check(self, inv_scale):
        self.grad_buckets.outside.check()
        return self.master.take_grads(inv_scale)

    def master_grads(self):
        return self.master.grads()

    def grad_norms(self) -> list[torch.Tensor]:
        return list(torch._foreach_norm(self.master_grads()))

    def apply_update(self, optimizer, clip_coef) -> None:
        grads = self.master_grads()
        if clip_coef is not None and grads:
            torch._foreach_mul_(grads, clip_coef.to(grads[0].device))
        optimizer.step()

    def norm_weights(self, tp: int) -> list[float] | None:
        from ..precision import norm_share

        weights = [norm_share(p, tp) for p in self.master.model_params]
        if self.norm_group is not None:  # summed over every data-parallel rank: each copy counts 1/copies
            weights = [w / self.groups.of(p).size for w, p in zip(weights, self.master.model_params)]
        return None if all(w == 1.0 for w in weights) else weights

    def reduce_accumulated(self):
        """Reduce gradients accumulated without reduction (pipeline schedules: after the last backward)."""
        self.grad_buckets.sync = True
        self.grad_buckets.finish()

    def reduced_grads(self, params) -> list[torch.Tensor]:
        """After the reduction: the tensors holding `params`' gradients on this rank."""
        return [p.grad for p in params]

    replicated = True  # every data-parallel rank holds every piece (checkpoints: one rank saves)

    def pieces(self):
        """(parameter, start, length, master, offset in master) of what this rank updates."""
        for p, m in zip(self.master.model_params, self.master.masters):
            yield p, 0, p.numel(), m, 0

    def publish(self, from_masters: bool = False):
        self.master.copy_to_model()

    def param_shape(self, param):
        return param.shape if id(param) in self._master_of else None

    def grad_pieces(self, param):
        return None if param.grad is None else [(0, param.numel(), param.grad, 0)]

    def grads_changed(self, params):
        pass  # the gradients are where the step reads them

    @torch.no_grad()
    def republish(self, params, comm=None):
        for p in params:
            master = self._master_of[id(p)]
            if master is not p:
                p.data.copy_(master)

    def destroy(self):
        self.grad_buckets.remove_hooks()

    def zero_grads(self):
        self.grad_buckets.zero()

    def memory(self) -> dict[str, int]:
        grads = sum(g.numel() * g.element_size() for g in self.grad_buckets.flat_grads())
        if self.master.separate:
            grads += sum(m.numel() * 4 for m in self.master.masters)
        return {
            "grads": grads,
            "master_weights": sum(m.numel() * 4 for m in self.master.masters) if self.master.separate else 0,
        }
