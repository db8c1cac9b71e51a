"""Tensor-parallel communication as autograd functions: each forward collective has its
conjugate in backward (Megatron's f / g operators and their sequence-parallel versions).

    copy_to_region        forward: identity        backward: all-reduce
    reduce_from_region    forward: all-reduce      backward: identity
    gather_last_dim       forward: all-gather      backward: take own slice
    gather_sequence       forward: all-gather(seq) backward: reduce-scatter(seq)
    scatter_sequence      forward: reduce-scatter  backward: all-gather(seq)
    split_sequence        forward: take own slice  backward: all-gather(seq)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Comm


class Pending:
    """A collective issued without waiting. `result` is the output, in its final shape, but holds
    the result only once `wait()` has returned (NCCL's rule, which strict mode enforces on gloo):
    it may be handed on (to the one consumer that waits first), never read before."""

    def __init__(self, work, result: torch.Tensor, source: torch.Tensor):
        self.work, self.result = work, result
        self._source = source  # the input stays alive until the collective is done with it

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work, self._source = None, None
        return self.result


def start_all_gather(x: torch.Tensor, comm: Comm, dim: int) -> Pending:
    """All-gather `x` along `dim` without waiting; the result is a view (not contiguous)."""
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((comm.size * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
    return Pending(comm.all_gather_flat(out, x, async_op=True), out.movedim(0, dim), x)


def start_reduce_scatter(x: torch.Tensor, comm: Comm, dim: int) -> Pending:
    """Sum `x` over the group and keep this rank's part along `dim`, without waiting (a view)."""
    x = x.movedim(dim, 0).contiguous()
    if x.shape[0] % comm.size:
        raise ValueError(f"dimension of size {x.shape[0]} does not split over {comm.size} tensor-parallel ranks")
    out = torch.empty((x.shape[0] // comm.size,) + x.shape[1:], dtype=x.dtype, device=x.device)
    return Pending(comm.reduce_scatter_flat(out, x, async_op=True), out.movedim(0, dim), x)


def start_all_reduce(x: torch.Tensor, comm: Comm) -> Pending:
    """Sum `x` over the group in place (x must be a tensor nothing else reads), without waiting."""
    x = x.contiguous()
    return Pending(comm.all_reduce(x, async_op=True), x, x)


def _all_gather(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    # Contiguous once here: otherwise each linear that consumes it (q, k and v) copies it for its
    # matmul and keeps its own copy for backward.
    return start_all_gather(x, comm, dim).wait().contiguous()


def _reduce_scatter(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    return start_reduce_scatter(x, comm, dim).wait().contiguous()


def _own_slice(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    if x.shape[dim] % comm.size:
        raise ValueError(f"dimension of size {x.shape[dim]} does not split over {comm.size} tensor-parallel ranks")
    return x.chunk(comm.size, dim=dim)[comm.rank].contiguous()


def _all_reduce(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return start_all_reduce(x, comm).wait()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.comm), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        return _all_reduce(x.clone(), comm)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _all_gather(x, comm, -1)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.comm, -1), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _all_gather(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.comm, ctx.dim), None, None


class _ScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _reduce_scatter(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim), None, None


class _SplitSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, dim):
        ctx.comm, ctx.dim = comm, dim
        return _own_slice(x, comm, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.comm, ctx.dim), None, None


def copy_to_region(x, comm: Comm):
    return _CopyToRegion.apply(x, comm) if comm.size > 1 else x


def reduce_from_region(x, comm: Comm):
    return _ReduceFromRegion.apply(x, comm) if comm.size > 1 else x


def gather_last_dim(x, comm: Comm):
    return _GatherLastDim.apply(x, comm) if comm.size > 1 else x


def gather_sequence(x, comm: Comm, dim: int = 1):
    return _GatherSequence.apply(x, comm, dim) if comm.size > 1 else x


def scatter_sequence(x, comm: Comm, dim: int = 1):
    return _ScatterSequence.apply(x, comm, dim) if comm.size > 1 else x


def split_sequence(x, comm: Comm, dim: int = 1):
    return _SplitSequence.apply(x, comm, dim) if comm.size > 1 else x


def all_reduce_max(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """In-place max over the group, outside autograd (for the parallel softmax's stability shift)."""
    if comm.size > 1:
        comm.all_reduce(x, op=dist.ReduceOp.MAX)
    return x
