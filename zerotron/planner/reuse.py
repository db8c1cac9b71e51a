"""DeepSpeed ZeRO-3's release of gathered parameters, sub-module by sub-module (cost.py uses it for
`Layout.zero3_regather`; zerotron's own engine releases whole layers: overlap.zero3_forward).

DeepSpeed hooks every sub-module. It records the order in which the sub-modules run in one step
(forward; then backward, where a checkpointed block first runs its forward again and then its
backward, sub-modules in reverse), and when a sub-module finishes it keeps that sub-module's
parameters gathered only if the sub-module runs again within `stage3_max_reuse_distance`
elements, counted over the parameters of the sub-modules that run in between. Otherwise the
parameters are released and the next use gathers them again:
- 0.3.13: deepspeed/runtime/zero/stage3.py, `PartitionedParameterCoordinator.release_sub_module`
  and `_keep_for_later` (kept if that distance is under the limit; `PrefetchCoordinator.
  get_reuse_distance_in_numel` sums the parameters from the current trace step to the next use);
- 0.6.2: deepspeed/runtime/zero/partitioned_param_coordinator.py, `__params_to_release` (walks
  the trace from the current step and keeps the parameters met before more than the limit has
  been traversed: kept if the distance is at most the limit).

So the distance is measured per sub-module, not per layer. Right after a block's recomputed
forward its last linear is reused at once (distance 0), its first only after the rest of the
block has run forward and backward again (about twice the rest of the block): with GPT-3 175B's
linears (query_key_value 3h², dense h², and 4h², 4h² for the MLP) and the default 1e9, the
first three are gathered again for the backward (2/3 of the block); with the Azure recipes' 3e9,
none is.

The sub-modules here are a block's linears in execution order (ModelShape.linears); norms and
biases are below `stage3_param_persistence_threshold` (1e5, both versions' default and the
recipes') and stay gathered. The root's parameters (embedding, final norm, head) count as one
sub-module between the forward and the backward; cost.py gathers the root itself.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=256)
def gathered(
    linears: tuple[int, ...], layers: int, recomputed: tuple[bool, ...], reuse: float, root: int = 0
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Elements of each block gathered for its forward, and for its backward (its recomputed
    forward, when `recomputed[i]`, and its backward), under DeepSpeed's release rule above."""
    trace = []  # (sub-module, elements, block, 0 forward / 1 backward)
    for i in range(layers):
        trace += [((i, j), n, i, 0) for j, n in enumerate(linears)]
    trace.append(("root", root, None, 0))
    for i in reversed(range(layers)):
        if recomputed[i]:
            trace += [((i, j), n, i, 1) for j, n in enumerate(linears)]
        trace += [((i, j), n, i, 1) for j, n in reversed(list(enumerate(linears)))]
    before = [0]  # elements of the sub-modules before each step
    for _, n, _, _ in trace:
        before.append(before[-1] + n)
    out = ([0.0] * layers, [0.0] * layers)
    last: dict = {}
    for k, (key, n, block, phase) in enumerate(trace):
        if key in last:
            kept = before[k] - before[last[key] + 1] <= reuse
        else:
            kept = False
        if not kept and block is not None:
            out[phase][block] += n
        last[key] = k
    return tuple(out[0]), tuple(out[1])
