"""ZeRO stage 3: parameters are partitioned too. This file decides when each unit is gathered and
released (the mechanism is zero/residency.py, the prefetch and reuse rules zero/gather_rules.py).

The model is cut into units: by default every repeated block (each child of a ModuleList or
Sequential whose children share one class, e.g. a transformer layer), plus the root unit holding
everything else (embeddings, final norm, head). Each unit's parameters live in one flat bucket,
of which a rank keeps only its shard. A unit is

- gathered (one all-gather) right before its forward, and released right after it;
- gathered again right before its backward (a hook on its outputs' gradients), and released as
  soon as all of its gradients are in and reduce-scattered;
- prefetched: while one unit computes, the next ones in execution order (recorded in the first
  forward; reversed for backward) are already being gathered, as long as fewer than
  `stage3_prefetch_bucket_size` elements are gathered ahead of their use (0: no prefetching).

The root unit wraps the whole forward, so it stays gathered from the start of forward to the end
of backward; that is also what makes parameters read outside their own module's forward (a head
tied to the embedding, say) work. Parameters smaller than `stage3_param_persistence_threshold`
stay whole on every rank, like stage 2's. Buffers are never partitioned.

A model built under `zero.Init` arrives as per-parameter pieces (DeepSpeed's ds_tensor): each
unit in turn is gathered from them, cut into its bucket's shard and released, so the model is
never whole on a rank. Inside `GatheredParameters` the units it gathered are pinned: the hooks
leave them gathered until the outermost block ends (ranks may then run different numbers of
forwards, e.g. generation of different lengths).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm, local_device
from ..nested import tensors_in
from . import gather_rules
from . import offload as host_memory
from .offload import Uploads, host_empty
from .partitioned_init import ZeroParamStatus, _ds_ids, materialize, take_whole
from .residency import set_holder
from .shard_group import ShardGroup, ShardGroups
from .sharded import ShardedStates
from .sharded_bucket import ShardedBucket
from .units import KeptWhole, Unit, _recomputing, find_units


class Stage3States(ShardedStates):
    """Stage 3: ShardedStates over partitioned unit buckets plus the hooks that gather them."""

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        group_of: dict[int, int],
        groups: ShardGroups,
        zero,
        reduce_dtype=None,
        unit_classes: list[str] | None = None,
        offload=None,
    ):
        self.root = module
        # offload_param: partitioned shards wait in host memory; a gather brings them to the device.
        op = zero.offload_param
        self.param_host = op is not None and op.device == "cpu"
        self.pin = self.param_host and host_memory.can_pin()  # whatever pin_memory says: see zero/offload.py
        # DeepSpeed's knobs, in parameter elements (zero/gather_rules.py says how each is read)
        self.prefetch_numel = zero.stage3_prefetch_bucket_size
        self.max_live_numel = zero.stage3_max_live_parameters
        self.max_reuse_numel = zero.stage3_max_reuse_distance
        # Measurements: the most parameter elements gathered at once, the most gathered ahead of
        # their use, how many units found their gather already issued when their turn came.
        self.peak_live_numel = self.peak_ahead_numel = self.prefetch_hits = 0
        self.ahead: set[Unit] = set()  # units prefetched and not yet used
        self.units, buckets = self._build_units(
            module, {id(p) for p in params}, groups, zero.stage3_param_persistence_threshold, unit_classes
        )
        self.root_unit = self.units[-1]
        self.partitioned_buckets = {id(u.bucket) for u in self.units if u.bucket is not None}
        super().__init__(
            buckets,
            {i for i, b in enumerate(buckets) if id(b) in self.partitioned_buckets},
            group_of,
            groups,
            zero.stage,
            zero.allgather_bucket_size,
            reduce_dtype,
            on_grads_done=self._grads_done,
            offload=offload,
            sub_group_numel=zero.sub_group_size,
        )
        self._unit_of = {id(u.bucket): u for u in self.units if u.bucket is not None}
        # bf16/fp16 without offload: the fp32 master is the only copy of a partitioned shard, and
        # each gather casts it (FSDP2 keeps no low-precision shard either); saves 2 bytes/element
        if not self.masters_are_params and self.host is None and not self.param_host:
            for i in self.partitioned:
                b = self.buckets[i]
                b.shard = None
                _point_pieces(b, b.master)
        self.trace: list[Unit] = []
        self.tracing = True
        self._forward_hooks = [
            h
            for u in self.units
            for h in (
                u.module.register_forward_pre_hook(self._make_pre_forward(u)),
                u.module.register_forward_hook(self._make_post_forward(u)),
            )
        ]

    def _build_units(
        self, module, trainable: set[int], groups: ShardGroups, threshold: int, unit_classes
    ) -> tuple[list[Unit], list[ShardedBucket]]:
        """Cut the model into units (the root last), one at a time: each unit's own parameters are
        materialized (meta device) or gathered from their zero.Init pieces, partitioned into its
        bucket (those under `threshold` into a bucket kept whole) and released, so only one unit is
        ever whole on a rank. A module whose parameters belong to two shard groups (a block holding
        experts) is two units, one per group, the experts' first. The buckets come back in the order
        their gradients complete."""
        units, buckets, claimed, owner = [], [], set(), {}
        uploads = Uploads() if self.param_host else None
        seed = _agreed_seed(groups.dense.gather)
        found = find_units(module, unit_classes) + [("", module)]
        for index, (name, m) in enumerate(found):
            own = [p for p in m.parameters() if id(p) not in claimed]  # blocks claim theirs first; the root the rest
            claimed.update(id(p) for p in own)
            if any(p.is_meta for p in own):  # on the meta device: materialize this unit only
                materialize(m, module, own, local_device(), seed + index)
            take_whole(own)  # (built under zero.Init: whole now, handed to the unit)
            present = {id(groups.of(p)): groups.of(p) for p in own}
            experts = [g for g in present.values() if g is not groups.dense]
            # (the root always ends with a dense unit; a module without parameters is one too)
            for group in experts + (
                [groups.dense] if m is module or not experts or id(groups.dense) in present else []
            ):
                mine = [p for p in own if groups.of(p) is group]
                big = [p for p in mine if p.numel() >= threshold]
                small = [p for p in mine if p.numel() < threshold and id(p) in trainable]
                unit = Unit(len(units), name, m, self._partition(big, group) if big else None, group.gather, uploads)
                units.append(unit)
                if unit.bucket is not None:
                    set_holder(big, unit)
                    _describe(unit.bucket, persist=False)
                    buckets.append(unit.bucket)
                    owner[id(unit.bucket)] = unit
                if small:
                    kept = ShardedBucket(small, group)
                    set_holder(small, KeptWhole(unit.index, kept, group.gather))
                    _describe(kept, persist=True)
                    buckets.append(kept)
                    owner[id(kept)] = unit
                unit.release()  # one unit whole at a time
        # Gradients complete in reverse forward order: blocks last-to-first, the root at the end.
        rank_of = {id(u): i for i, u in enumerate(list(reversed(units[:-1])) + [units[-1]])}
        buckets.sort(key=lambda b: rank_of[id(owner[id(b)])])
        return units, buckets

    def _partition(self, params, group: ShardGroup) -> ShardedBucket:
        def keep(own):  # the only copy this rank keeps (in host memory with offload_param)
            if not self.param_host:
                return own.clone()
            return host_empty(own.numel(), own.dtype, self.pin).copy_(own)

        return ShardedBucket(params, group, keep=keep)

    # ---- hooks ------------------------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit):
        def hook(module, args):
            if _recomputing():  # activation checkpointing runs the forward again inside backward
                unit.gather()
                return
            if self.tracing and unit is not self.root_unit and unit not in self.trace:
                self.trace.append(unit)
            if unit is self.root_unit and self.trace:
                self.tracing = False  # one full forward recorded the execution order
            self._use(unit)
            self._prefetch(unit, step=+1)

        return hook

    def _live_numel(self) -> int:
        return sum(u.numel for u in self.units if not u.released)

    def _make_post_forward(self, unit: Unit):
        def hook(module, args, output):
            if _recomputing():  # backward is about to use these parameters: _grads_done releases them
                return output
            training = torch.is_grad_enabled()
            if training:
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad, u=unit: self._pre_backward(u))
            if (unit is not self.root_unit or not training) and not (training and self._reused_soon(unit)):
                unit.release()
            if unit is self.root_unit and not training:
                self.release_all()
            return output

        return hook

    def _pre_backward(self, unit: Unit):
        self._use(unit)
        self._prefetch(unit, step=-1)

    def _use(self, unit: Unit):
        """`unit` runs now: gathered (waited on, if its prefetch is still in flight), no longer ahead."""
        if unit in self.ahead:
            self.ahead.discard(unit)
            self.prefetch_hits += 1
        unit.gather()

    def _reused_soon(self, unit: Unit) -> bool:
        """stage3_max_reuse_distance (gather_rules.reused_soon) at the end of a unit's forward."""
        if self.tracing or unit not in self.trace:
            return False  # the first step records the order: everything is released
        later = [u.numel for u in self.trace[self.trace.index(unit) + 1 :]]
        return gather_rules.reused_soon(later, self.max_reuse_numel)

    def _prefetch(self, unit: Unit, step: int):
        """Start gathering the units that run next in execution order (`step` +1: forward, -1:
        backward), as gather_rules.prefetch decides."""
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())
        if self.tracing or not self.trace:
            return
        if unit is self.root_unit:  # forward starts at the first block, backward at the last
            order = self.trace if step > 0 else self.trace[::-1]
        elif unit in self.trace:
            i = self.trace.index(unit)
            order = self.trace[i + 1 :] if step > 0 else self.trace[:i][::-1]
        else:
            return
        chosen = gather_rules.prefetch(
            [(u.numel, u.released) for u in order],
            sum(u.numel for u in self.ahead),
            self._live_numel(),
            self.prefetch_numel,
            self.max_live_numel,
        )
        for k in chosen:
            order[k].start_gather()
            self.ahead.add(order[k])
        self.peak_ahead_numel = max(self.peak_ahead_numel, sum(u.numel for u in self.ahead))
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _grads_done(self, bucket: ShardedBucket):
        """All of a unit's gradients are in: its backward is over, unless some of its parameters
        are frozen (their backward may still be running), in which case end_backward releases it."""
        unit = self._unit_of.get(id(bucket))
        if unit is not None and unit is not self.root_unit and all(p.requires_grad for p in bucket.params):
            unit.release()

    def _on_grad_ready(self, param: torch.nn.Parameter):
        if self.open:
            return super()._on_grad_ready(param)
        raise RuntimeError(
            f"a backward that is not this engine's (another engine's loss through this model, e.g. a GAN's "
            f"generator loss through its discriminator) reached a parameter of shape {tuple(param.shape)}: ZeRO-3 "
            "gathers, reduces and frees gradients only in its own backward. Freeze this model around the other "
            "backward (requires_grad_(False); the gradient still flows through it), or use ZeRO stage 0-2 for it"
        )

    def end_backward(self):
        super().end_backward()
        self.release_all()

    def destroy(self):
        super().destroy()
        for h in self._forward_hooks:
            h.remove()
        self.release_all()

    def release_all(self):
        self.ahead.clear()
        for u in self.units:
            u.release()

    # ---- bookkeeping ------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        out = super().memory()
        shards = sum(
            b.shard.numel() * b.shard.element_size()
            for i, b in enumerate(self.buckets)
            if i in self.partitioned and b.shard is not None
        )
        out["params"] = shards + sum(
            b.full.numel() * b.full.element_size() for i, b in enumerate(self.buckets) if i not in self.partitioned
        )
        if self.param_host:
            out["host"] = out.get("host", 0) + shards
        return out


