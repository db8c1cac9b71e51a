"""ZeRO stage 3: parameters are partitioned too. This file holds all of the gather/release logic.

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

from ..comm import Comm, to_device
from ..nested import tensors_in
from .flat import FlatBucket
from . import offload as host_memory
from .offload import Uploads, host_empty
from .partition_api import ZeroParamStatus, _ds_ids, _gather_init, built_under_init, materialize
from .sharded import ShardedStates

_RELEASED, _GATHERING, _GATHERED = "released", "gathering", "gathered"


def find_units(module: nn.Module, unit_classes: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """(name, module) of each unit below the root: modules marked as leaves
    (zerotron.utils.set_z3_leaf_modules), then modules of the named classes, or by default the
    children of containers whose children are all of one class (repeated blocks)."""
    if getattr(module, "_z3_leaf", False):
        return []
    found = []
    for name, m in module.named_modules():
        if any(name == n or name.startswith(n + ".") for n, _ in found):
            continue
        if getattr(m, "_z3_leaf", False) and m is not module:  # set_z3_leaf_modules: one unit, never split below
            found.append((name, m))
            continue
        if unit_classes is not None:
            if type(m).__name__ in unit_classes and m is not module:
                found.append((name, m))
        elif isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1 and \
                len({type(c) for c in m}) == 1 and any(True for _ in m[0].parameters()):
            found.extend((f"{name}.{i}" if name else str(i), c) for i, c in enumerate(m))
    return found


def _recomputing() -> bool:
    """Inside backward (a checkpointed forward being recomputed)?"""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One gather/release unit: its partitioned bucket and where it is in the gather cycle."""

    def __init__(self, name: str, module: nn.Module, bucket: FlatBucket | None, comm: Comm,
                 uploads: Uploads | None = None):
        self.name, self.module, self.bucket, self.comm = name, module, bucket, comm
        self.uploads = uploads  # the shard is in host memory (offload_param): see offload.Uploads
        self.state = _GATHERED  # a new bucket's parameters still point at its full buffer
        self.work = None
        self.pinned = 0  # GatheredParameters blocks holding it gathered: hooks do not release it
        if bucket is not None:  # what a released parameter reads as (DeepSpeed's too): no elements
            self.placeholder = torch.empty(0, dtype=bucket.dtype, device=bucket.device)

    @property
    def numel(self) -> int:
        return self.bucket.padded_numel if self.bucket is not None else 0

    def start_gather(self):
        if self.state != _RELEASED:
            return
        b = self.bucket
        b.full.untyped_storage().resize_(b.padded_numel * b.full.element_size())
        if self.uploads is None:
            self._source = b.own_values()
            self.work = self.comm.all_gather_flat(b.full, self._source, async_op=True)
        else:  # with offload_param the shard comes from host memory first (a no-op copy on a CPU machine)
            with self.uploads.issue():
                self._source = to_device(b.own_values(), b.full.device)
                self.work = self.comm.all_gather_flat(b.full, self._source, async_op=True)
        self.state = _GATHERING
        self._mark(ZeroParamStatus.INFLIGHT)

    def wait(self):
        if self.state == _GATHERING:
            self.work.wait()
            self.work, self._source = None, None
            self.state = _GATHERED
            self.bucket.point_params_at(self.bucket.full)
            self._mark(ZeroParamStatus.AVAILABLE)

    def gather(self):
        self.start_gather()
        self.wait()

    def release(self):
        """Free the full buffer's memory. Autograd may hold views of it (tensors saved for
        backward), so freeing the storage itself is what actually returns the memory, and the
        next gather regrows it in place. The parameters meanwhile read as empty placeholders (a
        view into freed storage would crash the process when a script reads it); a gather points
        them back at the buffer."""
        if self.bucket is None or self.state == _RELEASED or self.pinned:
            return
        self.wait()
        self.bucket.full.untyped_storage().resize_(0)
        for p in self.bucket.params:
            p.data = self.placeholder
        self.state = _RELEASED
        self._mark(ZeroParamStatus.NOT_AVAILABLE)

    def _mark(self, status: ZeroParamStatus):
        for p in self.bucket.params:
            p.ds_status = status


