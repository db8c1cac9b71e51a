"""What the engine overlaps, as the planner times it (used by cost.py).

One compute stream and one link: collectives run on the link one after another, in the order the
engine issues them, each as long as the alpha-beta ring model says; compute runs its segments in
order. `timeline` plays a sequence of segments with the collectives the engine issues around each:

- the boundary's gradient buckets (stages 0-2): a segment is the backward between two buckets'
  last gradients, each bucket reduced as it fills (zero/replicated.py, zero/sharded.py: stages 1-2
  let backward run at most one bucket ahead of the reduction in flight);
- ZeRO-3's units: a segment is one unit's forward or backward, its all-gather issued when the unit
  `depth` units before it starts (stage3_prefetch_bucket_size), its gradients' reduce-scatter when
  its backward ends (zero/stage3.py);
- overlap_param_gather: every bucket's all-gather issued at the step, a segment is the forward of
  the layers whose parameters a bucket holds (zero/param_gather.py);
- tensor_parallel.tp_overlap_comm: a segment is one half of a block's batch, its exit (forward) or
  entry (backward) collective issued when it ends, sequence-parallel gathers issued at the start
  (parallel/overlap.py); without the option the block is one segment.

On a GPU a collective runs beside compute at little cost (NCCL has SMs of its own). On a CPU the
collective's copies and sums take cores from the compute: `Hardware.overlap` is the fraction of a
collective's time that compute running beside it hides (bench/planner.py measures it).
"""

from __future__ import annotations

from typing import NamedTuple

from ..zero.flat import bucket_numel, cut
from ..zero.gather_rules import forward_plan
from .model import ModelShape


def timeline(
    compute: list[float],
    pre: list[float] | None = None,
    post: list[float] | None = None,
    ahead: int | list[int] | None = 0,
    in_flight: int | None = None,
) -> float:
    """When the last segment's compute and the last collective are done. Segment i computes for
    compute[i] once its pre[i] collective is done and then issues post[i]. When segment i starts
    it issues the pre collectives of the `ahead` segments after it not issued yet (a list: ahead[i]
    for segment i; None: every one at time 0; 0: each when its segment starts). After issuing a
    post, compute waits until at most `in_flight` posts are unfinished (None: never waits)."""
    n = len(compute)
    pre, post = pre or [0.0] * n, post or [0.0] * n
    link, t, done, posts = 0.0, 0.0, {}, []

    def send(cost: float, at: float) -> float:
        nonlocal link
        link = max(link, at) + cost
        return link

    if ahead is None:
        for j in range(n):
            if pre[j]:
                done[j] = send(pre[j], 0.0)
    for i in range(n):
        if pre[i] and i not in done:
            done[i] = send(pre[i], t)
        t = max(t, done.get(i, 0.0))
        for j in range(i + 1, min(n, i + 1 + (ahead[i] if isinstance(ahead, list) else ahead or 0))):
            if pre[j] and j not in done:
                done[j] = send(pre[j], t)
        t += compute[i]
        if post[i]:
            posts.append(send(post[i], t))
            if in_flight is not None and len(posts) > in_flight:
                t = max(t, posts[-1 - in_flight])
    return max(t, link)


def added_time(finish: float, compute: float, comm: float, overlap: float) -> float:
    """What the collectives add to `compute`: the part of `finish` beyond it, plus the share of the
    collectives that ran beside compute which the hardware does not hide (1 - overlap)."""
    exposed = max(0.0, finish - compute)
    return exposed + (1.0 - overlap) * max(0.0, comm - exposed)


class Bucket(NamedTuple):
    elements: int
    flops: float  # backward FLOPs per token that produce its gradients
    expert: bool  # a mixture's experts under expert parallelism: reduced over the expert-data group


def grad_buckets(shape: ModelShape, tp: int, pp: int, seq: int, configured: int | None, ep: int = 1) -> list[Bucket]:
    """Each gradient bucket of one rank, in the order the engine launches them: its parameters in
    reverse module order, cut by zero/flat.py's rule (with pipeline stages: the first stage's,
    embedding and its share of the blocks); under expert parallelism (`ep` > 1) the rank's experts,
    1/ep of them, in buckets of their own, as the engine keeps each bucket in one shard group."""
    tensors, block = [], 0
    stage_blocks = -(-shape.layers // pp)
    for where, n, split in shape.tensors():
        if where in ("block", "expert"):
            block += 1
            if block > stage_blocks * shape.tensors_per_block:
                continue
        elif where == "head" and pp > 1:
            continue
        numel = n // tp if split else n // ep if where == "expert" else n
        # dgrad and wgrad of a matrix; the attention's own matmuls ride with its first projection; an
        # expert tensor's rows are top_k / experts of the tokens (the rank's experts, ep x their share)
        flops = 4.0 * numel if split and where != "embed" else 0.0
        if where == "expert":
            flops = 4.0 * n * shape.top_k / shape.experts
        if where == "block" and (block - 1) % shape.tensors_per_block == 1:
            flops += 8.0 * seq * shape.hidden / tp
        tensors.append(Bucket(numel, flops, where == "expert" and ep > 1))
    if shape.tied and pp == 1:  # the head's backward comes first, the tied embedding's gradient last
        tensors.append(Bucket(0, 4.0 * shape.vocab * shape.hidden / tp, False))
    tensors.reverse()
    limit = bucket_numel(configured, sum(t.elements for t in tensors))
    runs = cut(tensors, lambda t: t.elements, limit, lambda first, t: first.expert == t.expert)
    return [Bucket(sum(t.elements for t in b), sum(t.flops for t in b), b[0].expert) for b in runs]


def zero3_forward(
    layers: int, unit: int, root: int, window: float, max_live: float, reuse: float
) -> tuple[list[int], int]:
    """ZeRO-3's forward as the engine runs it (zero/gather_rules.py: the same rules, played over
    `layers` blocks of `unit` elements and a root of `root`): per segment (the root's, then each
    block's) how many segments after it have their gather issued when it starts, and how many
    blocks stay gathered for their backward (stage3_max_reuse_distance)."""
    plan = forward_plan([unit] * layers, root, window, max_live, reuse)
    ahead = [max(j + 1 for j in step.started) - s if step.started else 0 for s, step in enumerate(plan)]
    return ahead, sum(step.kept for step in plan[1:])