def _describe(bucket: ShardedBucket, persist: bool) -> None:
    """DeepSpeed's per-parameter ZeRO-3 attributes, which scripts read: ds_id, ds_shape,
    ds_numel, ds_persist, ds_status, and ds_tensor (this rank's part of the parameter, flat,
    possibly empty: zerotron partitions whole buckets, not each parameter)."""
    for i, p in enumerate(bucket.params):
        p.ds_id = next(_ds_ids)
        p.ds_shape, p.ds_numel, p.ds_persist = bucket.shapes[i], bucket.numels[i], persist
        p.ds_status = ZeroParamStatus.AVAILABLE
        if persist:
            p.ds_tensor = p.data.view(-1)
    if not persist:
        _point_pieces(bucket, bucket.shard)


def _point_pieces(bucket: ShardedBucket, flat: torch.Tensor) -> None:
    """Each parameter's ds_tensor: its piece of `flat` (the shard, or the fp32 master where no
    shard is kept), empty where this rank holds none of it."""
    pieces = {i: (start_in_shard, length) for i, _, start_in_shard, length in bucket.param_slices_in_shard()}
    for i, p in enumerate(bucket.params):
        start, length = pieces.get(i, (0, 0))
        p.ds_tensor = flat[start : start + length]


def _agreed_seed(comm: Comm) -> int:
    """A seed every rank agrees on (rank 0's), for initializing units built under zero.Init."""
    seed = torch.tensor([torch.initial_seed() % (2**31)], dtype=torch.int64, device=local_device())
    if comm.size > 1:
        comm.broadcast(seed, src_group_rank=0)
    return int(seed.item())