class Stage3States(ShardedStates):
    """Stage 3: ShardedStates over partitioned unit buckets plus the hooks that gather them."""

    def __init__(self, module: nn.Module, params: list[nn.Parameter], group_of: dict[int, int], comm: Comm,
                 gather_comm: Comm, zero, reduce_dtype=None, unit_classes: list[str] | None = None, offload=None):
        self.root = module
        # offload_param: partitioned shards wait in host memory; a gather brings them to the device.
        op = zero.offload_param
        self.param_host = op is not None and op.device == "cpu"
        self.pin = self.param_host and host_memory.can_pin()  # whatever pin_memory says: see zero/offload.py
        self.prefetch_numel = zero.stage3_prefetch_bucket_size
        # DeepSpeed's caps, in parameter elements: prefetching stops while this many are gathered
        # (stage3_max_live_parameters); a unit used again before this many more are fetched stays
        # gathered after its forward (stage3_max_reuse_distance: its backward needs it again).
        self.max_live_numel = zero.stage3_max_live_parameters
        self.max_reuse_numel = zero.stage3_max_reuse_distance
        self.peak_live_numel = 0  # the most parameter elements gathered at once (a measurement)
        # Units prefetched and not yet used; measured: the most elements gathered ahead at once,
        # and how many units found their gather already issued when their turn came.
        self.ahead: set[Unit] = set()
        self.peak_ahead_numel = 0
        self.prefetch_hits = 0
        threshold = zero.stage3_param_persistence_threshold
        trainable = {id(p) for p in params}
        named_units = find_units(module, unit_classes) + [("", module)]
        claimed: set[int] = set()
        units, buckets = [], []
        uploads = Uploads() if self.param_host else None
        seed = _agreed_seed(comm)
        for index, (name, m) in enumerate(named_units):  # blocks claim their parameters first; the root the rest
            own = [p for p in m.parameters() if id(p) not in claimed]
            claimed.update(id(p) for p in own)
            if any(p.is_meta for p in own):  # on the meta device: materialize this unit only
                materialize(m, module, own, comm_device(comm), seed + index)
            # Built under zero.Init: this unit's parameters are gathered from their pieces (only
            # this unit is ever whole), cut into the unit's bucket shard below, and released.
            from_init = [p for p in own if built_under_init(p)]
            _gather_init(from_init)
            for p in from_init:
                _forget_init(p)
            big = [p for p in own if p.numel() >= threshold]
            small = [p for p in own if p.numel() < threshold and id(p) in trainable]
            unit = Unit(name, m, self._partition(big, comm, self.param_host, self.pin) if big else None, gather_comm,
                        uploads if self.param_host else None)
            unit.index = index
            units.append(unit)
            if unit.bucket is not None:
                unit.bucket.unit = unit.bucket.owner = unit
                for p in big:
                    p.zt_unit = unit
                _describe(unit.bucket, persist=False)
                buckets.append(unit.bucket)
            if small:
                persistent = FlatBucket.partition(small, comm.size, comm.rank)
                persistent.owner, persistent.comm = unit, gather_comm
                for p in small:
                    p.zt_bucket = persistent
                _describe(persistent, persist=True)
                buckets.append(persistent)
            unit.release()  # one unit whole at a time
        self.root_unit = units[-1]
        self.units = units
        # Gradients complete in reverse forward order: blocks last-to-first, the root at the end.
        rank_of = {id(u): i for i, u in enumerate(list(reversed(units[:-1])) + [self.root_unit])}
        buckets.sort(key=lambda b: rank_of[id(b.owner)])
        partitioned = {i for i, b in enumerate(buckets) if b.unit is not None}
        super().__init__(buckets, partitioned, group_of, comm, gather_comm, zero.stage, zero.allgather_bucket_size,
                         reduce_dtype, on_grads_done=self._grads_done, offload=offload,
                         sub_group_numel=zero.sub_group_size)
        # bf16/fp16 without offload: the fp32 master is the only copy of a partitioned shard, and
        # each gather casts it (FSDP2 keeps no low-precision shard either); saves 2 bytes/element
        if not self.masters_are_params and self.host is None and not self.param_host:
            for i in self.partitioned:
                b = self.buckets[i]
                b.shard = None
                _point_pieces(b, b.master)
        self.trace: list[Unit] = []
        self.tracing = True
        self._forward_hooks = [h for u in self.units for h in (
            u.module.register_forward_pre_hook(self._make_pre_forward(u)),
            u.module.register_forward_hook(self._make_post_forward(u)))]

    @staticmethod
    def _partition(params, comm, on_host: bool = False, pin: bool = False) -> FlatBucket:
        def keep(own):  # the only copy this rank keeps (in host memory with offload_param)
            if not on_host:
                return own.clone()
            return host_empty(own.numel(), own.dtype, pin).copy_(own)
        return FlatBucket.partition(params, comm.size, comm.rank, keep=keep)

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
        return sum(u.numel for u in self.units if u.state != _RELEASED)

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
        """DeepSpeed's stage3_max_reuse_distance, at the end of a unit's forward: its next use is
        its backward, after the later units' forwards and backwards fetch their parameters; it
        stays gathered when fewer than max_reuse_numel elements come between."""
        if self.tracing or unit not in self.trace:
            return False  # the first step records the order: everything is released
        between = 2 * sum(u.numel for u in self.trace[self.trace.index(unit) + 1:])
        return between < self.max_reuse_numel

    def _prefetch(self, unit: Unit, step: int):
        """Start gathering the units that run next, in execution order, while fewer than
        stage3_prefetch_bucket_size elements are gathered ahead of their use and fewer than
        stage3_max_live_parameters are gathered in all (DeepSpeed's rule: the last unit started
        may cross either limit; a prefetch bucket of 0 prefetches nothing)."""
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())
        if self.tracing or not self.trace:
            return
        if unit is self.root_unit:  # forward starts at the first block, backward at the last
            i = 0 if step > 0 else len(self.trace) - 1
        elif unit in self.trace:
            i = self.trace.index(unit) + step
        else:
            return
        window = self.prefetch_numel - sum(u.numel for u in self.ahead)
        room = self.max_live_numel - self._live_numel()
        while 0 <= i < len(self.trace) and window > 0 and room > 0:
            u = self.trace[i]
            if u.state == _RELEASED:  # as DeepSpeed: a unit already gathered (kept for reuse) costs nothing
                u.start_gather()
                self.ahead.add(u)
                window -= u.numel
                room -= u.numel
            i += step
        self.peak_ahead_numel = max(self.peak_ahead_numel, sum(u.numel for u in self.ahead))
        self.peak_live_numel = max(self.peak_live_numel, self._live_numel())

    def _grads_done(self, bucket: FlatBucket):
        """All of a unit's gradients are in: its backward is over, unless some of its parameters
        are frozen (their backward may still be running), in which case end_backward releases it."""
        unit = getattr(bucket, "unit", None)
        if unit is not None and unit is not self.root_unit and all(p.requires_grad for p in bucket.params):
            unit.release()

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
        shards = sum(b.shard.numel() * b.shard.element_size() for i, b in enumerate(self.buckets)
                     if i in self.partitioned and b.shard is not None)
        out["params"] = shards + sum(b.full.numel() * b.full.element_size() for i, b in enumerate(self.buckets)
                                     if i not in self.partitioned)
        if self.param_host:
            out["host"] = out.get("host", 0) + shards
        return out

    def gathered(self, params):
        """Context manager body for GatheredParameters: units owning `params`."""
        ids = {id(p) for p in params}
        return [u for u in self.units if u.bucket is not None and any(id(p) in ids for p in u.bucket.params)]


