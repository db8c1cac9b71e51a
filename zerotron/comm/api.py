"""`deepspeed.comm`: DeepSpeed's module of communication functions, over torch.distributed.

    import zerotron as deepspeed            # or: import zerotron.comm as dist
    deepspeed.comm.all_reduce(t)            # zerotron.comm is this API plus zerotron's Comm

Each function takes DeepSpeed's arguments, including its logging ones (`prof`, `log_name`; `debug`
is the log's setting): with the comms logger on (the config's "comms_logger" section, or configure()),
each call is logged under its log_name (zerotron/comm/log.py) beside the engine's own collectives, and
log_summary() prints them. ReduceOp is torch's; DeepSpeed's own ReduceOp enum is also accepted wherever
an `op` is. init_distributed is zerotron's (zerotron.comm.init_distributed).
"""

from __future__ import annotations

import enum
import os

import torch
import torch.distributed as dist

from ..timeouts import group_timeout
from .core import _all_gather_flat, _reduce_scatter_flat
from .groups import init_distributed, shutdown
from .log import configure, log_summary, logged, reset_log  # noqa: F401 (DeepSpeed's names)

ReduceOp = dist.ReduceOp

__all__ = [
    "init_distributed",
    "is_initialized",
    "is_available",
    "destroy_process_group",
    "new_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_global_rank",
    "get_all_ranks_from_group",
    "get_world_group",
    "barrier",
    "monitored_barrier",
    "all_reduce",
    "inference_all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "broadcast_object_list",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "allgather_fn",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_fn",
    "all_to_all_single",
    "all_to_all",
    "gather",
    "scatter",
    "send",
    "recv",
    "isend",
    "irecv",
    "ReduceOp",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "has_coalescing_manager",
    "has_all_reduce_coalesced",
    "configure",
    "log_summary",
    "reset_log",
]


def _op(op):
    """torch's ReduceOp for torch's or DeepSpeed's (an Enum with the same member names)."""
    return getattr(ReduceOp, op.name) if isinstance(op, enum.Enum) else op


def _require(what: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"deepspeed.comm.{what}() before any process group exists: call "
            "deepspeed.init_distributed() or deepspeed.initialize(...) first"
        )


# --- the process group ----------------------------------------------------------------------------


def is_initialized() -> bool:
    return dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def destroy_process_group(group=None) -> None:
    """Without a group: zerotron's orderly teardown (watchdog, cached groups, then the default group)."""
    if group is None:
        shutdown()
    else:
        dist.destroy_process_group(group)


def new_group(ranks, **kwargs):
    """A process group of `ranks`, with the timeout of every group zerotron creates."""
    _require("new_group")
    kwargs.setdefault("timeout", group_timeout())
    return dist.new_group(ranks, **kwargs)


def get_rank(group=None) -> int:
    _require("get_rank")
    return dist.get_rank(group)


def get_world_size(group=None) -> int:
    _require("get_world_size")
    return dist.get_world_size(group)


def get_local_rank() -> int:
    """This process's rank on its node, from the launcher (LOCAL_RANK, or Open MPI's), else 0."""
    _require("get_local_rank")
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_global_rank(group=None, group_rank: int = 0) -> int:
    _require("get_global_rank")
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_all_ranks_from_group(group=None) -> list[int]:
    _require("get_all_ranks_from_group")
    return dist.get_process_group_ranks(dist.group.WORLD if group is None else group)


def get_world_group():
    _require("get_world_group")
    return dist.group.WORLD


# --- collectives ----------------------------------------------------------------------------------


@logged
def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


@logged
def monitored_barrier(
    group=None, timeout=None, wait_all_ranks=False, prof=False, log_name="monitored_barrier", debug=None
):
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


@logged
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    return dist.all_reduce(tensor, op=_op(op), group=group, async_op=async_op)


@logged
def inference_all_reduce(
    tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None
):
    """A blocking all-reduce in place (DeepSpeed's fused inference kernel is one); returns `tensor`."""
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=_op(op), group=group)
    return tensor


