"""A stage's backward in two passes, for zero-bubble schedules: B computes the gradient of the
stage's inputs (what the previous stage waits for), W later computes the weight gradients without
running the input-gradient chain again.

How it splits autograd's graph (the idea of torch.distributed.pipelining's `_backward.py`): the
nodes on a path from the outputs to an input are B's. B runs exactly those (`torch.autograd.grad`
to the inputs) and records the gradient arriving at each "frontier" node: one on an input path
that also feeds a weight (a matmul, whose input gradient B needs and whose weight gradient W
computes). W starts from the frontier nodes with the recorded gradients and goes only towards the
weights (`torch.autograd.backward(..., inputs=weights)`), so each weight's .grad accumulates and
its post-accumulate-grad hooks (ZeRO's gradient reduction) fire as in a plain backward.

W runs one backward per group of frontier nodes that share weights, restricted to that group's
weights: a single call over all of them would flow from each frontier node down the input path to
the ones below it and run the chain again. A weight used at two depths puts both nodes in one
group; the flow between them along the input path is then replaced by the recorded gradients, so
nothing is counted twice.

Costs: a frontier node runs in both passes, each computing its own part. A micro-batch's graph,
with everything it saved (what only B needed too), lives from its forward to its W. Activation-checkpointed
regions are recomputed once for B and once for all of W (torch's GraphExecGroup; without it, on
older torch, once per W group); selective checkpointing allows only one recomputation (the engine
refuses it with zb-h1). A custom autograd Function that takes a weight computes all its
gradients in each pass, and runs any communication in its backward twice.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Callable

import torch
from torch.autograd.graph import GradientEdge

# Checkpointed regions recompute once for all the backward calls made inside one GraphExecGroup;
# a torch without it recomputes them for each call.
_one_recomputation = getattr(torch.utils.checkpoint, "GraphExecGroup", contextlib.nullcontext)


def backward_input(
    outputs: list[torch.Tensor], grads: list | None, inputs: list[torch.Tensor], weights: list[torch.nn.Parameter]
) -> tuple[list, Callable[[], None]]:
    """B: the gradients of `inputs` (None where an input needs none or is unused), and W: a
    function that accumulates the weight gradients into .grad, to be called once, later."""
    wanted = [x for x in inputs if x.requires_grad]
    if not wanted:  # the first stage: nothing to send back, the whole backward is W's
        return [None] * len(inputs), partial(torch.autograd.backward, outputs, grads)
    graph = _Graph(outputs, wanted, weights)
    if graph.roots_off_path:
        # An output that does not depend on the inputs: W runs the whole backward towards the
        # weights again (correct, slower; no model zerotron ships does this).
        got = torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
        return _per_input(inputs, got), partial(torch.autograd.backward, outputs, grads, inputs=weights)
    recorded: dict = {}
    handles = [n.register_prehook(partial(_record, recorded, n)) for n in graph.frontier]
    try:
        got = torch.autograd.grad(outputs, wanted, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    groups = [
        (nodes, [graph.weight_of[w] for w in reach], [recorded.get(n, ()) for n in nodes])
        for nodes, reach in reversed(graph.groups())
    ]  # the weights backward reaches first, first
    return _per_input(inputs, got), partial(_weight_pass, groups)


def _record(recorded: dict, node, grads):
    recorded[node] = grads


def _per_input(inputs, got) -> list:
    it = iter(got)
    return [next(it) if x.requires_grad else None for x in inputs]


def _weight_pass(groups: list):
    with _one_recomputation():
        for nodes, weights, grads in groups:
            edges = [GradientEdge(n, i) for n, gs in zip(nodes, grads) for i, g in enumerate(gs) if g is not None]
            if not edges:
                continue
            values = [g for gs in grads for g in gs if g is not None]
            # Between two frontier nodes of one group, the input path's flow is B's, already recorded.
            clamps = (
                [n.register_prehook(partial(_replace, gs)) for n, gs in zip(nodes, grads)] if len(nodes) > 1 else []
            )
            try:
                torch.autograd.backward(edges, values, inputs=weights, retain_graph=True)
            finally:
                for h in clamps:
                    h.remove()
    groups.clear()  # the graph (and the activations it saved) goes now


def _replace(recorded_grads, grads):
    return recorded_grads


def _node(t: torch.Tensor):
    """A tensor's node in the graph: its grad_fn, or a leaf's gradient accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]


class _Graph:
    """The autograd graph below `outputs`: which nodes lie on a path to an input (B's), which feed
    a weight, and the frontier between the two."""

    def __init__(self, outputs, inputs, weights):
        roots = [t.grad_fn for t in outputs]
        self.roots_off_path = any(r is None for r in roots)
        order = _children_first([r for r in roots if r is not None])
        input_nodes = {_node(x) for x in inputs}
        self.weight_of = {_node(w): w for w in weights if w.requires_grad}
        self.on_path, self.feeds_weight = set(), set()
        for n in order:
            kids = [c for c, _ in n.next_functions if c is not None]
            if n in input_nodes or any(c in self.on_path for c in kids):
                self.on_path.add(n)
            if n in self.weight_of or any(c in self.feeds_weight for c in kids):
                self.feeds_weight.add(n)
        self.roots_off_path |= any(r not in self.on_path for r in roots if r is not None)
        self.frontier = [n for n in order if n in self.on_path and self._off_path_kids(n)]

    def _off_path_kids(self, n) -> list:
        return [c for c, _ in n.next_functions if c is not None and c not in self.on_path and c in self.feeds_weight]

    def _weights_below(self, n) -> set:
        found, seen, stack = set(), set(), self._off_path_kids(n)
        while stack:
            c = stack.pop()
            if c in seen:
                continue
            seen.add(c)
            if c in self.weight_of:
                found.add(c)
            stack += [k for k, _ in c.next_functions if k is not None and k in self.feeds_weight]
        return found

    def groups(self) -> list[tuple[list, set]]:
        """Frontier nodes joined while they reach a common weight, each with the weights it reaches."""
        groups: list[tuple[list, set]] = []
        for n in self.frontier:
            nodes, reach = [n], self._weights_below(n)
            for g in [g for g in groups if g[1] & reach]:
                groups.remove(g)
                nodes, reach = g[0] + nodes, g[1] | reach
            groups.append((nodes, reach))
        return groups


def _children_first(roots) -> list:
    """Every node below `roots`, each after all the nodes it leads to (iterative: graphs are deep)."""
    seen, order, stack = set(), [], [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack += [(c, False) for c, _ in node.next_functions if c is not None and c not in seen]
    return order
