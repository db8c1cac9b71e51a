"""Process-group setup and the collectives the engine issues, with byte counters.

Every collective goes through `Comm`, so there is one place that counts bytes (and, later, times
and checks them). Torch renames collectives between releases; the names are resolved once here.
"""
from __future__ import annotations

import datetime
import os
from collections import defaultdict

import torch
import torch.distributed as dist

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
    if launched_by_torchrun():
        dist.init_process_group(backend, init_method=init_method, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def local_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Comm:
    """Collectives on one process group, counting the bytes of the full tensor each one moves."""

    KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "p2p")

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.bytes = defaultdict(int)

    def _count(self, kind: str, tensor: torch.Tensor):
        self.bytes[kind] += tensor.numel() * tensor.element_size()

    def stats(self) -> dict[str, int]:
        return {kind: self.bytes[kind] for kind in self.KINDS}

    def reset_stats(self):
        self.bytes.clear()

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, async_op=False):
        self._count("all_reduce", tensor)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)

    def all_gather_flat(self, output, shard, async_op=False):
        self._count("all_gather", output)
        return _all_gather_flat(output, shard, group=self.group, async_op=async_op)

    def reduce_scatter_flat(self, shard, full, op=dist.ReduceOp.SUM, async_op=False):
        self._count("reduce_scatter", full)
        return _reduce_scatter_flat(shard, full, op=op, group=self.group, async_op=async_op)

    def broadcast(self, tensor, src_group_rank: int = 0, async_op=False):
        self._count("broadcast", tensor)
        src = dist.get_global_rank(self.group, src_group_rank) if self.group is not None else src_group_rank
        return dist.broadcast(tensor, src=src, group=self.group, async_op=async_op)