class _ThenWork:
    """A work that runs `then()` once it has completed (copies out of a staging buffer)."""

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self, *args):
        if self.then is not None:
            self.work.wait(*args)
            self.then()
            self.then = None
        return True

    def is_completed(self) -> bool:
        return self.then is None


@logged
def all_reduce_coalesced(
    tensors, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None
):
    """All tensors reduced as one flat buffer: one collective (torch's own function is deprecated)."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    work = dist.all_reduce(flat, op=_op(op), group=group, async_op=async_op)

    def unflatten():
        for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            t.copy_(part.view_as(t))

    if async_op:
        return _ThenWork(work, unflatten)
    unflatten()


@logged
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce", debug=None):
    return dist.reduce(tensor, dst=dst, op=_op(op), group=group, async_op=async_op)


@logged
def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    return dist.broadcast(tensor, src=src, group=group, async_op=async_op)


def broadcast_object_list(object_list, src, group=None, device=None):
    return dist.broadcast_object_list(object_list, src=src, group=group, device=device)


@logged
def all_gather(tensor_list, tensor, group=None, async_op=False, prof=False, log_name="all_gather", debug=None):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_object(object_list, obj, group=None, prof=False, log_name="all_gather_object", debug=None):
    return dist.all_gather_object(object_list, obj, group=group)


@logged
def all_gather_into_tensor(
    output_tensor, tensor, group=None, async_op=False, prof=False, log_name="all_gather_into_tensor", debug=None
):
    return _all_gather_flat(output_tensor, tensor, group=group, async_op=async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@logged
def reduce_scatter(
    output, input_list, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="reduce_scatter", debug=None
):
    return dist.reduce_scatter(output, input_list, op=_op(op), group=group, async_op=async_op)


@logged
def reduce_scatter_tensor(
    output_tensor,
    tensor,
    op=ReduceOp.SUM,
    group=None,
    async_op=False,
    prof=False,
    log_name="reduce_scatter_tensor",
    debug=None,
):
    return _reduce_scatter_flat(output_tensor, tensor, op=_op(op), group=group, async_op=async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


@logged
def all_to_all_single(
    output,
    tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op=False,
    prof=False,
    log_name="all_to_all_single",
    debug=None,
):
    return dist.all_to_all_single(
        output,
        tensor,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=async_op,
    )


@logged
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    return dist.all_to_all(output_tensor_list, input_tensor_list, group=group, async_op=async_op)


@logged
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False, prof=False, log_name="gather", debug=None):
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


@logged
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False, prof=False, log_name="scatter", debug=None):
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


# --- point to point -------------------------------------------------------------------------------


@logged
def send(tensor, dst, group=None, tag=0, prof=False, log_name="send", debug=None):
    return dist.send(tensor, dst=dst, group=group, tag=tag)


@logged
def recv(tensor, src=None, group=None, tag=0, prof=False, log_name="recv", debug=None):
    return dist.recv(tensor, src=src, group=group, tag=tag)


@logged
def isend(tensor, dst, group=None, tag=0, prof=False, log_name="isend", debug=None):
    """Asynchronous: returns a work to wait on (DeepSpeed 0.19's isend blocks and returns None)."""
    return dist.isend(tensor, dst=dst, group=group, tag=tag)


@logged
def irecv(tensor, src=None, group=None, tag=0, prof=False, log_name="irecv", debug=None):
    return dist.irecv(tensor, src=src, group=group, tag=tag)


# --- what the backend offers ----------------------------------------------------------------------


def has_all_gather_into_tensor() -> bool:
    return True  # resolved in zerotron.comm for every supported torch release


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True  # all_reduce_coalesced above works on every torch release


def has_coalescing_manager() -> bool:
    return hasattr(dist.distributed_c10d, "_coalescing_manager")


# --- DeepSpeed's comms logger: configure, log_summary and reset_log are zerotron/comm/log.py's -------
