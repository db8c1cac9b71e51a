"""The collectives the engine issues, with byte counters, and strict mode (NCCL's rules on gloo).

Every collective goes through `Comm`, so there is one place that counts their bytes and registers
them with the watchdog (zerotron/watchdog.py), which turns a hang into a message naming the
operation, the group and the ranks that did not arrive. Torch renames collectives between
releases; the names are resolved once here.
"""

from __future__ import annotations

import os
import time
from collections import defaultdict
from functools import cached_property

import torch
import torch.distributed as dist

from .. import watchdog
from . import log

# torch 2.13 deprecates *_into_tensor / *_tensor in favour of *_single; older releases lack the latter.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def local_device() -> torch.device:
    """This rank's device: its GPU when the default group runs NCCL (alone, or as the cuda part of
    a mixed backend such as "cpu:gloo,cuda:nccl"), else the CPU."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# Strict mode: a group's first operation is a rendezvous of exactly its ranks, as NCCL's lazy
# communicator creation is (see comm/groups.py); waiting longer than this fails fast with the group named.
STRICT_FIRST_OPERATION_WAIT_S = 20.0
_first_done: dict = {}  # "world": the default group they belong to; group key -> True


def _group_key(group) -> str:
    return "world" if group is None or group is dist.group.WORLD else str(group.group_name)


def forget_first_operations() -> None:
    _first_done.clear()


def _first_operation(comm: "Comm") -> None:
    if comm.first_operation_done:
        return
    comm.first_operation_done = True
    if _first_done.get("world") is not dist.group.WORLD:  # a new job in this process
        _first_done.clear()
        _first_done["world"] = dist.group.WORLD
    key = _group_key(comm.group)
    if key in _first_done:
        return
    _first_done[key] = True
    if comm.size == 1:
        return
    store = dist.distributed_c10d._get_default_store()
    counter = f"zerotron/strict/first_operation/{key}"
    store.add(counter, 1)
    deadline = time.monotonic() + STRICT_FIRST_OPERATION_WAIT_S
    while store.add(counter, 0) < comm.size:
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"strict mode: the first operation on group {comm.name}{comm.ranks} waited "
                f"{STRICT_FIRST_OPERATION_WAIT_S:g} s for the group's other ranks to reach their first operation "
                "on it. "
                "On NCCL that operation creates the group's communicator and blocks until every rank of the group "
                "arrives: this order of operations would hang. Connect groups where they are made "
                "(comm.groups.cached_groups)."
            )
        time.sleep(0.001)


class Comm:
    """Collectives on one process group, counting the bytes of the full tensor each one moves.
    `name` (dp, tp, pp, ...) is how the watchdog's messages call the group."""

    KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all", "p2p")

    def __init__(self, group: dist.ProcessGroup | None = None, name: str | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes = defaultdict(int)
        self.name = name or ("world" if group is None else "group")
        self.first_operation_done = False  # (strict mode: see _first_operation)
        self.blocking_wait = _waits_block(group)
        self._counted = None  # (kind, bytes) the next operation counted, for the comms log

    @cached_property
    def ranks(self) -> list[int]:
        return list(range(dist.get_world_size())) if self.group is None else dist.get_process_group_ranks(self.group)

    def _count(self, kind: str, tensor: torch.Tensor):
        self._add(kind, tensor.numel() * tensor.element_size())

    def _add(self, kind: str, nbytes: int):
        self.bytes[kind] += nbytes
        before = self._counted[1] if self._counted is not None and self._counted[0] == kind else 0
        self._counted = (kind, before + nbytes)

    def stats(self) -> dict[str, int]:
        return {kind: self.bytes[kind] for kind in self.KINDS}

    def reset_stats(self):
        self.bytes.clear()

    def count_into(self, other: "Comm") -> None:
        """Count this group's bytes in `other`'s counters (a pipeline's stage-to-stage flows, one
        group each, report as the pipeline group)."""
        self.bytes = other.bytes

    # Every operation goes through _issue: `call(outputs)` issues the backend operation writing
    # into `outputs` and returns its work (a list of works for a point-to-point batch). Under strict
    # mode (ZEROTRON_STRICT_COMM=1, for tests) an asynchronous operation writes into scratch buffers
    # that reach `outputs` only at wait(), as NCCL's outputs are valid only then: code that reads a
    # buffer before waiting reads stale values. `details`: what the watchdog says of each operation
    # (default: one operation, described by its first tensor's dtype and shape).
    def _issue(
        self,
        op: str,
        call,
        tensors: tuple,
        outputs: tuple,
        async_op: bool,
        in_place: bool = False,
        details: list[str] | None = None,
    ):
        if strict():
            _first_operation(self)
            for t in tensors:
                check_device(t, op, self)
        deferred = strict() and async_op and outputs
        targets = outputs
        if deferred:
            targets = tuple(o.clone() if in_place else torch.empty_like(o) for o in outputs)
        counted, self._counted = self._counted or (op.split("(")[0], 0), None
        timing = None
        if log.LOG.enabled and log.LOG.wants(counted[0]):  # (disabled: this one test)
            timing = log.Timing(*counted, self.size, tensors[0] if tensors else None)
        watch = watchdog.get() if self.size > 1 else None
        records = []
        if watch is not None:
            if details is None:
                shape = next((t for t in tensors if t is not None), None)
                details = ["" if shape is None else f"{str(shape.dtype).removeprefix('torch.')}{list(shape.shape)}"]
            records = [watch.begin(op, f"{self.name}{self.ranks}", self.ranks, d) for d in details]
        # Issued asynchronously whenever the backend can, blocking or not: its work tells the watchdog when
        # the operation completes (on NCCL neither the call nor wait() blocks the host until then).
        work = call(targets)
        issued = Work(
            work if isinstance(work, list) else [] if work is None else [work],
            watch,
            records,
            list(zip(targets, outputs)) if deferred else [],
            None if timing is None else timing.done,
            self.blocking_wait,
        )
        if async_op:
            return issued
        issued.wait()
        return None

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False):
        self._count("all_reduce", tensor)
        return self._issue(
            f"all_reduce({str(op).rsplit('.', 1)[-1]})",
            lambda out: dist.all_reduce(out[0], op=op, group=self.group, async_op=True),
            (tensor,),
            (tensor,),
            async_op,
            in_place=True,
        )

    def all_gather_flat(self, output, shard, async_op=False):
        self._count("all_gather", output)
        return self._issue(
            "all_gather",
            lambda out: _all_gather_flat(out[0], shard, group=self.group, async_op=True),
            (output, shard),
            (output,),
            async_op,
        )

    def reduce_scatter_flat(self, shard, full, op=dist.ReduceOp.SUM, async_op=False):
        self._count("reduce_scatter", full)
        return self._issue(
            "reduce_scatter",
            lambda out: _reduce_scatter_flat(out[0], full, op=op, group=self.group, async_op=True),
            (full, shard),
            (shard,),
            async_op,
        )

    def all_to_all_single(self, output, tensor, output_splits=None, input_splits=None, async_op=False):
        """Blocks along dim 0: block i of `tensor` goes to group rank i, block j of `output` comes
        from group rank j; equal blocks, or of `input_splits` / `output_splits` rows. Counted as the
        bytes this rank sends to the others."""
        if input_splits is None:
            self._add("all_to_all", tensor.numel() * tensor.element_size() * (self.size - 1) // self.size)
        else:
            row = tensor[0].numel() * tensor.element_size() if len(tensor) else 0
            self._add("all_to_all", row * (sum(input_splits) - input_splits[self.rank]))
        return self._issue(
            "all_to_all",
            lambda out: dist.all_to_all_single(
                out[0], tensor, output_splits, input_splits, group=self.group, async_op=True
            ),
            (tensor, output),
            (output,),
            async_op,
        )

    def broadcast(self, tensor, src_group_rank: int = 0, async_op=False):
        self._count("broadcast", tensor)
        src = dist.get_global_rank(self.group, src_group_rank) if self.group is not None else src_group_rank
        return self._issue(
            f"broadcast(from {src})",
            lambda out: dist.broadcast(out[0], src=src, group=self.group, async_op=True),
            (tensor,),
            (tensor,),
            async_op,
            in_place=True,
        )

    def all_gather_list(self, tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all), in group-rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._count("all_gather", tensor)
        self._issue(
            "all_gather",
            lambda o: dist.all_gather(out, tensor.contiguous(), group=self.group, async_op=True),
            (tensor,),
            (),
            False,
        )
        return out

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        self._issue("all_gather_object", lambda o: dist.all_gather_object(out, obj, group=self.group), (), (), False)
        return out

    def gather_object(self, obj, dst_group_rank: int = 0) -> list | None:
        """Every rank's picklable `obj` on group rank `dst_group_rank` (None elsewhere)."""
        dst = dist.get_global_rank(self.group, dst_group_rank) if self.group is not None else dst_group_rank
        out = [None] * self.size if self.rank == dst_group_rank else None
        self._issue("gather_object", lambda o: dist.gather_object(obj, out, dst=dst, group=self.group), (), (), False)
        return out

    def barrier(self):
        self._issue("barrier", lambda o: dist.barrier(group=self.group, async_op=True), (), (), False)

    def batch_p2p(self, ops: list, header: int = 0) -> "Work":
        """Post point-to-point sends and receives together. Returns one work for the whole batch,
        as NCCL coalesces them (gloo gives one per operation): waiting on it waits for every one.
        The sends' bytes count as "p2p", except the first `header` operations' (a description of
        the others, such as a pipeline message's header)."""
        for o in ops[header:]:
            if o.op in (dist.isend, dist.send):
                self._count("p2p", o.tensor)
        receives = [i for i, o in enumerate(ops) if o.op in (dist.irecv, dist.recv)]

        def post(buffers):  # a receive's buffer may be a scratch one (strict mode), written at wait()
            landing = dict(zip(receives, buffers))
            return dist.batch_isend_irecv(
                [
                    o if landing.get(i, o.tensor) is o.tensor else dist.P2POp(o.op, landing[i], o.peer, o.group, o.tag)
                    for i, o in enumerate(ops)
                ]
            )

        details = [f"{'send to' if o.op in (dist.isend, dist.send) else 'recv from'} rank {o.peer}" for o in ops]
        return self._issue(
            "p2p", post, tuple(o.tensor for o in ops), tuple(ops[i].tensor for i in receives), True, details=details
        )


def _waits_block(group) -> bool:
    """gloo's wait() returns when the operation is done (and some of its works report completion no other way:
    its reduce-scatter's); NCCL's returns at once, having made the current stream wait for the operation."""
    return "nccl" not in {part.split(":")[-1] for part in str(dist.get_backend(group)).split(",")}


def strict() -> bool:
    """Tests run with NCCL's rules on gloo (ZEROTRON_STRICT_COMM=1): see Comm._issue and check_device."""
    return os.environ.get("ZEROTRON_STRICT_COMM", "0") == "1"


class HostTensor(torch.Tensor):
    """Under strict mode, a tensor kept in host memory on purpose (offload buffers) and everything
    computed from one (a tensor subclass propagates through operations): a collective on it is an
    error even on a CPU-only machine, where host and device are the same memory, because on a GPU
    it would be a host tensor in an NCCL call. `to_device` is the way back."""


def host_buffer(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(HostTensor) if strict() else t


def to_device(t: torch.Tensor, device=None) -> torch.Tensor:
    """`t` on the engine's device (a copy from host memory, asynchronous where it can be)."""
    out = t.to(device or local_device(), non_blocking=True)
    return out.as_subclass(torch.Tensor) if isinstance(out, HostTensor) else out


def check_device(tensor, op: str, comm: "Comm") -> None:
    if tensor is None:
        return
    device = local_device()
    if isinstance(tensor, HostTensor) or tensor.device.type != device.type:
        where = "host memory (offload)" if isinstance(tensor, HostTensor) else f"{tensor.device}"
        raise RuntimeError(
            f"{op} on group {comm.name} of a {str(tensor.dtype).removeprefix('torch.')}"
            f"{list(tensor.shape)} tensor in {where}, while the engine's collectives run on {device}: "
            "move it to the device first (NCCL refuses host tensors)"
        )


class Work:
    """The work of one operation or one batch of point-to-point operations. wait() waits for all,
    writes deferred outputs (strict mode) and tells the watchdog; the watchdog also sees a work
    complete without being waited on (is_completed)."""

    def __init__(self, works: list, watch, records: list, deferred: list, on_done=None, blocking_wait=True):
        self.works, self.watch, self.records, self.deferred = works, watch, records, deferred
        self.on_done = on_done  # the comms log's timing, when it logs this operation
        self.blocking_wait = blocking_wait  # (Comm.blocking_wait)
        if watch is not None:
            for work, record in zip(works if len(works) == len(records) else works * len(records), records):
                watch.track(record, work)

    def wait(self, *args):
        """Idempotent: a batch's work is waited on by its receive and again with the stage's sends
        (gloo's point-to-point works must be waited on once: a second wait blocks)."""
        if self.works is None:
            return True
        failed = True
        try:
            for w in self.works:
                w.wait(*args)
            for scratch, out in self.deferred:
                out.copy_(scratch)
            self.works, self.deferred = None, []
            if self.on_done is not None:
                self.on_done()
            failed = False
        finally:
            if self.watch is not None:  # (on NCCL wait() returns before the device is done: the watchdog
                for r in self.records:  # ends those records when their works complete, or names them)
                    if failed or self.blocking_wait or r.work is None or watchdog.completed(r.work):
                        self.watch.end(r)
        return True

    def is_completed(self) -> bool:
        return self.works is None or (all(w.is_completed() for w in self.works) and not self.deferred)


_comms: dict = {}


def comm_for(group: dist.ProcessGroup | None, name: str | None = None) -> Comm:
    """The shared Comm of a process group (for code that is handed groups, not Comms)."""
    key = id(group)
    if key not in _comms:
        _comms[key] = Comm(group, name)
    return _comms[key]