def _describe(bucket: FlatBucket, persist: bool) -> None:
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


def _point_pieces(bucket: FlatBucket, flat: torch.Tensor) -> None:
    """Each parameter's ds_tensor: its piece of `flat` (the shard, or the fp32 master where no
    shard is kept), empty where this rank holds none of it."""
    pieces = {i: (start_in_shard, length) for i, _, start_in_shard, length in bucket.param_slices_in_shard()}
    for i, p in enumerate(bucket.params):
        start, length = pieces.get(i, (0, 0))
        p.ds_tensor = flat[start:start + length]


def _forget_init(p: nn.Parameter) -> None:
    """A zero.Init parameter, whole now, handed to a unit: its per-parameter piece is dropped."""
    for name in ("zt_init_comm", "zt_gathered", "ds_tensor"):
        if hasattr(p, name):
            delattr(p, name)


def comm_device(comm: Comm) -> torch.device:
    from ..comm import local_device
    return local_device()


def _agreed_seed(comm: Comm) -> int:
    """A seed every rank agrees on (rank 0's), for initializing units built under zero.Init."""
    seed = torch.tensor([torch.initial_seed() % (2 ** 31)], dtype=torch.int64, device=comm_device(comm))
    if comm.size > 1:
        comm.broadcast(seed, src_group_rank=0)
    return int(seed.item())
