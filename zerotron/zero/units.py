"""ZeRO-3's units: which modules are gathered and released as one (find_units), and the unit itself
(Unit: a module and the partitioned bucket of its own parameters, gathered and released through
the bucket's Residency; KeptWhole: a bucket every rank keeps whole). Also the GatheredParameters
side of both: hold (gathered and pinned) and let_go (a modifier's values reach every shard)."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm, to_device
from .offload import Uploads
from .partitioned_init import mark_status
from .residency import State
from .sharded_bucket import ShardedBucket


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
        elif (
            isinstance(m, (nn.ModuleList, nn.Sequential))
            and len(m) > 1
            and len({type(c) for c in m}) == 1
            and any(True for _ in m[0].parameters())
        ):
            found.extend((f"{name}.{i}" if name else str(i), c) for i, c in enumerate(m))
    return found


def _recomputing() -> bool:
    """Inside backward (a checkpointed forward being recomputed)?"""
    return torch._C._current_graph_task_id() != -1


class Unit:
    """One gather/release unit: a module and the partitioned bucket of its own parameters (None:
    all of them kept whole), gathered and released through the bucket's Residency."""

    order_kind = 2  # GatheredParameters holds zero.Init pieces, then buckets kept whole, then units

    def __init__(
        self,
        index: int,
        name: str,
        module: nn.Module,
        bucket: ShardedBucket | None,
        comm: Comm,
        uploads: Uploads | None = None,
    ):
        self.index, self.name, self.module, self.bucket, self.comm = index, name, module, bucket, comm
        self.uploads = uploads  # the shard is in host memory (offload_param): see offload.Uploads
        self._held: list[bool] = []  # per GatheredParameters block: was it gathered before?
        if bucket is not None:
            bucket.residency.on_change = mark_status(bucket.params)

    @property
    def order(self):
        return self.order_kind, self.index

    @property
    def numel(self) -> int:
        return self.bucket.padded_numel if self.bucket is not None else 0

    @property
    def released(self) -> bool:
        return self.bucket is None or self.bucket.residency.released

    def start_gather(self):
        if self.bucket is None or not self.bucket.residency.released:
            return
        b = self.bucket
        if self.uploads is None:
            b.residency.start(b.own_values(), self.comm)
        else:  # with offload_param the shard comes from host memory first (a no-op copy on a CPU machine)
            with self.uploads.issue():
                b.residency.start(to_device(b.own_values(), b.full.device), self.comm)

    def wait(self):
        if self.bucket is not None:
            self.bucket.residency.wait()

    def gather(self):
        self.start_gather()
        self.wait()

    def release(self):
        if self.bucket is not None:
            self.bucket.residency.release()

    # ---- GatheredParameters -------------------------------------------------------------------
    def hold(self):
        """Gathered and pinned: the hooks leave it gathered until let_go."""
        if self.bucket is None:
            return
        self._held.append(self.bucket.residency.state is State.GATHERED and not self.bucket.residency.pins)
        self.gather()
        self.bucket.residency.pin()

    @torch.no_grad()
    def let_go(self, modifier_rank: int | None):
        if self.bucket is None:
            return
        b = self.bucket
        b.residency.unpin()
        if modifier_rank is not None:  # that rank's values, into every rank's shard and fp32 master
            self.comm.broadcast(b.full, src_group_rank=modifier_rank)
            own = b.own_slice(b.full)
            if b.shard is not None:
                b.shard.copy_(own)
            if b.master is not b.shard:
                b.master.copy_(own.float())
        if not self._held.pop():
            self.release()


class KeptWhole:
    """GatheredParameters' view of a stage-3 bucket kept whole on every rank (parameters under
    stage3_param_persistence_threshold): nothing to gather; a modifier's values reach the masters."""

    order_kind = 1

    def __init__(self, index: int, bucket: ShardedBucket, comm: Comm):
        self.index, self.bucket, self.comm = index, bucket, comm

    @property
    def order(self):
        return self.order_kind, self.index

    def hold(self):
        pass

    @torch.no_grad()
    def let_go(self, modifier_rank: int | None):
        if modifier_rank is not None:
            self.comm.broadcast(self.bucket.full, src_group_rank=modifier_rank)
            self.bucket.master.copy_(self.bucket.own_slice(self.bucket.full).float())
