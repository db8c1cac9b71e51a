"""Process-group setup and the collectives the engine issues, with byte counters.

Every collective goes through `Comm`, so there is one place that counts their bytes and registers
them with the watchdog (zerotron/watchdog.py), which turns a hang into a message naming the
operation, the group and the ranks that did not arrive. Torch renames collectives between
releases; the names are resolved once here.
"""
from __future__ import annotations

import datetime
import os
from collections import defaultdict
from functools import cached_property

import torch
import torch.distributed as dist

from . import watchdog

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

# torch 2.13 deprecates *_into_tensor / *_tensor in favour of *_single; older releases lack the latter.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def init_distributed(dist_backend: str | None = None, timeout: datetime.timedelta = DEFAULT_TIMEOUT,
                     init_method: str | None = None, **_ignored) -> None:
    """Join the process group described by the launcher's environment (RANK, WORLD_SIZE, ...).

    Without a launcher, a plain process becomes a world of one, so every code path is the same.
    Accepts (and ignores) DeepSpeed's extra keyword arguments such as auto_mpi_discovery.
    """
    if dist.is_initialized():
        return
    backend = dist_backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if launched_by_torchrun() and init_method is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        dist.init_process_group(backend, store=_attempt_store(timeout), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    elif launched_by_torchrun():
        dist.init_process_group(backend, init_method=init_method, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def _attempt_store(timeout: datetime.timedelta) -> dist.Store:
    """torchrun's key-value store, namespaced by restart attempt. After an elastic restart the new
    workers must not read the dead ones' entries: torch 2.13 does not separate them, and gloo then
    tries to connect to the dead workers' addresses and fails."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(f"zerotron/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def local_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Comm:
    """Collectives on one process group, counting the bytes of the full tensor each one moves.
    `name` (dp, tp, pp, ...) is how the watchdog's messages call the group."""

    KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")

    def __init__(self, group: dist.ProcessGroup | None = None, name: str | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes = defaultdict(int)
        self.name = name or ("world" if group is None else "group")

    @cached_property
    def ranks(self) -> list[int]:
        return list(range(dist.get_world_size())) if self.group is None else dist.get_process_group_ranks(self.group)

    def _count(self, kind: str, tensor: torch.Tensor):
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def stats(self) -> dict[str, int]:
        return {kind: self.bytes[kind] for kind in self.KINDS}

    def reset_stats(self):
        self.bytes.clear()

    def _watched(self, op: str, tensor, issue, async_op: bool):
        """Run `issue()` (the backend call) registered with the watchdog; async works are released
        when they are waited on."""
        watch = watchdog.get() if self.size > 1 else None
        if watch is None:
            return issue()
        detail = "" if tensor is None else f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
        call = watch.begin(op, f"{self.name}{self.ranks}", self.ranks, detail)
        work = issue()
        if async_op:
            return _Tracked(work, watch, call)
        watch.end(call)
        return work

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False):
        self._count("all_reduce", tensor)
        return self._watched(f"all_reduce({str(op).rsplit('.', 1)[-1]})", tensor,
                             lambda: dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op), async_op)

    def all_gather_flat(self, output, shard, async_op=False):
        self._count("all_gather", output)
        return self._watched("all_gather", output,
                             lambda: _all_gather_flat(output, shard, group=self.group, async_op=async_op), async_op)

    def reduce_scatter_flat(self, shard, full, op=dist.ReduceOp.SUM, async_op=False):
        self._count("reduce_scatter", full)
        return self._watched("reduce_scatter", full,
                             lambda: _reduce_scatter_flat(shard, full, op=op, group=self.group, async_op=async_op),
                             async_op)

    def broadcast(self, tensor, src_group_rank: int = 0, async_op=False):
        self._count("broadcast", tensor)
        src = dist.get_global_rank(self.group, src_group_rank) if self.group is not None else src_group_rank
        return self._watched(f"broadcast(from {src})", tensor,
                             lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=async_op), async_op)

    def all_gather_list(self, tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all), in group-rank order."""
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._count("all_gather", tensor)
        self._watched("all_gather", tensor, lambda: dist.all_gather(out, tensor.contiguous(), group=self.group), False)
        return out

    def all_gather_object(self, obj) -> list:
        out = [None] * self.size
        self._watched("all_gather_object", None, lambda: dist.all_gather_object(out, obj, group=self.group), False)
        return out

    def barrier(self):
        self._watched("barrier", None, lambda: dist.barrier(group=self.group), False)

    def batch_p2p(self, ops: list) -> list:
        """Post point-to-point sends and receives together; each returned work is watched until waited."""
        watch = watchdog.get() if self.size > 1 else None
        works = dist.batch_isend_irecv(ops)
        if watch is None:
            return works
        tracked = []
        for o, w in zip(ops, works):
            kind = "send to" if o.op in (dist.isend, dist.send) else "recv from"
            peer = getattr(o, "peer", None)
            tracked.append(_Tracked(w, watch, watch.begin("p2p", f"{self.name}{self.ranks}", self.ranks,
                                                          f"{kind} rank {peer}")))
        return tracked


class _Tracked:
    """A backend Work whose wait() also tells the watchdog the collective finished."""

    def __init__(self, work, watch, call):
        self.work, self.watch, self.call = work, watch, call

    def wait(self, *args):
        try:
            return self.work.wait(*args)
        finally:
            self.watch.end(self.call)

    def __getattr__(self, name):
        return getattr(self.work, name)


_comms: dict = {}


def comm_for(group: dist.ProcessGroup | None, name: str | None = None) -> Comm:
    """The shared Comm of a process group (for code that is handed groups, not Comms)."""
    key = id(group)
    if key not in _comms:
        _comms[key] = Comm(group, name)
    return _comms[key]

