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

Each collective pair (collectives.Conjugates: the region's entry and exit, plain or sequence
parallel) runs between two points of the graph as a `Span`, the handle both points keep in their
autograd context: forward, `_Start` starts the collective and `_Finish` waits for it; backward,
`_Finish` starts the conjugate on the gradient and `_Start` waits. The entries of both halves start
in one `_Start` node (at the split) and the exits finish in one `_Finish` node (at the join).

The order in backward comes from autograd itself: the split and the join are single nodes with
two inputs/outputs, so backward runs half 1's chain down to its entry (launching its collective),
then half 0's, and only then the split, which waits. What stays exposed per region and direction
is one half's collective (the first gather, the last exit; the first gradient gather, the last
entry), the rest runs under the other half's compute. The math is the plain tensor-parallel
math row by row; a batch of one sequence runs whole (nothing to split).

What a region must be, checked when the plan is applied: its first argument is the input of its
column layers (nothing replicated-but-split happens in between), its output is its one row layer's
output unchanged (a bias added after the sum would be added per half before it), and its other
arguments are the same for every row of the batch (the reference GPT's rotary tables). A collective
in flight is waited on only by the point that receives its result.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..comm import Comm
from ..errors import ConfigError
from .collectives import Conjugates


class Span:
    """One half's collective pair between two points of the graph: forward, the first starts the
    pair's collective and the second waits for it; backward, the second starts the conjugate on
    the gradient and the first waits. At most one collective is in flight, and a span holds no
    tensor once it is waited on (the graph holds the span: holding the graph's tensors back would
    keep a step's graph alive past it)."""

    def __init__(self, pair: Conjugates, comm: Comm):
        self.pair, self.comm = pair, comm
        self.collective, self.pending = None, None

    def start(self, x: torch.Tensor, backward: bool = False) -> torch.Tensor:
        """Start the forward collective (or backward's) on x: its result, to be read only after finish()."""
        self.collective = self.pair.backward if backward else self.pair.forward
        self.pending = self.collective.start(x, self.comm)
        return self.pending.result

    def finish(self) -> torch.Tensor | None:
        """The result of the collective in flight (None when none was started)."""
        pending, self.pending = self.pending, None
        return None if pending is None else self.collective.finish(pending)

    def started(self, result: torch.Tensor) -> bool:
        return self.pending is not None and self.pending.result is result


class _Start(torch.autograd.Function):
    """The first point of each span: starts its forward collective. Backward waits for the
    conjugate its _Finish started (nothing reaches a half no gradient reached)."""

    @staticmethod
    def forward(ctx, spans, *xs):
        ctx.spans = spans
        return tuple(span.start(x) for span, x in zip(spans, xs))

    @staticmethod
    def backward(ctx, *grads):
        return (None,) + tuple(span.finish() for span in ctx.spans)


class _Finish(torch.autograd.Function):
    """The second point of each span: waits for its forward collective. Backward starts the
    conjugate on each gradient, last span first (half 1 runs its backward first)."""

    @staticmethod
    def forward(ctx, spans, *started):
        ctx.spans = spans
        return tuple(span.finish() for span in spans)

    @staticmethod
    def backward(ctx, *grads):
        for span, grad in reversed(list(zip(ctx.spans, grads))):
            if grad is not None:
                span.start(grad, backward=True)
        return (None,) + grads  # (what _Start receives is not read: it waits for the conjugates)


def split_batch(module: nn.Module, region, comm: Comm, name: str) -> None:
    """Make `module` (a region: see the module docstring) run its batch in two overlapped halves."""
    _check_region(module, name)
    forward = module.forward

    def run(x, *args, **kwargs):
        if not region.collectives_inside or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[0] < 2:
            return forward(x, *args, **kwargs)
        entry, exit = region.pairs()
        entries, exits = (Span(entry, comm), Span(entry, comm)), (Span(exit, comm), Span(exit, comm))
        # both entries start now: with sequence parallelism, the second gather runs under half 0
        entered = _Start.apply(entries, *x.tensor_split(2, dim=0))
        outs = []
        for i, part in enumerate(entered):
            with region.collectives_outside(lambda y: _Start.apply((exits[i],), y)[0]):
                y = forward(_Finish.apply((entries[i],), part)[0], *args, **kwargs)
            if not exits[i].started(y):
                raise RuntimeError(
                    f"tensor_parallel.tp_overlap_comm: {name} ({type(module).__name__}) must return its "
                    "row-parallel layer's output unchanged to run in two halves; leave it out of the "
                    'plan\'s "region" entries'
                )
            outs.append(y)
        return torch.cat(_Finish.apply(exits, *outs), dim=0)

    module.forward = run


def _check_region(module: nn.Module, name: str) -> None:
    from .layers import ColumnParallelLinear, RowParallelLinear

    rows = [m for m in module.modules() if isinstance(m, RowParallelLinear)]
    columns = [m for m in module.modules() if isinstance(m, ColumnParallelLinear)]
    if (
        len(rows) != 1
        or not columns
        or rows[0].bias is not None
        or rows[0].split_input
        or any(c.gather_output for c in columns)
    ):
        raise ConfigError(
            "tensor_parallel.tp_overlap_comm",
            True,
            f'the plan\'s "region" {name} ({type(module).__name__}) must hold column-parallel layers '
            f"and exactly one row-parallel layer without a bias (it has {len(columns)} and {len(rows)}"
            f"{', the row layer with a bias' if len(rows) == 1 and rows[0].bias is not None else ''}); "
            "mark only attention and MLP blocks as regions, or turn tp_overlap_comm off",
        )
