"""Tensor-parallel communication as autograd functions: each forward collective has its
conjugate in backward (Megatron's f / g operators and their sequence-parallel versions).

    copy_to_region        forward: identity        backward: all-reduce
    reduce_from_region    forward: all-reduce      backward: identity
    gather_last_dim       forward: all-gather      backward: take own slice
    gather_sequence       forward: all-gather(seq) backward: reduce-scatter(seq)
    scatter_sequence      forward: reduce-scatter  backward: all-gather(seq)
    split_sequence        forward: take own slice  backward: all-gather(seq)

Each pair is data (`Conjugates`: two `Collective`s, each started without waiting and finished by
waiting on its `Pending`), run by one autograd function; the two-halves overlap (overlap.py) runs
the same pairs with the start and the wait at two points of the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

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


class Collective:
    """One collective over a tensor-parallel group, started without waiting: `start(x, comm)`
    returns its Pending. The plain path is `start(...).wait()`; the overlap (parallel/overlap.py)
    starts at one point of the graph and waits at another."""

    def start(self, x: torch.Tensor, comm: Comm) -> Pending:
        raise NotImplementedError

    def finish(self, pending: Pending) -> torch.Tensor:
        """The result, once there."""
        return pending.wait()


class _AsIs(Collective):
    """No communication: the tensor as it is."""

    def start(self, x, comm):
        return Pending(None, x, None)


class _AllReduce(Collective):
    """The sum over the group, into a copy (the input may be read by others)."""

    def start(self, x, comm):
        x = x.clone().contiguous()
        return Pending(comm.all_reduce(x, async_op=True), x, x)


class _AllGather(Collective):
    """The parts of every rank along `dim`; the result is a view (not contiguous)."""

    def __init__(self, dim: int):
        self.dim = dim

    def start(self, x, comm):
        x = x.movedim(self.dim, 0).contiguous()
        out = torch.empty((comm.size * x.shape[0],) + x.shape[1:], dtype=x.dtype, device=x.device)
        return Pending(comm.all_gather_flat(out, x, async_op=True), out.movedim(0, self.dim), x)

    def finish(self, pending):
        # Contiguous once here: a gathered tensor is read by compute, and otherwise each linear that
        # consumes it (q, k and v) copies it for its matmul and keeps its own copy for backward.
        return pending.wait().contiguous()


class _ReduceScatter(Collective):
    """The sum over the group, of which this rank keeps its part along `dim` (a view)."""

    def __init__(self, dim: int):
        self.dim = dim

    def start(self, x, comm):
        x = x.movedim(self.dim, 0).contiguous()
        _check_splits(x.shape[0], comm)
        out = torch.empty((x.shape[0] // comm.size,) + x.shape[1:], dtype=x.dtype, device=x.device)
        return Pending(comm.reduce_scatter_flat(out, x, async_op=True), out.movedim(0, self.dim), x)


class _OwnPart(Collective):
    """No communication: this rank's part along `dim`."""

    def __init__(self, dim: int):
        self.dim = dim

    def start(self, x, comm):
        _check_splits(x.shape[self.dim], comm)
        return Pending(None, x.chunk(comm.size, dim=self.dim)[comm.rank].contiguous(), None)


def _check_splits(n: int, comm: Comm):
    if n % comm.size:
        raise ValueError(f"dimension of size {n} does not split over {comm.size} tensor-parallel ranks")


@dataclass(frozen=True)
class Conjugates:
    """A forward collective and the one backward runs on its gradient."""

    forward: Collective
    backward: Collective


AS_IS, ALL_REDUCE = _AsIs(), _AllReduce()
COPY_IN = Conjugates(AS_IS, ALL_REDUCE)
REDUCE_OUT = Conjugates(ALL_REDUCE, AS_IS)
GATHER_LAST_DIM = Conjugates(_AllGather(-1), _OwnPart(-1))
GATHER_SEQUENCE = Conjugates(_AllGather(1), _ReduceScatter(1))  # (the sequence dimension of (batch, seq, ...))
SCATTER_SEQUENCE = Conjugates(_ReduceScatter(1), _AllGather(1))


def _run(collective: Collective, x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return collective.finish(collective.start(x, comm)).contiguous()


class _Conjugate(torch.autograd.Function):
    """The forward collective of `pair` on x; its backward collective on the gradient."""

    @staticmethod
    def forward(ctx, x, pair: Conjugates, comm):
        ctx.pair, ctx.comm = pair, comm
        return _run(pair.forward, x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _run(ctx.pair.backward, grad, ctx.comm), None, None


def conjugate(x, pair: Conjugates, comm: Comm):
    """x through `pair` (nothing to do on a group of one)."""
    return _Conjugate.apply(x, pair, comm) if comm.size > 1 else x


def copy_to_region(x, comm: Comm):
    return conjugate(x, COPY_IN, comm)


def reduce_from_region(x, comm: Comm):
    return conjugate(x, REDUCE_OUT, comm)


def gather_last_dim(x, comm: Comm):
    return conjugate(x, GATHER_LAST_DIM, comm)


def gather_sequence(x, comm: Comm, dim: int = 1):
    return conjugate(x, Conjugates(_AllGather(dim), _ReduceScatter(dim)), comm)


def scatter_sequence(x, comm: Comm, dim: int = 1):
    return conjugate(x, Conjugates(_ReduceScatter(dim), _AllGather(dim)), comm)


def split_sequence(x, comm: Comm, dim: int = 1):
    return conjugate(x, Conjugates(_OwnPart(dim), _AllGather(dim)), comm)


def all_reduce_max(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """In-place max over the group, outside autograd (for the parallel softmax's stability shift)."""
    if comm.size > 1:
        comm.all_reduce(x, op=dist.ReduceOp.MAX)
    return x
