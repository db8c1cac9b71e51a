"""Tensor-parallel communication overlapped with compute by splitting the batch in two
(`tensor_parallel.tp_overlap_comm`, DeepSpeed's key; Megatron-LM's --tp-comm-overlap).

A region is a module between the entry into the tensor-parallel region (the input of its column
layers: copied in, or all-gathered along the sequence) and the exit (its row layer's output:
all-reduced, or reduce-scattered along the sequence): an attention or MLP block. Its rows of the
batch are independent, so with overlap on it runs on the two halves of the batch one after the
other, and each half's collectives are issued without waiting:

    forward   [gather 0, gather 1: sequence parallel only]  half 0  |exit 0|  half 1  |exit 1|  join
                                   (gather 1 runs under half 0; exit 0 under half 1; waited at the join)
    backward  [gather 1, gather 0 of the gradient: sequence parallel]  half 1  |entry 1|  half 0
              |entry 0|  split    (entry 1's all-reduce / reduce-scatter runs under half 0's backward)

The order in backward comes from autograd itself: the split and the join are single nodes with
two inputs/outputs, so backward runs half 1's chain down to its entry (launching its collective),
then half 0's, and only then the split, which waits. What stays exposed per region and direction
is one half's collective (the first gather, the last exit; the first gradient gather, the last
entry), the rest runs under the other half's compute. The math is the plain tensor-parallel
math row by row; a batch of one sequence runs whole (nothing to split).

What a region must be, checked when the plan is applied: its first argument is the input of its
column layers (nothing replicated-but-split happens in between), its output is its one row layer's
output unchanged (a bias added after the sum would be added per half before it), and its other
arguments are the same for every row of the batch (the reference GPT's rotary tables). Collectives
in flight are waited on only by the split and the join, which alone receive their results.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm
from ..errors import ConfigError
from .collectives import start_all_gather, start_all_reduce, start_reduce_scatter


class Half:
    """One half of a region's batch: its collectives in flight (collectives.Pending) and the row
    layer's output (`exit_in`, recorded by Region.exit)."""

    def __init__(self):
        self.entry = self.entry_grad = self.exit = self.exit_grad = None
        self.exit_in = None


class _Split(torch.autograd.Function):
    """x -> its two halves along the batch. Backward waits for both halves' entry collectives."""

    @staticmethod
    def forward(ctx, x, halves):
        ctx.halves = halves
        parts = x.tensor_split(2, dim=0)
        ctx.shapes = [p.shape for p in parts]
        return parts

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for h, g, shape in zip(ctx.halves, grads, ctx.shapes):
            if h.entry_grad is not None:
                g = h.entry_grad.wait()
                h.entry_grad = None
            out.append(g if g is not None else torch.zeros(shape, dtype=grads[0].dtype, device=grads[0].device))
        return torch.cat(out, dim=0), None


class _EnterHalf(torch.autograd.Function):
    """A half enters the region: identity (plain) or the all-gather started ahead (sequence
    parallel). Backward issues the conjugate collective and hands its future result to _Split."""

    @staticmethod
    def forward(ctx, x, comm, half, sequence):
        ctx.comm, ctx.half, ctx.sequence = comm, half, sequence
        if not sequence:
            return x
        gathered = half.entry.wait().contiguous()
        half.entry = None
        return gathered

    @staticmethod
    def backward(ctx, grad):
        comm, half = ctx.comm, ctx.half
        half.entry_grad = start_reduce_scatter(grad, comm, 1) if ctx.sequence else start_all_reduce(grad.clone(), comm)
        return half.entry_grad.result, None, None, None


class _ExitHalf(torch.autograd.Function):
    """A half leaves the region: its all-reduce (reduce-scatter) issued, its future result handed
    to _Join. Backward: identity (plain) or the gradient's all-gather _Join started (sequence)."""

    @staticmethod
    def forward(ctx, y, comm, half, sequence):
        ctx.half, ctx.sequence = half, sequence
        half.exit = start_reduce_scatter(y, comm, 1) if sequence else start_all_reduce(y.clone(), comm)
        return half.exit.result

    @staticmethod
    def backward(ctx, grad):
        if not ctx.sequence:
            return grad, None, None, None
        gathered = ctx.half.exit_grad.wait().contiguous()
        ctx.half.exit_grad = None
        return gathered, None, None, None


class _Join(torch.autograd.Function):
    """The halves' outputs, waited on, joined along the batch. Backward splits the gradient and,
    sequence parallel, starts both halves' all-gathers at once (half 0's runs under half 1)."""

    @staticmethod
    def forward(ctx, first, second, halves, comm, sequence):
        ctx.halves, ctx.comm, ctx.sequence = halves, comm, sequence
        ctx.sizes = [first.shape[0], second.shape[0]]
        outs = []
        for h in halves:
            outs.append(h.exit.wait())
            h.exit = None
        return torch.cat(outs, dim=0)

    @staticmethod
    def backward(ctx, grad):
        parts = grad.split(ctx.sizes, dim=0)
        if ctx.sequence:
            for h, g in zip(reversed(ctx.halves), reversed(parts)):  # in the order backward uses them
                h.exit_grad = start_all_gather(g, ctx.comm, 1)
        return parts[0], parts[1], None, None, None


def split_batch(module: nn.Module, region, comm: Comm, name: str) -> None:
    """Make `module` (a region: see the module docstring) run its batch in two overlapped halves."""
    _check_region(module, name)
    forward = module.forward

    def run(x, *args, **kwargs):
        if region.half is not None or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] < 2:
            return forward(x, *args, **kwargs)
        sequence = region.split
        halves = (Half(), Half())
        parts = _Split.apply(x, halves)
        if sequence:  # both gathers start now: the second runs under the first half's compute
            for h, part in zip(halves, parts):
                h.entry = start_all_gather(part.detach(), comm, 1)
        outs = []
        for h, part in zip(halves, parts):
            region.half = h
            try:
                y = forward(_EnterHalf.apply(part, comm, h, sequence), *args, **kwargs)
            finally:
                region.half = None
            if y is not h.exit_in:
                raise RuntimeError(f"tensor_parallel.tp_overlap_comm: {name} ({type(module).__name__}) must return its "
                                   "row-parallel layer's output unchanged to run in two halves; leave it out of the "
                                   "plan's \"region\" entries")
            h.exit_in = None  # y's graph holds h: keeping y here too would be a cycle kept past the step
            outs.append(_ExitHalf.apply(y, comm, h, sequence))
        return _Join.apply(*outs, halves, comm, sequence)

    module.forward = run


def _check_region(module: nn.Module, name: str) -> None:
    from .layers import ColumnParallelLinear, RowParallelLinear
    rows = [m for m in module.modules() if isinstance(m, RowParallelLinear)]
    columns = [m for m in module.modules() if isinstance(m, ColumnParallelLinear)]
    if len(rows) != 1 or not columns or rows[0].bias is not None or rows[0].split_input or \
            any(c.gather_output for c in columns):
        raise ConfigError("tensor_parallel.tp_overlap_comm", True,
                          f"the plan's \"region\" {name} ({type(module).__name__}) must hold column-parallel layers "
                          f"and exactly one row-parallel layer without a bias (it has {len(columns)} and {len(rows)}"
                          f"{', the row layer with a bias' if len(rows) == 1 and rows[0].bias is not None else ''}); "
                          "mark only attention and MLP blocks as regions, or turn tp_overlap_comm off")
